/* Paged attention for single query rows on CPU, float32: one pass over each request's pages, no
 * gathered copy of K or V (tokenrouter/models/attention/paged_decode_kernel.py builds and calls it).
 *
 * Each entry i is one query row: request reqs[i] of the page table, row rows[i] of q and out
 * ([T, H, D], contiguous), attending that request's keys 0 .. lens[i] - 1. The pool layer kc / vc is
 * [slots, Hkv, D], contiguous; a page holds page_size consecutive slots, so a key row (every KV head
 * of one position, Hkv * D floats) is contiguous and is read once for all H query heads. Query head j
 * uses KV head j / (H / Hkv).
 *
 * Per entry: scores of every key and head into a scratch buffer, their maximum, exp and sum, then the
 * weighted sum of the value rows. While a page is read, the next page's rows are prefetched (the last
 * key page prefetches the first value page): pages are scattered over the pool, and the hardware
 * prefetcher does not cross into them (measured: 1.2x on SmolLM2's shapes at batch 8 and 32). Entries are independent: a row's result does not depend on which
 * other rows share the call. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256

static inline void attend(const float *restrict q, const float *restrict kc, const float *restrict vc,
                          const int64_t *restrict pages, int64_t len, int64_t page_size, int64_t h,
                          int64_t hkv, int64_t d, float scale, float *restrict out, float *restrict s) {
    const int64_t group = h / hkv, row = hkv * d;
    float mx[MAX_HEADS], sum[MAX_HEADS];
    for (int64_t j = 0; j < h; j++) {
        mx[j] = -FLT_MAX;
        sum[j] = 0.f;
    }
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const float *kp = kc + pages[p] * page_size * row;
        const float *kn = t0 + page_size < len ? kc + pages[p + 1] * page_size * row : vc + pages[0] * page_size * row;
        /* one cache line of 16 floats per prefetch */
        for (int64_t u = 0; u < n; u++) {
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(kn + u * row + c);
            float *st = s + (t0 + u) * h;
            for (int64_t kh = 0; kh < hkv; kh++) {
                const float *kr = kp + u * row + kh * d;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t j = kh * group + g;
                    const float *qj = q + j * d;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t x = 0; x < d; x++) acc += qj[x] * kr[x];
                    acc *= scale;
                    st[j] = acc;
                    mx[j] = acc > mx[j] ? acc : mx[j];
                }
            }
        }
    }
    for (int64_t t = 0; t < len; t++) {
        float *st = s + t * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) st[j] = expf(st[j] - mx[j]);
        for (int64_t j = 0; j < h; j++) sum[j] += st[j];
    }
    memset(out, 0, (size_t)(h * d) * sizeof(float));
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const float *vp = vc + pages[p] * page_size * row;
        const float *vn = t0 + page_size < len ? vc + pages[p + 1] * page_size * row : vp;
        for (int64_t u = 0; u < n; u++) {
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(vn + u * row + c);
            const float *st = s + (t0 + u) * h;
            for (int64_t kh = 0; kh < hkv; kh++) {
                const float *vr = vp + u * row + kh * d;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t j = kh * group + g;
                    const float w = st[j];
                    float *o = out + j * d;
#pragma omp simd
                    for (int64_t x = 0; x < d; x++) o[x] += w * vr[x];
                }
            }
        }
    }
    for (int64_t j = 0; j < h; j++) {
        const float r = 1.f / sum[j];
        for (int64_t x = 0; x < d; x++) out[j * d + x] *= r;
    }
}

/* 0 on success; -1: more than MAX_HEADS heads or H not a multiple of Hkv; -2: an entry with no key;
 * -3: no memory for the scratch buffer. */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *page_table,
                     int64_t table_stride, const int64_t *reqs, const int64_t *rows, const int64_t *lens,
                     int64_t n, int64_t h, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out) {
    if (h > MAX_HEADS || hkv < 1 || h % hkv != 0) return -1;
    int64_t longest = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lens[i] < 1) return -2;
        longest = lens[i] > longest ? lens[i] : longest;
    }
    float *s = malloc(sizeof(float) * (size_t)(longest * h + 1));
    if (!s) return -3;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *pages = page_table + reqs[i] * table_stride;
        const int64_t off = rows[i] * h * d;
        /* Constant head sizes let the compiler unroll the row loops fully. */
        if (d == 64)
            attend(q + off, kc, vc, pages, lens[i], page_size, h, hkv, 64, scale, out + off, s);
        else if (d == 128)
            attend(q + off, kc, vc, pages, lens[i], page_size, h, hkv, 128, scale, out + off, s);
        else
            attend(q + off, kc, vc, pages, lens[i], page_size, h, hkv, d, scale, out + off, s);
    }
    free(s);
    return 0;
}
