/* Part of qgemm.c, included by it on the AMX-BF16 builds (SLUICE_AMX_BF16): the bf16 tiles,
 * which multiply prompt rows. qgemm.c defines the formats' helpers, unpacked_block and OUT_ROW
 * first. */
#ifndef SLUICE_QGEMM_AMX_BF16_H
#define SLUICE_QGEMM_AMX_BF16_H

#ifdef SLUICE_AMX_BF16
#include "amx_tiles.h"

/* ------------------------------------------------------------ AMX-BF16: prompt rows
 *
 * A row group's weights are dequantized once per chunk of rows into bf16 B tiles (a 32-weight
 * block of its 16 rows is one tile: 16 tile rows of a pair of consecutive weights of each row),
 * by the vector units while the tile unit multiplies the pair of row groups before; the
 * activation rows are rounded to bf16, and C tiles sum every block's products in float32 in
 * the tile itself: no per-block read-back and scaling, which bounds the int8 tiles. Each row's
 * result depends on that row alone (the tiles sum K in the same order whichever rows share
 * them), but not the int8 path's bits: prompt rows only take this path, every time. */
#define BF16_TILE_WORDS 256 /* 32-bit words of one B tile: 16 weight pairs x 16 rows */
#define BF16_CHUNK_BYTES (1 << 20) /* of bf16 rows: a chunk's slice of them stays in L2 */
#define BF16_K_SLICE 64 /* blocks: 2,048 weights */

/* Tiles (configure_bf16_tiles): C 0-3, A 4-5 (16 rows x 32 bf16), B 6-7 (16 pairs x 16 rows). */

/* Blocks [b0, b1) of a row group's weights, any format, as bf16 B tiles: tiles[(b - b0) * 256 +
 * pair * 16 + row] holds weights 2 pair and 2 pair + 1 of block b of that row (low half first),
 * rounded to nearest even. */
static void dequantize_group_bf16(int format, const uint8_t *w, int b0, int b1, uint32_t *tiles) {
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i low_byte = _mm512_set1_epi32(0xFF);
    const size_t super_bytes = format == SLUICE_Q8_0 ? 0 : super_bytes_of(format);
    for (int b = b0; b < b1; b++) {
        unpacked_block u;
        if (format == SLUICE_Q8_0) {
            const uint8_t *block = w + (size_t)b * SLUICE_Q8_0_GROUP_BLOCK_BYTES;
            for (int g = 0; g < 8; g++) u.q[g] = _mm512_loadu_si512((const void *)(block + 64 * g));
            u.first = load_halves(block + 32 * GROUP);
        } else {
            unpack_super_block(format, w + (size_t)(b / 8) * super_bytes, b % 8, &u);
        }
        uint32_t *tile = tiles + (size_t)(b - b0) * BF16_TILE_WORDS;
        for (int g = 0; g < 8; g++) {
            __m512 v[4];
            for (int t = 0; t < 4; t++) {
                const __m512i ints = format == SLUICE_Q8_0
                                         ? _mm512_srai_epi32(_mm512_slli_epi32(u.q[g], 24 - 8 * t), 24)
                                         : _mm512_and_si512(_mm512_srli_epi32(u.q[g], 8 * t), low_byte);
                const __m512 q = _mm512_cvtepi32_ps(ints);
                if (format == SLUICE_Q8_0) v[t] = _mm512_mul_ps(q, u.first);
                else if (format == SLUICE_Q6_K)
                    v[t] = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(32.0f)), g < 4 ? u.first : u.second);
                else v[t] = _mm512_fmsub_ps(u.first, q, u.second);
            }
            for (int pair = 0; pair < 2; pair++) {
                const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(v[2 * pair + 1], v[2 * pair]);
                _mm512_store_si512((void *)(tile + (2 * g + pair) * 16), _mm512_permutexvar_epi16(pair_order, halves));
            }
        }
    }
}

/* One row of K floats -> bf16 (NULL: a row of zeros, padding a tile). */
static void round_row_bf16(const float *x, int K, uint16_t *xb) {
    for (int k = 0; k < K; k += 16) {
        const __m512 v = x != NULL ? _mm512_loadu_ps(x + k) : _mm512_setzero_ps();
        _mm256_storeu_si256((__m256i *)(xb + k), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Two row groups' packed weights that a tile loop asks for towards L2 as it goes, two lines
 * of each per block (bf16_rows: the next pair's, while this pair's tiles keep the core busy).
 * The next pair's blocks are dequantized in the same loop; at one line a block the requests
 * kept too little ahead of them (`perf`: half the dequantization's samples on its loads of
 * the packed weights), and a 1 B body's 32 x 130-token prompts took 3.7% more time (six
 * alternating rounds; four lines a block: no better than two). */
typedef struct {
    const char *next[2], *end[2];
} weights_ahead;

ALWAYS_INLINE void ask_ahead(weights_ahead *ahead) {
    for (int g = 0; g < 2; g++)
        for (int line = 0; line < 2 && ahead->next[g] < ahead->end[g]; line++) {
            _mm_prefetch(ahead->next[g], _MM_HINT_T1);
            ahead->next[g] += 64;
        }
}

/* The next pair's blocks [next, end) of its two row groups, still to dequantize as B tiles:
 * one block of one group every `every` tile steps of this pair's loop (bf16_tiles_32x32), so
 * that the vector units dequantize while the tile unit multiplies. */
typedef struct {
    int format, b0, next, end, group, every, wait;
    const uint8_t *w[2];
    uint32_t *tiles[2];
} dequant_ahead;

ALWAYS_INLINE void dequantize_ahead(dequant_ahead *d) {
    if (d->next >= d->end || --d->wait > 0) return;
    d->wait = d->every;
    dequantize_group_bf16(d->format, d->w[d->group], d->next, d->next + 1,
                          d->tiles[d->group] + (size_t)(d->next - d->b0) * BF16_TILE_WORDS);
    d->next += d->group;
    d->group ^= 1;
}

/* 32 rows of xb (bf16, `row` apart) against `blocks` blocks of two row groups' tiles, added to
 * from[32][32] float32 (NULL: zeros) -> c[32][32]. */
static void bf16_tiles_32x32(const uint16_t *xb, size_t row, int blocks, const uint32_t *tiles0, const uint32_t *tiles1,
                             const float *from, float *c, weights_ahead *ahead, dequant_ahead *dequant) {
    const size_t stride = row * 2;
    if (from != NULL) {
        _tile_loadd(0, from, 128);
        _tile_loadd(1, from + 16, 128);
        _tile_loadd(2, from + 16 * 32, 128);
        _tile_loadd(3, from + 16 * 32 + 16, 128);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int b = 0; b < blocks; b++) {
        _tile_loadd(4, xb + (size_t)b * QK, stride);
        _tile_loadd(5, xb + 16 * row + (size_t)b * QK, stride);
        _tile_loadd(6, tiles0 + (size_t)b * BF16_TILE_WORDS, 64);
        _tile_loadd(7, tiles1 + (size_t)b * BF16_TILE_WORDS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        ask_ahead(ahead);
        dequantize_ahead(dequant);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* Row group g (0 or 1) of pair `pair`: gated, gate group `pair` beside up group `pair +
 * pairs`; else groups 2 pair and 2 pair + 1 (the last pair of an odd count repeats its one). */
static inline int pair_group(int pair, int g, int gated, int pairs, int groups) {
    if (gated) return pair + g * pairs;
    return 2 * pair + g < groups ? 2 * pair + g : 2 * pair;
}

/* A thread's B tiles of row group g (0 or 1) of the pair on side `side` (0 or 1: the pair
 * it multiplies and the next one take turns). */
static inline uint32_t *group_tiles(uint32_t *buffers, int side, int g, int slice_blocks) {
    return buffers + (size_t)(2 * side + g) * slice_blocks * BF16_TILE_WORDS;
}

/* bf16 words from one bf16 row to the next: K and a cache line. With rows a power of two
 * of bytes apart, a tile load's 16 rows all fall in one set of L1 and evict each other. */
static size_t bf16_row_stride(int K) { return (size_t)K + 32; }

/* Bytes of the bf16 rows: M rounded up to whole 32-row tiles. */
static size_t bf16_scratch_bytes(int M, int K) {
    return ((size_t)(M + 31) / 32 * 32 * bf16_row_stride(K) * 2 + 63) / 64 * 64;
}

/* The bf16 path: M rows (row r is x's and out's row OUT_ROW(r)), xb: bf16_scratch_bytes(M, K).
 *
 * Rows go in chunks and K in slices of up to 2,048 weights, so that a chunk's slice of bf16
 * rows (1 MiB: 256 rows of a 2,048-weight slice, 512 of a 1,024-weight K) stays in L2 while
 * every row group passes over it; each row group's slice is dequantized once a chunk. With K
 * over one slice, the 32 x 32 float sums wait between slices in `partial` (a store and load
 * of float32 tiles: the bits of a row's result do not depend on the slicing).
 *
 * activation >= 0 (enum sluice_activation): W is a gated MLP's [gate; up], N = 2 I with I a
 * multiple of GROUP, and out [M, I] = act(x @ gate^T) * (x @ up^T). Each task then takes gate
 * group j beside up group j, and its 32 x 32 sums become 32 x 16 products on the way out: the
 * [M, 2 I] matrix is never written, nor read back (gated_row, so the same bits as the
 * product of the stored matrix). */
static int bf16_rows(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, size_t group_bytes,
                     float *out, int out_stride, const int *out_rows, uint16_t *xb, int activation) {
    if (!amx_permitted()) return -2;
    const int nb = K / QK, slices = (nb + BF16_K_SLICE - 1) / BF16_K_SLICE;
    const int groups = (N + GROUP - 1) / GROUP, pairs = (groups + 1) / 2;
    const int gated = activation >= 0;
    if (gated && N % (2 * GROUP) != 0) return -1;
    const int padded = (M + 31) / 32 * 32;
    const size_t xs = bf16_row_stride(K);
    /* A row group's slice of blocks as B tiles (four a thread: two pairs); the sums between slices. */
    const int slice_blocks = nb < BF16_K_SLICE ? nb : BF16_K_SLICE;
    /* 512 rows where K is 1,024 (Qwen3-0.6B's hidden size) halve the dequantization of a
     * 512-token prompt step: its qkv and gate/up products took 5-9% less time than in chunks
     * of 256 on the AMX Xeon. */
    const int chunk_rows = BF16_CHUNK_BYTES / (slice_blocks * QK * 2) / 32 * 32;
    /* Two pairs' worth a thread: the pair it multiplies and the one it dequantizes meanwhile. */
    const size_t tile_words = (size_t)4 * slice_blocks * BF16_TILE_WORDS;
    const size_t partial_floats = slices > 1 ? (size_t)(chunk_rows / 32) * pairs * 32 * 32 : 0;
    uint32_t *all_tiles = aligned_alloc(64, (tile_words * (size_t)omp_get_max_threads() + partial_floats) * 4);
    if (all_tiles == NULL) return -1;
    float *partial = (float *)(all_tiles + tile_words * (size_t)omp_get_max_threads());
    int claimed = 0; /* pairs handed out in this chunk's slice */
#pragma omp parallel
    {
        configure_bf16_tiles();
        uint32_t *buffers = all_tiles + tile_words * (size_t)omp_get_thread_num();
        float c[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int r = 0; r < padded; r++) {
            const float *row = r < M ? x + OUT_ROW(r) * K : NULL;
            round_row_bf16(row, K, xb + (size_t)r * xs);
        }
        for (int chunk = 0; chunk < padded; chunk += chunk_rows) {
            const int chunk_end = padded - chunk < chunk_rows ? padded : chunk + chunk_rows;
            const int row_tiles = (chunk_end - chunk) / 32;
            for (int slice = 0; slice < slices; slice++) {
                const int b0 = slice * BF16_K_SLICE, b1 = b0 + BF16_K_SLICE < nb ? b0 + BF16_K_SLICE : nb;
                const int last = slice == slices - 1;
                const size_t block_share = group_bytes / nb; /* slices are whole super-blocks */
#pragma omp single
                claimed = 0;
                /* Pairs go a pair at a time to whichever thread asks (a thread that loses its
                 * core leaves the rest to the other), each one claimed a pair ahead: its weights
                 * are asked for towards L2 and dequantized while the pair before is multiplied.
                 * On the AMX Xeon, q4_1 16,384 x 2,048 at 512 rows took 16.6-17.5 against
                 * 18.4-19.7 ms dequantized first, and a 1 B body's 512-token prompt step 5-8%
                 * less time. */
                int pair = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), side = 0;
                for (int g = 0; g < 2 && pair < pairs; g++) {
                    const int group = pair_group(pair, g, gated, pairs, groups);
                    dequantize_group_bf16(weight_type, packed + (size_t)group * group_bytes, b0, b1,
                                          group_tiles(buffers, side, g, slice_blocks));
                }
                while (pair < pairs) {
                    const int next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
                    weights_ahead ahead = {{NULL, NULL}, {NULL, NULL}};
                    /* The next pair's 2 (b1 - b0) blocks, one every `every` of this pair's
                     * row_tiles (b1 - b0) tile steps. */
                    const int every = row_tiles / 2 > 1 ? row_tiles / 2 : 1;
                    dequant_ahead dequant = {weight_type, b0, b0, next < pairs ? b1 : b0, 0, every, 1, {0}, {0}};
                    for (int g = 0; g < 2 && next < pairs; g++) {
                        const uint8_t *w = packed + (size_t)pair_group(next, g, gated, pairs, groups) * group_bytes;
                        dequant.w[g] = w;
                        dequant.tiles[g] = group_tiles(buffers, 1 - side, g, slice_blocks);
                        ahead.next[g] = (const char *)w + (size_t)b0 * block_share;
                        ahead.end[g] = ahead.next[g] + (size_t)(b1 - b0) * block_share;
                    }
                    const int g0 = pair_group(pair, 0, gated, pairs, groups);
                    const int n0 = g0 * GROUP, width = gated ? GROUP : N - n0 < 2 * GROUP ? N - n0 : 2 * GROUP;
                    for (int r = chunk; r < chunk_end; r += 32) {
                        float *sums =
                            slices > 1 ? partial + ((size_t)(r - chunk) / 32 * pairs + pair) * 32 * 32 : NULL;
                        bf16_tiles_32x32(xb + (size_t)r * xs + (size_t)b0 * QK, xs, b1 - b0,
                                         group_tiles(buffers, side, 0, slice_blocks),
                                         group_tiles(buffers, side, 1, slice_blocks), slice > 0 ? sums : NULL,
                                         last ? c : sums, &ahead, &dequant);
                        if (!last) continue;
                        if (gated) {
                            for (int i = 0; i < 32 && r + i < M; i++)
                                gated_row(GROUP, c + i * 32, c + i * 32 + GROUP, out + OUT_ROW(r + i) * out_stride + n0,
                                          activation == SLUICE_GELU_TANH);
                            continue;
                        }
                        for (int i = 0; i < 32 && r + i < M; i++)
                            for (int n = 0; n < width; n += 16)
                                store_group(out + OUT_ROW(r + i) * out_stride + n0 + n,
                                            width - n < 16 ? width - n : 16, _mm512_load_ps(c + i * 32 + n));
                    }
                    dequant.every = 1; /* what the tile steps left */
                    while (dequant.next < dequant.end) dequantize_ahead(&dequant);
                    pair = next, side = 1 - side;
                }
#pragma omp barrier
            }
        }
        _tile_release();
    }
    free(all_tiles);
    return 0;
}
#endif

#endif
