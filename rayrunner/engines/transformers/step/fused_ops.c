/* Fused bf16 operations of the fast decode step (fused_ops.py builds and loads this file). Each rounds as the
   PyTorch operations it replaces round: every intermediate bf16 tensor of those is rounded here too. */
#include <math.h>
#include <stdint.h>

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

/* For each of `rows` rows of `width`: hidden += addend (rounded to bf16; skipped when addend is NULL), then
   out = weight * bf16(hidden * rsqrt(mean(hidden^2) + eps)), the float32 arithmetic of transformers' LlamaRMSNorm. */
void add_rms_norm(uint16_t *hidden, const uint16_t *addend, const uint16_t *weight, uint16_t *out, int64_t rows,
                  int64_t width, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * width;
        uint16_t *o = out + r * width;
        if (addend) {
            const uint16_t *a = addend + r * width;
            for (int64_t i = 0; i < width; i++) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(a[i]));
        }
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) {
            float x = bf16_to_float(h[i]);
            squares += x * x;
        }
        float scale = 1.f / sqrtf(squares / (float)width + eps);
        for (int64_t i = 0; i < width; i++)
            o[i] = float_to_bf16(bf16_to_float(weight[i]) * bf16_to_float(float_to_bf16(bf16_to_float(h[i]) * scale)));
    }
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
