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
 * way. They widen a row into an aligned float32 scratch row, run the very row helpers the float32
 * ops run (noinline: one copy of the machine code, so vectorisation and its tails cannot differ
 * between the two), and round as torch rounds, to nearest even: their results are the float32
 * ones' converted by torch. They return 0, or -2 when the scratch row cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* The row helpers (noinline; see the top). */
__attribute__((noinline)) static void norm_row(const float *h, const float *w, float eps, int64_t dim, float *o) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < dim; j++) ss += h[j] * h[j];
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t j = 0; j < dim; j++) o[j] = w[j] * (h[j] * scale);
}

__attribute__((noinline)) static void silu_mul_row(const float *g, const float *u, int64_t n, float *o) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* A 64-byte aligned float32 scratch of n floats (as torch aligns its tensors), or NULL. */
static float *scratch(int64_t n) {
    return aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
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
        norm_row(h, w, eps, dim, out + i * dim);
    }
}

/* add_rms_norm_f32 on one-head rows with out in bfloat16, and x in bfloat16 where x_bf16 (then with
 * res: sum = x + res in float32, as torch adds a bfloat16 and a float32 tensor). */
int add_rms_norm_bf16(const void *x, int64_t x_bf16, int64_t ld, const float *res, const float *w, float eps,
                      int64_t rows, int64_t dim, float *sum, uint16_t *out) {
    float *row = scratch(dim);
    if (!row) return -2;
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
        norm_row(h, w, eps, dim, row);
        uint16_t *o = out + i * dim;
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) o[j] = to_bf16(row[j]);
    }
    free(row);
    return 0;
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
        const float *g = gate_up + r * ld;
        silu_mul_row(g, g + n, n, out + r * n);
    }
}

/* silu_mul_f32 on bfloat16 rows, rounded to bfloat16. */
int silu_mul_bf16(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t n, uint16_t *out) {
    float *g = scratch(2 * n), *o = scratch(n);  /* laid out as silu_mul_f32 reads a row and writes one */
    if (!g || !o) {
        free(g);
        free(o);
        return -2;
    }
    float *u = g + n;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gb = gate_up + r * ld;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) g[j] = from_bf16(gb[j]);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) u[j] = from_bf16(gb[n + j]);
        silu_mul_row(g, u, n, o);
        uint16_t *ob = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) ob[j] = to_bf16(o[j]);
    }
    free(g);
    free(o);
    return 0;
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
