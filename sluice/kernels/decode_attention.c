/* Attention of query tokens over their cached K/V, read in place from the token-granular
 * pool through each request's slot list (no gather copy); float32 arithmetic over K/V
 * stored as float32, float16 or bfloat16 (kv_dtype, enum sluice_kv_dtype).
 *
 * q   [queries] rows of q_stride floats, each holding [heads, head_dim] first
 * out [queries, heads, head_dim]
 * k/v pool [slots, kv_heads, head_dim]     slots [requests, max_len] (int64, padded)
 * slot_rows [queries]: the row of `slots` each query reads (NULL: query i reads row i, one
 * query per request, a decode step); seq_lens [queries]: how many of those slots it sees.
 * Query heads h * group .. h * group + group - 1 share KV head h (grouped-query attention).
 *
 * A prompt token at position p is computed exactly as a decode step at p would be: the same
 * slots in the same order. So a request's results do not depend on how its prompt was split
 * into chunks, on its cached prefix or on its batch neighbours.
 *
 * A decode step reads all of its requests' cached K/V, so it is bound by memory: the query
 * heads of a group are done together, each K row and V row read once for all of them, and a
 * 16-bit pool halves the bytes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUP 8
/* Tokens ahead whose K/V rows are prefetched: a slot list is not a stream the hardware
 * prefetcher follows across pages (measured: -30% time at 128 cached tokens). */
#define PREFETCH_AHEAD 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* s[0..len) = exp(s - max(s)) / sum. */
static void softmax(float *s, int len) {
    __m256 maxes = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= len; t += 8) maxes = _mm256_max_ps(maxes, _mm256_loadu_ps(s + t));
    float max_score = hmax(maxes);
    for (; t < len; t++) max_score = s[t] > max_score ? s[t] : max_score;
    const __m256 max_vec = _mm256_set1_ps(max_score);
    __m256 sums = _mm256_setzero_ps();
    t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), max_vec));
        _mm256_storeu_ps(s + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = hsum(sums);
    for (; t < len; t++) {
        s[t] = expf(s[t] - max_score);
        total += s[t];
    }
    const float inv_total = 1.0f / total;
    for (t = 0; t < len; t++) s[t] *= inv_total;
}

/* Element size of a KV pool's dtype. */
static inline size_t kv_element_bytes(int kv_dtype) { return kv_dtype == SLUICE_KV_FLOAT32 ? 4 : 2; }

/* 8 consecutive K/V elements as float32. */
ALWAYS_INLINE __m256 load_kv8(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case SLUICE_KV_BFLOAT16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

ALWAYS_INLINE float load_kv1(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _cvtsh_ss(*(const uint16_t *)p);
    case SLUICE_KV_BFLOAT16: {
        const uint32_t bits = (uint32_t)(*(const uint16_t *)p) << 16;
        float value;
        __builtin_memcpy(&value, &bits, 4);
        return value;
    }
    default: return *(const float *)p;
    }
}

/* Where one KV head's rows of one pool live: row t of a request is
 * base + req_slots[t] * slot_bytes (its head_dim elements of kv_dtype). */
typedef struct {
    const char *base; /* the pool, offset to this KV head */
    size_t slot_bytes;
} kv_rows;

ALWAYS_INLINE const char *kv_row(kv_rows rows, const int64_t *req_slots, int t) {
    return rows.base + (size_t)req_slots[t] * rows.slot_bytes;
}

ALWAYS_INLINE void prefetch_row(const char *row, size_t bytes) {
    for (size_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
}

/* scores[g * len + t] = scale * q_g . k_t for the G heads of one group (head_dim % 8 == 0). */
ALWAYS_INLINE void group_scores(const int G, const int kv_dtype, const float *q, int head_dim, int len, float scale,
                                kv_rows keys, const int64_t *req_slots, float *scores) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int t = 0; t < len; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        if (t + PREFETCH_AHEAD < len) prefetch_row(kv_row(keys, req_slots, t + PREFETCH_AHEAD), head_dim * elem);
        __m256 acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int i = 0; i < head_dim; i += 8) {
            const __m256 k = load_kv8(kt + i * elem, kv_dtype);
            for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + i), k, acc[g]);
        }
        for (int g = 0; g < G; g++) scores[g * len + t] = hsum(acc[g]) * scale;
    }
}

/* out_g = sum_t p_g[t] * v_t, a slice of `width` vectors of the head at a time with the G
 * heads' slices in registers (G * width <= 12 leaves room for the V vectors). */
ALWAYS_INLINE void group_values(const int G, const int width, const int kv_dtype, const float *p, int head_dim, int len,
                                kv_rows values, const int64_t *req_slots, float *out) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int c = 0; c < head_dim; c += 8 * width) {
        __m256 acc[MAX_GROUP][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++) acc[g][j] = _mm256_setzero_ps();
        for (int t = 0; t < len; t++) {
            const char *vt = kv_row(values, req_slots, t) + c * elem;
            if (t + PREFETCH_AHEAD < len) _mm_prefetch(kv_row(values, req_slots, t + PREFETCH_AHEAD) + c * elem, _MM_HINT_T0);
            __m256 v[4];
            for (int j = 0; j < width; j++) v[j] = load_kv8(vt + 8 * j * elem, kv_dtype);
            for (int g = 0; g < G; g++) {
                const __m256 weight = _mm256_set1_ps(p[g * len + t]);
                for (int j = 0; j < width; j++) acc[g][j] = _mm256_fmadd_ps(weight, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++) _mm256_storeu_ps(out + g * head_dim + c + 8 * j, acc[g][j]);
    }
}

ALWAYS_INLINE void attend_group(const int G, const int kv_dtype, const float *q, int head_dim, int len, float scale,
                                kv_rows keys, kv_rows values, const int64_t *req_slots, float *scores, float *out) {
    group_scores(G, kv_dtype, q, head_dim, len, scale, keys, req_slots, scores);
    for (int g = 0; g < G; g++) softmax(scores + (size_t)g * len, len);
    /* The widest slice that divides head_dim and keeps the accumulators in registers. */
    const int width = G <= 3 && head_dim % 32 == 0 ? 4 : G <= 6 && head_dim % 16 == 0 ? 2 : 1;
    switch (width) {
    case 4: group_values(G, 4, kv_dtype, scores, head_dim, len, values, req_slots, out); break;
    case 2: group_values(G, 2, kv_dtype, scores, head_dim, len, values, req_slots, out); break;
    default: group_values(G, 1, kv_dtype, scores, head_dim, len, values, req_slots, out); break;
    }
}

/* Any head_dim and group: one head at a time, scalar. */
static void attend_head_scalar(const float *qh, int kv_dtype, int head_dim, int len, float scale, kv_rows keys,
                               kv_rows values, const int64_t *req_slots, float *scores, float *oh) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int t = 0; t < len; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        float dot = 0.0f;
        for (int i = 0; i < head_dim; i++) dot += qh[i] * load_kv1(kt + i * elem, kv_dtype);
        scores[t] = dot * scale;
    }
    softmax(scores, len);
    for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const char *vt = kv_row(values, req_slots, t);
        for (int i = 0; i < head_dim; i++) oh[i] += scores[t] * load_kv1(vt + i * elem, kv_dtype);
    }
}

/* The G query heads of one KV head, with G and the dtype compile-time constants. */
#define GROUP_CASE(G, DTYPE)                                                                               \
    case G: attend_group(G, DTYPE, q_group, head_dim, len, scale, keys, values, req_slots, scores, out_group); break;
#define GROUP_SWITCH(DTYPE)                                                                                \
    switch (group) {                                                                                       \
        GROUP_CASE(1, DTYPE) GROUP_CASE(2, DTYPE) GROUP_CASE(3, DTYPE) GROUP_CASE(4, DTYPE)                \
        GROUP_CASE(5, DTYPE) GROUP_CASE(6, DTYPE) GROUP_CASE(7, DTYPE) GROUP_CASE(8, DTYPE)                \
    }

int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, long q_stride, const void *k_pool, const void *v_pool, int kv_dtype,
                            const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens, float *out) {
    const int group = heads / kv_heads;
    const int vectorized = head_dim % 8 == 0 && group <= MAX_GROUP;
    const size_t elem = kv_element_bytes(kv_dtype);
    const size_t slot_bytes = (size_t)kv_heads * head_dim * elem;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_len > 0 ? max_len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* One task per (query, KV head): the K/V rows of a group come from memory once. */
#pragma omp for schedule(dynamic) collapse(2)
        for (int r = 0; r < queries; r++) {
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                if (scores == NULL) continue;
                const int len = (int)seq_lens[r];
                const int64_t *req_slots = slots + (size_t)(slot_rows != NULL ? slot_rows[r] : r) * max_len;
                const float *q_group = q + (size_t)r * q_stride + (size_t)kvh * group * head_dim;
                float *out_group = out + ((size_t)r * heads + (size_t)kvh * group) * head_dim;
                const size_t head_offset = (size_t)kvh * head_dim * elem;
                const kv_rows keys = {(const char *)k_pool + head_offset, slot_bytes};
                const kv_rows values = {(const char *)v_pool + head_offset, slot_bytes};
                if (!vectorized) {
                    for (int g = 0; g < group; g++)
                        attend_head_scalar(q_group + g * head_dim, kv_dtype, head_dim, len, scale, keys, values,
                                           req_slots, scores, out_group + g * head_dim);
                    continue;
                }
                switch (kv_dtype) {
                case SLUICE_KV_FLOAT16: GROUP_SWITCH(SLUICE_KV_FLOAT16) break;
                case SLUICE_KV_BFLOAT16: GROUP_SWITCH(SLUICE_KV_BFLOAT16) break;
                default: GROUP_SWITCH(SLUICE_KV_FLOAT32) break;
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
