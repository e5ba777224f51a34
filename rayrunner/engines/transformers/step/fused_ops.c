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
