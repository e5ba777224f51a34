/* Causal attention of a prompt's tokens on AMX tiles (CPUs with AMX BF16); prompt_attention.py builds and loads this
   file. Per KV head its keys and values are first laid out as the tiles multiply them (pairs of bf16 side by side);
   then each query head's 16 tokens at a time: their scores against 16 keys a tile (float32 sums), the softmax in
   float32 as PyTorch's flash attention computes it over one block of keys (`exponentiate_as_sdpa`), its weights
   rounded to bf16 as it rounds them, times the values on the tiles (float32 sums), times the inverse of the weights'
   float32 total and rounded to bf16 once. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "softmax.h"

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, TILE_ELEMENTS = 512 };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* 1 when this process may use the tiles (Linux grants them on request, once per process), else 0. */
int prompt_tiles_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Every tile 16 rows of 64 bytes: 16 tokens by 32 bf16, 16 pairs by 16 pairs, or 16 by 16 float32 sums. */
static void configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) config.bytes_per_row[tile] = 64, config.rows[tile] = 16;
    _tile_loadconfig(&config);
}

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* `keys` [positions, dim] as tiles for scores: per block of 16 keys and 32 dims, 16 dim pairs by 16 keys. */
static void lay_out_keys(const uint16_t *keys, int64_t positions, int64_t dim, uint32_t *out) {
    int64_t blocks = round_up(positions, 16) / 16, dim_blocks = dim / 32;
    memset(out, 0, (size_t)(blocks * dim_blocks) * TILE_ELEMENTS * 2);
    for (int64_t p = 0; p < positions; p++) {
        const uint32_t *pairs = (const uint32_t *)(keys + p * dim);
        for (int64_t d = 0; d < dim_blocks; d++) {
            uint32_t *tile = out + ((p / 16) * dim_blocks + d) * 256;
            for (int64_t i = 0; i < 16; i++) tile[i * 16 + p % 16] = pairs[d * 16 + i];
        }
    }
}

/* `values` [positions, dim] as tiles for the weighted sum: per block of 32 positions and 16 dims, 16 position pairs
   by 16 dims (positions past the end zero). */
static void lay_out_values(const uint16_t *values, int64_t positions, int64_t dim, uint16_t *out) {
    int64_t blocks = round_up(positions, 32) / 32, dim_blocks = dim / 16;
    for (int64_t p = 0; p < blocks * 32; p += 2) {
        for (int64_t n = 0; n < dim_blocks; n++) {
            __m512i even = p < positions ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                               (const __m256i *)(values + p * dim + n * 16)))
                                         : _mm512_setzero_si512();
            __m512i odd = p + 1 < positions ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                  (const __m256i *)(values + (p + 1) * dim + n * 16)))
                                            : _mm512_setzero_si512();
            _mm512_store_si512(out + ((p / 32) * dim_blocks + n) * TILE_ELEMENTS + (p % 32 / 2) * 32,
                               _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
    }
}

typedef struct {
    const uint16_t *query;
    int64_t query_row_stride, tokens, start, heads, kv_heads, dim;
    float scale;
    uint16_t *out;
    int64_t out_row_stride;
} prompt_call;

/* Scores of 16 query tokens (`q`: 16 rows of `dim`) against `key_blocks` blocks of 16 laid-out `keys`, into scores
   (a row every `stride` floats). */
static void block_scores(const uint16_t *q, int64_t dim, const uint32_t *keys, int64_t key_blocks, float *scores,
                         int64_t stride) {
    int64_t dim_blocks = dim / 32;
    for (int64_t b = 0; b < key_blocks; b++) {
        _tile_zero(2);
        for (int64_t d = 0; d < dim_blocks; d++) {
            _tile_loadd(0, q + d * 32, dim * 2);
            _tile_loadd(1, keys + (b * dim_blocks + d) * 256, 64);
            _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, scores + b * 16, stride * 4);
    }
}

/* 16 rows of `weights` (bf16, a row every `stride`, `blocks` blocks of 32 positions) times `values` laid out for
   the tiles, for dims [first, first + 64), into sums (16 rows of 64 floats). */
static void weigh_values(const uint16_t *weights, int64_t stride, int64_t blocks, const uint16_t *values,
                         int64_t dim, int64_t first, float *sums) {
    int64_t dim_blocks = dim / 16;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *tiles = values + (b * dim_blocks + first / 16) * TILE_ELEMENTS;
        _tile_loadd(0, weights + b * 32, stride * 2);
        _tile_loadd(1, tiles, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, tiles + TILE_ELEMENTS, 64);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, tiles + 2 * TILE_ELEMENTS, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, tiles + 3 * TILE_ELEMENTS, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, sums, 256);
    _tile_stored(5, sums + 16, 256);
    _tile_stored(6, sums + 32, 256);
    _tile_stored(7, sums + 48, 256);
}

/* The scores of query head `head`'s tokens [first, first + 16) against the keys up to the last one's own, from the
   laid-out `keys`, into `scores` (16 rows of round_up(positions, 32) floats). */
static void block_scores_of(const prompt_call *call, int64_t head, int64_t first, const uint32_t *keys,
                            float *scores) {
    int64_t dim = call->dim, rows = call->tokens - first < 16 ? call->tokens - first : 16;
    int64_t positions = call->start + first + rows;
    uint16_t q[16 * 128]; /* the tokens' queries, padded to 16 rows */
    memset(q, 0, sizeof(uint16_t) * 16 * (size_t)dim);
    for (int64_t r = 0; r < rows; r++)
        memcpy(q + r * dim, call->query + (first + r) * call->query_row_stride + head * dim, (size_t)dim * 2);
    block_scores(q, dim, keys, round_up(positions, 16) / 16, scores, round_up(positions, 32));
}

/* The softmax of the tokens [first, first + 16) over their `scores` (causal: each up to its own position): its
   weights in bf16 into `weights` (zero past each token's own position, and for rows past the prompt), and the
   inverse of each row's float32 total. */
static void block_softmax(const prompt_call *call, int64_t first, float *scores, uint16_t *weights,
                          float inverse[16]) {
    int64_t rows = call->tokens - first < 16 ? call->tokens - first : 16;
    int64_t width = round_up(call->start + first + rows, 32);
    __m512 scale = _mm512_set1_ps(call->scale);
    for (int64_t r = 0; r < 16; r++) {
        float *row = scores + r * width;
        uint16_t *weight = weights + r * width;
        int64_t seen = r < rows ? call->start + first + r + 1 : 0, t = 0;
        for (; t < seen; t += 16) {
            __mmask16 m = first_lanes(seen - t);
            _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), scale));
        }
        if (seen) inverse[r] = 1.f / exponentiate_as_sdpa(row, seen, call->start + call->tokens);
        for (t = 0; t < seen; t += 16) {
            __mmask16 m = first_lanes(seen - t);
            _mm256_mask_storeu_epi16(weight + t, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, row + t)));
        }
        t = seen;
        memset(weight + t, 0, (size_t)(width - t) * 2);
    }
}

/* Query head `head`'s output for the tokens [first, first + 16): their `weights` times the laid-out `values`,
   times each row's `inverse` total, rounded to bf16. */
static void block_output(const prompt_call *call, int64_t head, int64_t first, const uint16_t *values,
                         const uint16_t *weights, const float inverse[16]) {
    int64_t dim = call->dim, rows = call->tokens - first < 16 ? call->tokens - first : 16;
    int64_t width = round_up(call->start + first + rows, 32);
    float sums[16 * 64];
    for (int64_t part = 0; part < dim; part += 64) {
        weigh_values(weights, width, width / 32, values, dim, part, sums);
        for (int64_t r = 0; r < rows; r++) {
            uint16_t *o = call->out + (first + r) * call->out_row_stride + head * dim + part;
            for (int64_t n = 0; n < 64; n += 16)
                _mm256_storeu_si256((__m256i *)(o + n), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                                            _mm512_loadu_ps(sums + r * 64 + n),
                                                            _mm512_set1_ps(inverse[r]))));
        }
    }
}

/* Query head `head` over its KV head's laid-out keys and values, 16 tokens at a time; `scores` and `weights` hold
   16 rows of `width` each. */
static void attend_head(const prompt_call *call, int64_t head, const uint32_t *keys, const uint16_t *values,
                        float *scores, uint16_t *weights) {
    float inverse[16];
    for (int64_t first = 0; first < call->tokens; first += 16) {
        block_scores_of(call, head, first, keys, scores);
        block_softmax(call, first, scores, weights, inverse);
        block_output(call, head, first, values, weights, inverse);
    }
}

/* Causal attention of `tokens` query tokens (token i at position start + i; query + i * query_row_stride holds its
   `heads` heads of `dim`, 64 or 128) over the `start + tokens` keys and values of each of `kv_heads` heads (head h
   at keys/values + h * kv_head_stride, a position every `dim`); out + i * out_row_stride gets token i's heads in
   bf16. Query heads are shared among `threads` OpenMP threads, once every KV head's keys and values are laid out.
   Returns 0, -1 when scratch cannot be allocated, -2 for shapes it does not take. */
int prompt_attention(const uint16_t *query, int64_t query_row_stride, int64_t tokens, int64_t start,
                     const uint16_t *keys, const uint16_t *values, int64_t kv_head_stride, uint16_t *out,
                     int64_t out_row_stride, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    if ((dim != 64 && dim != 128) || tokens < 1 || start < 0 || kv_heads < 1 || heads % kv_heads) return -2;
    prompt_call call = {query, query_row_stride, tokens, start, heads, kv_heads, dim, scale, out, out_row_stride};
    int64_t positions = start + tokens, width = round_up(positions, 32), group = heads / kv_heads;
    size_t key_bytes = (size_t)(round_up(positions, 16) * dim * 2), value_bytes = (size_t)(width * dim * 2);
    char *laid = aligned_alloc(64, (size_t)kv_heads * (key_bytes + value_bytes)); /* every KV head's, laid out */
    if (!laid) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < kv_heads; h++) {
            lay_out_keys(keys + h * kv_head_stride, positions, dim, (uint32_t *)(laid + h * key_bytes));
            lay_out_values(values + h * kv_head_stride, positions, dim,
                           (uint16_t *)(laid + kv_heads * key_bytes + h * value_bytes));
        }
        float *scores = malloc(sizeof(float) * 16 * (size_t)width);
        uint16_t *weights = malloc(2 * 16 * (size_t)width);
        if (!scores || !weights) failed = 1;
        configure();
#pragma omp for schedule(dynamic)
        for (int64_t head = 0; head < heads; head++) {
            int64_t h = head / group;
            if (scores && weights)
                attend_head(&call, head, (const uint32_t *)(laid + h * key_bytes),
                            (const uint16_t *)(laid + kv_heads * key_bytes + h * value_bytes), scores, weights);
        }
        _tile_release();
        free(scores), free(weights);
    }
    free(laid);
    return failed ? -1 : 0;
}
/* `count` positions of `kv_heads` heads of `dim` (position i's head h at src + i * src_row_stride + h *
   src_head_stride) into a cache's positions [at, at + count) (head h at dst + h * dst_head_stride, a position every
   `dim`). */
static void copy_positions(const uint16_t *src, int64_t src_row_stride, int64_t src_head_stride, int64_t count,
                           uint16_t *dst, int64_t dst_head_stride, int64_t at, int64_t kv_heads, int64_t dim) {
    for (int64_t h = 0; h < kv_heads; h++)
        for (int64_t i = 0; i < count; i++)
            memcpy(dst + h * dst_head_stride + (at + i) * dim, src + i * src_row_stride + h * src_head_stride,
                   (size_t)dim * 2);
}

enum { ROW, TOKENS, START, KEYS, VALUES, HEAD_STRIDE, CACHED_KEYS, CACHED_VALUES, CACHED_HEAD_STRIDE, OUT_ROW,
       PROMPT_FIELDS };

/* One layer's causal attention of `count` prompts fed in one forward, each on a cache of its own. `rotated` holds
   the forward's rows (a row every `rotated_row_stride`: `heads` query heads, then `kv_heads` rotated key heads, of
   `dim` each), `new_values` their value heads (a row every `values_row_stride`). Prompt p is `prompts[p * 10 ...]`:
   its tokens' first row, its tokens, its cached positions before them (`start`), its cache's keys and values (a
   head every head_stride, room for start + tokens positions), where its cached positions are now (keys, values,
   their head stride; 0 when it has none) and its output's first row in `out`. Each prompt's cached and
   new keys and values are written into its cache first, then attended as `prompt_attention` does. Returns 0, or
   the first prompt's failure. */
int prompts_attention(int64_t count, const int64_t *prompts, const uint16_t *rotated, int64_t rotated_row_stride,
                      const uint16_t *new_values, int64_t values_row_stride, uint16_t *out, int64_t out_row_stride,
                      int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    for (int64_t p = 0; p < count; p++) {
        const int64_t *prompt = prompts + p * PROMPT_FIELDS;
        int64_t row = prompt[ROW], tokens = prompt[TOKENS], start = prompt[START], stride = prompt[HEAD_STRIDE];
        uint16_t *keys = (uint16_t *)(intptr_t)prompt[KEYS], *values = (uint16_t *)(intptr_t)prompt[VALUES];
        if (prompt[CACHED_KEYS]) {
            copy_positions((const uint16_t *)(intptr_t)prompt[CACHED_KEYS], dim, prompt[CACHED_HEAD_STRIDE], start,
                           keys, stride, 0, kv_heads, dim);
            copy_positions((const uint16_t *)(intptr_t)prompt[CACHED_VALUES], dim, prompt[CACHED_HEAD_STRIDE],
                           start, values, stride, 0, kv_heads, dim);
        }
        const uint16_t *mine = rotated + row * rotated_row_stride;
        copy_positions(mine + heads * dim, rotated_row_stride, dim, tokens, keys, stride, start, kv_heads, dim);
        copy_positions(new_values + row * values_row_stride, values_row_stride, dim, tokens, values, stride, start,
                       kv_heads, dim);
        int status = prompt_attention(mine, rotated_row_stride, tokens, start, keys, values, stride,
                                      out + prompt[OUT_ROW] * out_row_stride, out_row_stride, heads, kv_heads, dim,
                                      scale, threads);
        if (status) return status;
    }
    return 0;
}
#else
int prompt_tiles_ready(void) { return 0; }
int prompt_attention(const uint16_t *query, int64_t query_row_stride, int64_t tokens, int64_t start,
                     const uint16_t *keys, const uint16_t *values, int64_t kv_head_stride, uint16_t *out,
                     int64_t out_row_stride, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    (void)query, (void)query_row_stride, (void)tokens, (void)start, (void)keys, (void)values, (void)kv_head_stride;
    (void)out, (void)out_row_stride, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)threads;
    return -2;
}
int prompts_attention(int64_t count, const int64_t *prompts, const uint16_t *rotated, int64_t rotated_row_stride,
                      const uint16_t *new_values, int64_t values_row_stride, uint16_t *out, int64_t out_row_stride,
                      int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    (void)count, (void)prompts, (void)rotated, (void)rotated_row_stride, (void)new_values, (void)values_row_stride;
    (void)out, (void)out_row_stride, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)threads;
    return -2;
}
#endif
