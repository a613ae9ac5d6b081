/* Block-quantized matrix multiply on x86-64 with AVX2 + FMA (F16C for the scales).
 *
 * out[M, N] = x[M, K] @ W[N, K]^T where W is stored in blocks of 32 weights along K:
 *   q8_0: int8 q, one scale d per block            w = d * q
 *   q4_1: 4-bit q, a scale d and a minimum m        w = d * q + m
 *
 * x is quantized on the fly to int8 per block of 32 (scale = max|x| / 127), so each block's
 * dot product is an integer dot of 32 pairs: the weights are read once as bytes, which is
 * what a decode step is bound by. This is the arithmetic of llama.cpp's q8_0 and q4_1 dot
 * products; the code and the layout below are our own.
 *
 * Weights are interleaved by 8 output rows ("a row group"), block after block, so that one
 * 256-bit register holds 4 consecutive weights of each of the 8 rows. Against the same 4
 * activation bytes broadcast to every lane, maddubs + madd yield the 8 rows' partial dots in
 * the 8 lanes: no horizontal sums, and a block's scales for 8 rows are one vector. A row
 * group's block is (sluice/model/quantized_linear.py writes this layout):
 *   q4_1: 128 bytes: byte [j][i][t] = q[row i][4j + t] | q[row i][4j + t + 16] << 4
 *                    (j < 4, t < 4), then 8 float16 d, then 8 float16 m      (160 bytes)
 *   q8_0: 256 bytes: byte [g][i][t] = q[row i][4g + t] (g < 8), then 8 float16 d (272 bytes)
 *
 * Each output is accumulated in block order by one chain of FMAs, whatever M, the tile or
 * the thread split: a row's result never depends on the other rows in the batch.
 *
 * Compiled at first use by sluice/kernels/loader.py and called through ctypes; the OpenMP
 * runtime is the libgomp that torch has already loaded, so both share one thread pool.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

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

#define GROUP 8 /* output rows interleaved in one row group */
#define TILE 4  /* activation rows sharing each loaded weight vector */
#define M_CHUNK 128
#define Q4_1_GROUP_BLOCK_BYTES 160
#define Q8_0_GROUP_BLOCK_BYTES 272
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __m256i broadcast4(const int8_t *p) {
    int32_t word;
    __builtin_memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

ALWAYS_INLINE __m256 load_halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 outputs (one row group) for each of `rows` activation rows. A block's 8 unpacked weight
 * vectors stay in registers while the rows pass; each row's sum is a balanced tree (written
 * as one chain, gcc reassociates it and spills the 32 products of a 4-row tile). */
ALWAYS_INLINE void group_q4_1(const int rows, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, const float *xdsum, __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q4_1_GROUP_BLOCK_BYTES) {
        __m256i q[8]; /* q[g]: weights 4g .. 4g + 3 of each of the 8 rows */
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
            q[j] = _mm256_and_si256(raw, nibble);
            q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
        const __m256 d = load_halves(w + 128), m = load_halves(w + 144);
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xq + (size_t)r * K + b * QK;
            __m256i pairs[4];
            for (int g = 0; g < 8; g += 2)
                pairs[g / 2] = _mm256_add_epi16(_mm256_maddubs_epi16(q[g], broadcast4(x + 4 * g)),
                                                _mm256_maddubs_epi16(q[g + 1], broadcast4(x + 4 * g + 4)));
            /* 8 products of at most 2 * 15 * 127 each: int16 cannot overflow. */
            const __m256i sums = _mm256_add_epi16(_mm256_add_epi16(pairs[0], pairs[1]), _mm256_add_epi16(pairs[2], pairs[3]));
            const size_t index = (size_t)r * nb + b;
            const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
            acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(xd[index])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xdsum[index]), acc[r]);
        }
    }
}

ALWAYS_INLINE void group_q8_0(const int rows, int nb, int K, const uint8_t *w, const int8_t *xq,
                              const float *xd, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q8_0_GROUP_BLOCK_BYTES) {
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
        const __m256 d = load_halves(w + 256);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(xd[(size_t)r * nb + b])),
                                     acc[r]);
    }
}

/* A tile of 1..TILE activation rows, with the row count a compile-time constant. */
#define DISPATCH_ROWS(call_with_rows)                              \
    switch (rows) {                                                \
    case 1: call_with_rows(1); break;                              \
    case 2: call_with_rows(2); break;                              \
    case 3: call_with_rows(3); break;                              \
    default: call_with_rows(4); break;                             \
    }

enum { WEIGHT_Q8_0 = 0, WEIGHT_Q4_1 = 1 };

/* Bytes of scratch sluice_qgemm needs: the int8 activations and two floats per block. */
size_t sluice_qgemm_scratch_bytes(int M, int K) { return (size_t)M * ((size_t)K + 2 * sizeof(float) * (size_t)(K / QK)); }

/* Activation rows [r_begin, r_end) against one row group: out columns n0 .. n0 + width. */
static void multiply_group(int weight_type, const uint8_t *w, int n0, int width, int N, int K, int r_begin,
                           int r_end, const int8_t *xq, const float *xd, const float *xdsum, float *out) {
    const int nb = K / QK;
    for (int r0 = r_begin; r0 < r_end; r0 += TILE) {
        const int rows = r_end - r0 < TILE ? r_end - r0 : TILE;
        const int8_t *xq_tile = xq + (size_t)r0 * K;
        const float *xd_tile = xd + (size_t)r0 * nb, *xdsum_tile = xdsum + (size_t)r0 * nb;
        __m256 acc[TILE];
#define Q8_0_ROWS(R) group_q8_0(R, nb, K, w, xq_tile, xd_tile, acc)
#define Q4_1_ROWS(R) group_q4_1(R, nb, K, w, xq_tile, xd_tile, xdsum_tile, acc)
        if (weight_type == WEIGHT_Q8_0) {
            DISPATCH_ROWS(Q8_0_ROWS)
        } else {
            DISPATCH_ROWS(Q4_1_ROWS)
        }
        for (int r = 0; r < rows; r++) {
            float *o = out + (size_t)(r0 + r) * N + n0;
            if (width == GROUP) {
                _mm256_storeu_ps(o, acc[r]);
            } else {
                float lanes[GROUP];
                _mm256_storeu_ps(lanes, acc[r]);
                for (int i = 0; i < width; i++) o[i] = lanes[i];
            }
        }
    }
}

/* out[M, N] = x[M, K] @ W^T, W in row groups (N rounded up to a multiple of 8 there).
 * K must be a multiple of 32. scratch: sluice_qgemm_scratch_bytes(M, K). */
int sluice_qgemm(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                 void *scratch) {
    if (K % QK != 0) return -1;
    const int nb = K / QK;
    const int groups = (N + GROUP - 1) / GROUP;
    const size_t group_bytes = (size_t)nb * (weight_type == WEIGHT_Q8_0 ? Q8_0_GROUP_BLOCK_BYTES : Q4_1_GROUP_BLOCK_BYTES);
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(xq + (size_t)M * K);
    float *xdsum = xd + (size_t)M * nb;

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++)
            quantize_row(x + (size_t)r * K, K, xq + (size_t)r * K, xd + (size_t)r * nb, xdsum + (size_t)r * nb);
        /* Activation rows in chunks that stay in L2 while every row group passes over them. */
        for (int chunk = 0; chunk < M; chunk += M_CHUNK) {
            const int chunk_end = M - chunk < M_CHUNK ? M : chunk + M_CHUNK;
#pragma omp for schedule(static)
            for (int group = 0; group < groups; group++) {
                const int n0 = group * GROUP;
                multiply_group(weight_type, packed + (size_t)group * group_bytes, n0, N - n0 < GROUP ? N - n0 : GROUP,
                               N, K, chunk, chunk_end, xq, xd, xdsum, out);
            }
        }
    }
    return 0;
}
