/* Every decoder layer of a decode step in one call (decode_layers.py builds and loads this file): the same kernels
   the fast step calls one by one from Python (tile matmuls, fused norms, RoPE, SiLU, decode attention), called here
   in the same order on the same buffers, so the step's arithmetic is unchanged and only the interpreter's work
   between them goes. The kernels come as function pointers from their own libraries. */
#include <stdint.h>
#include <string.h>

typedef int (*gemm_fn)(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads);
typedef int (*glu_fn)(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                      int64_t group, const void *combine, uint16_t *out, int64_t out_stride, int threads);
typedef int (*add_norm_fn)(uint16_t *hidden, const uint16_t *addend, const uint16_t *weight, uint16_t *out,
                           int64_t rows, int64_t width, float eps);
typedef void (*rope_fn)(const uint16_t *x, int64_t row_stride, const uint16_t *cos, const uint16_t *sin,
                        uint16_t *out, int64_t rows, int64_t heads, int64_t dim);
typedef void (*silu_mul_fn)(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int64_t rows, int64_t width,
                            int threads);
typedef int (*attention_fn)(const uint16_t *query, int64_t query_row_stride, const uint16_t *keys,
                            const uint16_t *values, int64_t kv_row_stride, int64_t kv_head_stride, const float *bias,
                            int64_t positions, uint16_t *out, int64_t rows, int64_t kv_heads, int64_t group,
                            int64_t dim, float scale, int threads);

typedef struct {
    gemm_fn gemm;
    glu_fn glu;
    const void *silu_sums; /* the SiLU `glu` combines the gate's and up's sums with */
    add_norm_fn add_norm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    attention_fn attention;
} kernels;

typedef struct { /* a weight packed for the tiles (tile_weights.py) and its bias (NULL: none) */
    const uint16_t *packed, *bias;
    int64_t n, k, group;
} weight;

typedef struct {
    const uint16_t *input_norm, *post_norm;
    float input_eps, post_eps;
    weight qkv, o, gate_up, down;
    uint16_t *keys, *values; /* the layer's room: row r, KV head h, position p at + r * kv_row_stride + h *
                                kv_head_stride + p * dim */
    int64_t kv_row_stride, kv_head_stride;
} layer;

typedef struct {
    int64_t rows, hidden_size, heads, kv_heads, dim, intermediate, length; /* the new keys go to position `length` */
    float scale;
    int threads;
    const uint16_t *cos, *sin; /* [rows, dim] each, sin's first half negated */
    const float *bias;         /* [rows, length + 1]: -inf where not attended */
    const uint16_t *final_norm;
    float final_eps;
    uint16_t *hidden, *normed, *qkv, *rotated, *attended, *projected, *gate_up, *activated; /* scratch, by shape */
} step;

static int multiply(const kernels *k, const weight *w, const uint16_t *x, int64_t rows, uint16_t *y, int threads) {
    return k->gemm(x, w->k, rows, w->k, w->packed, w->n, w->group, w->bias, y, w->n, threads);
}

/* SiLU of the gate times up, from s->normed into s->activated: from the tiles' sums where the weight has no bias
   (`glu` refuses weights whose halves are not whole groups), else after the matmul into s->gate_up. */
static int activate(const kernels *k, const weight *w, const step *s) {
    const uint16_t *x = s->normed;
    if (!w->bias && k->glu(x, w->k, s->rows, w->k, w->packed, w->n, w->group, k->silu_sums, s->activated,
                           s->intermediate, s->threads) == 0)
        return 0;
    if (multiply(k, w, x, s->rows, s->gate_up, s->threads)) return -1;
    k->silu_mul(s->gate_up, 2 * s->intermediate, s->activated, s->rows, s->intermediate, s->threads);
    return 0;
}

/* One layer on s->normed (its input norm's output); leaves the next norm's output (`next`, `next_eps`) there. */
static int run_layer(const kernels *k, const layer *l, const step *s, const uint16_t *next, float next_eps) {
    int64_t rows = s->rows, dim = s->dim, heads = s->heads, kv = s->kv_heads;
    int64_t qkv_width = (heads + 2 * kv) * dim, rotated_width = (heads + kv) * dim;
    if (multiply(k, &l->qkv, s->normed, rows, s->qkv, s->threads)) return -1;
    k->rope(s->qkv, qkv_width, s->cos, s->sin, s->rotated, rows, heads + kv, dim);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv; h++) {
            int64_t at = r * l->kv_row_stride + h * l->kv_head_stride + s->length * dim;
            memcpy(l->keys + at, s->rotated + r * rotated_width + (heads + h) * dim, (size_t)dim * 2);
            memcpy(l->values + at, s->qkv + r * qkv_width + (heads + kv + h) * dim, (size_t)dim * 2);
        }
    if (k->attention(s->rotated, rotated_width, l->keys, l->values, l->kv_row_stride, l->kv_head_stride, s->bias,
                     s->length + 1, s->attended, rows, kv, heads / kv, dim, s->scale, s->threads))
        return -2;
    if (multiply(k, &l->o, s->attended, rows, s->projected, s->threads)) return -1;
    if (k->add_norm(s->hidden, s->projected, l->post_norm, s->normed, rows, s->hidden_size, l->post_eps)) return -3;
    if (activate(k, &l->gate_up, s)) return -1;
    if (multiply(k, &l->down, s->activated, rows, s->projected, s->threads)) return -1;
    if (k->add_norm(s->hidden, s->projected, next, s->normed, rows, s->hidden_size, next_eps)) return -3;
    return 0;
}

/* The `count` layers of one decode step on s->hidden [rows, hidden_size] (updated in place): s->normed gets the
   final norm's output. Each layer appends its keys and values at position `length` of its room. Returns 0, -1 when
   a matmul refuses its shapes, -2 when the attention cannot allocate its scratch, -3 when a norm cannot. */
int decode_layers(const kernels *k, const layer *layers, int64_t count, const step *s) {
    if (k->add_norm(s->hidden, NULL, layers[0].input_norm, s->normed, s->rows, s->hidden_size, layers[0].input_eps))
        return -3;
    for (int64_t i = 0; i < count; i++) {
        const uint16_t *next = i + 1 < count ? layers[i + 1].input_norm : s->final_norm;
        float next_eps = i + 1 < count ? layers[i + 1].input_eps : s->final_eps;
        int status = run_layer(k, &layers[i], s, next, next_eps);
        if (status) return status;
    }
    return 0;
}
