/* The element-wise work between a decoder layer's products, float32 on CPU, each one pass over its
 * rows: RMSNorm (with the residual add before it), the rotary rotation, SiLU(gate) * up, and the
 * greedy argmax. In PyTorch each is several dispatched ops (RMSNorm about eight), which at decode's
 * few rows cost more than their arithmetic. See tokenrouter/models/fused_ops.py.
 *
 * Built with -ffast-math (the sum of squares vectorised, exp from glibc's vector library) but with
 * -ffp-contract=off, so the rotation rounds x*cos and x'*sin apart as PyTorch does (bit-identical);
 * the norm's sum and the exp differ from PyTorch's by float rounding.
 *
 * The bfloat16 variants read and write the quantized products' own bfloat16 (their inputs and
 * outputs, models/quantized_linear.py), so a layer hands its rows on without a conversion op each
 * way; they compute in float32 exactly as the float32 ones (the same row helpers) and round as torch
 * rounds, to nearest even, so their results are the float32 ones' converted by torch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* As torch's c10::BFloat16 conversion: NaN to 0x7fc0, else to nearest even. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 1 / sqrt(mean(h^2) + eps) over a row of dim; one copy of the code for both norms (noinline), so the
 * vectorised sum adds in the same order in each. */
__attribute__((noinline)) static float inverse_rms(const float *h, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < dim; j++) ss += h[j] * h[j];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* Row r, head g of x (at x + r * ld + g * dim) normalised: out[r, g] = w * h / sqrt(mean(h^2) + eps),
 * with h that head (+ res[r, g], then also written to sum[r, g]). out, res and sum are contiguous
 * [rows, heads, dim]. Heads let Qwen3's per-head q and k norms read the fused q/k/v rows in place. */
void add_rms_norm_f32(const float *x, int64_t ld, const float *res, const float *w, float eps, int64_t rows,
                      int64_t heads, int64_t dim, float *sum, float *out) {
    for (int64_t i = 0; i < rows * heads; i++) {
        const float *xr = x + (i / heads) * ld + (i % heads) * dim;
        const float *h = xr;
        if (res) {
            float *hs = sum + i * dim;
            const float *rr = res + i * dim;
#pragma omp simd
            for (int64_t j = 0; j < dim; j++) hs[j] = xr[j] + rr[j];
            h = hs;
        }
        const float scale = inverse_rms(h, dim, eps);
        float *o = out + i * dim;
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) o[j] = w[j] * (h[j] * scale);
    }
}

/* add_rms_norm_f32 on one-head rows with out in bfloat16, and x in bfloat16 where x_bf16 (then with
 * res: sum = x + res in float32, as torch adds a bfloat16 and a float32 tensor). */
void add_rms_norm_bf16(const void *x, int64_t x_bf16, int64_t ld, const float *res, const float *w, float eps,
                       int64_t rows, int64_t dim, float *sum, uint16_t *out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *h = (const float *)x + i * ld;
        if (res) {
            float *hs = sum + i * dim;
            const float *rr = res + i * dim;
            if (x_bf16) {
                const uint16_t *xr = (const uint16_t *)x + i * ld;
#pragma omp simd
                for (int64_t j = 0; j < dim; j++) hs[j] = from_bf16(xr[j]) + rr[j];
            } else {
#pragma omp simd
                for (int64_t j = 0; j < dim; j++) hs[j] = h[j] + rr[j];
            }
            h = hs;
        }
        const float scale = inverse_rms(h, dim, eps);
        uint16_t *o = out + i * dim;
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) o[j] = to_bf16(w[j] * (h[j] * scale));
    }
}

/* Rows of `heads` heads of size d (row stride ld) rotated by their row's angles: cos and sin [rows, d]
 * as (cos | cos) and (-sin | sin), so out = x * cos + swap_halves(x) * sin. out is [rows, heads, d]. */
void rotate_f32(const float *x, int64_t ld, int64_t rows, int64_t heads, int64_t d, const float *cos,
                const float *sin, float *out) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * ld + h * d;
            float *o = out + (r * heads + h) * d;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) o[j] = xh[j] * c[j] + xh[j + half] * s[j];
#pragma omp simd
            for (int64_t j = half; j < d; j++) o[j] = xh[j] * c[j] + xh[j - half] * s[j];
        }
    }
}

/* out[r, j] = silu(g[r, j]) * u[r, j], with g and u the two halves of row r of gate_up (row stride ld). */
void silu_mul_f32(const float *gate_up, int64_t ld, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * ld, *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* silu_mul_f32 on bfloat16 rows, rounded to bfloat16. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t n, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * ld, *u = g + n;
        uint16_t *o = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            const float gj = from_bf16(g[j]);
            o[j] = to_bf16(gj / (1.0f + expf(-gj)) * from_bf16(u[j]));
        }
    }
}

/* The first index of each row's largest value (rows of width n, row stride ld), as torch.argmax for
 * finite rows. */
void argmax_f32(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        float best = xr[0];
        int64_t at = 0;
        for (int64_t j = 1; j < n; j++)
            if (xr[j] > best) { best = xr[j]; at = j; }
        out[r] = at;
    }
}
