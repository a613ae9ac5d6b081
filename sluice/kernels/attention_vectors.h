/* The vectors of the attention kernel, one set per build: the vector type and its
 * operations (VLEN lanes), loads that widen float16/bfloat16/fp8 K/V rows to float32, the
 * square transpose that puts VLEN keys in the lanes of a vector, and the scores of a run of
 * keys against a KV group's query heads. */
#ifndef SLUICE_ATTENTION_VECTORS_H
#define SLUICE_ATTENTION_VECTORS_H

#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif

/* The vector width of this build: 16 floats with AVX-512, 8 with AVX2. A head's dot products
 * and value sums run VLEN lanes at a time, so the two builds sum in different orders (their
 * attention agrees to rounding, not bit for bit; within a build every query is computed the
 * same way). */
/* 8 K/V elements widened to float32. */
ALWAYS_INLINE __m256 load_kv8(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case SLUICE_KV_BFLOAT16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case SLUICE_KV_FP8_E5M2: /* each byte the high byte of a float16 */
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

#ifdef SLUICE_AVX512_VNNI
#define VLEN 16
#define SCORE_QUERIES 3 /* queries whose scores share each transposed K load: 24 accumulators */
#define VECTOR_REGISTERS 32
#define MAX_ACCUMULATORS 24 /* a value slice's, over V rows read from the pool (value_width) */
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vfmadd _mm512_fmadd_ps
#define vexp exp512
ALWAYS_INLINE __m256 half_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
ALWAYS_INLINE float vreduce_max(__m512 v) { return _mm512_reduce_max_ps(v); }
ALWAYS_INLINE __m512 load_kv(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case SLUICE_KV_BFLOAT16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    case SLUICE_KV_FP8_E5M2:
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    default: return _mm512_loadu_ps((const float *)p);
    }
}
/* 8 elements of row a in the low half, 8 of row b in the high half, widened. */
ALWAYS_INLINE __m512 load_kv8_pair(const char *a, const char *b, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16:
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                       _mm_loadu_si128((const __m128i *)b), 1));
    case SLUICE_KV_BFLOAT16: {
        const __m256i halves = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                       _mm_loadu_si128((const __m128i *)b), 1);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    }
    case SLUICE_KV_FP8_E5M2: {
        const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
    }
    default: return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)a)), _mm256_loadu_ps((const float *)b), 1);
    }
}
ALWAYS_INLINE __m512 unpacklo_pairs(__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
ALWAYS_INLINE __m512 unpackhi_pairs(__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
/* r[i][j] becomes r[j][i]. After the two unpack rounds u[4m + c] holds, in its 128-bit lane L,
 * column 4L + c of rows 4m..4m+3; two rounds of 128-bit lane shuffles gather the four m. */
ALWAYS_INLINE void transpose_square(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) {
        u[4 * m] = unpacklo_pairs(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = unpackhi_pairs(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = unpacklo_pairs(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = unpackhi_pairs(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512 even_a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), odd_a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 even_b = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 odd_b = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(even_a, even_b, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(even_a, even_b, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(odd_a, odd_b, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(odd_a, odd_b, 0xDD);
    }
}
#else
#define VLEN 8
#define VECTOR_REGISTERS 16
#define MAX_ACCUMULATORS 12 /* a value slice's, over V rows read from the pool (value_width) */
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vfmadd _mm256_fmadd_ps
#define vexp exp256
ALWAYS_INLINE __m256 half_sum(__m256 v) { return v; }
ALWAYS_INLINE float vreduce_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* Queries whose scores share each transposed K load: their 8 chains would not fit in 16
 * registers, so they are summed a chain at a time (see chain_scores). */
#define SCORE_QUERIES 4
#define CHAIN_KEY_VECTORS 2 /* key vectors per chain pass: 4 x 2 accumulators, 2 K vectors, a q */
ALWAYS_INLINE __m256 load_kv(const char *p, const int kv_dtype) { return load_kv8(p, kv_dtype); }
ALWAYS_INLINE __m256 unpacklo_pairs(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}
ALWAYS_INLINE __m256 unpackhi_pairs(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}
/* r[i][j] becomes r[j][i]: after the unpack rounds u[4m + c] holds, in its 128-bit lane L,
 * column 4L + c of rows 4m..4m+3; one 128-bit lane permute joins m = 0 and 1. */
ALWAYS_INLINE void transpose_square(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 2; m++) {
        u[4 * m] = unpacklo_pairs(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = unpackhi_pairs(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = unpacklo_pairs(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = unpackhi_pairs(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}
#endif

/* ------------------------------------------------------------ decode scores, a run of keys at once */
/* Every score is one dot product summed the same way in both builds and by both score
 * functions: 8 partial sums, sum l over d = l, l + 8, l + 16, ... in order (fused multiply-
 * adds from zero), which then meet as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), and
 * the total times `scale`. */
ALWAYS_INLINE __m128 sum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* hadd pairs neighbours: lane 0 of the result is ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)). */
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

#ifdef SLUICE_AVX512_VNNI
#define SCORE_KEYS 8           /* two to a vector: 4 G accumulators */
#define SCORE_KEYS_MAX_GROUP 4 /* 16 accumulators, 4 K vectors, a q slice: 21 of 32 registers */
/* scores[g * stride + j] = scale * q_g . k_j for the SCORE_KEYS keys at rows[j], each summed
 * as sum8x4 sums it: lane l of key j's chain is its partial sum l, and two rounds of hadd
 * then the halves of 128 bits added give every key ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6
 * + s7)), the eight keys of a head in one vector. */
ALWAYS_INLINE void run_scores(const int G, const int kv_dtype, const float *q, int head_dim, float scale,
                              const char *const *rows, size_t elem, float *scores, size_t stride) {
    __m512 acc[SCORE_KEYS_MAX_GROUP][SCORE_KEYS / 2];
    for (int g = 0; g < G; g++)
        for (int p = 0; p < SCORE_KEYS / 2; p++) acc[g][p] = _mm512_setzero_ps();
    for (int i = 0; i < head_dim; i += 8) {
        __m512 k[SCORE_KEYS / 2];
        for (int p = 0; p < SCORE_KEYS / 2; p++) k[p] = load_kv8_pair(rows[2 * p] + i * elem, rows[2 * p + 1] + i * elem, kv_dtype);
        for (int g = 0; g < G; g++) {
            const __m512 qg = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * head_dim + i));
            for (int p = 0; p < SCORE_KEYS / 2; p++) acc[g][p] = _mm512_fmadd_ps(qg, k[p], acc[g][p]);
        }
    }
    for (int g = 0; g < G; g++) {
        __m256 pairs[SCORE_KEYS / 2];
        for (int p = 0; p < SCORE_KEYS / 2; p++)
            pairs[p] = _mm256_hadd_ps(_mm512_castps512_ps256(acc[g][p]), _mm512_extractf32x8_ps(acc[g][p], 1));
        const __m256 first = _mm256_hadd_ps(pairs[0], pairs[1]), second = _mm256_hadd_ps(pairs[2], pairs[3]);
        const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20),
                                          _mm256_permute2f128_ps(first, second, 0x31));
        _mm256_storeu_ps(scores + (size_t)g * stride, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
}
#else
#define SCORE_KEYS 4           /* one to a vector: 4 G accumulators */
#define SCORE_KEYS_MAX_GROUP 3 /* 12 accumulators, a K vector, a q slice: 14 of 16 registers */
/* As above, four keys of a head reduced by one sum8x4. */
ALWAYS_INLINE void run_scores(const int G, const int kv_dtype, const float *q, int head_dim, float scale,
                              const char *const *rows, size_t elem, float *scores, size_t stride) {
    __m256 acc[SCORE_KEYS_MAX_GROUP][SCORE_KEYS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < SCORE_KEYS; j++) acc[g][j] = _mm256_setzero_ps();
    for (int i = 0; i < head_dim; i += 8)
        for (int j = 0; j < SCORE_KEYS; j++) {
            const __m256 k = load_kv8(rows[j] + i * elem, kv_dtype);
            for (int g = 0; g < G; g++) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + i), k, acc[g][j]);
        }
    for (int g = 0; g < G; g++)
        _mm_storeu_ps(scores + (size_t)g * stride,
                      _mm_mul_ps(sum8x4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
}
#endif

#endif
