/* Part of qgemm.c, included by it when it is built for AVX-512 VNNI: the row-group kernels of
 * each block format for 16 rows a register (the layout and the arithmetic are described at
 * the top of qgemm.c, which defines QK, GROUP, TILE, ALWAYS_INLINE and load_word first). */
#ifndef SLUICE_QGEMM_AVX512_H
#define SLUICE_QGEMM_AVX512_H
/* ------------------------------------------------------------ AVX-512 VNNI: 16 rows a register */
typedef __m512 group_acc;

ALWAYS_INLINE __m512 load_halves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The exact integer dots of one activation block (32 int8 at x) with a block's 8 weight
 * vectors, unsigned, lanes = rows. Two chains, so consecutive vpdpbusd do not wait on each other. */
ALWAYS_INLINE __m512i block_dots(const __m512i *q, const int8_t *x) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
        even = _mm512_dpbusd_epi32(even, q[g], _mm512_set1_epi32(load_word(x + 4 * g)));
        odd = _mm512_dpbusd_epi32(odd, q[g + 1], _mm512_set1_epi32(load_word(x + 4 * g + 4)));
    }
    return _mm512_add_epi32(even, odd);
}

/* A block's 16 G nibble bytes -> q[g]: weights 4g .. 4g + 3 of each of the 16 rows (g >= 4:
 * the high nibbles). */
ALWAYS_INLINE void unpack_nibbles(const uint8_t *w, __m512i *q) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * j));
        q[j] = _mm512_and_si512(raw, nibble);
        q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
}

/* G bytes (a q4_k block's 6-bit scales or minimums, one a row) times a float per row. */
ALWAYS_INLINE __m512 scaled_bytes(const uint8_t *bytes, __m512 by) {
    return _mm512_mul_ps(by, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes))));
}

ALWAYS_INLINE __m512i nibble_block_dots(const __m512i *q, const int8_t *x, const int five_bits) {
    (void)five_bits; /* vpdpbusd sums 4 products into int32: nothing to widen */
    return block_dots(q, x);
}

/* q5_k, q5_1: the fifth bits of a block (a word a row, bit g of byte t for weight 4g + t) into
 * bit 4 of the unpacked nibbles q[g]. Each 16-bit shift is masked after, to bit 4 of each
 * byte, which only the same byte's bit g can reach. */
ALWAYS_INLINE void add_fifth_bits(const uint8_t *w, __m512i *q) {
    const __m512i h = _mm512_loadu_si512((const void *)w), bit4 = _mm512_set1_epi8(0x10);
    for (int g = 0; g < 8; g++) {
        const __m512i moved = g < 4 ? _mm512_slli_epi16(h, 4 - g) : g == 4 ? h : _mm512_srli_epi16(h, g - 4);
        q[g] = _mm512_ternarylogic_epi32(q[g], moved, bit4, 0xF8); /* q | (moved & bit4) */
    }
}

/* q4_1, or q5_1 where five_bits (a compile-time constant where it is inlined). */
ALWAYS_INLINE void group_q4_1(const int rows, const int five_bits, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, const int32_t *xqsum, const float *xdsum, __m512 *acc) {
    (void)xqsum;
    const int block_bytes = five_bits ? SLUICE_Q5_1_GROUP_BLOCK_BYTES : SLUICE_Q4_1_GROUP_BLOCK_BYTES;
    const int scales_at = (five_bits ? 20 : 16) * GROUP;
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += block_bytes) {
        prefetch_ahead(w, block_bytes);
        __m512i q[8];
        unpack_nibbles(w, q);
        if (five_bits) add_fifth_bits(w + 16 * GROUP, q);
        const __m512 d = load_halves(w + scales_at), m = load_halves(w + scales_at + 2 * GROUP);
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            const __m512 dots = _mm512_cvtepi32_ps(block_dots(q, xq + (size_t)r * K + b * QK));
            acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(xd[index])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xdsum[index]), acc[r]);
        }
    }
}

ALWAYS_INLINE void group_q8_0(const int rows, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, const int32_t *xqsum, __m512 *acc) {
    /* vpdpbusd wants one unsigned operand: q + 128 (q xor 0x80), and 128 * sum(x) comes off after. */
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += SLUICE_Q8_0_GROUP_BLOCK_BYTES) {
        prefetch_ahead(w, SLUICE_Q8_0_GROUP_BLOCK_BYTES);
        __m512i q[8];
        for (int g = 0; g < 8; g++) q[g] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64 * g)), bias);
        const __m512 d = load_halves(w + 32 * GROUP);
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            const __m512i biased = block_dots(q, xq + (size_t)r * K + b * QK);
            const __m512i dots = _mm512_sub_epi32(biased, _mm512_set1_epi32(128 * xqsum[index]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, _mm512_set1_ps(xd[index])), acc[r]);
        }
    }
}

/* Bits 4..5 of q6_k's quants for word g of a block (g < 4 within its half), from a word of
 * high bits holding them at bits 2g..2g+1, every other bit zero. Masked before the 16-bit
 * shift, so no bit crosses into the next byte. */
ALWAYS_INLINE __m512i high_bits(__m512i h, int g) {
    switch (g) {
    case 0: return _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(0x03)), 4);
    case 1: return _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(0x0C)), 2);
    case 2: return _mm512_and_si512(h, _mm512_set1_epi8(0x30));
    default: return _mm512_srli_epi16(_mm512_and_si512(h, _mm512_set1_epi8((char)0xC0)), 2);
    }
}

/* Bytes of low where the mask byte is 0x0F, of high elsewhere: one vpternlogd. */
ALWAYS_INLINE __m512i nibble_or_high(__m512i low, __m512i high) {
    return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x0F), 0xE4);
}

/* The two half-block dots of one activation block: lanes = rows, (q - 32) . x of weights
 * 0..15 and 16..31, as int32. */
ALWAYS_INLINE void half_block_dots(const __m512i *q, const int8_t *x, int32_t low_sum, int32_t high_sum,
                                   __m512i *low, __m512i *high) {
    /* The chains start at -32 sum(x): no subtraction after. */
    __m512i a = _mm512_set1_epi32(-32 * low_sum), b = _mm512_set1_epi32(-32 * high_sum);
    for (int g = 0; g < 4; g++) {
        a = _mm512_dpbusd_epi32(a, q[g], _mm512_set1_epi32(load_word(x + 4 * g)));
        b = _mm512_dpbusd_epi32(b, q[g + 4], _mm512_set1_epi32(load_word(x + 16 + 4 * g)));
    }
    *low = a;
    *high = b;
}

/* G int8 (a q6_k sub-block's scales, one a row) as floats. */
ALWAYS_INLINE __m512 signed_bytes(const int8_t *bytes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes)));
}

/* A q6_k block's 24 G bytes -> q[g]: the 6-bit quants of weights 4g .. 4g + 3 of each row. */
ALWAYS_INLINE void unpack_six_bits(const uint8_t *block, __m512i *q) {
    const __m512i h0 = _mm512_loadu_si512((const void *)(block + 16 * GROUP));
    const __m512i h1 = _mm512_loadu_si512((const void *)(block + 20 * GROUP));
    for (int j = 0; j < 4; j++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(block + 64 * j));
        q[j] = nibble_or_high(raw, high_bits(h0, j));
        q[j + 4] = nibble_or_high(_mm512_srli_epi16(raw, 4), high_bits(h1, j));
    }
}

/* One activation block against a q6_k block, added to its super-block's sum: each half's dot
 * times that half's scale. */
ALWAYS_INLINE __m512 add_six_bit_block(__m512 part, const __m512i *q, const int8_t *x, int32_t low_sum,
                                       int32_t high_sum, __m512 low_scale, __m512 high_scale) {
    __m512i low, high;
    half_block_dots(q, x, low_sum, high_sum, &low, &high);
    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), low_scale, part);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), high_scale, part);
}

ALWAYS_INLINE void store_group(float *o, int width, __m512 acc) {
    _mm512_mask_storeu_ps(o, (__mmask16)((1u << width) - 1), acc);
}


/* The vector operations group_super (in qgemm.c) takes on this instruction set. */
#define VEC_ZERO _mm512_setzero_ps
#define VEC_FMADD _mm512_fmadd_ps
#define VEC_FNMADD _mm512_fnmadd_ps
#define VEC_MUL _mm512_mul_ps
#define VEC_SET1 _mm512_set1_ps
#define VEC_CVT_INT _mm512_cvtepi32_ps
typedef __m512i block_ints;

#endif
