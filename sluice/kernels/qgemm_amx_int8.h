/* Part of qgemm.c, included by it on the AMX builds (SLUICE_AMX): the int8 tiles, which
 * multiply a decode step's batch of AMX_MIN_ROWS rows or more. qgemm.c defines the formats'
 * helpers, quantized_rows and unpacked_block first. */
#ifndef SLUICE_QGEMM_AMX_INT8_H
#define SLUICE_QGEMM_AMX_INT8_H

#ifdef SLUICE_AMX
#include "amx_tiles.h"

/* ------------------------------------------------------------ AMX-INT8: 16 activation rows a tile
 *
 * Per 32-weight block: C[16 x 16] int32 = A (16 activation rows x 32 int8) . B (the row
 * group's block, 8 tile rows of 4 bytes x 16 weight rows), then the same float steps as
 * group_q8_0 / group_q4_1 with one 16-lane accumulator per activation row. The integer
 * dots are exact, so the results are those of the VNNI path, bit for bit.
 *
 * A call's last tile may hold fewer rows: it loads 16 (the scratch rows are padded to whole
 * tiles) and reads back the dots of its own. Calls of AMX_MIN_ROWS rows or more take the
 * tiles: a 1 B body's decode step (Q4_K_M, on the AMX Xeon) took 54 / 59 ms at 8 / 12 rows
 * on them against 64 / 83 ms on the VNNI code, about the same at 5 and 6 rows, and more
 * below (56 against 40 ms at 4 rows, which the VNNI code reads as one 4-row tile). */
#define AMX_ROWS 16
#define AMX_MIN_ROWS 6
/* Bytes of a block's B tiles: q4_1's and q8_0's one (8 tile rows of 64 bytes), q6_k's two. */
#define AMX_TILE_BYTES 512
#define AMX_SIX_BIT_TILE_BYTES 1024

/* The read-back space of a row tile of the super-block formats: the C tiles' int32 dots (two,
 * for q6_k's halves), each row's sum so far and its super-block's sum. */
typedef struct {
    int32_t dots[2][AMX_ROWS][16];
    __m512 acc[AMX_ROWS], part[AMX_ROWS];
} amx_readback;

/* Two sets of tiles, used by alternate blocks: C (16 x 16 int32), A (16 rows x 32 bytes), B
 * (8 rows x 64 bytes) = tiles 0, 1, 2 for even blocks and 3, 4, 5 for odd ones; tiles 6 and 7
 * are two more C, for q6_k's second halves (amx_six_bit_group). */
static void configure_tiles(void) {
    tile_config config = {0};
    config.palette_id = 1;
    for (int set = 0; set < 6; set += 3) {
        config.rows[set] = AMX_ROWS, config.colsb[set] = 64;
        config.rows[set + 1] = AMX_ROWS, config.colsb[set + 1] = QK;
        config.rows[set + 2] = QK / 4, config.colsb[set + 2] = 64;
    }
    config.rows[6] = config.rows[7] = AMX_ROWS, config.colsb[6] = config.colsb[7] = 64;
    _tile_loadconfig(&config);
}

/* The B tile of a q4_1 block: tile row g < 4 holds the low nibbles of word g (weights
 * 4g..4g+3), g >= 4 the high ones. */
static inline void unpack_q4_1_tile(const uint8_t *w, uint8_t *unpacked) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * j));
        _mm512_store_si512((void *)(unpacked + 64 * j), _mm512_and_si512(raw, nibble));
        _mm512_store_si512((void *)(unpacked + 64 * (j + 4)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
    }
}

/* Start block b's integer dots in tiles C, A, B (literal numbers: gcc spells them into the
 * asm), unpacking block b + 1's B tile first (the first tile of a call; the next ones find it).
 * The first tile also asks for the weights PREFETCH_AHEAD bytes on, as the VNNI loops do: a
 * tile load (q8_0's B tiles come straight from the weights) waited for memory without it. */
#define AMX_START_BLOCK(C, A, B, b)                                                                \
    do {                                                                                           \
        const uint8_t *block = w + (size_t)(b) * block_bytes;                                      \
        if (!unpacked_before) prefetch_ahead(block, block_bytes);                                  \
        _tile_zero(C);                                                                             \
        _tile_loadd(A, xq + (size_t)(b) * QK, K);                                                  \
        if (weight_type == SLUICE_Q8_0) {                                                          \
            _tile_loadd(B, block, 64);                                                             \
            _tile_dpbssd(C, A, B);                                                                 \
        } else {                                                                                   \
            if (!unpacked_before && (b) + 1 < nb)                                                  \
                unpack_q4_1_tile(block + block_bytes, unpacked_blocks + (size_t)((b) + 1) * AMX_TILE_BYTES); \
            _tile_loadd(B, unpacked_blocks + (size_t)(b) * AMX_TILE_BYTES, 64);                    \
            _tile_dpbsud(C, A, B);                                                                 \
        }                                                                                          \
    } while (0)

/* The head of block b's turn in amx_group and amx_super_group: block b + 1's dots started in
 * the other tile set by START (tiles 0, 1, 2 and 3, 4, 5 take turns), then block b's stored
 * into `dots` for its read-back. */
#define AMX_NEXT_BLOCK(START, b)                                                                   \
    do {                                                                                           \
        if ((b) % 2 == 0) {                                                                        \
            if ((b) + 1 < nb) START(3, 4, 5, (b) + 1);                                             \
            _tile_stored(0, dots, 64);                                                             \
        } else {                                                                                   \
            if ((b) + 1 < nb) START(0, 1, 2, (b) + 1);                                             \
            _tile_stored(3, dots, 64);                                                             \
        }                                                                                          \
    } while (0)

/* Activation rows [r0, r0 + rows), rows <= 16, against one row group. Block b + 1's tile
 * multiply is issued before block b's dots are read back and scaled, so the two overlap; each
 * row still sums its blocks in order, in the same float steps as group_q8_0 / group_q4_1.
 * q4_1's blocks are unpacked into their B tiles one block ahead of their tile load: a tile
 * load right behind the vector stores of its bytes waited for them (q4_1 16,384 x 2,048 at
 * 16 rows, one thread: 2.1 against 2.35 ms; a 32-row decode step of a 1 B body: 99-102
 * against 109 ms, with q6_k's blocks unpacked ahead too). */
static void amx_group(int weight_type, const uint8_t *w, int K, int r0, int rows, const quantized_rows *x, __m512 *acc,
                      uint8_t *unpacked_blocks, int unpacked_before) {
    const int nb = K / QK;
    int32_t dots[AMX_ROWS][16] __attribute__((aligned(64)));
    const int block_bytes = weight_type == SLUICE_Q8_0 ? SLUICE_Q8_0_GROUP_BLOCK_BYTES : SLUICE_Q4_1_GROUP_BLOCK_BYTES;
    const int8_t *xq = x->q + (size_t)r0 * K;
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    if (weight_type == SLUICE_Q4_1 && !unpacked_before) unpack_q4_1_tile(w, unpacked_blocks);
    AMX_START_BLOCK(0, 1, 2, 0);
    for (int b = 0; b < nb; b++) {
        AMX_NEXT_BLOCK(AMX_START_BLOCK, b);
        const uint8_t *block = w + (size_t)b * block_bytes;
        const __m512 d = load_halves(block + (weight_type == SLUICE_Q8_0 ? 32 : 16) * GROUP);
        const __m512 m = weight_type == SLUICE_Q4_1 ? load_halves(block + 18 * GROUP) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)(r0 + r) * nb + b;
            const __m512 row_dots = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)dots[r]));
            acc[r] = _mm512_fmadd_ps(row_dots, _mm512_mul_ps(d, _mm512_set1_ps(x->d[index])), acc[r]);
            if (weight_type == SLUICE_Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->dsum[index]), acc[r]);
        }
    }
}
#undef AMX_START_BLOCK

/* The end of a super-block (its last block b): each row's sum of it, times the activations'
 * scale, into acc (group_super's float steps). */
static inline void add_super_block_sums(int r0, int rows, int nb, int b, const quantized_rows *x, __m512 *part,
                                        __m512 *acc) {
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(x->d[(size_t)(r0 + r) * nb + b]), acc[r]);
        part[r] = _mm512_setzero_ps();
    }
}

/* ------------------------------------------------------------ q6_k on the int8 tiles
 *
 * A q6_k block's halves have scales of their own, so each half is its own dot: the block's
 * quants, less 32 (signed bytes), go in two B tiles, the first with the second half's four
 * tile rows zero and the second with the first half's, against the same A tile (the block's
 * 32 activation bytes). Each C tile then holds one half's (q - 32) . x, the integers that
 * half_block_dots forms, and the float steps are add_six_bit_block's and group_super's: the
 * results are the VNNI path's bits. The B tiles hold the zero rows, so there is twice the
 * tile arithmetic a block needs; what bounds the tiles is the read-back, which is the same
 * per half as q8_0's per block. */

/* Block b of a q6_k row group as its two B tiles (the halves' quants less 32, each with the
 * other half's tile rows zero) at halves. */
static inline void unpack_six_bit_tiles(const uint8_t *w, int b, uint8_t *halves) {
    const __m512i thirty_two = _mm512_set1_epi8(32);
    __m512i q[8];
    const uint8_t *block =
        w + (size_t)(b / 8) * SLUICE_Q6_K_GROUP_SUPER_BYTES + (size_t)(b % 8) * SLUICE_Q6_K_GROUP_BLOCK_BYTES;
    prefetch_ahead(w + (size_t)b * (SLUICE_Q6_K_GROUP_SUPER_BYTES / 8), SLUICE_Q6_K_GROUP_SUPER_BYTES / 8);
    unpack_six_bits(block, q);
    for (int g = 0; g < 4; g++) {
        _mm512_store_si512((void *)(halves + 64 * g), _mm512_sub_epi8(q[g], thirty_two));
        _mm512_store_si512((void *)(halves + 64 * (g + 4)), _mm512_setzero_si512());
        _mm512_store_si512((void *)(halves + 512 + 64 * g), _mm512_setzero_si512());
        _mm512_store_si512((void *)(halves + 512 + 64 * (g + 4)), _mm512_sub_epi8(q[g + 4], thirty_two));
    }
}

/* Start block b's two half dots in C tiles CL and CH (A tile A; B tiles 2 and 5), unpacking
 * block b + 1 first (see AMX_START_BLOCK). */
#define AMX_START_SIX_BITS(CL, CH, A, b)                                                           \
    do {                                                                                           \
        if (!unpacked_before && (b) + 1 < nb)                                                      \
            unpack_six_bit_tiles(w, (b) + 1, unpacked_blocks + (size_t)((b) + 1) * AMX_SIX_BIT_TILE_BYTES); \
        const uint8_t *halves = unpacked_blocks + (size_t)(b) * AMX_SIX_BIT_TILE_BYTES;           \
        _tile_zero(CL);                                                                            \
        _tile_zero(CH);                                                                            \
        _tile_loadd(A, xq + (size_t)(b) * QK, K);                                                  \
        _tile_loadd(2, halves, 64);                                                                \
        _tile_loadd(5, halves + 512, 64);                                                          \
        _tile_dpbssd(CL, A, 2);                                                                    \
        _tile_dpbssd(CH, A, 5);                                                                    \
    } while (0)

/* Activation rows [r0, r0 + rows), rows <= 16, against one q6_k row group, block b + 1's tile
 * multiplies issued before block b's dots are read back (as amx_group). */
static void amx_six_bit_group(const uint8_t *w, int K, int r0, int rows, const quantized_rows *x, __m512 *acc,
                              uint8_t *unpacked_blocks, int unpacked_before) {
    const int nb = K / QK;
    amx_readback space;
    int32_t(*low)[16] = space.dots[0], (*high)[16] = space.dots[1];
    __m512 *sums = space.acc, *part = space.part;
    const int8_t *xq = x->q + (size_t)r0 * K;
    for (int r = 0; r < AMX_ROWS; r++) sums[r] = part[r] = _mm512_setzero_ps();
    if (!unpacked_before) unpack_six_bit_tiles(w, 0, unpacked_blocks);
    AMX_START_SIX_BITS(0, 6, 1, 0);
    for (int b = 0; b < nb; b++) {
        if (b % 2 == 0) {
            if (b + 1 < nb) AMX_START_SIX_BITS(3, 7, 4, b + 1);
            _tile_stored(0, low, 64);
            _tile_stored(6, high, 64);
        } else {
            if (b + 1 < nb) AMX_START_SIX_BITS(0, 6, 1, b + 1);
            _tile_stored(3, low, 64);
            _tile_stored(7, high, 64);
        }
        const uint8_t *super = w + (size_t)(b / 8) * SLUICE_Q6_K_GROUP_SUPER_BYTES;
        const int8_t *scales = (const int8_t *)(super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES);
        const __m512 d = load_halves(super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES + 16 * GROUP);
        const __m512 low_scale = _mm512_mul_ps(d, signed_bytes(scales + 2 * (b % 8) * GROUP));
        const __m512 high_scale = _mm512_mul_ps(d, signed_bytes(scales + (2 * (b % 8) + 1) * GROUP));
        for (int r = 0; r < rows; r++) {
            part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)low[r])), low_scale, part[r]);
            part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)high[r])), high_scale, part[r]);
        }
        if (b % 8 == 7) add_super_block_sums(r0, rows, nb, b, x, part, sums);
    }
    for (int r = 0; r < rows; r++) acc[r] = sums[r];
}
#undef AMX_START_SIX_BITS

/* ------------------------------------------------------------ q4_k and q5_k on the int8 tiles
 *
 * A block unpacked as the VNNI code unpacks it (unpack_super_block) is its own B tile: q[g],
 * the unsigned quants of weights 4g .. 4g + 3 of the 16 rows, is tile row g. Each block's
 * dots are read back in group_super's float steps: times d sc, less dmin mn times the
 * block's activation sum, into the super-block's sum, which goes into acc times the
 * activations' scale once a super-block: two float steps a row and block, where q4_1 takes
 * four. On the AMX Xeon q4_k 16,384 x 2,048 at 32 rows took 2.37-2.51 ms against 3.24-3.29 on
 * the VNNI code, q5_k 4,096 x 2,048 0.66-0.70 against 0.85-0.88. */

/* Start block b's integer dots in tiles C, A, B, unpacking block b + 1 first (see
 * AMX_START_BLOCK). */
#define AMX_START_SUPER_BLOCK(C, A, B, b)                                                          \
    do {                                                                                           \
        if (!unpacked_before && (b) + 1 < nb) {                                                    \
            prefetch_ahead(w + (size_t)((b) + 1) * (super_bytes / 8), super_bytes / 8);            \
            unpack_super_block(format, w + (size_t)(((b) + 1) / 8) * super_bytes, ((b) + 1) % 8, blocks + (b) + 1); \
        }                                                                                          \
        _tile_zero(C);                                                                             \
        _tile_loadd(A, xq + (size_t)(b) * QK, K);                                                  \
        _tile_loadd(B, blocks[b].q, 64);                                                           \
        _tile_dpbsud(C, A, B);                                                                     \
    } while (0)

/* Activation rows [r0, r0 + rows), rows <= 16, against one q4_k or q5_k row group, block
 * b + 1's tile multiply issued before block b's dots are read back (as amx_group). Inlined
 * into multiply_group as the other two are: as a call there, it made q4_1's tile loop (the
 * same instructions) 10-18% slower at 32 rows (16,384 x 2,048, builds alternating in one
 * process); why, we did not find. */
ALWAYS_INLINE void amx_super_group(int format, const uint8_t *w, int K, int r0, int rows, const quantized_rows *x,
                            __m512 *acc, unpacked_block *blocks, int unpacked_before) {
    const int nb = K / QK;
    const size_t super_bytes = super_bytes_of(format);
    amx_readback space;
    int32_t(*dots)[16] = space.dots[0];
    __m512 *sums = space.acc, *part = space.part;
    const int8_t *xq = x->q + (size_t)r0 * K;
    for (int r = 0; r < AMX_ROWS; r++) sums[r] = part[r] = _mm512_setzero_ps();
    if (!unpacked_before) unpack_super_block(format, w, 0, blocks);
    AMX_START_SUPER_BLOCK(0, 1, 2, 0);
    for (int b = 0; b < nb; b++) {
        AMX_NEXT_BLOCK(AMX_START_SUPER_BLOCK, b);
        const unpacked_block *u = blocks + b;
        const float *activation_sums = x->dsum + (size_t)r0 * nb + b;
        for (int r = 0; r < rows; r++) {
            part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)dots[r])), u->first, part[r]);
            part[r] = _mm512_fnmadd_ps(u->second, _mm512_set1_ps(activation_sums[(size_t)r * nb]), part[r]);
        }
        if (b % 8 == 7) add_super_block_sums(r0, rows, nb, b, x, part, sums);
    }
    for (int r = 0; r < rows; r++) acc[r] = sums[r];
}
#undef AMX_START_SUPER_BLOCK
#undef AMX_NEXT_BLOCK
#endif

#endif
