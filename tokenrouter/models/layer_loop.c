/* A decoder's layers over a few rows in one C call: the loop `DecoderLayer.fused_forward` runs in
 * Python, for layers whose four products are GGUF blocks on block_gemm and whose attention is the
 * paged kernel. See tokenrouter/models/layer_loop.py.
 *
 * Every product, norm, rotation, SiLU and attention is the very function the Python loop calls,
 * reached through a pointer to it in its own library (block_gemm.c, fused_ops.c, paged_decode.c,
 * each built with its own flags), so the results are bit for bit the Python loop's. What runs here
 * is only what PyTorch ran between them, each exact: bfloat16 to float32 (exact), float32 to
 * bfloat16 (to nearest even, NaN to 0x7fc0, as torch converts), the K/V rows copied into the pool,
 * and the residual add float32(bf16) + x (one rounding, as torch adds a bfloat16 and a float32
 * tensor), which is fused into the next norm as its residual, as the Python loop's next norm would
 * compute it from the sum.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gemm_fn)(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *codes, int bits,
                       const uint16_t *d, const uint16_t *m, int64_t n, void *y, int y_bf16, int threads);
typedef int (*norm_fn)(const void *x, int64_t x_bf16, int64_t ld, const float *res, const float *w, float eps,
                       int64_t rows, int64_t dim, float *sum, uint16_t *out);
typedef void (*rotate_fn)(const float *x, int64_t ld, int64_t rows, int64_t heads, int64_t d, const float *cos,
                          const float *sin, float *out);
typedef int (*silu_fn)(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t n, uint16_t *out);
typedef int (*attend_fn)(const float *q, const float *kc, const float *vc, const int64_t *page_table,
                         int64_t table_stride, const int64_t *reqs, const int64_t *rows, const int64_t *lens,
                         int64_t n, int64_t h, int64_t hkv, int64_t d, int64_t page_size, float scale, float *out);

/* The functions the loop calls (LayerLoop in layer_loop.py fills it from the three libraries). */
typedef struct {
    gemm_fn gemm;
    norm_fn norm;
    rotate_fn rotate;
    silu_fn silu;
    attend_fn attend;
} functions;

/* One product's packed blocks (block_gemm.py PackedBlocks). */
typedef struct {
    const uint8_t *codes;
    const uint16_t *d, *m;
    int64_t bits, n, k;
} blocks;

/* One layer: its norms' weights and its products, in the order q/k/v, o, gate/up, down. */
typedef struct {
    const float *input_norm, *post_norm;
    blocks w[4];
} layer;

/* The model's shape. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim;
    float eps;
} shape;

/* The step: its rows' rotary angles ([rows, d] each), K/V slots, and the paged kernel's plan for them
 * (every row attends through it); the pool's K and V of layer 0 and the floats between layers. */
typedef struct {
    const float *cos, *sin;
    const int64_t *slots, *page_table, *reqs, *rows, *lens;
    int64_t table_stride, page_size;
    float *kc, *vc;
    int64_t layer_stride;
    float scale;
} step;

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int product(const functions *f, const blocks *w, const void *x, int64_t rows, uint16_t *y, int threads) {
    return f->gemm(x, 1, rows, w->k, w->codes, (int)w->bits, w->d, w->m, w->n, y, 1, threads);
}

/* x [rows, hidden] float32: in, the hidden rows entering layer 0; out, those leaving the last layer.
 * Returns 0; -2 when a buffer cannot be allocated; the attention kernel's code minus 100 where it
 * fails (paged_decode.c: -101, -102, -103). */
int decode_layers(const functions *f, const layer *ls, const shape *s, const step *st, float *x, int64_t rows,
                  int threads) {
    const int64_t h = s->heads, hk = s->kv_heads, d = s->head_dim, width = (h + 2 * hk) * d;
    int64_t widest = width;
    for (int64_t l = 0; l < s->layers; l++)
        for (int i = 0; i < 4; i++) widest = ls[l].w[i].n > widest ? ls[l].w[i].n : widest;
    uint16_t *a = malloc(sizeof(uint16_t) * (size_t)(rows * widest)), *b = malloc(sizeof(uint16_t) * (size_t)(rows * widest));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * width)), *qk = malloc(sizeof(float) * (size_t)(rows * (h + hk) * d));
    float *att = malloc(sizeof(float) * (size_t)(rows * h * d)), *sum = malloc(sizeof(float) * (size_t)(rows * s->hidden));
    int rc = 0;
    if (!a || !b || !qkv || !qk || !att || !sum) {
        rc = -2;
        goto done;
    }
    const uint16_t *pending = NULL; /* the last layer's down product, not yet added to x */
    for (int64_t l = 0; l < s->layers && rc == 0; l++) {
        const layer *L = &ls[l];
        float *kc = st->kc + l * st->layer_stride, *vc = st->vc + l * st->layer_stride;
        /* input norm, of x + the previous layer's down product where there is one */
        if (pending) {
            if ((rc = f->norm(pending, 1, s->hidden, x, L->input_norm, s->eps, rows, s->hidden, sum, a))) break;
            memcpy(x, sum, sizeof(float) * (size_t)(rows * s->hidden));
        } else if ((rc = f->norm(x, 0, s->hidden, NULL, L->input_norm, s->eps, rows, s->hidden, NULL, a))) {
            break;
        }
        if ((rc = product(f, &L->w[0], a, rows, b, threads))) break;
        for (int64_t i = 0; i < rows * width; i++) qkv[i] = from_bf16(b[i]);
        f->rotate(qkv, width, rows, h + hk, d, st->cos, st->sin, qk);
        for (int64_t r = 0; r < rows; r++) { /* this step's K and V into the pool, before any row attends */
            memcpy(kc + st->slots[r] * hk * d, qk + (r * (h + hk) + h) * d, sizeof(float) * (size_t)(hk * d));
            memcpy(vc + st->slots[r] * hk * d, qkv + r * width + (h + hk) * d, sizeof(float) * (size_t)(hk * d));
        }
        for (int64_t r = 0; r < rows; r++) /* q alone, contiguous, as the kernel reads it */
            memmove(qk + r * h * d, qk + r * (h + hk) * d, sizeof(float) * (size_t)(h * d));
        if ((rc = f->attend(qk, kc, vc, st->page_table, st->table_stride, st->reqs, st->rows, st->lens, rows, h, hk, d,
                            st->page_size, st->scale, att))) {
            rc -= 100;
            break;
        }
        for (int64_t i = 0; i < rows * h * d; i++) a[i] = to_bf16(att[i]);
        if ((rc = product(f, &L->w[1], a, rows, b, threads))) break;
        if ((rc = f->norm(b, 1, s->hidden, x, L->post_norm, s->eps, rows, s->hidden, sum, a))) break;
        memcpy(x, sum, sizeof(float) * (size_t)(rows * s->hidden));
        if ((rc = product(f, &L->w[2], a, rows, b, threads))) break;
        if ((rc = f->silu(b, L->w[2].n, rows, L->w[2].n / 2, a))) break;
        if ((rc = product(f, &L->w[3], a, rows, b, threads))) break;
        pending = b;
    }
    if (rc == 0 && pending)
        for (int64_t i = 0; i < rows * s->hidden; i++) x[i] = from_bf16(pending[i]) + x[i];
done:
    free(a);
    free(b);
    free(qkv);
    free(qk);
    free(att);
    free(sum);
    return rc;
}
