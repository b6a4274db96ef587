/* y = x @ W^T (+ bias) for few rows of x (decode batches, the head's sampled rows), float32 on CPU.
 *
 * W [n, k] is packed once into panels of 16 output columns, [ceil(n / 16)][k][16] (the last panel
 * zero-padded), so a tile streams its panels' weights front to back, each weight read once from
 * memory for up to ROWS rows of x, and keeps every partial sum in a vector register: no horizontal
 * reductions and nothing written until a panel's sums are done. Rows beyond ROWS re-read the tile's
 * panels from cache, not from memory.
 *
 * Every output element is the sum over k in order, one fused multiply-add per k, whatever the tile
 * shape: a row gets bit-identical results alone or in any batch (tests/test_skinny_gemm.py).
 * Built without -ffast-math (only -ffp-contract=fast, for the fused multiply-adds), so the compiler
 * keeps that order. See tokenrouter/models/skinny_gemm.py for the call and the build.
 *
 * The screened head (tokenrouter/models/screened_head.py) adds three entry points: skinny_screen_bf16,
 * approximate products on bfloat16 copies of x and W (half the bytes of W; on CPUs with AVX512-BF16
 * one instruction does two multiply-adds a lane); skinny_select, the columns each row must have
 * computed exactly; skinny_gather_f32, those columns computed by the same tile as skinny_gemm_f32,
 * hence bit-identical to it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PANEL 16
typedef float v16 __attribute__((vector_size(64), aligned(4)));

#if defined(__AVX512F__)
#define ROWS 8  /* 32 vector registers: up to 4 panels x 4 rows or 2 panels x 8 rows of sums */
#else
#define ROWS 4  /* 16 (AVX2) registers hold 2 each of v16: one panel x 4 rows */
#endif

static inline __attribute__((always_inline)) void store(float *y, v16 acc, const float *bias, int64_t cols) {
    if (cols == PANEL) {
        if (bias) acc += *(const v16 *)bias;
        *(v16 *)y = acc;
        return;
    }
    float tmp[PANEL];
    memcpy(tmp, &acc, sizeof tmp);
    for (int64_t j = 0; j < cols; j++) y[j] = tmp[j] + (bias ? bias[j] : 0.0f);
}

/* Sums of `mr` rows against `np` panels starting at w (np, mr compile-time after inlining). */
static inline __attribute__((always_inline)) void tile(const int np, const int mr, const float *x, int64_t ldx,
                                                       const float *w, int64_t k, const float *bias, float *y,
                                                       int64_t ldy, int64_t cols) {
    v16 acc[4][ROWS];
    for (int p = 0; p < np; p++)
        for (int m = 0; m < mr; m++) acc[p][m] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        v16 b[4];
        for (int p = 0; p < np; p++) b[p] = *(const v16 *)(w + (p * k + i) * PANEL);
        for (int m = 0; m < mr; m++) {
            const float s = x[m * ldx + i];
            for (int p = 0; p < np; p++) acc[p][m] += s * b[p];
        }
    }
    for (int m = 0; m < mr; m++)
        for (int p = 0; p < np; p++) {
            const int64_t c = cols - p * PANEL;
            store(y + m * ldy + p * PANEL, acc[p][m], bias ? bias + p * PANEL : 0, c < PANEL ? c : PANEL);
        }
}

#define CASE(NP, MR) case MR: tile(NP, MR, xr, ldx, w, k, b, yr, ldy, cols); break;
#define NARROW(NP) switch (mr) { CASE(NP, 1) CASE(NP, 2) CASE(NP, 3) default: tile(NP, 4, xr, ldx, w, k, b, yr, ldy, cols); }
#define ANY(NP) switch (mr) { CASE(NP, 1) CASE(NP, 2) CASE(NP, 3) CASE(NP, 4) CASE(NP, 5) CASE(NP, 6) CASE(NP, 7) \
                              default: tile(NP, 8, xr, ldx, w, k, b, yr, ldy, cols); }

/* x [m rows, k] with row stride ldx; panels as above; bias [n] or NULL; y [m rows, n] with row
 * stride ldy. Returns 0, or -1 for a shape it does not take. */
int skinny_gemm_f32(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n, int64_t k,
                    const float *bias, float *y, int64_t ldy) {
    if (m < 1 || n < 1 || k < 1 || ldx < k || ldy < n) return -1;
    const int64_t npanels = (n + PANEL - 1) / PANEL;
    /* the most panels a tile takes with the sums of ROWS (or, for a smaller m, m) rows in registers */
    const int64_t width = ROWS == 8 ? (m <= 4 ? 4 : 2) : 1;
    for (int64_t p0 = 0; p0 < npanels; p0 += width) {
        const int64_t np = npanels - p0 < width ? npanels - p0 : width;
        const float *w = panels + p0 * k * PANEL, *b = bias ? bias + p0 * PANEL : 0;
        const int64_t cols = n - p0 * PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int64_t mr = m - r0 < ROWS ? m - r0 : ROWS;
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy + p0 * PANEL;
#if ROWS == 8
            if (np == 4) { NARROW(4) } else if (np == 3) { NARROW(3) } else if (np == 2) { ANY(2) } else { ANY(1) }
#else
            (void)np;  /* one panel a tile */
            NARROW(1)
#endif
        }
    }
    return 0;
}

/* x [m rows, k] times W [n, k] given as bfloat16 pair panels [ceil(n / 16)][ceil(k / 2)][16][2]
 * (panel p, input pair i: the 16 columns' weights k = 2i, 2i + 1 side by side; zero-padded), x rounded
 * to bfloat16 (to nearest even) first; y [m rows, n] with row stride ldy. Each element is an ordered sum
 * of exact bfloat16 products, one float32 rounding a term. Returns 0, -1 for a shape it does not take,
 * -2 without memory. */
typedef uint32_t u16x2 __attribute__((vector_size(64), aligned(4)));

static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  /* NaN stays NaN */
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

static inline __attribute__((always_inline)) void screen_tile(const int np, const int mr, const uint32_t *xp, int64_t kp,
                                                              const uint32_t *w, float *y, int64_t ldy, int64_t cols) {
    v16 acc[4][ROWS];
    for (int p = 0; p < np; p++)
        for (int m = 0; m < mr; m++) acc[p][m] = (v16){0};
    for (int64_t i = 0; i < kp; i++) {
        u16x2 b[4];
        for (int p = 0; p < np; p++) b[p] = *(const u16x2 *)(w + (p * kp + i) * PANEL);
        for (int m = 0; m < mr; m++) {
            const uint32_t s = xp[m * kp + i];
#if defined(__AVX512BF16__)
            const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)s);
            for (int p = 0; p < np; p++) acc[p][m] = (v16)_mm512_dpbf16_ps((__m512)acc[p][m], xs, (__m512bh)b[p]);
#else
            float lo, hi;
            const uint32_t l = s << 16, h = s & 0xffff0000u;
            memcpy(&lo, &l, 4);
            memcpy(&hi, &h, 4);
            for (int p = 0; p < np; p++) {
                acc[p][m] += lo * (v16)(b[p] << 16);
                acc[p][m] += hi * (v16)(b[p] & 0xffff0000u);
            }
#endif
        }
    }
    for (int m = 0; m < mr; m++)
        for (int p = 0; p < np; p++) {
            const int64_t c = cols - p * PANEL;
            store(y + m * ldy + p * PANEL, acc[p][m], 0, c < PANEL ? c : PANEL);
        }
}

#define SCASE(NP, MR) case MR: screen_tile(NP, MR, xr, kp, w, yr, ldy, cols); break;
#define SNARROW(NP) switch (mr) { SCASE(NP, 1) SCASE(NP, 2) SCASE(NP, 3) default: screen_tile(NP, 4, xr, kp, w, yr, ldy, cols); }
#define SANY(NP) switch (mr) { SCASE(NP, 1) SCASE(NP, 2) SCASE(NP, 3) SCASE(NP, 4) SCASE(NP, 5) SCASE(NP, 6) \
                               SCASE(NP, 7) default: screen_tile(NP, 8, xr, kp, w, yr, ldy, cols); }

int skinny_screen_bf16(const float *x, int64_t m, int64_t ldx, const uint16_t *pairs, int64_t n, int64_t k,
                       float *y, int64_t ldy) {
    if (m < 1 || n < 1 || k < 1 || ldx < k || ldy < n) return -1;
    const int64_t kp = (k + 1) / 2, npanels = (n + PANEL - 1) / PANEL;
    uint32_t *xp = malloc((size_t)(m * kp) * sizeof(uint32_t));
    if (!xp) return -2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < kp; i++) {
            const uint32_t lo = bf16_bits(x[r * ldx + 2 * i]), hi = 2 * i + 1 < k ? bf16_bits(x[r * ldx + 2 * i + 1]) : 0;
            xp[r * kp + i] = lo | hi << 16;
        }
    const int64_t width = ROWS == 8 ? (m <= 4 ? 4 : 2) : 1;
    for (int64_t p0 = 0; p0 < npanels; p0 += width) {
        const int64_t np = npanels - p0 < width ? npanels - p0 : width;
        const uint32_t *w = (const uint32_t *)pairs + p0 * kp * PANEL;
        const int64_t cols = n - p0 * PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int64_t mr = m - r0 < ROWS ? m - r0 : ROWS;
            const uint32_t *xr = xp + r0 * kp;
            float *yr = y + r0 * ldy + p0 * PANEL;
#if ROWS == 8
            if (np == 4) { SNARROW(4) } else if (np == 3) { SNARROW(3) } else if (np == 2) { SANY(2) } else { SANY(1) }
#else
            (void)np;
            SNARROW(1)
#endif
        }
    }
    free(xp);
    return 0;
}

/* Min-heap of the `top` largest values seen: heap[0] is the smallest of them; `cols`, where not NULL,
 * moves along with the values (each value's column). */
static void sift_down(double *heap, int64_t *cols, int64_t size, int64_t i) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= size) return;
        if (c + 1 < size && heap[c + 1] < heap[c]) c++;
        if (!(heap[c] < heap[i])) return;
        const double t = heap[c];
        heap[c] = heap[i];
        heap[i] = t;
        if (cols) {
            const int64_t tc = cols[c];
            cols[c] = cols[i];
            cols[i] = tc;
        }
        i = c;
    }
}

/* Row r of approx [m rows, n] (row stride ld) is within scale[r] * norms[j] + offset of the exact
 * product in column j. For each row: floor_r, the `top`-th largest of approx - bound (at most the exact
 * `top`-th largest), and every column whose approx + bound reaches it (all in double), marked in mark
 * (n bytes). 0; -1 for a shape it does not take or a row that is not finite, -2 without memory. */
static int mark_candidates(const float *approx, int64_t m, int64_t n, int64_t ld, int64_t top, const double *scale,
                           const double *norms, double offset, uint8_t *mark) {
    if (m < 1 || n < 1 || top < 1 || top > n || ld < n) return -1;
    double *heap = malloc((size_t)top * sizeof(double));
    if (!heap) return -2;
    int rc = 0;
    for (int64_t r = 0; r < m && rc == 0; r++) {
        const float *a = approx + r * ld;
        const double s = scale[r];
        for (int64_t j = 0; j < top; j++) heap[j] = a[j] - s * norms[j] - offset;
        for (int64_t i = top / 2 - 1; i >= 0; i--) sift_down(heap, NULL, top, i);
        float bad = 0.0f;  /* stays 0 unless a value is infinite or NaN */
        for (int64_t j = 0; j < n; j++) bad += a[j] * 0.0f;
        for (int64_t j = top; j < n; j++) {
            const double lo = a[j] - s * norms[j] - offset;
            if (lo > heap[0]) {
                heap[0] = lo;
                sift_down(heap, NULL, top, 0);
            }
        }
        const double floor_ = heap[0];
        if (bad != 0.0f || !(floor_ - floor_ == 0.0)) {
            rc = -1;
            break;
        }
        for (int64_t j = 0; j < n; j++) mark[j] |= a[j] + s * norms[j] + offset >= floor_;
    }
    free(heap);
    return rc;
}

/* The union over the rows of mark_candidates' columns, ascending, to cols (room for n); returns how
 * many, or mark_candidates' error (the caller computes exactly). */
int64_t skinny_select(const float *approx, int64_t m, int64_t n, int64_t ld, int64_t top, const double *scale,
                      const double *norms, double offset, int64_t *cols) {
    uint8_t *mark = n > 0 ? calloc((size_t)n, 1) : NULL;
    if (!mark) return n > 0 ? -2 : -1;
    const int rc = mark_candidates(approx, m, n, ld, top, scale, norms, offset, mark);
    int64_t count = 0;
    if (rc == 0)
        for (int64_t j = 0; j < n; j++)
            if (mark[j]) cols[count++] = j;
    free(mark);
    return rc == 0 ? count : rc;
}

/* y[r, j] = x[r] . weight[idx[j]] for j < count: weight [n, k] row-major float32 (row stride ldw),
 * y [m rows, count] (row stride ldy); each value bit-identical to column idx[j] of skinny_gemm_f32 on
 * the weight's float32 panels (the same tile over a panel packed here). Returns 0, -1 for a shape it
 * does not take or an index out of range, -2 without memory. */
int skinny_gather_f32(const float *x, int64_t m, int64_t ldx, const float *weight, int64_t n, int64_t k,
                      int64_t ldw, const int64_t *idx, int64_t count, float *y, int64_t ldy) {
    if (m < 1 || k < 1 || count < 0 || ldx < k || ldw < k || ldy < count) return -1;
    for (int64_t j = 0; j < count; j++)
        if (idx[j] < 0 || idx[j] >= n) return -1;
    float *panel = aligned_alloc(64, (size_t)k * PANEL * sizeof(float));
    if (!panel) return -2;
    for (int64_t j0 = 0; j0 < count; j0 += PANEL) {
        const int64_t cols = count - j0 < PANEL ? count - j0 : PANEL;
        for (int64_t c = 0; c < PANEL; c++)
            for (int64_t i = 0; i < k; i++) panel[i * PANEL + c] = c < cols ? weight[idx[j0 + c] * ldw + i] : 0.0f;
        const float *w = panel, *b = 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int64_t mr = m - r0 < ROWS ? m - r0 : ROWS;
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy + j0;
#if ROWS == 8
            ANY(1)
#else
            NARROW(1)
#endif
        }
    }
    free(panel);
    return 0;
}

static int64_t find(const int64_t *sorted, int64_t count, int64_t col) {
    int64_t lo = 0, hi = count;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (sorted[mid] < col) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* ScreenedHead.top's ranked form in one call. Rows x [m, k] with their screen approx [m, n] (bounds as
 * mark_candidates'): each row's `top` columns that approx ranks highest (ids), their exact products
 * (skinny_gather_f32's values, so bit-identical to the float32 head's) in values, descending; and
 * argmax, each row's first largest exact product over the union of the ranked columns and the columns
 * that can hold its largest (recomputed exactly, ascending). Returns 0; -1 for a shape it does not take
 * or a row that is not finite, -2 without memory, -3 when the union passes max_columns (for both -1
 * and -3 the caller takes the full head). */
int skinny_top_ranked(const float *x, int64_t m, int64_t ldx, const float *weight, int64_t n, int64_t k, int64_t ldw,
                      const float *approx, int64_t ld, int64_t top, const double *scale, const double *norms,
                      double offset, int64_t max_columns, int64_t *argmax, float *values, int64_t *ids) {
    if (m < 1 || n < 1 || top < 1 || top > n || ld < n || max_columns < 1) return -1;
    uint8_t *mark = calloc((size_t)n, 1);
    int64_t *cols = malloc((size_t)max_columns * sizeof(int64_t));
    double *heap = malloc((size_t)top * sizeof(double));
    float *exact = NULL;
    int rc = !mark || !cols || !heap ? -2 : mark_candidates(approx, m, n, ld, 1, scale, norms, offset, mark);
    for (int64_t r = 0; r < m && rc == 0; r++) {
        const float *a = approx + r * ld;
        int64_t *c = ids + r * top;
        for (int64_t j = 0; j < top; j++) heap[j] = a[j], c[j] = j;
        for (int64_t i = top / 2 - 1; i >= 0; i--) sift_down(heap, c, top, i);
        for (int64_t j = top; j < n; j++)
            if (a[j] > heap[0]) {
                heap[0] = a[j], c[0] = j;
                sift_down(heap, c, top, 0);
            }
        for (int64_t j = 0; j < top; j++) mark[c[j]] = 1;
    }
    int64_t count = 0;
    for (int64_t j = 0; j < n && rc == 0; j++)
        if (mark[j]) {
            if (count == max_columns) rc = -3;
            else cols[count++] = j;
        }
    if (rc == 0 && !(exact = malloc((size_t)(m * count) * sizeof(float)))) rc = -2;
    if (rc == 0) rc = skinny_gather_f32(x, m, ldx, weight, n, k, ldw, cols, count, exact, count);
    for (int64_t r = 0; r < m && rc == 0; r++) {
        const float *e = exact + r * count;
        int64_t best = 0;
        for (int64_t j = 1; j < count; j++)
            if (e[j] > e[best]) best = j;
        argmax[r] = cols[best];
        float *v = values + r * top;
        int64_t *c = ids + r * top;
        for (int64_t j = 0; j < top; j++) v[j] = e[find(cols, count, c[j])];
        for (int64_t i = 1; i < top; i++) {  /* insertion sort, descending: top is small (R2R's 100) */
            const float tv = v[i];
            const int64_t tc = c[i];
            int64_t j = i;
            for (; j > 0 && v[j - 1] < tv; j--) v[j] = v[j - 1], c[j] = c[j - 1];
            v[j] = tv, c[j] = tc;
        }
    }
    free(mark);
    free(cols);
    free(heap);
    free(exact);
    return rc;
}
