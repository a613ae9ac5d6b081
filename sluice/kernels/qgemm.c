/* Block-quantized matrix multiply for small batches on x86-64 with AVX2 + FMA.
 *
 * out[M, N] = x[M, K] @ W[N, K]^T where W is stored in blocks of 32 weights along K:
 *   q8_0: int8 q, one float scale d per block            w = d * q
 *   q4_1: 4-bit q (two per byte), float d and m per block w = d * q + m
 * In a q4_1 row, block b's byte j holds weight 32b + j in its low nibble and 32b + j + 16
 * in its high nibble (GGUF's layout).
 *
 * x is quantized on the fly to int8 per block of 32 (scale = max|x| / 127), so each block's
 * dot product is an integer dot of 32 int8 pairs: the weights are read once as bytes, which
 * is what a decode step is bound by. This is the arithmetic of llama.cpp's q8_0 and q4_1
 * dot products; the code is our own.
 *
 * Compiled at first use by sluice/kernels/loader.py and called through ctypes; the OpenMP
 * runtime is the libgomp that torch has already loaded, so both share one thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* One row of K floats -> K int8, with per block: d (scale) and d * sum(q) (for q4_1's m). */
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *dsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float scale = max_abs / 127.0f;
        const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), rnd));
        /* The packs interleave 128-bit lanes; the permute puts the 32 bytes back in order. */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        packed = _mm256_permutevar8x32_epi32(packed, perm);
        _mm256_storeu_si256((__m256i *)(q + b * QK), packed);
        const int sum = hsum_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, packed), ones16));
        d[b] = scale;
        dsum[b] = scale * (float)sum;
    }
}

/* 32 q4_1 weights (16 bytes) as 32 unsigned bytes 0..15, in element order. */
static inline __m256i unpack_q4(const uint8_t *bytes) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)bytes);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

#define TILE 4 /* activation rows sharing each loaded weight block */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Each row keeps two accumulators (even and odd blocks) so that consecutive FMAs do not
 * wait on each other: with one row, a single chain would be bound by FMA latency. The block
 * loop is unrolled by two so every accumulator index is a constant and stays in a register. */

ALWAYS_INLINE __m256 q8_0_block(__m256i wb, __m256i abs_w, const int8_t *xb_ptr, float scale, __m256 acc) {
    const __m256i xb = _mm256_loadu_si256((const __m256i *)xb_ptr);
    /* maddubs wants one unsigned operand: |w| * (x * sign(w)) == w * x. */
    const __m256i prod = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(xb, wb));
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
    return _mm256_fmadd_ps(dots, _mm256_set1_ps(scale), acc);
}

ALWAYS_INLINE void rows_q8_0(const int rows, int n, int K, const int8_t *xq, const float *xd,
                             const int8_t *wq, const float *wd, float *out, int ldo) {
    const int nb = K / QK;
    const int8_t *w = wq + (size_t)n * K;
    const float *d = wd + (size_t)n * nb;
    __m256 even[TILE], odd[TILE];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (b + 1) * QK));
        const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xq + (size_t)r * K + b * QK;
            const float *s = xd + (size_t)r * nb + b;
            even[r] = q8_0_block(w0, a0, x, d[b] * s[0], even[r]);
            odd[r] = q8_0_block(w1, a1, x + QK, d[b + 1] * s[1], odd[r]);
        }
    }
    if (b < nb) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i a0 = _mm256_sign_epi8(w0, w0);
        for (int r = 0; r < rows; r++)
            even[r] = q8_0_block(w0, a0, xq + (size_t)r * K + b * QK, d[b] * xd[(size_t)r * nb + b], even[r]);
    }
    for (int r = 0; r < rows; r++) out[(size_t)r * ldo + n] = hsum_ps(_mm256_add_ps(even[r], odd[r]));
}

ALWAYS_INLINE __m256 q4_1_block(__m256i wb, const int8_t *xb_ptr, float scale, __m256 acc) {
    const __m256i xb = _mm256_loadu_si256((const __m256i *)xb_ptr);
    const __m256i prod = _mm256_maddubs_epi16(wb, xb); /* weights are unsigned 0..15 */
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
    return _mm256_fmadd_ps(dots, _mm256_set1_ps(scale), acc);
}

ALWAYS_INLINE void rows_q4_1(const int rows, int n, int K, const int8_t *xq, const float *xd, const float *xdsum,
                             const uint8_t *wq, const float *wd, const float *wm, float *out, int ldo) {
    const int nb = K / QK;
    const uint8_t *w = wq + (size_t)n * (K / 2);
    const float *d = wd + (size_t)n * nb;
    const float *m = wm + (size_t)n * nb;
    __m256 even[TILE], odd[TILE];
    float min_terms[TILE];
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        min_terms[r] = 0.0f;
    }
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i w0 = unpack_q4(w + b * (QK / 2));
        const __m256i w1 = unpack_q4(w + (b + 1) * (QK / 2));
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xq + (size_t)r * K + b * QK;
            const float *s = xd + (size_t)r * nb + b;
            const float *sums = xdsum + (size_t)r * nb + b;
            even[r] = q4_1_block(w0, x, d[b] * s[0], even[r]);
            odd[r] = q4_1_block(w1, x + QK, d[b + 1] * s[1], odd[r]);
            min_terms[r] += m[b] * sums[0] + m[b + 1] * sums[1];
        }
    }
    if (b < nb) {
        const __m256i w0 = unpack_q4(w + b * (QK / 2));
        for (int r = 0; r < rows; r++) {
            const size_t index = (size_t)r * nb + b;
            even[r] = q4_1_block(w0, xq + (size_t)r * K + b * QK, d[b] * xd[index], even[r]);
            min_terms[r] += m[b] * xdsum[index];
        }
    }
    for (int r = 0; r < rows; r++)
        out[(size_t)r * ldo + n] = hsum_ps(_mm256_add_ps(even[r], odd[r])) + min_terms[r];
}

/* A tile of 1..TILE rows against weight row n, with the row count a compile-time constant. */
#define DISPATCH_ROWS(call_with_rows)                              \
    switch (rows) {                                                \
    case 1: call_with_rows(1); break;                              \
    case 2: call_with_rows(2); break;                              \
    case 3: call_with_rows(3); break;                              \
    default: call_with_rows(4); break;                             \
    }

enum { WEIGHT_Q8_0 = 0, WEIGHT_Q4_1 = 1 };

/* out[M, N] = x[M, K] @ W^T. K must be a multiple of 32. scratch: M * (K + 2 * K / 32 * 4) bytes. */
int sluice_qgemm(int M, int N, int K, const float *x, int weight_type, const void *wq,
                 const float *wd, const float *wm, float *out, void *scratch) {
    if (K % QK != 0) return -1;
    const int nb = K / QK;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(xq + (size_t)M * K);
    float *xdsum = xd + (size_t)M * nb;

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++)
            quantize_row(x + (size_t)r * K, K, xq + (size_t)r * K, xd + (size_t)r * nb, xdsum + (size_t)r * nb);
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            for (int r0 = 0; r0 < M; r0 += TILE) {
                const int rows = M - r0 < TILE ? M - r0 : TILE;
                const int8_t *xq_tile = xq + (size_t)r0 * K;
                const float *xd_tile = xd + (size_t)r0 * nb;
                float *out_tile = out + (size_t)r0 * N;
                const float *xdsum_tile = xdsum + (size_t)r0 * nb;
#define Q8_0_ROWS(R) rows_q8_0(R, n, K, xq_tile, xd_tile, (const int8_t *)wq, wd, out_tile, N)
#define Q4_1_ROWS(R) rows_q4_1(R, n, K, xq_tile, xd_tile, xdsum_tile, (const uint8_t *)wq, wd, wm, out_tile, N)
                if (weight_type == WEIGHT_Q8_0) {
                    DISPATCH_ROWS(Q8_0_ROWS)
                } else {
                    DISPATCH_ROWS(Q4_1_ROWS)
                }
            }
        }
    }
    return 0;
}
