/* Fused bf16 operations of the fast decode step (fused_ops.py builds and loads this file). Each rounds as the
   PyTorch operations it replaces round: every intermediate bf16 tensor of those is rounded here too. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as PyTorch; NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* The sum of `x[0..n)` in the order PyTorch's CPU kernel sums a contiguous float32 row (aten's SumKernel.cpp:
   `vectorized_inner_sum` over vectors of 8 floats (it has no AVX-512 build: AVX-512 CPUs run its AVX2 one), its
   `row_sum` over 4 interleaved accumulators, each a `multi_row_sum` cascade of 4 levels; then the scalar tail and
   the lanes in order), so that a norm's scale is PyTorch's to the bit. */
static float torch_order_sum(const float *x, int64_t n) {
    enum { ILP = 4, LEVELS = 4, LANES = 8 };
    float acc[LEVELS][ILP][LANES] = {{{0}}};
    const int64_t lanes = LANES;
    int64_t vectors = n / lanes, rows = vectors / ILP;
    int64_t log2 = 0;
    while (((int64_t)1 << log2) < rows) log2++;
    int64_t power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * ILP + k) * lanes + l];
        for (int64_t level = 1; level < LEVELS; level++) {
            for (int64_t k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int64_t k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(i * ILP + k) * lanes + l];
    for (int64_t level = 1; level < LEVELS; level++)
        for (int64_t k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = rows * ILP; v < vectors; v++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l];
    for (int64_t k = 1; k < ILP; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int64_t t = vectors * lanes; t < n; t++) total += x[t];
    for (int64_t l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* For each of `rows` rows of `width`: hidden += addend (rounded to bf16; skipped when addend is NULL), then
   out = weight * bf16(hidden * rsqrt(mean(hidden^2) + eps)), transformers' LlamaRMSNorm in float32, the mean summed
   in PyTorch's order (`torch_order_sum`). Returns 0, or -1 when its scratch row cannot be allocated. */
int add_rms_norm(uint16_t *hidden, const uint16_t *addend, const uint16_t *weight, uint16_t *out, int64_t rows,
                 int64_t width, float eps) {
    float *squares = malloc(sizeof(float) * (size_t)width);
    if (!squares) return -1;
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * width;
        uint16_t *o = out + r * width;
        if (addend) {
            const uint16_t *a = addend + r * width;
            for (int64_t i = 0; i < width; i++) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(a[i]));
        }
        for (int64_t i = 0; i < width; i++) {
            float x = bf16_to_float(h[i]);
            squares[i] = x * x;
        }
        float scale = 1.f / sqrtf(torch_order_sum(squares, width) / (float)width + eps);
        for (int64_t i = 0; i < width; i++)
            o[i] = float_to_bf16(bf16_to_float(weight[i]) * bf16_to_float(float_to_bf16(bf16_to_float(h[i]) * scale)));
    }
    free(squares);
    return 0;
}

/* RoPE on the first `heads` heads (of `dim`) of each of `rows` rows of `x` (a row every `row_stride` elements):
   out = bf16(x * cos) + bf16(roll(x, dim / 2) * sin), rounded to bf16, where `sin` holds its first half negated
   (fast_decode's form of transformers' rotate_half); `cos` and `sin` are [rows, dim], `out` [rows, heads, dim]. */
void rope(const uint16_t *x, int64_t row_stride, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
          int64_t rows, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *in = x + r * row_stride + h * dim;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) { /* the halves swapped: turned[d] = in[(d + half) % dim] */
                int64_t from = d < half ? d + half : d - half;
                float straight = bf16_to_float(float_to_bf16(bf16_to_float(in[d]) * bf16_to_float(c[d])));
                float turned = bf16_to_float(float_to_bf16(bf16_to_float(in[from]) * bf16_to_float(s[d])));
                o[d] = float_to_bf16(straight + turned);
            }
        }
    }
}
