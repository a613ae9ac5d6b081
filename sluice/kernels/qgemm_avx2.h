/* Part of qgemm.c, included by it when it is built for AVX2: the row-group kernels of
 * each block format for 8 rows a register (the layout and the arithmetic are described at
 * the top of qgemm.c, which defines QK, GROUP, TILE, ALWAYS_INLINE and load_word first). */
#ifndef SLUICE_QGEMM_AVX2_H
#define SLUICE_QGEMM_AVX2_H
/* ------------------------------------------------------------ AVX2: 8 rows a register */
typedef __m256 group_acc;

ALWAYS_INLINE __m256i broadcast4(const int8_t *p) { return _mm256_set1_epi32(load_word(p)); }

ALWAYS_INLINE __m256 load_halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 outputs (one row group) for each of `rows` activation rows. A block's 8 unpacked weight
 * vectors stay in registers while the rows pass; each row's sum is a balanced tree (written
 * as one chain, gcc reassociates it and spills the 32 products of a 4-row tile). */
/* A block's 16 G nibble bytes -> q[g]: weights 4g .. 4g + 3 of each of the 8 rows. */
ALWAYS_INLINE void unpack_nibbles(const uint8_t *w, __m256i *q) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
        q[j] = _mm256_and_si256(raw, nibble);
        q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    }
}

/* G bytes (a q4_k block's 6-bit scales or minimums, one a row) times a float per row. */
ALWAYS_INLINE __m256 scaled_bytes(const uint8_t *bytes, __m256 by) {
    return _mm256_mul_ps(by, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes))));
}

/* The exact integer dots of one activation block with a block of unpacked nibbles (five_bits:
 * q5_k's and q5_1's, a compile-time constant where it is inlined). Each int16 lane of a
 * maddubs holds two products of a row, so summing all 8 words' lanes adds 16 products: at
 * most 16 * 15 * 127 = 30,480 for 4-bit q, within int16, but up to 62,992 for 5-bit q, which
 * wrapped (a block of equal activations against q = 31 came out negative). Five-bit blocks
 * are summed as two halves of 8 products, widened to int32 before they are added. */
ALWAYS_INLINE __m256i nibble_block_dots(const __m256i *q, const int8_t *x, const int five_bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i pairs[4];
    for (int g = 0; g < 8; g += 2)
        pairs[g / 2] = _mm256_add_epi16(_mm256_maddubs_epi16(q[g], broadcast4(x + 4 * g)),
                                        _mm256_maddubs_epi16(q[g + 1], broadcast4(x + 4 * g + 4)));
    const __m256i first = _mm256_add_epi16(pairs[0], pairs[1]), second = _mm256_add_epi16(pairs[2], pairs[3]);
    if (five_bits) return _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones));
    return _mm256_madd_epi16(_mm256_add_epi16(first, second), ones);
}

/* q5_k's and q5_1's fifth bits into bit 4 of the unpacked nibbles; see the AVX-512 version. */
ALWAYS_INLINE void add_fifth_bits(const uint8_t *w, __m256i *q) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)w), bit4 = _mm256_set1_epi8(0x10);
    for (int g = 0; g < 8; g++) {
        const __m256i moved = g < 4 ? _mm256_slli_epi16(h, 4 - g) : g == 4 ? h : _mm256_srli_epi16(h, g - 4);
        q[g] = _mm256_or_si256(q[g], _mm256_and_si256(moved, bit4));
    }
}

/* q4_1, or q5_1 where five_bits (a compile-time constant where it is inlined). */
ALWAYS_INLINE void group_q4_1(const int rows, const int five_bits, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, const int32_t *xqsum, const float *xdsum, __m256 *acc) {
    (void)xqsum;
    const int block_bytes = five_bits ? SLUICE_Q5_1_GROUP_BLOCK_BYTES : SLUICE_Q4_1_GROUP_BLOCK_BYTES;
    const int scales_at = (five_bits ? 20 : 16) * GROUP;
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += block_bytes) {
        prefetch_ahead(w, block_bytes);
        __m256i q[8];
        unpack_nibbles(w, q);
        if (five_bits) add_fifth_bits(w + 16 * GROUP, q);
        const __m256 d = load_halves(w + scales_at), m = load_halves(w + scales_at + 2 * GROUP);
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            const __m256 dots = _mm256_cvtepi32_ps(nibble_block_dots(q, xq + (size_t)r * K + b * QK, five_bits));
            acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(xd[index])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xdsum[index]), acc[r]);
        }
    }
}

ALWAYS_INLINE void group_q8_0(const int rows, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, const int32_t *xqsum, __m256 *acc) {
    (void)xqsum;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += SLUICE_Q8_0_GROUP_BLOCK_BYTES) {
        prefetch_ahead(w, SLUICE_Q8_0_GROUP_BLOCK_BYTES);
        __m256i sums[TILE];
        /* Half a block at a time: its 4 weight vectors and their magnitudes stay in registers. */
        for (int half = 0; half < 2; half++) {
            __m256i q[4], abs_q[4];
            for (int g = 0; g < 4; g++) {
                q[g] = _mm256_loadu_si256((const __m256i *)(w + 32 * (4 * half + g)));
                abs_q[g] = _mm256_sign_epi8(q[g], q[g]);
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xq + (size_t)r * K + b * QK + 16 * half;
                __m256i dots[4];
                for (int g = 0; g < 4; g++) /* maddubs wants one unsigned operand: |q| * (x * sign(q)) == q * x */
                    dots[g] = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(abs_q[g], _mm256_sign_epi8(broadcast4(x + 4 * g), q[g])), ones);
                const __m256i half_sum = _mm256_add_epi32(_mm256_add_epi32(dots[0], dots[1]), _mm256_add_epi32(dots[2], dots[3]));
                sums[r] = half == 0 ? half_sum : _mm256_add_epi32(sums[r], half_sum);
            }
        }
        const __m256 d = load_halves(w + 32 * GROUP);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(xd[(size_t)r * nb + b])),
                                     acc[r]);
    }
}

/* Bits 4..5 of q6_k's quants for word g of a block; see the AVX-512 version. */
ALWAYS_INLINE __m256i high_bits(__m256i h, int g) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (g) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), mask);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), mask);
    case 2: return _mm256_and_si256(h, mask);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), mask);
    }
}

/* (q - 32) . x of one 16-weight half (4 words), lanes = rows. maddubs pairs are at most
 * 2 * 63 * 127, so two of them still fit int16. */
ALWAYS_INLINE __m256i half_block_dot(const __m256i *q, const int8_t *x, int32_t x_sum) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], broadcast4(x)), _mm256_maddubs_epi16(q[1], broadcast4(x + 4)));
    const __m256i second =
        _mm256_add_epi16(_mm256_maddubs_epi16(q[2], broadcast4(x + 8)), _mm256_maddubs_epi16(q[3], broadcast4(x + 12)));
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones));
    return _mm256_sub_epi32(dot, _mm256_set1_epi32(32 * x_sum));
}

/* G int8 (a q6_k sub-block's scales, one a row) as floats. */
ALWAYS_INLINE __m256 signed_bytes(const int8_t *bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes)));
}

/* A q6_k block's 24 G bytes -> q[g]: the 6-bit quants of weights 4g .. 4g + 3 of each row. */
ALWAYS_INLINE void unpack_six_bits(const uint8_t *block, __m256i *q) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)(block + 16 * GROUP));
    const __m256i h1 = _mm256_loadu_si256((const __m256i *)(block + 20 * GROUP));
    for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
        q[j] = _mm256_or_si256(_mm256_and_si256(raw, nibble), high_bits(h0, j));
        q[j + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), high_bits(h1, j));
    }
}

/* One activation block against a q6_k block, added to its super-block's sum; see the
 * AVX-512 version. */
ALWAYS_INLINE __m256 add_six_bit_block(__m256 part, const __m256i *q, const int8_t *x, int32_t low_sum,
                                       int32_t high_sum, __m256 low_scale, __m256 high_scale) {
    const __m256i low = half_block_dot(q, x, low_sum), high = half_block_dot(q + 4, x + 16, high_sum);
    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), low_scale, part);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), high_scale, part);
}

ALWAYS_INLINE void store_group(float *o, int width, __m256 acc) {
    if (width == GROUP) {
        _mm256_storeu_ps(o, acc);
        return;
    }
    float lanes[GROUP];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < width; i++) o[i] = lanes[i];
}


/* The vector operations group_super (in qgemm.c) takes on this instruction set. */
#define VEC_ZERO _mm256_setzero_ps
#define VEC_FMADD _mm256_fmadd_ps
#define VEC_FNMADD _mm256_fnmadd_ps
#define VEC_MUL _mm256_mul_ps
#define VEC_SET1 _mm256_set1_ps
#define VEC_CVT_INT _mm256_cvtepi32_ps
typedef __m256i block_ints;

#endif
