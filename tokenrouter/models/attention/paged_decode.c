/* Paged attention for single query rows on CPU, float32: one pass over each request's pages, no
 * gathered copy of K or V (tokenrouter/models/attention/paged_decode_kernel.py builds and calls it).
 *
 * Each entry i is one query row: request reqs[i] of the page table, row rows[i] of q and out
 * ([T, H, D], contiguous), attending that request's keys 0 .. lens[i] - 1. Consecutive entries that
 * are the consecutive rows of one extend are attended together, each key row read once for all of
 * them; the arithmetic of each row is the same either way. The pool layer kc / vc is
 * [slots, Hkv, D], contiguous; a page holds page_size consecutive slots, so a key row (every KV head
 * of one position, Hkv * D floats) is contiguous and is read once for all H query heads. Query head j
 * uses KV head j / (H / Hkv).
 *
 * Per block: scores of every key and head into a scratch buffer, their maximum, exp and sum, then the
 * weighted sum of the value rows. While a page is read, the next page's rows are prefetched (the last
 * key page prefetches the first value page): pages are scattered over the pool, and the hardware
 * prefetcher does not cross into them (measured: 1.2x on SmolLM2's shapes at batch 8 and 32). They
 * are prefetched into L2, not L1: a page of keys is 12 KB for SmolLM2, and pulling it into L1 evicted
 * the scores and the output rows being summed (1.2-1.4x measured, benchmarks/decode_attention_costs.py).
 * Requests are independent: a row's result does not depend on which other requests share the call. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256

/* Rows e = 0 .. n_rows - 1 of one request, consecutive in q and out, row e attending keys
 * 0 .. len0 + e - 1 (an extend: the rows share their keys, so each key row is read once for all).
 * s: scratch for n_rows * (len0 + n_rows - 1) * h scores; mx, sum: n_rows * h each. */
static inline void attend(const float *restrict q, const float *restrict kc, const float *restrict vc,
                          const int64_t *restrict pages, int64_t len0, int64_t n_rows, int64_t page_size,
                          int64_t h, int64_t hkv, int64_t d, float scale, float *restrict out,
                          float *restrict s, float *restrict mx, float *restrict sum) {
    const int64_t group = h / hkv, row = hkv * d, len = len0 + n_rows - 1;
    for (int64_t j = 0; j < n_rows * h; j++) {
        mx[j] = -FLT_MAX;
        sum[j] = 0.f;
    }
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const float *kp = kc + pages[p] * page_size * row;
        const float *kn = t0 + page_size < len ? kc + pages[p + 1] * page_size * row : vc + pages[0] * page_size * row;
        for (int64_t u = 0; u < n; u++) {
            /* one cache line of 16 floats per prefetch, into L2 (locality 1) */
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(kn + u * row + c, 0, 1);
            const int64_t t = t0 + u, first = t < len0 ? 0 : t - len0 + 1;  /* rows that see key t */
            for (int64_t e = first; e < n_rows; e++) {
                float *st = s + (e * len + t) * h, *me = mx + e * h;
                const float *qe = q + e * h * d;
                for (int64_t kh = 0; kh < hkv; kh++) {
                    const float *kr = kp + u * row + kh * d;
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t j = kh * group + g;
                        const float *qj = qe + j * d;
                        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                        for (int64_t x = 0; x < d; x++) acc += qj[x] * kr[x];
                        acc *= scale;
                        st[j] = acc;
                        me[j] = acc > me[j] ? acc : me[j];
                    }
                }
            }
        }
    }
    for (int64_t e = 0; e < n_rows; e++) {
        float *me = mx + e * h, *se = sum + e * h;
        for (int64_t t = 0; t < len0 + e; t++) {
            float *st = s + (e * len + t) * h;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) st[j] = expf(st[j] - me[j]);
            for (int64_t j = 0; j < h; j++) se[j] += st[j];
        }
    }
    memset(out, 0, (size_t)(n_rows * h * d) * sizeof(float));
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const float *vp = vc + pages[p] * page_size * row;
        const float *vn = t0 + page_size < len ? vc + pages[p + 1] * page_size * row : vp;
        for (int64_t u = 0; u < n; u++) {
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(vn + u * row + c, 0, 1);
            const int64_t t = t0 + u, first = t < len0 ? 0 : t - len0 + 1;
            for (int64_t e = first; e < n_rows; e++) {
                const float *st = s + (e * len + t) * h;
                float *oe = out + e * h * d;
                for (int64_t kh = 0; kh < hkv; kh++) {
                    const float *vr = vp + u * row + kh * d;
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t j = kh * group + g;
                        const float w = st[j];
                        float *o = oe + j * d;
#pragma omp simd
                        for (int64_t x = 0; x < d; x++) o[x] += w * vr[x];
                    }
                }
            }
        }
    }
    for (int64_t j = 0; j < n_rows * h; j++) {
        const float r = 1.f / sum[j];
        for (int64_t x = 0; x < d; x++) out[j * d + x] *= r;
    }
}

/* Entries i .. i + k - 1 form one block when they are consecutive rows of one request, each
 * attending one key more than the one before (the rows of one extend). */
static int64_t block_end(const int64_t *reqs, const int64_t *rows, const int64_t *lens, int64_t i, int64_t n) {
    int64_t j = i + 1;
    while (j < n && reqs[j] == reqs[i] && rows[j] == rows[j - 1] + 1 && lens[j] == lens[j - 1] + 1) j++;
    return j;
}

/* 0 on success; -1: more than MAX_HEADS heads or H not a multiple of Hkv; -2: an entry with no key;
 * -3: no memory for the scratch buffer. */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *page_table,
                     int64_t table_stride, const int64_t *reqs, const int64_t *rows, const int64_t *lens,
                     int64_t n, int64_t h, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out) {
    if (h > MAX_HEADS || hkv < 1 || h % hkv != 0) return -1;
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] < 1) return -2;
    for (int64_t i = 0, j; i < n; i = j) {
        j = block_end(reqs, rows, lens, i, n);
        const int64_t k = j - i, words = k * lens[j - 1] * h;
        need = words > need ? words : need;
    }
    float *s = malloc(sizeof(float) * (size_t)(need + 2 * n * h + 1));
    if (!s) return -3;
    float *mx = s + need, *sum = mx + n * h;
    for (int64_t i = 0, j; i < n; i = j) {
        j = block_end(reqs, rows, lens, i, n);
        const int64_t *pages = page_table + reqs[i] * table_stride;
        const int64_t off = rows[i] * h * d;
        /* Constant head sizes let the compiler unroll the row loops fully. */
        if (d == 64)
            attend(q + off, kc, vc, pages, lens[i], j - i, page_size, h, hkv, 64, scale, out + off, s, mx, sum);
        else if (d == 128)
            attend(q + off, kc, vc, pages, lens[i], j - i, page_size, h, hkv, 128, scale, out + off, s, mx, sum);
        else
            attend(q + off, kc, vc, pages, lens[i], j - i, page_size, h, hkv, d, scale, out + off, s, mx, sum);
    }
    free(s);
    return 0;
}
