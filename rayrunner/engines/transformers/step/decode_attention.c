/* The attention of a decode step's rows (one new position a row) on CPUs with AVX-512 BF16; decode_attention.py builds
   and loads this file. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "softmax.h"

enum { MAX_DIM = 128, MAX_GROUP = 16 }; /* heads of 64 or 128 (decode_attention checks) */

int has_decode_attention(void) { return 1; }

/* Each score of `group` queries (`q`, bf16 pairs, `nv` registers a query) against the key at `key` (`dim`), summed
   over its products in float32 by the CPU's bf16 dot-product instruction. */
static inline void key_scores(const __m512bh q[MAX_GROUP][MAX_DIM / 32], const uint16_t *key, int64_t nv,
                              int64_t group, float *scores, int64_t stride, float scale, float bias) {
    __m512bh k[MAX_DIM / 32];
    for (int64_t i = 0; i < nv; i++) k[i] = (__m512bh)_mm512_loadu_si512(key + 32 * i);
    for (int64_t g = 0; g < group; g++) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), k[0], q[g][0]);
        for (int64_t i = 1; i < nv; i++) acc = _mm512_dpbf16_ps(acc, k[i], q[g][i]);
        scores[g * stride] = _mm512_reduce_add_ps(acc) * scale + bias;
    }
}

/* Lane j of the result: the sum of the 16 lanes of a[j] (a transposed reduction: 15 adds and 31 shuffles where 16
   separate sums take ~130 operations). */
static inline __m512 sum_each(__m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xee));
    for (int j = 0; j < 4; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xdd));
    for (int j = 0; j < 2; j++)
        d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44), _mm512_shuffle_ps(c[j], c[j + 2], 0xee));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
    /* e holds the sums of a[0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15]: put each in its lane */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), e);
}

/* The scores of 16 positions from `keys` (a position every `dim`) for each of `group` queries, into
   scores[g * stride + 0..16); -inf where `bias` is. The same positions' `values` are fetched into cache meanwhile:
   the weighted sum reads them next. */
static inline void block_scores(const __m512bh q[MAX_GROUP][MAX_DIM / 32], const uint16_t *keys,
                                const uint16_t *values, int64_t nv,
                                int64_t dim, int64_t group, float *scores, int64_t stride, float scale,
                                const float *bias) {
    for (int64_t line = 0; line < 16 * dim; line += 32) _mm_prefetch((const char *)(values + line), _MM_HINT_T0);
    __m512 b = _mm512_loadu_ps(bias);
    __mmask16 hidden = _mm512_cmp_ps_mask(b, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    for (int64_t g = 0; g < group; g++) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) {
            const uint16_t *key = keys + j * dim;
            acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(key), q[g][0]);
            for (int64_t i = 1; i < nv; i++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(key + 32 * i), q[g][i]);
        }
        __m512 s = _mm512_fmadd_ps(sum_each(acc), _mm512_set1_ps(scale), b);
        _mm512_storeu_ps(scores + g * stride, _mm512_mask_mov_ps(s, hidden, _mm512_set1_ps(-INFINITY)));
    }
}

/* The weighted sum of `positions` values (a position every NF * 16) for G queries, their weights at
   scores[g * stride + t] (skipped where `bias` is -inf), each times its `inverse` total, into out[g * NF * 16 ...]
   in bf16. NF and G are constants, so that the G * NF sums stay in registers. */
#define WEIGH_VALUES(NF, G)                                                                                          \
    static void weigh_values_##NF##_##G(const float *scores, int64_t stride, const uint16_t *values,                \
                                        const float *bias, int64_t positions, const float *inverse, uint16_t *out,  \
                                        const uint16_t *next) {                                                     \
        __m512 acc[G][NF];                                                                                           \
        for (int g = 0; g < G; g++)                                                                                  \
            for (int i = 0; i < NF; i++) acc[g][i] = _mm512_setzero_ps();                                            \
        for (int64_t t = 0; t < positions; t++) {                                                                    \
            for (int i = 0; next && i < NF; i += 2)                                                                 \
                _mm_prefetch((const char *)(next + (t * NF + i) * 16), _MM_HINT_T0);                                 \
            if (bias[t] == -INFINITY) continue;                                                                      \
            __m512 v[NF];                                                                                            \
            for (int i = 0; i < NF; i++)                                                                             \
                v[i] = _mm512_cvtpbh_ps(                                                                             \
                    (__m256bh)_mm256_loadu_si256((const __m256i *)(values + (t * NF + i) * 16)));                    \
            for (int g = 0; g < G; g++) {                                                                            \
                __m512 w = _mm512_set1_ps(scores[g * stride + t]);                                                   \
                for (int i = 0; i < NF; i++) acc[g][i] = _mm512_fmadd_ps(w, v[i], acc[g][i]);                        \
            }                                                                                                        \
        }                                                                                                            \
        for (int g = 0; g < G; g++)                                                                                  \
            for (int i = 0; i < NF; i++)                                                                             \
                _mm256_storeu_si256((__m256i *)(out + (g * NF + i) * 16), (__m256i)_mm512_cvtneps_pbh(               \
                                        _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inverse[g]))));                      \
    }
WEIGH_VALUES(4, 1)
WEIGH_VALUES(4, 2)
WEIGH_VALUES(4, 3)
WEIGH_VALUES(4, 4)
WEIGH_VALUES(8, 1)
WEIGH_VALUES(8, 2)

/* `weigh_values_NF_G` for head size `dim` (64 or 128) and `n` queries (up to 4, or 2 for 128), their scores a row
   of `positions` each. */
static void weigh_values(const float *scores, int64_t positions, const uint16_t *values, const float *bias,
                         int64_t dim, int64_t n, const float *inverse, uint16_t *out, const uint16_t *next) {
    typedef void (*weigher)(const float *, int64_t, const uint16_t *, const float *, int64_t, const float *,
                            uint16_t *, const uint16_t *);
    static const weigher by_64[] = {weigh_values_4_1, weigh_values_4_2, weigh_values_4_3, weigh_values_4_4};
    static const weigher by_128[] = {weigh_values_8_1, weigh_values_8_2};
    (dim == 64 ? by_64 : by_128)[n - 1](scores, positions, values, bias, positions, inverse, out, next);
}

/* One row's and KV head's attention: `group` queries over `positions` keys and values (a position every `dim`),
   positions whose bias is -inf skipped; out = softmax(q.k * scale + bias) . v, rounded to bf16 once. */
static void attend_head(const uint16_t *query, const uint16_t *keys, const uint16_t *values, const float *bias,
                        int64_t positions, uint16_t *out, int64_t group, int64_t dim, float scale, float *scores,
                        const uint16_t *next_keys) {
    __m512bh q[MAX_GROUP][MAX_DIM / 32];
    int64_t nv = dim / 32;
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < nv; i++) q[g][i] = (__m512bh)_mm512_loadu_si512(query + g * dim + 32 * i);
    int64_t t = 0;
    for (; t + 16 <= positions; t += 16)
        block_scores((const __m512bh(*)[MAX_DIM / 32])q, keys + t * dim, values + t * dim, nv, dim, group, scores + t,
                     positions, scale, bias + t);
    for (; t < positions; t++) {
        if (bias[t] == -INFINITY) {
            for (int64_t g = 0; g < group; g++) scores[g * positions + t] = -INFINITY;
            continue;
        }
        key_scores((const __m512bh(*)[MAX_DIM / 32])q, keys + t * dim, nv, group, scores + t, positions, scale,
                   bias[t]);
    }
    float inverse[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float total = exponentiate(scores + g * positions, positions);
        inverse[g] = total > 0.f ? 1.f / total : 0.f;
    }
    int64_t chunk = dim == 64 ? 4 : 2;
    for (int64_t g = 0; g < group; g += chunk) {
        int64_t n = group - g < chunk ? group - g : chunk;
        weigh_values(scores + g * positions, positions, values, bias, dim, n, inverse + g, out + g * dim,
                     g == 0 ? next_keys : NULL);
    }
}

/* Attention of one new position per row (a decode step): for each of `rows` rows and `kv_heads` KV heads, its
   `group` query heads (query + r * query_row_stride, heads in order, `dim` each) over `positions` cached keys and
   values (row r, head h at + r * kv_row_stride + h * kv_head_stride, a position every `dim`), with an additive
   float32 `bias` (`positions` a row, -inf where not attended); out [rows, kv_heads * group * dim], bf16. Rows and
   heads are shared among `threads` OpenMP threads. Returns 0, -1 when a scratch row cannot be allocated, -2 when
   `dim` (64 or 128) or `group` (up to 16) is out of its range. */
int decode_attention(const uint16_t *query, int64_t query_row_stride, const uint16_t *keys, const uint16_t *values,
                     int64_t kv_row_stride, int64_t kv_head_stride, const float *bias, int64_t positions,
                     uint16_t *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim, float scale,
                     int threads) {
    if ((dim != 64 && dim != 128) || group < 1 || group > MAX_GROUP) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * positions + 16));
        if (!scores) failed = 1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * kv_heads; item++) {
            if (!scores) continue;
            int64_t r = item / kv_heads, h = item % kv_heads;
            int64_t offset = r * kv_row_stride + h * kv_head_stride;
            int64_t next = item + 1 < rows * kv_heads ? (item + 1) / kv_heads * kv_row_stride
                                                          + (item + 1) % kv_heads * kv_head_stride : -1;
            attend_head(query + r * query_row_stride + h * group * dim, keys + offset, values + offset,
                        bias + r * positions, positions, out + (r * kv_heads + h) * group * dim, group, dim, scale,
                        scores, next < 0 ? NULL : keys + next);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
#else
int has_decode_attention(void) { return 0; }
#endif
