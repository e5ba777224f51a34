/* Fused bf16 operations of the fast decode step (fused_ops.py builds and loads this file). Each rounds as the
   PyTorch operations it replaces round: every intermediate bf16 tensor of those is rounded here too. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* `float_to_bf16` on 16 lanes (in the low half of each 32-bit lane): subnormals kept, as PyTorch keeps them (the
   CPU's own bf16 conversion flushes them to zero). */
static inline __m512i bf16_bits16(__m512 f) {
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
}

/* `float_to_bf16` on 16 lanes, as 16 bf16s: the CPU's conversion, which rounds as it does but for subnormals
   (it flushes them to zero), which take `bf16_bits16`. */
static inline __m256i bf16_round16(__m512 f) {
    __mmask16 subnormal = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ)
                          & _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (__builtin_expect(subnormal != 0, 0)) return _mm512_cvtepi32_epi16(bf16_bits16(f));
    return (__m256i)_mm512_cvtneps_pbh(f);
}

/* 16 bf16s, as floats. */
static inline __m512 widen_bits16(__m256i bf16s) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16s), 16));
}

/* 16 bf16s from `p`, as floats. */
static inline __m512 widen16(const uint16_t *p) { return widen_bits16(_mm256_loadu_si256((const __m256i *)p)); }
#endif

/* PyTorch's float vectors on AVX2 and AVX-512 CPUs: 8 lanes (its sums have no AVX-512 build). */
enum { LANES = 8 };
#if defined(__AVX2__)
typedef __m256 lanes_t;
static inline lanes_t lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lanes_t lanes_load(const float *p) { return _mm256_loadu_ps(p); }
static inline lanes_t lanes_add(lanes_t a, lanes_t b) { return _mm256_add_ps(a, b); }
#else
typedef struct { float l[LANES]; } lanes_t;
static inline lanes_t lanes_zero(void) { lanes_t z = {{0}}; return z; }
static inline lanes_t lanes_load(const float *p) { lanes_t r; memcpy(r.l, p, sizeof r.l); return r; }
static inline lanes_t lanes_add(lanes_t a, lanes_t b) {
    for (int l = 0; l < LANES; l++) a.l[l] += b.l[l];
    return a;
}
#endif

/* The sum of `x[0..n)` in the order PyTorch's CPU kernel sums a contiguous float32 row (aten's SumKernel.cpp:
   `vectorized_inner_sum` over vectors of 8 floats (it has no AVX-512 build: AVX-512 CPUs run its AVX2 one), its
   `row_sum` over 4 interleaved accumulators, each a `multi_row_sum` cascade of 4 levels; then the scalar tail and
   the lanes in order), so that a norm's scale is PyTorch's to the bit. */
static float torch_order_sum(const float *x, int64_t n) {
    enum { ILP = 4, LEVELS = 4 };
    lanes_t acc[LEVELS][ILP];
    for (int64_t level = 0; level < LEVELS; level++)
        for (int64_t k = 0; k < ILP; k++) acc[level][k] = lanes_zero();
    int64_t vectors = n / LANES, rows = vectors / ILP;
    int64_t log2 = 0;
    while (((int64_t)1 << log2) < rows) log2++;
    int64_t power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < ILP; k++) acc[0][k] = lanes_add(acc[0][k], lanes_load(x + (i * ILP + k) * LANES));
        for (int64_t level = 1; level < LEVELS; level++) {
            for (int64_t k = 0; k < ILP; k++) {
                acc[level][k] = lanes_add(acc[level][k], acc[level - 1][k]);
                acc[level - 1][k] = lanes_zero();
            }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int64_t k = 0; k < ILP; k++) acc[0][k] = lanes_add(acc[0][k], lanes_load(x + (i * ILP + k) * LANES));
    for (int64_t level = 1; level < LEVELS; level++)
        for (int64_t k = 0; k < ILP; k++) acc[0][k] = lanes_add(acc[0][k], acc[level][k]);
    for (int64_t v = rows * ILP; v < vectors; v++) acc[0][0] = lanes_add(acc[0][0], lanes_load(x + v * LANES));
    for (int64_t k = 1; k < ILP; k++) acc[0][0] = lanes_add(acc[0][0], acc[0][k]);
    float total = 0.f, lanes[LANES];
    memcpy(lanes, &acc[0][0], sizeof lanes);
    for (int64_t t = vectors * LANES; t < n; t++) total += x[t];
    for (int64_t l = 0; l < LANES; l++) total += lanes[l];
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
        int64_t i = 0;
        if (addend) {
            const uint16_t *a = addend + r * width;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            for (; i + 16 <= width; i += 16)
                _mm256_storeu_si256((__m256i *)(h + i), bf16_round16(_mm512_add_ps(widen16(h + i), widen16(a + i))));
#endif
            for (; i < width; i++) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(a[i]));
        }
        for (i = 0; i < width; i++) {
            float x = bf16_to_float(h[i]);
            squares[i] = x * x;
        }
        float scale = 1.f / sqrtf(torch_order_sum(squares, width) / (float)width + eps);
        i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; i + 16 <= width; i += 16) {
            __m256i normed = bf16_round16(_mm512_mul_ps(widen16(h + i), _mm512_set1_ps(scale)));
            _mm256_storeu_si256((__m256i *)(o + i), bf16_round16(_mm512_mul_ps(widen16(weight + i),
                                                                               widen_bits16(normed))));
        }
#endif
        for (; i < width; i++)
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* `sleef_expf` on 16 lanes. */
static inline __m512 sleef_expf16(__m512 d) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(
                   1.442695040888963407359924681001892137426645954152985934135449406931f)),
                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    u = _mm512_scalef_ps(u, q); /* u * 2^q rounded once: SLEEF's two steps by halves of q, as one */
    u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                              _mm512_set1_ps(INFINITY));
}
#endif

/* exp(d) as SLEEF's expf_u10 computes it (what PyTorch's vectorized float exp calls): operation for operation, the
   multiply-adds fused, so that SiLU rounds as PyTorch's does. */
static inline float sleef_expf(float d) {
    float q = rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf(q, -0.693145751953125f, d);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    int32_t e = (int32_t)q, half = e >> 1;
    union { uint32_t u; float f; } a, b;
    a.u = (uint32_t)(half + 0x7f) << 23;
    b.u = (uint32_t)(e - half + 0x7f) << 23;
    u = u * a.f * b.f;
    if (d < -104.f) u = 0.f;
    if (d > 100.f) u = INFINITY;
    return u;
}

/* bf16(silu(g)) for every bf16 g, indexed by its bits (one more entry: the lanes' 32-bit lookups read past the last),
   filled when the library loads: SiLU is then one lookup. */
static uint16_t silu_table[65536 + 1];

__attribute__((constructor)) static void fill_silu_table(void) {
    int32_t bits = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    for (; bits < 65536; bits += 16) {
        __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(bits), _mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), 16));
        __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), sleef_expf16(_mm512_sub_ps(
            _mm512_setzero_ps(), x))));
        _mm256_storeu_si256((__m256i *)(silu_table + bits), bf16_round16(silu));
    }
#endif
    for (; bits < 65536; bits++) {
        float x = bf16_to_float((uint16_t)bits);
        silu_table[bits] = float_to_bf16(x / (1.0f + sleef_expf(-x)));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16(bf16(silu(gate)) * up) on 16 bf16 lanes of each. */
static inline __m256i silu_mul16(__m256i gate, __m256i up) {
    __m512i silu = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(gate), (const void *)silu_table, 2);
    return bf16_round16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(silu, 16)), widen_bits16(up)));
}

/* `silu_mul` of a matmul's float32 sums, for `tile_gemm_glu` (tile_gemm.c): `rows` rows of 16 gate and 16 up sums
   (16 floats a row each) rounded to bf16 as the tile kernel rounds its outputs (plus a zero bias), then SiLU times
   up into `rows` rows of 16 at `out`, a row every `out_stride`: the bits of the matmul then `silu_mul`. */
void silu_mul_sums(const float *gate, const float *up, int64_t rows, uint16_t *out, int64_t out_stride) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + r * out_stride), silu_mul16(
            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(gate + r * 16), zero)),
            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(up + r * 16), zero))));
}
#endif

/* 1 where `silu_mul` is built with its AVX-512 path: without it the scalar loop is slower than PyTorch's. */
int silu_mul_vectorized(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* out[r] = bf16(silu(gate[r])) * up[r], rounded to bf16, for `rows` rows whose gate is the first `width` values of
   gate_up (a row every `row_stride`) and up the next `width`: transformers' SiLU (x / (1 + exp(-x)) in float32,
   rounded to bf16) and the product after it, as PyTorch rounds them; rows shared among `threads` OpenMP threads
   where they are many. */
void silu_mul(const uint16_t *gate_up, int64_t row_stride, uint16_t *out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * row_stride, *up = gate + width;
        uint16_t *o = out + r * width;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; i + 16 <= width; i += 16) {
            _mm256_storeu_si256((__m256i *)(o + i), silu_mul16(
                _mm256_loadu_si256((const __m256i *)(gate + i)), _mm256_loadu_si256((const __m256i *)(up + i))));
        }
#endif
        for (; i < width; i++) {
            o[i] = float_to_bf16(bf16_to_float(silu_table[gate[i]]) * bf16_to_float(up[i]));
        }
    }
}
