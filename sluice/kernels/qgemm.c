/* Block-quantized matrix multiply on x86-64: AVX2 + FMA (F16C for the scales), or
 * AVX-512 with VNNI when this file is built for it.
 *
 * out[M, N] = x[M, K] @ W[N, K]^T where W is stored in blocks of 32 weights along K:
 *   q8_0: int8 q, one scale d per block            w = d * q
 *   q4_1: 4-bit q, a scale d and a minimum m        w = d * q + m
 *   q6_k: GGUF's Q6_K: 6-bit q, an int8 scale sc per 16 weights and a float16 d per 256
 *                                                   w = d * sc * (q - 32)
 *   q4_k: GGUF's Q4_K: 4-bit q, a 6-bit scale sc and minimum mn per 32 weights, float16 d
 *         and dmin per 256                          w = (d * sc) * q - (dmin * mn)
 *   q5_k: GGUF's Q5_K: q4_k with 5-bit q
 *   q5_1: GGUF's Q5_1 (and Q5_0, m = -16 d): q4_1 with 5-bit q
 *
 * x is quantized on the fly to int8 (scale = max|x| / 127) per block of 32 for q8_0, q4_1 and
 * q5_1, per super-block of 256 for q6_k, q4_k and q5_k, so each block's dot product is an
 * integer dot of 32 pairs: the weights are read once as bytes, which is what a decode step
 * is bound by. This is the arithmetic of llama.cpp's dot products against q8_0 and q8_K
 * activations; the code and the layout below are our own.
 *
 * Weights are interleaved by G output rows ("a row group", G = SLUICE_ROW_GROUP: 8 for
 * 256-bit registers, 16 for 512-bit ones), block after block, so that one register holds 4
 * consecutive weights of each of the G rows. Against the same 4 activation bytes broadcast
 * to every lane, the integer dot instructions yield the G rows' partial dots in the G lanes:
 * no horizontal sums, and a block's scales for G rows are one vector. A row group's block is
 * (sluice/model/quantized_linear.py writes this layout):
 *   q4_1: 16 G bytes: byte [j][i][t] = q[row i][4j + t] | q[row i][4j + t + 16] << 4
 *                     (j < 4, i < G, t < 4), then G float16 d, then G float16 m
 *   q8_0: 32 G bytes: byte [j][i][t] = q[row i][4j + t] (j < 8), then G float16 d
 *   q6_k: a super-block of 256 weights is eight blocks of 24 G bytes: the low nibbles as in
 *         q4_1 (16 G bytes), then two words of high bits, byte [4 + h][i][t] holding bits
 *         4..5 of q[row i][16h + 4g + t] at bits 2g..2g+1 (g < 4); then the 16 sub-block
 *         scales, int8 [16][G], then G float16 d
 *   q4_k: a super-block is eight blocks of q4_1's 16 G nibble bytes, then the blocks' sc as
 *         uint8 [8][G], their mn likewise, G float16 d and G float16 dmin
 *   q5_k: as q4_k, each block's nibbles followed by one word of high bits a row: byte
 *         [i][t] holds bit 4 of q[row i][4g + t] at bit g (g < 8)
 *   q5_1: q4_1's 16 G nibble bytes, then q5_k's word of high bits a row, then G float16 d
 *         and G float16 m
 *
 * The super-block formats sum a super-block's blocks before x's scale: a q6_k block's two
 * 16-weight halves are integer dots with the half's sum of x taken off 32 times (at most 32
 * * 127 * 16 < 2^24, exact as a float), each added times its scale (d times the int8
 * sub-block scale, exact in float32) into the super-block's sum in one FMA; a q4_k or q5_k
 * block's dot is added times d sc, and dmin mn times the block's sum of x taken off, in two.
 * One FMA a super-block adds its sum times x's scale into the output. A block of the other
 * formats goes into the output at once: its dot times d * x's scale, plus m times x's sum.
 * (With x's scale a block, the super-block formats took two or three more float operations
 * a block, which on the AMX tiles bound the time: q6_k 4,096 x 2,048 at 16 and 32 rows
 * takes about 10% less time this way.)
 *
 * Each block's integer dot is exact on either instruction set (no intermediate can
 * saturate), and each output is accumulated in block order by one chain of FMAs, whatever
 * M, the tile or the thread split. So a row's result never depends on the other rows in the
 * batch, and the AVX2 and AVX-512 builds give the same bits.
 */
#define _GNU_SOURCE /* syscall() for the AMX permission */
#include "kernels.h"
#include "vector_math.h"

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define QK SLUICE_BLOCK
#define GROUP SLUICE_ROW_GROUP
#define TILE 4 /* activation rows sharing each loaded weight vector */
/* The super-block formats cost more to unpack: on AVX-512 (32 registers) 8 rows share them. */
#ifdef SLUICE_AVX512_VNNI
#define SUPER_TILE 8
#else
#define SUPER_TILE TILE
#endif
#define M_CHUNK 128
#define PREFETCH_AHEAD 4096
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* The largest |x| of a 32-float block. */
static inline float block_max_abs(const float *xb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb)), _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8))),
                                _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 16)), _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 24))));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

/* One row of K floats -> K int8, in scales of `blocks_a_scale` blocks (scale = max|x| / 127 over
 * them): 1 for the 32-weight formats (llama.cpp's q8_0 activations), 8 for the super-block
 * ones (its q8_K: one scale per 256, which their float steps take once a super-block). Per
 * block: d (its scale), the sum of its quants, the sum of its first 16 (for q6_k's halves;
 * only where qsum_low is not NULL), and dsum: d * the sum (for q4_1's m), or with a scale per
 * super-block the sum itself as a float (exact: at most 32 * 127). */
static void quantize_row(const float *x, int K, int blocks_a_scale, int8_t *q, float *d, int32_t *qsum,
                         int32_t *qsum_low, float *dsum) {
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    float max_abs = 0.0f;
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        if (b % blocks_a_scale == 0) {
            max_abs = block_max_abs(xb);
            for (int next = 1; next < blocks_a_scale; next++) {
                const float other = block_max_abs(xb + next * QK);
                max_abs = other > max_abs ? other : max_abs;
            }
        }
        const float scale = max_abs / 127.0f;
        const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb), inv), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), inv), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), inv), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), inv), rnd));
        /* The packs interleave 128-bit lanes; the permute puts the 32 bytes back in order. */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        packed = _mm256_permutevar8x32_epi32(packed, perm);
        _mm256_storeu_si256((__m256i *)(q + b * QK), packed);
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, packed), ones16);
        const int sum = hsum_epi32(sums);
        d[b] = scale;
        qsum[b] = sum;
        if (qsum_low != NULL) qsum_low[b] = hsum_epi32(_mm256_zextsi128_si256(_mm256_castsi256_si128(sums))); /* lanes 0-3: bytes 0-15 */
        dsum[b] = blocks_a_scale == 1 ? scale * (float)sum : (float)sum;
    }
}

/* With a decode step's few rows, the hardware prefetcher alone fell behind on the super-block
 * formats (whose scales lie after their eight blocks): on Zen 3, q4_k and q6_k at one row
 * read 9-11 GB/s of a ~20 GB/s memory, and 18-22 GB/s with this. Each block asks for the
 * bytes PREFETCH_AHEAD further on, which the same thread reads a few microseconds later (the
 * rest of its row group, or the next group of its turn). */
ALWAYS_INLINE void prefetch_ahead(const uint8_t *block, int bytes) {
    for (int offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)block + PREFETCH_AHEAD + offset, _MM_HINT_T0);
}

ALWAYS_INLINE int32_t load_word(const int8_t *p) {
    int32_t word;
    __builtin_memcpy(&word, p, 4);
    return word;
}

/* The row-group kernels of each format, one file per instruction set. */
#ifdef SLUICE_AVX512_VNNI
#include "qgemm_avx512.h"
#else
#include "qgemm_avx2.h"
#endif


/* A block of the packed formats, on either instruction set, unpacked: its quants a byte each
 * (q[g]: weights 4g .. 4g + 3 of the G rows) and two vectors of per-row factors, formed
 * exactly in float32 from the file's numbers:
 *   q4_k, q5_k: the block's scale d sc and minimum dmin mn (11 + 6 bits), then q4_1's
 *               arithmetic, w = (d sc) q - (dmin mn); q5_k's q < 32 keeps the integer dots
 *               exact too (8 products of 31 * 127 fit AVX2's int16 pair sums);
 *   q4_1, q5_1: d and -m (w = d q + m: the same arithmetic, and the sign flip is exact, so
 *               the results are group_q4_1's bits);
 *   q6_k:       its two halves' scales d sc.
 * The super-block formats always run from these; q4_1 and q5_1 only where a call has more rows
 * than a tile (with a decode step's few rows their packed loop is faster). They have no
 * super-blocks: eight of their blocks in a row stand in for one below. */
typedef struct {
    block_ints q[8];
    group_acc first, second;
} unpacked_block;

ALWAYS_INLINE void unpack_super_block(const int format, const uint8_t *super, int k, unpacked_block *u) {
    if (format == SLUICE_Q4_1 || format == SLUICE_Q5_1) {
        const int five_bits = format == SLUICE_Q5_1;
        const uint8_t *block = super + k * (five_bits ? SLUICE_Q5_1_GROUP_BLOCK_BYTES : SLUICE_Q4_1_GROUP_BLOCK_BYTES);
        const int scales_at = (five_bits ? 20 : 16) * GROUP;
        unpack_nibbles(block, u->q);
        if (five_bits) add_fifth_bits(block + 16 * GROUP, u->q);
        u->first = load_halves(block + scales_at);
        u->second = VEC_MUL(load_halves(block + scales_at + 2 * GROUP), VEC_SET1(-1.0f));
        return;
    }
    if (format == SLUICE_Q6_K) {
        const int8_t *scales = (const int8_t *)(super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES);
        const group_acc d = load_halves(super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES + 16 * GROUP);
        unpack_six_bits(super + k * SLUICE_Q6_K_GROUP_BLOCK_BYTES, u->q);
        u->first = VEC_MUL(d, signed_bytes(scales + 2 * k * GROUP));
        u->second = VEC_MUL(d, signed_bytes(scales + (2 * k + 1) * GROUP));
        return;
    }
    const int five_bits = format == SLUICE_Q5_K;
    const int block_bytes = five_bits ? SLUICE_Q5_K_GROUP_BLOCK_BYTES : SLUICE_Q4_K_GROUP_BLOCK_BYTES;
    const uint8_t *scales = super + 8 * block_bytes, *minimums = scales + 8 * GROUP;
    unpack_nibbles(super + k * block_bytes, u->q);
    if (five_bits) add_fifth_bits(super + k * block_bytes + 16 * GROUP, u->q);
    u->first = scaled_bytes(scales + k * GROUP, load_halves(minimums + 8 * GROUP));
    u->second = scaled_bytes(minimums + k * GROUP, load_halves(minimums + 10 * GROUP));
}

static size_t super_bytes_of(int format) {
    return format == SLUICE_Q6_K   ? SLUICE_Q6_K_GROUP_SUPER_BYTES
           : format == SLUICE_Q5_K ? SLUICE_Q5_K_GROUP_SUPER_BYTES
           : format == SLUICE_Q4_1 ? 8 * SLUICE_Q4_1_GROUP_BLOCK_BYTES
           : format == SLUICE_Q5_1 ? 8 * SLUICE_Q5_1_GROUP_BLOCK_BYTES
                                   : SLUICE_Q4_K_GROUP_SUPER_BYTES;
}

#ifndef SLUICE_AVX512_VNNI
/* AVX2: `rows` activation rows against a row group's unpacked nibble blocks (q4_1, q5_1, q4_k,
 * q5_k), word by word: each weight vector is loaded once for all the rows, whose int16 sums
 * stay in registers (a block's 8 weight vectors held for the rows, as group_super does, leave
 * too few of AVX2's 16 for the rows' sums and accumulators, and gcc spilled them: 15-22%
 * slower at 128 rows on Zen 3).
 * The integer dots are the same exact sums, 4-bit ones in int16 (8 words: at most 16 * 15 *
 * 127), 5-bit ones widened after each 4 words (8 * 31 * 127); the float steps are
 * group_super's, so the bits are too. */
ALWAYS_INLINE void unpacked_nibble_rows(const int rows, const int five_bits, const int super_blocks, int nb, int K,
                                        const unpacked_block *u, const int8_t *xq, const float *xd, const float *xdsum,
                                        __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* In registers: acc is an array its caller indexes at run time. The super-block formats sum
     * a super-block here and add it into acc once a super-block (see group_super). */
    __m256 totals[TILE];
    for (int r = 0; r < rows; r++) acc[r] = totals[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, u++) {
        __m256i sums[TILE], wide[TILE];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m256i q = _mm256_load_si256(&u->q[g]);
            const int new_sum = g == 0 || (five_bits && g == 4); /* 5-bit: the second half's own sum */
            for (int r = 0; r < rows; r++) {
                const __m256i products = _mm256_maddubs_epi16(q, broadcast4(xq + (size_t)r * K + b * QK + 4 * g));
                sums[r] = new_sum ? products : _mm256_add_epi16(sums[r], products);
                __asm__("" : "+x"(sums[r])); /* kept a running sum: gcc's tree of all 32 products spills */
                if (five_bits && g == 3) wide[r] = _mm256_madd_epi16(sums[r], ones);
            }
        }
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            const __m256i dots = five_bits ? _mm256_add_epi32(wide[r], _mm256_madd_epi16(sums[r], ones))
                                           : _mm256_madd_epi16(sums[r], ones);
            const __m256 scale = super_blocks ? u->first : _mm256_mul_ps(u->first, _mm256_set1_ps(xd[index]));
            totals[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, totals[r]);
            totals[r] = _mm256_fnmadd_ps(u->second, _mm256_set1_ps(xdsum[index]), totals[r]);
            if (super_blocks && b % 8 == 7) {
                acc[r] = _mm256_fmadd_ps(totals[r], _mm256_set1_ps(xd[index]), acc[r]);
                totals[r] = _mm256_setzero_ps();
            }
        }
    }
    for (int r = 0; !super_blocks && r < rows; r++) acc[r] = totals[r];
}
#endif

/* `rows` activation rows against a row group of any format but q8_0, block by block, from
 * the packed weights or, where `unpacked` is not NULL, from all its blocks unpacked before
 * (the same numbers: the results are the same bits either way). The super-block formats sum
 * each super-block's blocks in `part` (their activations have one scale a super-block), then
 * add that times the scale into acc; q4_1 and q5_1 add each block into acc. */
ALWAYS_INLINE void group_super(const int rows, const int format, int nb, int K, const uint8_t *w,
                               const unpacked_block *unpacked, const int8_t *xq, const float *xd,
                               const int32_t *xqsum, const int32_t *xqsum_low, const float *xdsum, group_acc *acc) {
#ifndef SLUICE_AVX512_VNNI
    if (unpacked != NULL && format != SLUICE_Q6_K) {
        const int five_bits = format == SLUICE_Q5_K || format == SLUICE_Q5_1;
        unpacked_nibble_rows(rows, five_bits, SLUICE_SUPER_BLOCK_FORMAT(format), nb, K, unpacked, xq, xd, xdsum, acc);
        return;
    }
#endif
    const size_t super_bytes = super_bytes_of(format);
    const int super_blocks = SLUICE_SUPER_BLOCK_FORMAT(format);
    group_acc part[SUPER_TILE > TILE ? SUPER_TILE : TILE];
    for (int r = 0; r < rows; r++) acc[r] = part[r] = VEC_ZERO();
    for (int b = 0; b < nb; b++) {
        unpacked_block here;
        const unpacked_block *u = unpacked != NULL ? unpacked + b : &here;
        if (unpacked == NULL) {
            prefetch_ahead(w + (size_t)b * (super_bytes / 8), super_bytes / 8);
            unpack_super_block(format, w + (size_t)(b / 8) * super_bytes, b % 8, &here);
        }
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            const int8_t *x = xq + (size_t)r * K + b * QK;
            const int five_bits = format == SLUICE_Q5_K || format == SLUICE_Q5_1;
            if (format == SLUICE_Q6_K) {
                const int32_t low_sum = xqsum_low[index], high_sum = xqsum[index] - low_sum;
                part[r] = add_six_bit_block(part[r], u->q, x, low_sum, high_sum, u->first, u->second);
            } else if (super_blocks) {
                part[r] = VEC_FMADD(VEC_CVT_INT(nibble_block_dots(u->q, x, five_bits)), u->first, part[r]);
                part[r] = VEC_FNMADD(u->second, VEC_SET1(xdsum[index]), part[r]);
            } else {
                const group_acc dots = VEC_CVT_INT(nibble_block_dots(u->q, x, five_bits));
                acc[r] = VEC_FMADD(dots, VEC_MUL(u->first, VEC_SET1(xd[index])), acc[r]);
                acc[r] = VEC_FNMADD(u->second, VEC_SET1(xdsum[index]), acc[r]);
            }
            if (super_blocks && b % 8 == 7) {
                acc[r] = VEC_FMADD(part[r], VEC_SET1(xd[index]), acc[r]);
                part[r] = VEC_ZERO();
            }
        }
    }
}

/* Activation rows sharing each loaded (or unpacked) block of a format. */
static inline int tile_rows(int format) { return SLUICE_SUPER_BLOCK_FORMAT(format) ? SUPER_TILE : TILE; }

/* A tile of 1..TILE activation rows, with the row count a compile-time constant. */
#define DISPATCH_ROWS(call_with_rows)                              \
    switch (rows) {                                                \
    case 1: call_with_rows(1); break;                              \
    case 2: call_with_rows(2); break;                              \
    case 3: call_with_rows(3); break;                              \
    default: call_with_rows(4); break;                             \
    }
#if SUPER_TILE == TILE
#define DISPATCH_SUPER_ROWS DISPATCH_ROWS
#else
#define DISPATCH_SUPER_ROWS(call_with_rows)                        \
    switch (rows) {                                                \
    case 1: call_with_rows(1); break;                              \
    case 2: call_with_rows(2); break;                              \
    case 3: call_with_rows(3); break;                              \
    case 4: call_with_rows(4); break;                              \
    case 5: call_with_rows(5); break;                              \
    case 6: call_with_rows(6); break;                              \
    case 7: call_with_rows(7); break;                              \
    default: call_with_rows(SUPER_TILE); break;                    \
    }
#endif

/* The quantized activations in the scratch buffer. */
typedef struct {
    int8_t *q;      /* [M, K] */
    float *d;       /* [M, K / 32] scales */
    int32_t *qsum;  /* [M, K / 32] sums of each block's quants */
    int32_t *qsum_low; /* [M, K / 32] sums of each block's first 16 quants */
    float *dsum;    /* [M, K / 32] d * qsum, or qsum itself for the super-block formats */
} quantized_rows;

/* Room for the int8 rows: M rounded up to whole 16-row tiles, so that a tile of the last few
 * rows loads inside the buffer (the rows past M are never read back). */
static inline size_t padded_rows(int M) { return ((size_t)M + 15) / 16 * 16; }

static quantized_rows scratch_rows(void *scratch, int M, int K) {
    const size_t blocks = (size_t)M * (K / QK);
    quantized_rows rows;
    rows.q = (int8_t *)scratch;
    rows.d = (float *)(rows.q + padded_rows(M) * K);
    rows.qsum = (int32_t *)(rows.d + blocks);
    rows.qsum_low = rows.qsum + blocks;
    rows.dsum = (float *)(rows.qsum_low + blocks);
    return rows;
}

/* Row r of a call's activations is row out_rows[r] of x and out (r where out_rows is NULL). */
#define OUT_ROW(r) ((size_t)(out_rows != NULL ? out_rows[r] : (r)))

/* The AMX tile paths (nothing on other builds): int8 tiles for batches, bf16 tiles for prompts. */
#include "qgemm_amx_int8.h"
#include "qgemm_amx_bf16.h"

/* Activation rows [r_begin, r_end) against one row group: out columns n0 .. n0 + width of rows
 * out_stride floats apart (rows as OUT_ROW maps them). buffer: room for a row group's unpacked
 * blocks, or on the tiles their B tiles (NULL: none, or q8_0's, which are not unpacked). */
static void multiply_group(int weight_type, const uint8_t *w, int n0, int width, int out_stride, int K, int r_begin,
                           int r_end, const quantized_rows *x, const int *out_rows, float *out, int use_tiles,
                           unpacked_block *buffer) {
    const int nb = K / QK;
#ifdef SLUICE_AMX
    /* The tiles take every format but q5_1, which runs the VNNI code at every M. All but
     * q8_0 unpack their B tiles into the thread's buffer (without one, which only a
     * failed allocation leaves, every row takes the VNNI code: the same bits). The first 16
     * rows unpack each block, the next ones load it from there: at 64 rows q4_1 16,384 x
     * 2,048 took 3.9 ms against 4.4-5.0 unpacked per tile. */
    const int tiles_ready = weight_type == SLUICE_Q8_0 || (weight_type != SLUICE_Q5_1 && buffer != NULL);
    if (use_tiles && tiles_ready) {
        for (int first = 1; r_begin < r_end; r_begin += AMX_ROWS, first = 0) {
            const int rows = r_end - r_begin < AMX_ROWS ? r_end - r_begin : AMX_ROWS;
            __m512 acc[AMX_ROWS];
            if (weight_type == SLUICE_Q6_K) amx_six_bit_group(w, K, r_begin, rows, x, acc, (uint8_t *)buffer, !first);
            else if (weight_type == SLUICE_Q4_K || weight_type == SLUICE_Q5_K)
                amx_super_group(weight_type, w, K, r_begin, rows, x, acc, buffer, !first);
            else amx_group(weight_type, w, K, r_begin, rows, x, acc, (uint8_t *)buffer, !first);
            for (int r = 0; r < rows; r++) store_group(out + OUT_ROW(r_begin + r) * out_stride + n0, width, acc[r]);
        }
    }
#else
    (void)use_tiles;
#endif
    const int tile = tile_rows(weight_type);
    /* More rows than one tile: the blocks are unpacked once for all the tiles (the unpacking
     * costs as much as the dots of a few rows: a 2,048-token prompt of a Q4_K_M Llama-3.2-1B
     * body (q4_1 and q6_k) took 7% less time than with q4_1 unpacked per tile, a Gemma-3-1B
     * body's (mostly q5_1) 15% less, on Zen 3). */
    const unpacked_block *unpacked = buffer != NULL && r_end - r_begin > tile ? buffer : NULL;
    const size_t super_bytes = super_bytes_of(weight_type);
    for (int b = 0; unpacked != NULL && b < nb; b++) {
        prefetch_ahead(w + (size_t)b * (super_bytes / 8), super_bytes / 8);
        unpack_super_block(weight_type, w + (size_t)(b / 8) * super_bytes, b % 8, buffer + b);
    }
    for (int r0 = r_begin; r0 < r_end; r0 += tile) {
        const int rows = r_end - r0 < tile ? r_end - r0 : tile;
        const int8_t *xq_tile = x->q + (size_t)r0 * K;
        const size_t first_block = (size_t)r0 * nb;
        const float *xd = x->d + first_block, *xdsum = x->dsum + first_block;
        const int32_t *xqsum = x->qsum + first_block, *xqsum_low = x->qsum_low + first_block;
        group_acc acc[SUPER_TILE > TILE ? SUPER_TILE : TILE] = {0}; /* every row is set below; gcc cannot tell */
#define Q8_0_ROWS(R) group_q8_0(R, nb, K, w, xq_tile, xd, xqsum, acc)
#define SUPER_ROWS(R, FORMAT) group_super(R, FORMAT, nb, K, w, unpacked, xq_tile, xd, xqsum, xqsum_low, xdsum, acc)
/* q4_1 and q5_1 from the unpacked blocks where a call has them, else their packed loop. */
#define NIBBLE_ROWS(R, FORMAT, FIVE_BITS)                                                                  \
    (unpacked != NULL ? SUPER_ROWS(R, FORMAT) : group_q4_1(R, FIVE_BITS, nb, K, w, xq_tile, xd, xqsum, xdsum, acc))
#define Q4_1_ROWS(R) NIBBLE_ROWS(R, SLUICE_Q4_1, 0)
#define Q5_1_ROWS(R) NIBBLE_ROWS(R, SLUICE_Q5_1, 1)
#define Q6_K_ROWS(R) SUPER_ROWS(R, SLUICE_Q6_K)
#define Q4_K_ROWS(R) SUPER_ROWS(R, SLUICE_Q4_K)
#define Q5_K_ROWS(R) SUPER_ROWS(R, SLUICE_Q5_K)
        switch (weight_type) {
        case SLUICE_Q8_0: DISPATCH_ROWS(Q8_0_ROWS) break;
        case SLUICE_Q4_1: DISPATCH_ROWS(Q4_1_ROWS) break;
        case SLUICE_Q5_1: DISPATCH_ROWS(Q5_1_ROWS) break;
        case SLUICE_Q6_K: DISPATCH_SUPER_ROWS(Q6_K_ROWS) break;
        case SLUICE_Q4_K: DISPATCH_SUPER_ROWS(Q4_K_ROWS) break;
        default: DISPATCH_SUPER_ROWS(Q5_K_ROWS) break;
        }
        for (int r = 0; r < rows; r++) store_group(out + OUT_ROW(r0 + r) * out_stride + n0, width, acc[r]);
    }
}

/* Bytes of one row group's weights along K, 0 for a format or K it cannot take. */
static size_t group_bytes_of(int weight_type, int K) {
    const int nb = K / QK;
    if (SLUICE_SUPER_BLOCK_FORMAT(weight_type) && K % SLUICE_SUPER_BLOCK != 0) return 0;
    switch (weight_type) {
    case SLUICE_Q8_0: return (size_t)nb * SLUICE_Q8_0_GROUP_BLOCK_BYTES;
    case SLUICE_Q4_1: return (size_t)nb * SLUICE_Q4_1_GROUP_BLOCK_BYTES;
    case SLUICE_Q5_1: return (size_t)nb * SLUICE_Q5_1_GROUP_BLOCK_BYTES;
    case SLUICE_Q6_K: return (size_t)(K / SLUICE_SUPER_BLOCK) * SLUICE_Q6_K_GROUP_SUPER_BYTES;
    case SLUICE_Q4_K: return (size_t)(K / SLUICE_SUPER_BLOCK) * SLUICE_Q4_K_GROUP_SUPER_BYTES;
    case SLUICE_Q5_K: return (size_t)(K / SLUICE_SUPER_BLOCK) * SLUICE_Q5_K_GROUP_SUPER_BYTES;
    default: return 0;
    }
}

/* Bytes a block of a thread's buffer: an unpacked_block, or on the tiles a block's B tiles. */
static size_t buffer_block_bytes(int use_tiles) {
#ifdef SLUICE_AMX
    if (use_tiles && sizeof(unpacked_block) < AMX_SIX_BIT_TILE_BYTES) return AMX_SIX_BIT_TILE_BYTES;
#else
    (void)use_tiles;
#endif
    return sizeof(unpacked_block);
}

/* The int8 path: M rows (row r is x's and out's row OUT_ROW(r)), quantized into scratch. */
static int int8_rows(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, size_t group_bytes,
                     float *out, int out_stride, const int *out_rows, void *scratch) {
    const int nb = K / QK;
    const int groups = (N + GROUP - 1) / GROUP;
    const quantized_rows rows = scratch_rows(scratch, M, K);
    int use_tiles = 0;
#ifdef SLUICE_AMX
    if (M >= AMX_MIN_ROWS) {
        if (!amx_permitted()) return -2;
        use_tiles = 1;
    }
#endif

    /* Threads take row groups a few at a time (8 turns a thread), not a fixed half each: on a
     * machine whose cores also run the server's other processes, a thread that loses its core
     * for a while leaves its share to the others instead of holding up the whole call (served
     * one-stream decode of Qwen3-0.6B: 51.7 against 47.3 tok/s, 3 alternating rounds). A group's
     * outputs are computed the same way whichever thread takes it: the bits do not change. */
    const int spread = 8 * omp_get_max_threads();
    const int groups_a_turn = groups / spread > 0 ? groups / spread : 1;
#pragma omp parallel
    {
#ifdef SLUICE_AMX
        if (use_tiles) configure_tiles();
#endif
        /* Each thread's buffer for unpacked blocks or B tiles, once a call (none for a decode
         * step's few rows off the tiles; where it cannot be had, the blocks are unpacked per
         * tile, or the rows take the VNNI code: the same bits). */
        unpacked_block *buffer = weight_type != SLUICE_Q8_0 && (use_tiles || M > tile_rows(weight_type))
                                     ? aligned_alloc(64, (buffer_block_bytes(use_tiles) * (size_t)nb + 63) / 64 * 64)
                                     : NULL;
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++) {
            const size_t first_block = (size_t)r * nb;
            quantize_row(x + OUT_ROW(r) * K, K, SLUICE_SUPER_BLOCK_FORMAT(weight_type) ? 8 : 1, rows.q + (size_t)r * K,
                         rows.d + first_block, rows.qsum + first_block,
                         weight_type == SLUICE_Q6_K ? rows.qsum_low + first_block : NULL, rows.dsum + first_block);
        }
        /* Activation rows in chunks that stay in L2 while every row group passes over them. */
        for (int chunk = 0; chunk < M; chunk += M_CHUNK) {
            const int chunk_end = M - chunk < M_CHUNK ? M : chunk + M_CHUNK;
#pragma omp for schedule(dynamic, groups_a_turn)
            for (int group = 0; group < groups; group++) {
                const int n0 = group * GROUP;
                multiply_group(weight_type, packed + (size_t)group * group_bytes, n0, N - n0 < GROUP ? N - n0 : GROUP,
                               out_stride, K, chunk, chunk_end, &rows, out_rows, out, use_tiles, buffer);
            }
        }
        free(buffer);
#ifdef SLUICE_AMX
        if (use_tiles) _tile_release();
#endif
    }
    return 0;
}

/* Bytes of the int8 path's scratch: the int8 activations and four 4-byte values per block. */
static size_t int8_scratch_bytes(int M, int K) {
    return (padded_rows(M) * (size_t)K + (size_t)M * 4 * 4 * (size_t)(K / QK) + 63) / 64 * 64;
}

size_t sluice_qgemm_scratch_bytes(int M, int K) {
#ifdef SLUICE_AMX_BF16
    /* And the prompt rows in bf16, padded to whole tiles, and the two lists of rows. */
    return int8_scratch_bytes(M, K) + bf16_scratch_bytes(M, K) + 2 * sizeof(int) * (size_t)M;
#else
    return int8_scratch_bytes(M, K);
#endif
}

/* sluice_qgemm, or sluice_qgemm_gated where activation >= 0 (N = 2 I then). The prompt rows
 * (AMX-BF16 builds) go on bf16 tiles, gated there on the way out; the others on the int8 path,
 * whose [gate | up] products a gated call keeps in scratch, rows in place, to gate them after. */
static int qgemm(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                 int out_stride, void *scratch, const uint8_t *prompt_rows, int activation) {
    const size_t group_bytes = group_bytes_of(weight_type, K);
    if (group_bytes == 0) return -1;
    const int gated = activation >= 0;
    float *int8_out = gated ? (float *)((uint8_t *)scratch + sluice_qgemm_scratch_bytes(M, K)) : out;
    const int int8_stride = gated ? N : out_stride;
    const int *rest = NULL;
    int rest_count = M;
#ifdef SLUICE_AMX_BF16
    int prompt = 0;
    for (int r = 0; prompt_rows != NULL && r < M; r++) prompt += prompt_rows[r] != 0;
    if (prompt > 0) {
        uint8_t *bf16_scratch = (uint8_t *)scratch + int8_scratch_bytes(M, K);
        int *tiled = (int *)(bf16_scratch + bf16_scratch_bytes(M, K)), *others = tiled + M;
        for (int r = 0, t = 0, o = 0; r < M; r++) {
            if (prompt_rows[r]) tiled[t++] = r;
            else others[o++] = r;
        }
        const int status = bf16_rows(prompt, N, K, x, weight_type, packed, group_bytes, out, out_stride, tiled,
                                     (uint16_t *)bf16_scratch, activation);
        if (status != 0 || prompt == M) return status;
        rest = others, rest_count = M - prompt;
    }
#else
    (void)prompt_rows;
#endif
    const int status =
        int8_rows(rest_count, N, K, x, weight_type, packed, group_bytes, int8_out, int8_stride, rest, scratch);
    if (status != 0 || !gated) return status;
    const int I = N / 2;
#pragma omp parallel for schedule(static) if (rest_count > 16)
    for (int i = 0; i < rest_count; i++) {
        const size_t r = rest != NULL ? (size_t)rest[i] : (size_t)i;
        gated_row(I, int8_out + r * N, int8_out + r * N + I, out + r * out_stride, activation == SLUICE_GELU_TANH);
    }
    return 0;
}

/* out[M, N] = x[M, K] @ W^T, W in row groups (N rounded up to a multiple of GROUP there).
 * scratch: sluice_qgemm_scratch_bytes(M, K). prompt_rows (NULL: none) flags the rows of prompt
 * tokens, which an AMX-BF16 build multiplies on bf16 tiles (every other build, and every other
 * row, on the int8 path). */
int sluice_qgemm(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                 int out_stride, void *scratch, const uint8_t *prompt_rows) {
    if (K % QK != 0 || K <= 0 || out_stride < N || M < 0) return -1;
    return qgemm(M, N, K, x, weight_type, packed, out, out_stride, scratch, prompt_rows, -1);
}

size_t sluice_qgemm_gated_scratch_bytes(int M, int I, int K) {
    return sluice_qgemm_scratch_bytes(M, K) + ((size_t)M * 2 * (size_t)I * sizeof(float) + 63) / 64 * 64;
}

/* out[M, I] = act(x @ gate^T) * (x @ up^T), W = [gate; up] in row groups, I a multiple of GROUP. */
int sluice_qgemm_gated(int M, int I, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                       int out_stride, void *scratch, const uint8_t *prompt_rows, int activation) {
    if (K % QK != 0 || K <= 0 || I <= 0 || I % GROUP != 0 || out_stride < I || M < 0) return -1;
    if (activation != SLUICE_SILU && activation != SLUICE_GELU_TANH) return -1;
    return qgemm(M, 2 * I, K, x, weight_type, packed, out, out_stride, scratch, prompt_rows, activation);
}
