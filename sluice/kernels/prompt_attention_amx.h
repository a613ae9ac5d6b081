/* Part of decode_attention.c on the AMX-BF16 build: a prompt's queries on bf16 tiles.
 *
 * A block of consecutive prompt tokens of one request (the blocks attend_block takes) goes
 * through the same K/V tiles of KV_TILE keys from position 0, with the same online softmax,
 * but its two products run on tiles. The block's (query, head) pairs are the rows: row
 * i * G + g is query i's head g, 16 rows a tile.
 *   scores  C[16 rows x 16 keys] = Q (rows x head_dim, bf16) . K^T, summed over head_dim
 *           in 32-dimension steps; K^T's B tiles hold each key's dimension pairs down a
 *           column (the tile of 16 keys is a 16 x 16 transpose of 32-bit pairs);
 *   values  C[16 rows x 16 dimensions] += P (rows x 64 keys, bf16) . V, V's B tiles holding
 *           each pair of consecutive keys interleaved, C loaded from and stored back to the
 *           block's float32 sums.
 * Each tile's softmax weights are rounded to bf16; the sums are float32. A row keeps its
 * running maximum until a tile's passes it by more than LAZY_GROWTH (weights then reach up
 * to 2^8), so its sums are rescaled a few times a prompt, not once a tile: most tiles add
 * their values in the C tiles and nothing else touches the sums. A row's results
 * depend on that row alone (a tile's element sums its own row and column, in the same
 * steps whatever else shares the tile), so a prompt still gets the same bits however it was
 * chunked, cached or batched; but not a decode step's bits, as with the prompt rows of
 * qgemm on this build: prompt tokens take this path every time, in blocks of one too. */
#ifndef SLUICE_PROMPT_ATTENTION_AMX_H
#define SLUICE_PROMPT_ATTENTION_AMX_H

#ifdef SLUICE_AMX_BF16
#include "amx_tiles.h"

#define TILE_WORDS 256 /* 32-bit words of one B tile: 16 rows of 16 */
#define LAZY_GROWTH 8.0f

/* The tile path takes heads of whole 32-dimension steps (A tiles of 32 bf16), up to 256. */
static inline int prompt_tiles_fit(int head_dim) { return head_dim % 32 == 0 && head_dim <= 256; }

/* A thread's buffers for one block of up to TILE_QUERY_BLOCK queries of `group` heads. */
typedef struct {
    uint16_t *q;        /* [rows][head_dim] bf16, rows padded to 16 with zeros */
    uint32_t *k;        /* K^T B tiles: [head_dim / 32][KV_TILE / 16] tiles */
    uint32_t *v;        /* V B tiles: [KV_TILE / 32][head_dim / 16] tiles */
    float *scores;      /* [16][KV_TILE]: one row tile's scores, then its softmax weights */
    uint16_t *weights;  /* [16][KV_TILE] bf16 */
    float *sums;        /* [rows][head_dim]: each row's weighted values so far, unnormalized */
    float *running_max; /* [rows] */
    float *running_sum;
} prompt_tile_buffers;

/* Lays the buffers out from `scratch` (each 64-byte aligned, as the scratch is) and returns
 * the bytes they take; with scratch NULL it only counts them. */
static size_t prompt_tile_layout(char *scratch, int group, int head_dim, prompt_tile_buffers *b) {
    const size_t rows = ((size_t)TILE_QUERY_BLOCK * group + 15) / 16 * 16;
    size_t used = 0;
#define TAKE(field, type, bytes) (b->field = (type *)(scratch == NULL ? NULL : scratch + used), used += ((bytes) + 63) / 64 * 64)
    TAKE(q, uint16_t, rows * head_dim * 2);
    TAKE(k, uint32_t, (size_t)head_dim * KV_TILE * 2);
    TAKE(v, uint32_t, (size_t)head_dim * KV_TILE * 2);
    TAKE(scores, float, 16 * KV_TILE * 4);
    TAKE(weights, uint16_t, 16 * KV_TILE * 2);
    TAKE(sums, float, rows * head_dim * 4);
    TAKE(running_max, float, rows * 4);
    TAKE(running_sum, float, rows * 4);
#undef TAKE
    return used;
}

/* 32 elements of a K/V row (or of zeros) as bf16, rounded to nearest even. */
ALWAYS_INLINE __m512i load_bf16_32(const char *row, const int kv_dtype) {
    if (row == NULL) return _mm512_setzero_si512();
    switch (kv_dtype) {
    case SLUICE_KV_BFLOAT16: return _mm512_loadu_si512((const void *)row);
    case SLUICE_KV_FLOAT16:
        return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)row + 1)),
                                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)row)));
    case SLUICE_KV_FP8_E5M2: { /* float16 high bytes; every e5m2 value is a bf16 one */
        const __m512i halves = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)row)), 8);
        return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1)),
                                            _mm512_cvtph_ps(_mm512_castsi512_si256(halves)));
    }
    default:
        return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps((const float *)row + 16), _mm512_loadu_ps((const float *)row));
    }
}

/* r[i] word j -> r[j] word i, for 16 vectors of 16 32-bit words (VLEN is 16 on this build). */
ALWAYS_INLINE void transpose_16x16_words(__m512i r[16]) {
    __m512 square[16];
    for (int i = 0; i < 16; i++) square[i] = _mm512_castsi512_ps(r[i]);
    transpose_square(square);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(square[i]);
}

/* Keys [t0, t0 + n) of one head as K^T B tiles (keys from n to KV_TILE zero): tile (c, j)
 * row p, column n holds dimensions 32 c + 2 p and 32 c + 2 p + 1 of key 16 j + n. */
ALWAYS_INLINE void keys_to_tiles(const int kv_dtype, int head_dim, int t0, int n, kv_rows keys, const int64_t *req_slots,
                                 uint32_t *tiles) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    for (int j = 0; j < KV_TILE / 16; j++) {
        const char *rows[16];
        for (int r = 0; r < 16; r++) rows[r] = 16 * j + r < n ? kv_row(keys, req_slots, t0 + 16 * j + r) : NULL;
        for (int c = 0; c < head_dim / 32; c++) {
            __m512i words[16];
            for (int r = 0; r < 16; r++) words[r] = load_bf16_32(rows[r] == NULL ? NULL : rows[r] + 32 * c * elem, kv_dtype);
            transpose_16x16_words(words);
            uint32_t *tile = tiles + (size_t)(c * (KV_TILE / 16) + j) * TILE_WORDS;
            for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(tile + 16 * p), words[p]);
        }
    }
}

/* Values [t0, t0 + n) of one head as V B tiles (keys from n on zero): tile (h, d) row p,
 * column m holds dimension 16 d + m of keys 32 h + 2 p and 32 h + 2 p + 1. */
ALWAYS_INLINE void values_to_tiles(const int kv_dtype, int head_dim, int t0, int n, kv_rows values,
                                   const int64_t *req_slots, uint32_t *tiles) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    const __m512i low_pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                               6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high_pairs = _mm512_add_epi16(low_pairs, _mm512_set1_epi16(16));
    for (int key = 0; key < KV_TILE; key += 2) {
        const char *a = key < n ? kv_row(values, req_slots, t0 + key) : NULL;
        const char *b = key + 1 < n ? kv_row(values, req_slots, t0 + key + 1) : NULL;
        const int h = key / 32, p = key % 32 / 2;
        for (int c = 0; c < head_dim / 32; c++) {
            const __m512i va = load_bf16_32(a == NULL ? NULL : a + 32 * c * elem, kv_dtype);
            const __m512i vb = load_bf16_32(b == NULL ? NULL : b + 32 * c * elem, kv_dtype);
            uint32_t *tile = tiles + (size_t)(h * (head_dim / 16) + 2 * c) * TILE_WORDS + 16 * p;
            _mm512_store_si512((void *)tile, _mm512_permutex2var_epi16(va, low_pairs, vb));
            _mm512_store_si512((void *)(tile + TILE_WORDS), _mm512_permutex2var_epi16(va, high_pairs, vb));
        }
    }
}

/* C tiles 0-3 += A tile A . the four B tiles from b on (TILE_WORDS apart), loaded two at a
 * time into B tiles 6 and 7 (a macro: tile numbers are spelled into the instructions). */
#define ADD_FOUR_PRODUCTS(A, b)                                                                    \
    do {                                                                                           \
        const uint32_t *four = (b);                                                                \
        _tile_loadd(6, four, 64);                                                                  \
        _tile_loadd(7, four + TILE_WORDS, 64);                                                     \
        _tile_dpbf16ps(0, A, 6);                                                                   \
        _tile_dpbf16ps(1, A, 7);                                                                   \
        _tile_loadd(6, four + 2 * TILE_WORDS, 64);                                                 \
        _tile_loadd(7, four + 3 * TILE_WORDS, 64);                                                 \
        _tile_dpbf16ps(2, A, 6);                                                                   \
        _tile_dpbf16ps(3, A, 7);                                                                   \
    } while (0)

/* scores[16][KV_TILE] = the row tile's 16 rows of q (bf16, head_dim a row) . the tile's keys. */
static void tile_scores(const uint16_t *q, int head_dim, const uint32_t *k_tiles, float *scores) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < head_dim / 32; c++) {
        _tile_loadd(4, q + 32 * c, head_dim * 2);
        ADD_FOUR_PRODUCTS(4, k_tiles + (size_t)c * (KV_TILE / 16) * TILE_WORDS);
    }
    _tile_stored(0, scores, KV_TILE * 4);
    _tile_stored(1, scores + 16, KV_TILE * 4);
    _tile_stored(2, scores + 32, KV_TILE * 4);
    _tile_stored(3, scores + 48, KV_TILE * 4);
}

/* sums[16][head_dim] += weights (16 rows x KV_TILE keys, bf16) . the tile's values, in the
 * C tiles (loaded from the sums and stored back), four column tiles a pass while head_dim
 * allows: a C tile's two products are then four apart, not one, and the second need not wait
 * for the first to finish (a 4,096-token prompt's attention of Qwen3-0.6B's heads took 58-62
 * against 62 ms a layer in column pairs, on the AMX Xeon). Each C tile adds its two products
 * in the same order either way. */
static void tile_values(const uint16_t *weights, int head_dim, const uint32_t *v_tiles, float *sums) {
    const int columns = head_dim / 16;
    const size_t row = (size_t)head_dim * 4;
    _tile_loadd(4, weights, KV_TILE * 2);
    _tile_loadd(5, weights + 32, KV_TILE * 2);
    int d = 0;
    for (; d + 4 <= columns; d += 4) {
        _tile_loadd(0, sums + 16 * d, row);
        _tile_loadd(1, sums + 16 * (d + 1), row);
        _tile_loadd(2, sums + 16 * (d + 2), row);
        _tile_loadd(3, sums + 16 * (d + 3), row);
        ADD_FOUR_PRODUCTS(4, v_tiles + (size_t)d * TILE_WORDS);             /* keys 0-31 */
        ADD_FOUR_PRODUCTS(5, v_tiles + (size_t)(columns + d) * TILE_WORDS); /* keys 32-63 */
        _tile_stored(0, sums + 16 * d, row);
        _tile_stored(1, sums + 16 * (d + 1), row);
        _tile_stored(2, sums + 16 * (d + 2), row);
        _tile_stored(3, sums + 16 * (d + 3), row);
    }
    for (; d < columns; d += 2) {
        _tile_loadd(0, sums + 16 * d, row);
        _tile_loadd(1, sums + 16 * (d + 1), row);
        _tile_loadd(6, v_tiles + (size_t)d * TILE_WORDS, 64);
        _tile_loadd(7, v_tiles + (size_t)(columns + d) * TILE_WORDS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(6, v_tiles + (size_t)(d + 1) * TILE_WORDS, 64);
        _tile_loadd(7, v_tiles + (size_t)(columns + d + 1) * TILE_WORDS, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(1, 5, 7);
        _tile_stored(0, sums + 16 * d, row);
        _tile_stored(1, sums + 16 * (d + 1), row);
    }
}

/* The online softmax of a row tile's 16 rows over one K/V tile, the rows side by side, in
 * base 2: with c = scale log2(e), a score s has the weight 2^(c s - m), m the row's running
 * maximum of c s (or, with a softcap, of log2(e) softcap tanh(scale s / softcap)).
 * scores[16][KV_TILE] (q.k; row `row` sees its keys [before[row], seen[row]) of the tile)
 * become bf16 weights, zero outside what the row sees; each row's running maximum (lazily,
 * see the top) and sum move on, and correction[row] is the factor for the values summed so
 * far (1: they stay; -1: the row sees none of this tile, its sums stay). A row that sees the
 * whole tile (most rows of a long prompt's tiles) takes no masks. */
static void softmax_rows(float *scores, uint16_t *weights, const int *before, const int *seen, float scale,
                         float softcap, float *running_max, float *running_sum, float *correction) {
    float tile_max[16] __attribute__((aligned(64))), sums[16][16] __attribute__((aligned(64)));
    __mmask16 visible[16][KV_TILE / 16];
    int whole[16];
    float c = scale * LOG2E;
    if (softcap > 0.0f) {
        for (int row = 0; row < 16; row++) {
            float *s = scores + row * KV_TILE;
            for (int t = 0; t < KV_TILE; t += 16) _mm512_store_ps(s + t, _mm512_mul_ps(_mm512_load_ps(s + t), _mm512_set1_ps(scale)));
            softcap_tile(s, KV_TILE, softcap);
        }
        c = LOG2E;
    }
    /* Each row's maximum: its lanes' maxima, then down the transposed rows (a reduction a row
     * was 7-9% of the attention at head_dim 64), and no masks in rows that see the whole tile. */
    __m512i row_maxes[16];
    for (int row = 0; row < 16; row++) {
        const float *s = scores + row * KV_TILE;
        whole[row] = before[row] == 0 && seen[row] == KV_TILE;
        __m512 maxes = _mm512_set1_ps(-INFINITY);
        if (whole[row]) {
            for (int j = 0; j < KV_TILE / 16; j++) visible[row][j] = (__mmask16)0xFFFF;
            for (int j = 0; j < KV_TILE / 16; j++) maxes = _mm512_max_ps(maxes, _mm512_load_ps(s + 16 * j));
        } else {
            for (int j = 0; j < KV_TILE / 16; j++) {
                const int lo = before[row] - 16 * j, hi = seen[row] - 16 * j;
                const uint32_t below_hi = hi <= 0 ? 0u : hi >= 16 ? 0xFFFFu : (1u << hi) - 1u;
                const uint32_t below_lo = lo <= 0 ? 0u : lo >= 16 ? 0xFFFFu : (1u << lo) - 1u;
                visible[row][j] = (__mmask16)(below_hi & ~below_lo);
                maxes = _mm512_mask_max_ps(maxes, visible[row][j], maxes, _mm512_load_ps(s + 16 * j));
            }
        }
        row_maxes[row] = _mm512_castps_si512(maxes);
    }
    transpose_16x16_words(row_maxes);
    __m512 top = _mm512_castsi512_ps(row_maxes[0]);
    for (int i = 1; i < 16; i++) top = _mm512_max_ps(top, _mm512_castsi512_ps(row_maxes[i]));
    _mm512_store_ps(tile_max, top);
    __mmask16 active = 0;
    for (int row = 0; row < 16; row++) active |= (__mmask16)((seen[row] > before[row]) << row);
    const __m512 old_max = _mm512_loadu_ps(running_max);
    /* c > 0, so the largest c s is c times the largest s. */
    const __m512 tile_top = _mm512_mul_ps(_mm512_load_ps(tile_max), _mm512_set1_ps(c));
    /* A row keeps its maximum until the tile's passes it by more than LAZY_GROWTH (weights of
     * up to 2^LAZY_GROWTH), so most tiles rescale nothing. */
    const __mmask16 grows = _mm512_mask_cmp_ps_mask(active, tile_top, _mm512_add_ps(old_max, _mm512_set1_ps(LAZY_GROWTH)), _CMP_GT_OQ);
    const __m512 new_max = _mm512_mask_mov_ps(old_max, grows, tile_top);
    const __m512 factor = _mm512_mask_mov_ps(_mm512_set1_ps(-1.0f), active,
                                             _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grows, exp2_512(_mm512_sub_ps(old_max, new_max))));
    _mm512_storeu_ps(running_max, new_max);
    _mm512_storeu_ps(correction, factor);
    float maxima[16] __attribute__((aligned(64)));
    _mm512_store_ps(maxima, new_max);
    const __m512 cv = _mm512_set1_ps(c);
    for (int row = 0; row < 16; row++) {
        const float *s = scores + row * KV_TILE;
        const __m512 m = _mm512_set1_ps(maxima[row]);
        __m512 acc = _mm512_setzero_ps(), e[KV_TILE / 16];
        for (int j = 0; j < KV_TILE / 16; j++) {
            e[j] = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(s + 16 * j), cv, m));
            if (!whole[row]) e[j] = _mm512_maskz_mov_ps(visible[row][j], e[j]);
            acc = _mm512_add_ps(acc, e[j]);
        }
        for (int j = 0; j < KV_TILE / 16; j += 2)
            _mm512_store_si512((void *)(weights + row * KV_TILE + 16 * j), (__m512i)_mm512_cvtne2ps_pbh(e[j + 1], e[j]));
        _mm512_store_ps(sums[row], acc);
    }
    /* Each row's sum: its 16 lanes, added down the transposed rows. */
    __m512i lanes[16];
    for (int row = 0; row < 16; row++) lanes[row] = _mm512_load_si512((const void *)sums[row]);
    transpose_16x16_words(lanes);
    __m512 total = _mm512_castsi512_ps(lanes[0]);
    for (int i = 1; i < 16; i++) total = _mm512_add_ps(total, _mm512_castsi512_ps(lanes[i]));
    const __m512 old_sum = _mm512_loadu_ps(running_sum);
    _mm512_storeu_ps(running_sum, _mm512_mask_fmadd_ps(old_sum, active, factor, total));
}

/* A block of `count` consecutive prompt tokens of one request (query i sees lens[i] =
 * lens[0] + i slots of req_slots) against one KV head, on tiles; out as attend_block's.
 * The tiles must be configured (configure_bf16_tiles) on this thread. */
static void attend_block_tiles(const int G, const int kv_dtype, int count, const float *q, long q_stride, int head_dim,
                               const int64_t *lens, const int64_t *req_slots, float scale, int window, float softcap,
                               kv_rows keys, kv_rows values, prompt_tile_buffers b, float *out, size_t out_stride) {
    const int rows = count * G, padded = (rows + 15) / 16 * 16, longest = (int)lens[count - 1];
    for (int r = 0; r < padded; r++) {
        uint16_t *qb = b.q + (size_t)r * head_dim;
        const float *qr = r < rows ? q + (size_t)(r / G) * q_stride + (size_t)(r % G) * head_dim : NULL;
        for (int d = 0; d < head_dim; d += 16)
            _mm256_store_si256((__m256i *)(qb + d),
                               (__m256i)_mm512_cvtneps_pbh(qr != NULL ? _mm512_loadu_ps(qr + d) : _mm512_setzero_ps()));
        b.running_max[r] = -INFINITY, b.running_sum[r] = 0.0f;
        for (int d = 0; d < head_dim; d += 16) _mm512_store_ps(b.sums + (size_t)r * head_dim + d, _mm512_setzero_ps());
    }
    for (int t0 = window_start((int)lens[0], window) / KV_TILE * KV_TILE; t0 < longest; t0 += KV_TILE) {
        const int n = t0 + KV_TILE < longest ? KV_TILE : longest - t0;
        keys_to_tiles(kv_dtype, head_dim, t0, n, keys, req_slots, b.k);
        values_to_tiles(kv_dtype, head_dim, t0, n, values, req_slots, b.v);
        for (int r0 = 0; r0 < rows; r0 += 16) {
            /* The rows' queries are in order, so the tile's last query sees the most. */
            const int first_query = r0 / G, last_query = (r0 + 15 < rows ? r0 + 15 : rows - 1) / G;
            if (t0 >= lens[last_query] || t0 + KV_TILE <= window_start((int)lens[first_query], window)) continue;
            int before[16], seen[16];
            for (int row = 0; row < 16; row++) {
                const int len = r0 + row < rows ? (int)lens[(r0 + row) / G] : 0, start = window_start(len, window);
                before[row] = start > t0 ? start - t0 : 0;
                seen[row] = len <= t0 ? 0 : len - t0 < KV_TILE ? len - t0 : KV_TILE;
            }
            float correction[16];
            tile_scores(b.q + (size_t)r0 * head_dim, head_dim, b.k, b.scores);
            softmax_rows(b.scores, b.weights, before, seen, scale, softcap, b.running_max + r0, b.running_sum + r0,
                         correction);
            for (int row = 0; row < 16; row++) {
                if (correction[row] < 0.0f || correction[row] == 1.0f) continue;
                float *o = b.sums + (size_t)(r0 + row) * head_dim;
                const __m512 factor = _mm512_set1_ps(correction[row]);
                for (int d = 0; d < head_dim; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(_mm512_load_ps(o + d), factor));
            }
            tile_values(b.weights, head_dim, b.v, b.sums + (size_t)r0 * head_dim);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)(r / G) * out_stride + (size_t)(r % G) * head_dim;
        const float *sum = b.sums + (size_t)r * head_dim;
        const __m512 inv_sum = _mm512_set1_ps(1.0f / b.running_sum[r]);
        for (int d = 0; d < head_dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_load_ps(sum + d), inv_sum));
    }
}
#undef ADD_FOUR_PRODUCTS
#endif

#endif
