/* bf16 matmuls on AMX tiles for weights packed by tile_weights.py (which builds and loads this file):
   y[m, n] = x[m, k] . w[n, k]^T (+ bias), summed in float32 by the tiles and rounded to bf16 once. Each call loads
   its own tile configuration in every thread it uses and releases the tiles at its end, as PyTorch's and oneDNN's
   AMX kernels do around theirs (PyTorch's brgemm forgets its cached configuration when it releases). */
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, MAX_GROUP = 6, TILE_ELEMENTS = 512, AHEAD = 4096,
       CHUNK_ROWS = 512, PART_BLOCKS = 16 };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* 1 when this process may use the tiles (Linux grants them on request, once per process), else 0. */
int tiles_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

enum { SIXES = 0, PAIRS = 1 }; /* the two tile plans (see configure) */

/* The tiles for a pass of plan `plan` over `rows` rows of x. SIXES (up to 16 rows): tile 0 holds 32 columns of the
   rows, tile 1 a packed weight tile (16 column pairs of 16 outputs), tiles 2-7 the float32 sums of up to six blocks
   of 16 outputs. PAIRS (17 to 32 rows, a prompt's): tiles 0 and 1 the first 16 rows and the rest, tiles 2 and 3 two
   weight tiles, tiles 4-7 the sums of both row halves for two blocks, so each weight tile loaded serves 32 rows. */
static void configure(int plan, int rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int tile = 0; tile < 8; tile++) config.bytes_per_row[tile] = 64;
    if (plan == SIXES) {
        for (int tile = 0; tile < 8; tile++) config.rows[tile] = tile == 1 ? 16 : (uint8_t)rows;
    } else {
        uint8_t rest = (uint8_t)(rows - 16);
        const uint8_t by_tile[8] = {16, rest, 16, 16, 16, 16, rest, rest};
        memcpy(config.rows, by_tile, sizeof by_tile);
    }
    _tile_loadconfig(&config);
}

/* Rows of y from float32 `sums` (`count` blocks of 16 outputs, 16 rows of 16 each) plus `bias` (NULL: none),
   rounded to bf16. */
static void emit(const float *sums, int64_t rows, int64_t count, const uint16_t *bias, uint16_t *y,
                 int64_t y_stride) {
    for (int64_t g = 0; g < count; g++) {
        __m512 add = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(bias + g * 16)))
                          : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + g * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + g * 256 + r * 16),
                                                                          add)));
    }
}

#define ZERO(G, T) if (G < group) _tile_zero(T);
#define MULTIPLY(G, T)                                                                                               \
    if (G < group) {                                                                                                 \
        _tile_stream_loadd(1, weights + (b * group + G) * TILE_ELEMENTS, 64);                                        \
        _tile_dpbf16ps(T, 0, 1);                                                                                     \
    }
#define STORE(G, T) if (G < group) _tile_stored(T, sums + G * 256, 64);

/* Up to 16 `rows` of y for the outputs of one group of `group` blocks of 16 (`weights`: its tiles, block by block
   of 32 inputs), through `sums` (group * 256 floats); with `fetch`, the weights ahead are fetched into cache
   meanwhile (the first pass over a group: later passes find it in cache). Plan SIXES. */
static void group_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, const uint16_t *weights,
                       int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride, float *sums,
                       int fetch) {
    ZERO(0, 2) ZERO(1, 3) ZERO(2, 4) ZERO(3, 5) ZERO(4, 6) ZERO(5, 7)
    int64_t blocks = k / 32, bytes = group * TILE_ELEMENTS * 2; /* a block's tiles */
    for (int64_t b = 0; b < blocks; b++) {
        /* the weights AHEAD bytes on (prefetches never fault: past the end they do nothing) */
        const char *next = (const char *)(weights + b * group * TILE_ELEMENTS) + AHEAD;
        for (int64_t line = 0; fetch && line < bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
        _tile_loadd(0, x + b * 32, x_stride * 2);
        MULTIPLY(0, 2) MULTIPLY(1, 3) MULTIPLY(2, 4) MULTIPLY(3, 5) MULTIPLY(4, 6) MULTIPLY(5, 7)
    }
    STORE(0, 2) STORE(1, 3) STORE(2, 4) STORE(3, 5) STORE(4, 6) STORE(5, 7)
    emit(sums, rows, group, bias, y, y_stride);
}

/* 17 to 32 `rows` of y for the outputs of one group, as `group_rows`, two blocks of outputs at a time. Plan
   PAIRS. The inputs go in parts of at most PART_BLOCKS blocks of 32, every pair of blocks over one part before the
   next, so that a part of the rows stays in the first-level cache while the pairs pass over it; between parts a
   pair's float32 sums wait in `sums` (4 * 256 floats a pair), from where the tiles add on as if they had kept them. */
static void pair_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, const uint16_t *weights,
                      int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride, float *sums) {
    int64_t blocks = k / 32, parts = (blocks + PART_BLOCKS - 1) / PART_BLOCKS, per_part = (blocks + parts - 1) / parts;
    for (int64_t first = 0; first < blocks; first += per_part) {
        int64_t last = first + per_part < blocks ? first + per_part : blocks;
        for (int64_t g = 0; g < group; g += 2) {
            int two = g + 1 < group;
            float *pair = sums + g / 2 * 1024; /* the first 16 rows of both blocks, then the rest of both */
            if (first == 0) {
                _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
            } else {
                _tile_loadd(4, pair, 64); _tile_loadd(5, pair + 256, 64);
                _tile_loadd(6, pair + 512, 64); _tile_loadd(7, pair + 768, 64);
            }
            for (int64_t b = first; b < last; b++) {
                _tile_loadd(0, x + b * 32, x_stride * 2);
                _tile_loadd(1, x + 16 * x_stride + b * 32, x_stride * 2);
                _tile_stream_loadd(2, weights + (b * group + g) * TILE_ELEMENTS, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(6, 1, 2);
                if (two) {
                    _tile_stream_loadd(3, weights + (b * group + g + 1) * TILE_ELEMENTS, 64);
                    _tile_dpbf16ps(5, 0, 3);
                    _tile_dpbf16ps(7, 1, 3);
                }
            }
            _tile_stored(4, pair, 64);
            _tile_stored(5, pair + 256, 64);
            _tile_stored(6, pair + 512, 64);
            _tile_stored(7, pair + 768, 64);
        }
    }
    for (int64_t g = 0; g < group; g += 2) {
        const uint16_t *add = bias ? bias + g * 16 : NULL;
        int count = g + 1 < group ? 2 : 1;
        emit(sums + g / 2 * 1024, 16, count, add, y + g * 16, y_stride);
        emit(sums + g / 2 * 1024 + 512, rows - 16, count, add, y + 16 * y_stride + g * 16, y_stride);
    }
}

/* y[m, n] (a row every y_stride) = x[m, k] (a row every x_stride) times the packed weight [n, k] transposed, plus
   `bias` [n] unless NULL. The weight is packed by groups of `group` (1-6) blocks of 16 outputs, each group's tiles
   block by block of 32 inputs (tile_weights.py's layout); n a multiple of 16 * group, k of 32. The groups are
   shared among `threads` OpenMP threads. Returns 0, or -1 when the tiles are not
   granted or the shapes do not fit. */
int tile_gemm(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
              int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads) {
    if (group < 1 || group > MAX_GROUP || n % (16 * group) != 0 || k % 32 != 0 || m < 1) return -1;
    int64_t groups = n / (16 * group), group_elements = group * 16 * k;
#pragma omp parallel num_threads(threads)
    {
        float sums[(MAX_GROUP + 1) / 2 * 1024]; /* SIXES: a group's sums; PAIRS: each pair's */
        int plan = -1, configured = 0;
        /* rows a chunk at a time, so that a chunk's rows stay in cache while every group passes over them */
        for (int64_t start = 0; start < m; start += CHUNK_ROWS) {
            int64_t end = m - start < CHUNK_ROWS ? m : start + CHUNK_ROWS;
#pragma omp for schedule(static)
            for (int64_t index = 0; index < groups; index++) {
                const uint16_t *weights = packed + index * group_elements;
                const uint16_t *add = bias ? bias + index * group * 16 : NULL;
                for (int64_t m0 = start; m0 < end;) {
                    /* a first pass of up to 16 rows fetches the weights from memory; the rest 32 rows at a time */
                    int64_t left = end - m0, most = m0 == start ? 16 : 32;
                    int rows = (int)(left < most ? left : most);
                    int wanted = rows > 16 ? PAIRS : SIXES;
                    if (wanted != plan || rows != configured) {
                        configure(wanted, rows);
                        plan = wanted;
                        configured = rows;
                    }
                    if (plan == SIXES)
                        group_rows(x + m0 * x_stride, x_stride, rows, k, weights, group, add,
                                   y + m0 * y_stride + index * group * 16, y_stride, sums, m0 == start);
                    else
                        pair_rows(x + m0 * x_stride, x_stride, rows, k, weights, group, add,
                                  y + m0 * y_stride + index * group * 16, y_stride, sums);
                    m0 += rows;
                }
            }
        }
        _tile_release();
    }
    return 0;
}

/* Combines float32 sums of gate and up projections (16 outputs of `rows` rows, 16 floats a row) into `rows` rows of
   16 bf16 outputs at `out` (a row every `out_stride`): fused_ops.c's `silu_mul_sums`, for one. */
typedef void (*sums_combiner)(const float *gate, const float *up, int64_t rows, uint16_t *out, int64_t out_stride);

/* The tiles of a GLU pass over `rows` (1 to 32) rows: tiles 0 and 1 the first 16 rows and the rest, tiles 2 and 3 a
   gate and an up weight tile, tiles 4 and 5 the first rows' gate and up sums, 6 and 7 the rest's (unused up to 16). */
static void configure_glu(int rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    uint8_t first = (uint8_t)(rows < 16 ? rows : 16), rest = (uint8_t)(rows > 16 ? rows - 16 : 0);
    const uint8_t by_tile[8] = {first, rest, 16, 16, first, first, rest, rest};
    for (int tile = 0; tile < 8; tile++) config.bytes_per_row[tile] = by_tile[tile] ? 64 : 0;
    memcpy(config.rows, by_tile, sizeof by_tile);
    _tile_loadconfig(&config);
}

/* Up to 32 `rows` of the combined output for one gate group and the up group beside it (`gate`, `up`: their tiles,
   block by block of 32 inputs), block by block of 16 outputs, through `sums` (2 * 4 * 256 floats: a block's sums
   are combined while the tiles multiply the next block's into the other half). */
static void glu_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, const uint16_t *gate,
                     const uint16_t *up, int64_t group, sums_combiner combine, uint16_t *out, int64_t out_stride,
                     float *sums) {
    int64_t blocks = k / 32, first = rows < 16 ? rows : 16;
    int two = rows > 16;
    for (int64_t g = 0; g <= group; g++) {
        float *now = sums + (g & 1) * 1024, *before = sums + (~g & 1) * 1024;
        if (g < group) {
            _tile_zero(4); _tile_zero(5);
            if (two) { _tile_zero(6); _tile_zero(7); }
            for (int64_t b = 0; b < blocks; b++) {
                _tile_loadd(0, x + b * 32, x_stride * 2);
                _tile_stream_loadd(2, gate + (b * group + g) * TILE_ELEMENTS, 64);
                _tile_stream_loadd(3, up + (b * group + g) * TILE_ELEMENTS, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                if (two) {
                    _tile_loadd(1, x + 16 * x_stride + b * 32, x_stride * 2);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_dpbf16ps(7, 1, 3);
                }
            }
        }
        /* the block before, combined while the tiles multiply this one */
        if (g > 0) {
            combine(before, before + 256, first, out + (g - 1) * 16, out_stride);
            if (two) combine(before + 512, before + 768, rows - 16, out + 16 * out_stride + (g - 1) * 16, out_stride);
        }
        if (g < group) {
            _tile_stored(4, now, 64);
            _tile_stored(5, now + 256, 64);
            if (two) {
                _tile_stored(6, now + 512, 64);
                _tile_stored(7, now + 768, 64);
            }
        }
    }
}

/* out[m, n / 2] (a row every out_stride) = `combine` of x[m, k] times the first and the second half of the packed
   weight [n, k] (a gate and an up projection side by side, packed as `tile_gemm` takes them), without writing
   either: each 16 outputs of both are combined from the tiles' float32 sums. n / 2 a multiple of 16 * group. */
int tile_gemm_glu(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                  int64_t group, sums_combiner combine, uint16_t *out, int64_t out_stride, int threads) {
    if (group < 1 || group > MAX_GROUP || n % (32 * group) != 0 || k % 32 != 0 || m < 1) return -1;
    int64_t half = n / (32 * group), group_elements = group * 16 * k;
#pragma omp parallel num_threads(threads)
    {
        float sums[2 * 4 * 256];
        int configured = 0;
        for (int64_t start = 0; start < m; start += CHUNK_ROWS) {
            int64_t end = m - start < CHUNK_ROWS ? m : start + CHUNK_ROWS;
#pragma omp for schedule(static)
            for (int64_t index = 0; index < half; index++) {
                const uint16_t *gate = packed + index * group_elements, *up = gate + half * group_elements;
                for (int64_t m0 = start; m0 < end; m0 += 32) {
                    int rows = (int)(end - m0 < 32 ? end - m0 : 32);
                    if (rows != configured) {
                        configure_glu(rows);
                        configured = rows;
                    }
                    glu_rows(x + m0 * x_stride, x_stride, rows, k, gate, up, group, combine,
                             out + m0 * out_stride + index * group * 16, out_stride, sums);
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int tiles_ready(void) { return 0; }
int tile_gemm(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
              int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)group, (void)bias, (void)y;
    (void)y_stride, (void)threads;
    return -1;
}
int tile_gemm_glu(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                  int64_t group, void *combine, uint16_t *out, int64_t out_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)group, (void)combine, (void)out;
    (void)out_stride, (void)threads;
    return -1;
}
#endif
