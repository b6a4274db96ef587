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
 */
#include <stdint.h>
#include <string.h>

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
