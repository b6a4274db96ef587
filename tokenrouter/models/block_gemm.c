/* Products of a few rows by a GGUF block weight (Q4_0, Q4_1, Q8_0) on the CPU's integer dot-product
 * instructions: each row's block of 32 inputs as two int8 codes on one float scale (a coarse code and
 * its rounded remainder: 15 bits where llama.cpp's Q8_1 keeps 8), and each block's products summed
 * exactly in int32 (AVX512-VNNI's vpdpbusd: unsigned codes times signed 8-bit inputs), then scaled in
 * float32.
 *
 * The weight is w = d q + m for each block of 32 along a row (Q4_1 as stored; Q4_0's d (q - 8) as
 * m = -8 d; q the code in 0..15), or w = d q for Q8_0 (q in -128..127, stored as q + 128 so that it
 * is unsigned, 128 times the inputs' codes' sum taken off the int32 sum), d and m the file's float16
 * values, exactly. Per row r and column j the result is
 *     y[r][j] = sum over blocks b of  d_jb (dx_rb / 254) (q_jb . (254 xq_rb + rq_rb))  +  m_jb sx_rb,
 * with dx_rb = max |x_rb| / 127, xq_rb = round(x_rb / dx_rb), rq_rb = round(254 (x_rb / dx_rb - xq_rb))
 * and sx_rb the block's float32 sum of x. The int32 sums are exact; the inputs' codes stand for x_rb
 * to within dx_rb / 508 (plus the float rounding of x / dx), a 64,000th of the block's largest input,
 * where a bfloat16 input is off by up to a 512th of itself.
 *
 * Layout (block_gemm.py packs it): panels of 16 output columns; per panel, per block, groups of 64
 * bytes: 4-bit codes in four groups of 8 inputs, byte 4c + i holding column c's code for input 8g + i
 * in its low nibble and for input 8g + 4 + i in its high nibble; 8-bit codes in eight groups of 4
 * inputs, byte 4c + i column c's for input 4g + i. One vpdpbusd takes four inputs of all 16 columns
 * against four input bytes broadcast. d and m: per panel, per block, 16 float16 values.
 *
 * Threads: the panels are shared out by OpenMP (the process's runtime, torch's: the library links
 * libgomp by its soname, which torch has already loaded), on the threads the caller names (torch's
 * count, which OpenMP's own setting follows only on the thread that set it).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define PANEL 16
#define BLOCK 32
#define TILE 4 /* rows sharing one pass over a panel's codes */
#define SPLIT 254 /* the remainder's codes are in units of dx / SPLIT */
#define AHEAD 1024 /* bytes of codes fetched ahead of the block in hand */

int block_gemm_vnni(void) { return HAVE_VNNI; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline uint32_t magnitude_bits(const void *x, int x_bf16, int64_t at) { /* orders as |x| does; NaN last */
    if (x_bf16) return (uint32_t)(((const uint16_t *)x)[at] & 0x7fff) << 16;
    uint32_t bits;
    memcpy(&bits, (const float *)x + at, 4);
    return bits & 0x7fffffff;
}

/* Each row's blocks to two int8 codes, xq and rq [rows][k] (x = dx (xq + rq / 254) up to dx / 508,
 * rq the rounded remainder), the unit dx / 254 of the codes' sum 254 xq + rq and the float sums sx
 * [rows][k / 32]. A row whose largest input
 * is outside 2^-60..2^60 is first scaled by the power of two 2^e that brings it into [1, 2), exactly,
 * and its outputs by 2^-e (`unscale`): no block scale or scaled product then leaves float32's normal
 * range. A block under 2^-100 of its row's largest input reads as zero (its products are below the
 * roundings of the row's larger ones); a block holding a NaN or an infinity gets scale NaN, so every
 * output of its row is NaN. */
static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t k, int8_t *xq, int8_t *rq,
                          float *unit, float *sx, float *unscale) {
    for (int64_t r = 0; r < rows; r++) {
        uint32_t top = 0;
        for (int64_t i = 0; i < k; i++) {
            uint32_t bits = magnitude_bits(x, x_bf16, r * k + i);
            top = bits > top ? bits : top;
        }
        int exponent = (int)(top >> 23) - 127, e = 0;
        if (top != 0 && top < 0x7f800000u && (exponent < -60 || exponent > 60)) {
            float largest;
            memcpy(&largest, &top, 4);
            e = -ilogbf(largest);
        }
        /* 2^e as two factors, each within float32's range (|e| <= 149) */
        float up = ldexpf(1.0f, e / 2), up2 = ldexpf(1.0f, e - e / 2);
        unscale[r] = ldexpf(1.0f, -e);
        for (int64_t b = 0; b < k / BLOCK; b++) {
            float v[BLOCK], sum = 0.0f;
            uint32_t block_top = 0;
            for (int i = 0; i < BLOCK; i++) {
                int64_t at = r * k + b * BLOCK + i;
                float value = x_bf16 ? bf16_to_float(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                v[i] = e == 0 ? value : value * up * up2;
                uint32_t bits = magnitude_bits(x, x_bf16, at);
                block_top = bits > block_top ? bits : block_top;
                sum += v[i];
            }
            float amax; /* |x| of the block's largest input, as scaled */
            memcpy(&amax, &block_top, 4);
            amax = e == 0 ? amax : amax * up * up2;
            int finite = block_top < 0x7f800000u;
            float scale = finite ? amax / 127.0f : NAN, inv = finite && amax >= 0x1p-100f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < BLOCK; i++) {
                float t = v[i] * inv, hi = nearbyintf(t);
                xq[r * k + b * BLOCK + i] = (int8_t)hi;
                rq[r * k + b * BLOCK + i] = (int8_t)nearbyintf((t - hi) * 254.0f);
            }
            unit[r * (k / BLOCK) + b] = scale / SPLIT;
            sx[r * (k / BLOCK) + b] = sum;
        }
    }
}

static inline void store_row(void *y, int y_bf16, int64_t n, int64_t r, int64_t col0, const float *v, int64_t width,
                             float unscale) {
    for (int64_t c = 0; c < width; c++) {
        if (y_bf16)
            ((uint16_t *)y)[r * n + col0 + c] = float_to_bf16(v[c] * unscale);
        else
            ((float *)y)[r * n + col0 + c] = v[c] * unscale;
    }
}

#if HAVE_VNNI
static void panel_tile(const uint8_t *codes, int bits, const uint16_t *d, const uint16_t *m, int64_t blocks,
                       const int8_t *xq, const int8_t *rq, const float *unit, const float *sx, const int32_t *bias,
                       int64_t k, int64_t tile_rows, float out[TILE][PANEL]) {
    const __m512i low = _mm512_set1_epi8(0x0f), split = _mm512_set1_epi32(SPLIT);
    __m512 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i dot[TILE], rest[TILE];
        for (int r = 0; r < TILE; r++) dot[r] = rest[r] = _mm512_setzero_si512();
        if (bits == 8) {
            const uint8_t *q = codes + b * (PANEL * BLOCK);
            for (int g = 0; g < 8; g++) _mm_prefetch((const char *)(q + AHEAD + 64 * g), _MM_HINT_T0);
            for (int g = 0; g < 8; g++) {
                __m512i w = _mm512_loadu_si512((const void *)(q + 64 * g));
                for (int r = 0; r < tile_rows; r++) {
                    int32_t a, c;
                    memcpy(&a, xq + r * k + b * BLOCK + 4 * g, 4);
                    memcpy(&c, rq + r * k + b * BLOCK + 4 * g, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(a));
                    rest[r] = _mm512_dpbusd_epi32(rest[r], w, _mm512_set1_epi32(c));
                }
            }
        } else {
            const uint8_t *q = codes + b * (PANEL * BLOCK / 2);
            for (int g = 0; g < 4; g++) _mm_prefetch((const char *)(q + AHEAD + 64 * g), _MM_HINT_T0);
            for (int g = 0; g < 4; g++) {
                __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * g));
                __m512i lo = _mm512_and_si512(packed, low), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                for (int r = 0; r < tile_rows; r++) {
                    const int8_t *xb = xq + r * k + b * BLOCK + 8 * g, *rb = rq + r * k + b * BLOCK + 8 * g;
                    int32_t a, c, e, f;
                    memcpy(&a, xb, 4);
                    memcpy(&c, xb + 4, 4);
                    memcpy(&e, rb, 4);
                    memcpy(&f, rb + 4, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(a));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(c));
                    rest[r] = _mm512_dpbusd_epi32(rest[r], lo, _mm512_set1_epi32(e));
                    rest[r] = _mm512_dpbusd_epi32(rest[r], hi, _mm512_set1_epi32(f));
                }
            }
        }
        __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * PANEL)));
        for (int r = 0; r < tile_rows; r++) {
            int64_t at = r * (k / BLOCK) + b;
            /* q . (SPLIT xq + rq), less the Q8_0 codes' offset of 128 times the same sum of the inputs */
            __m512i whole = _mm512_add_epi32(_mm512_mullo_epi32(dot[r], split), rest[r]);
            if (bits == 8) whole = _mm512_sub_epi32(whole, _mm512_set1_epi32(bias[at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole), _mm512_mul_ps(db, _mm512_set1_ps(unit[at])),
                                     acc[r]);
        }
        if (m != NULL) {
            __m512 mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * PANEL)));
            for (int r = 0; r < tile_rows; r++)
                acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[r * (k / BLOCK) + b]), acc[r]);
        }
    }
    for (int r = 0; r < tile_rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#else
static void panel_tile(const uint8_t *codes, int bits, const uint16_t *d, const uint16_t *m, int64_t blocks,
                       const int8_t *xq, const int8_t *rq, const float *unit, const float *sx, const int32_t *bias,
                       int64_t k, int64_t tile_rows, float out[TILE][PANEL]) {
    for (int r = 0; r < tile_rows; r++) {
        for (int c = 0; c < PANEL; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *xb = xq + r * k + b * BLOCK, *rb = rq + r * k + b * BLOCK;
                int32_t dot = 0, rest = 0;
                if (bits == 8) {
                    const uint8_t *q = codes + b * (PANEL * BLOCK);
                    for (int g = 0; g < 8; g++) {
                        for (int i = 0; i < 4; i++) {
                            dot += q[64 * g + 4 * c + i] * xb[4 * g + i];
                            rest += q[64 * g + 4 * c + i] * rb[4 * g + i];
                        }
                    }
                } else {
                    const uint8_t *q = codes + b * (PANEL * BLOCK / 2);
                    for (int g = 0; g < 4; g++) {
                        for (int i = 0; i < 4; i++) {
                            uint8_t byte = q[64 * g + 4 * c + i];
                            dot += (byte & 15) * xb[8 * g + i] + (byte >> 4) * xb[8 * g + 4 + i];
                            rest += (byte & 15) * rb[8 * g + i] + (byte >> 4) * rb[8 * g + 4 + i];
                        }
                    }
                }
                int64_t at = r * (k / BLOCK) + b;
                int32_t whole = dot * SPLIT + rest - (bits == 8 ? bias[at] : 0);
                acc = fmaf((float)whole, half_to_float(d[b * PANEL + c]) * unit[at], acc);
                if (m != NULL) acc = fmaf(half_to_float(m[b * PANEL + c]), sx[at], acc);
            }
            out[r][c] = acc;
        }
    }
}
#endif

/* y [rows, n] (float32, or bfloat16 with y_bf16) = x [rows, k] (float32, or bfloat16 with x_bf16)
 * times the packed weight of n output columns (k a multiple of 32): 4-bit codes (bits 4), or 8-bit
 * ones (bits 8: Q8_0's codes plus 128, m NULL). Returns 0, or -2 when the scratch of
 * the rounded inputs cannot be allocated. */
int block_gemm(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *codes, int bits, const uint16_t *d,
               const uint16_t *m, int64_t n, void *y, int y_bf16, int threads) {
    int64_t blocks = k / BLOCK, panels = (n + PANEL - 1) / PANEL;
    int64_t panel_bytes = blocks * PANEL * BLOCK / (bits == 8 ? 1 : 2);
    int8_t *xq = malloc((size_t)(2 * rows * k)), *rq = xq == NULL ? NULL : xq + rows * k;
    float *scales = malloc(sizeof(float) * (size_t)(3 * rows * blocks + rows));
    if (xq == NULL || scales == NULL) {
        free(xq);
        free(scales);
        return -2;
    }
    float *unit = scales, *sx = scales + rows * blocks;
    int32_t *bias = (int32_t *)(scales + 2 * rows * blocks);
    float *unscale = scales + 3 * rows * blocks;
    quantize_rows(x, x_bf16, rows, k, xq, rq, unit, sx, unscale);
    for (int64_t i = 0; bits == 8 && i < rows * blocks; i++) { /* Q8_0's offset of 128, only there */
        int32_t sum = 0;
        for (int j = 0; j < BLOCK; j++) sum += SPLIT * xq[i * BLOCK + j] + rq[i * BLOCK + j];
        bias[i] = 128 * sum;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *pc = codes + p * panel_bytes;
        const uint16_t *pd = d + p * blocks * PANEL, *pm = m == NULL ? NULL : m + p * blocks * PANEL;
        int64_t width = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int64_t tile = rows - r0 < TILE ? rows - r0 : TILE;
            float out[TILE][PANEL];
            panel_tile(pc, bits, pd, pm, blocks, xq + r0 * k, rq + r0 * k, unit + r0 * blocks, sx + r0 * blocks,
                       bias + r0 * blocks, k, tile, out);
            for (int64_t r = 0; r < tile; r++)
                store_row(y, y_bf16, n, r0 + r, p * PANEL, out[r], width, unscale[r0 + r]);
        }
    }
    free(xq);
    free(scales);
    return 0;
}
