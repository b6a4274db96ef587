// R2R's folded router (routers.py FoldedR2R) over a step's rows in one call: the torch form spends
// most of its time in the overhead of its ~20 calls at the few rows a decode step has.
//
// Every product reads its weight input-major (in x out, out contiguous) and walks the weight once
// for all rows, so each weight row is read once per call whatever the row count; float32 throughout,
// as the module's parameters are (a bfloat16 copy would move scores the calibrated threshold was
// set on).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *norm_w, *norm_b, *up, *up_b, *down, *down_b;  // up: width x 4 width; down: 4 width x width
    float eps;
} Block;

typedef struct {
    int64_t hidden, top_k, width, blocks, vocab;
    const float *token_rows;   // vocab x width: the input projection's token columns times the embedding
    const float *hidden_map;   // hidden x width
    const float *logit_map;    // top_k x width
    const float *bias;         // width
    const Block *block;
    const float *norm_w, *norm_b, *out;  // out: width
    float norm_eps, out_bias;
} Router;

#define STEP 8

// The four-row step of `product`: the 4 x STEP inputs copied out first, so that the compiler sees no
// store to y reaching them.
static void quad(const float *x, int64_t xs, const float *restrict wi, int64_t n, float *restrict y) {
    float a[4][STEP];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < STEP; t++) a[r][t] = x[r * xs + t];
    for (int64_t j = 0; j < n; j++) {
        float s0 = y[j], s1 = y[n + j], s2 = y[2 * n + j], s3 = y[3 * n + j];
        for (int t = 0; t < STEP; t++) {
            const float v = wi[t * n + j];
            s0 += a[0][t] * v; s1 += a[1][t] * v; s2 += a[2][t] * v; s3 += a[3][t] * v;
        }
        y[j] = s0; y[n + j] = s1; y[2 * n + j] = s2; y[3 * n + j] = s3;
    }
}

// y[r, :n] += sum_i x[r, i] * w[i, :n] for every row r (x's rows `xs` apart, y's `n`). The
// weight's rows are read in runs of STEP, in order (the prefetcher streams them), and each run is
// applied to four rows at a time while it sits in L1: STEP x 4 products per load and store of y.
static void product(const float *x, int64_t xs, int64_t rows, const float *w, int64_t k, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + STEP <= k; i += STEP) {
        const float *wi = w + i * n;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) quad(x + r * xs + i, xs, wi, n, y + r * n);
        for (; r < rows; r++) {
            const float *a = x + r * xs + i;
            float *yr = y + r * n;
            for (int64_t j = 0; j < n; j++) {
                float s = yr[j];
                for (int t = 0; t < STEP; t++) s += a[t] * wi[t * n + j];
                yr[j] = s;
            }
        }
    }
    for (; i < k; i++) {
        const float *wi = w + i * n;
        for (int64_t r = 0; r < rows; r++) {
            const float a = x[r * xs + i];
            float *yr = y + r * n;
            for (int64_t j = 0; j < n; j++) yr[j] += a * wi[j];
        }
    }
}

// One row's LayerNorm into out; mean and variance in double (cheap at this width, and no float
// summation order to match).
static void layer_norm(const float *x, int64_t n, const float *w, const float *b, float eps, float *out) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < n; j++) mean += x[j];
    mean /= (double)n;
    for (int64_t j = 0; j < n; j++) var += ((double)x[j] - mean) * ((double)x[j] - mean);
    const float m = (float)mean, rstd = (float)(1.0 / sqrt(var / (double)n + (double)eps));
    for (int64_t j = 0; j < n; j++) out[j] = (x[j] - m) * rstd * w[j] + b[j];
}

// logits[r] for rows hidden[r] (row stride hs), tokens[r], top[r] (row stride ts); 0, or -1 when out of
// memory, -2 when a token is outside the vocabulary. One thread: the router runs between a model's
// steps, outside the step's claim on the second core (engine/step_board.py), and at 8 rows and more a
// second thread here did not pay for its barriers.
int r2r_score(const Router *m, const float *hidden, int64_t hs, const int64_t *tokens, const float *top,
              int64_t ts, int64_t rows, float *logits) {
    const int64_t w = m->width, w4 = 4 * m->width;
    float *x = malloc(sizeof(float) * rows * w), *n = malloc(sizeof(float) * rows * w);
    float *u = malloc(sizeof(float) * rows * w4);
    int rc = 0;
    if (x == NULL || n == NULL || u == NULL) { rc = -1; goto done; }
    for (int64_t r = 0; r < rows; r++) {
        if (tokens[r] < 0 || tokens[r] >= m->vocab) { rc = -2; goto done; }
        const float *t = m->token_rows + tokens[r] * w;
        for (int64_t j = 0; j < w; j++) x[r * w + j] = m->bias[j] + t[j];
    }
    product(hidden, hs, rows, m->hidden_map, m->hidden, w, x);
    product(top, ts, rows, m->logit_map, m->top_k, w, x);
    for (int64_t b = 0; b < m->blocks; b++) {
        const Block *k = &m->block[b];
        for (int64_t r = 0; r < rows; r++) {
            layer_norm(x + r * w, w, k->norm_w, k->norm_b, k->eps, n + r * w);
            memcpy(u + r * w4, k->up_b, sizeof(float) * w4);
        }
        product(n, w, rows, k->up, w, w4, u);
#pragma omp simd
        for (int64_t i = 0; i < rows * w4; i++) u[i] = 0.5f * u[i] * (1.0f + erff(u[i] * 0.70710678118654752f));
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < w; j++) x[r * w + j] += k->down_b[j];
        product(u, w4, rows, k->down, w4, w, x);
    }
    for (int64_t r = 0; r < rows; r++) {
        layer_norm(x + r * w, w, m->norm_w, m->norm_b, m->norm_eps, n + r * w);
        float acc = m->out_bias;
        for (int64_t j = 0; j < w; j++) acc += n[r * w + j] * m->out[j];
        logits[r] = acc;
    }
done:
    free(x); free(n); free(u);
    return rc;
}
