/* int8 weights with one scale per output row (int8_rows.py's layout: q[n, k] row-major, scale[n] bf16) times bf16
   rows, for CPUs with AVX-512 BF16: y[m, n] = bf16(scale[n] * sum over k of x[m, k] * q[n, k]). Each int8 is widened
   to bf16 (exactly: |q| <= 127), multiplied by vdpbf16ps and summed in float32, so the sums are those of float32
   products, as PyTorch's `_weight_int8pack_mm` sums them. int8_rows.py builds and loads this file. */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdlib.h>

enum { OUTS = 4, ROWS = 4, AHEAD_BLOCKS = 2 };

/* 32 int8 at `q` as 32 bf16 */
static inline __m512bh widen(const int8_t *q) {
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(high, low);
}

static inline float from_bf16(uint16_t value) {
    union { uint32_t bits; float number; } wide = {.bits = (uint32_t)value << 16};
    return wide.number;
}

/* `value` rounded to bf16, to nearest even (a NaN stays a NaN) */
static inline uint16_t to_bf16(float value) {
    union { float number; uint32_t bits; } narrow = {.number = value};
    if ((narrow.bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((narrow.bits >> 16) | 0x40);
    return (uint16_t)((narrow.bits + 0x7fffu + ((narrow.bits >> 16) & 1)) >> 16);
}

enum { WIDEN = 0, WIDEN_AND_KEEP = 1, READ_KEPT = 2 }; /* where `block` takes the weights from */

/* `rows` (1 to ROWS) rows of y for the OUTS outputs whose weights start at `q` (OUTS rows of k int8). `how`: WIDEN
   them from `q`, fetching the weights of the blocks ahead into cache meanwhile (the hardware's prefetcher alone left
   a row of four streams 1.5x slower); WIDEN_AND_KEEP, the same, keeping the bf16 weights in `kept` (OUTS rows of
   k) for the block's next rows; READ_KEPT, read them from `kept` (in cache: no second widening). Inlined for each
   constant `rows` and `how`, so that the sums stay in registers and the choice costs nothing. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t x_stride, const int rows,
                                                        int64_t k, const int8_t *q, uint16_t *kept, const int how,
                                                        const uint16_t *scale, uint16_t *y, int64_t y_stride) {
    __m512 sums[ROWS][OUTS];
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < OUTS; o++) sums[r][o] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 32) {
        if (how != READ_KEPT && c % 64 == 0) /* a line of each weight row AHEAD_BLOCKS blocks on, where this reads */
            for (int o = 0; o < OUTS; o++)
                _mm_prefetch((const char *)(q + (AHEAD_BLOCKS * OUTS + o) * k + c), _MM_HINT_T0);
        __m512bh weights[OUTS];
        for (int o = 0; o < OUTS; o++) {
            if (how == READ_KEPT) {
                weights[o] = (__m512bh)_mm512_loadu_si512(kept + o * k + c);
            } else {
                weights[o] = widen(q + o * k + c);
                if (how == WIDEN_AND_KEEP) _mm512_storeu_si512(kept + o * k + c, (__m512i)weights[o]);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m512bh row = (__m512bh)_mm512_loadu_si512(x + r * x_stride + c);
            for (int o = 0; o < OUTS; o++) sums[r][o] = _mm512_dpbf16_ps(sums[r][o], row, weights[o]);
        }
    }
    for (int o = 0; o < OUTS; o++) {
        float factor = from_bf16(scale[o]);
        for (int r = 0; r < rows; r++)
            y[r * y_stride + o] = to_bf16(_mm512_reduce_add_ps(sums[r][o]) * factor);
    }
}

int int8_rows_ready(void) { return 1; }

#define BLOCK(ROWS_NOW, HOW) block(rows, x_stride, ROWS_NOW, k, weights, kept, HOW, scale + b * OUTS, out, y_stride)
#define BY_ROWS(COUNT, HOW)                                                                                          \
    switch (COUNT) {                                                                                                 \
    case 1: BLOCK(1, HOW); break;                                                                                    \
    case 2: BLOCK(2, HOW); break;                                                                                    \
    case 3: BLOCK(3, HOW); break;                                                                                    \
    default: BLOCK(4, HOW); break;                                                                                   \
    }

/* y[m, n] (a row every y_stride) = x[m, k] (a row every x_stride) times (q * scale[:, None])^T for q [n, k]
   row-major; n a multiple of OUTS, k of 32. The outputs are shared among `threads` OpenMP threads in contiguous
   runs, each streaming its part of q once; rows go ROWS at a time over each block of outputs, the block's weights
   widened once when more than ROWS rows read them (where a thread's scratch for them cannot be allocated, once for
   each ROWS rows). Returns 0, or -1 when the shapes do not fit. */
int int8_rows_gemm(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *q, int64_t n,
                   const uint16_t *scale, uint16_t *y, int64_t y_stride, int threads) {
    if (n % OUTS != 0 || k % 32 != 0 || m < 1) return -1;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *kept = m > ROWS ? malloc(sizeof(uint16_t) * (size_t)(OUTS * k)) : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n / OUTS; b++) {
            const int8_t *weights = q + b * OUTS * k;
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                const uint16_t *rows = x + r0 * x_stride;
                uint16_t *out = y + r0 * y_stride + b * OUTS;
                int64_t count = m - r0 < ROWS ? m - r0 : ROWS;
                if (!kept) {
                    BY_ROWS(count, WIDEN)
                } else if (r0 == 0) {
                    BLOCK(4, WIDEN_AND_KEEP); /* m > ROWS: the first ROWS rows */
                } else {
                    BY_ROWS(count, READ_KEPT)
                }
            }
        }
        free(kept);
    }
    return 0;
}
#else
int int8_rows_ready(void) { return 0; }
int int8_rows_gemm(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *q, int64_t n,
                   const uint16_t *scale, uint16_t *y, int64_t y_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)q, (void)n, (void)scale, (void)y, (void)y_stride, (void)threads;
    return -1;
}
#endif
