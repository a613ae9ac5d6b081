/* Attention of query tokens over their cached K/V, read in place from the token-granular
 * pool through each request's slot list (no gather copy), float32.
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
 * heads of a group are done together, each K row and V row read once for all of them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* scores[g * len + t] = scale * q_g . k_t for the G heads of one group (head_dim % 8 == 0). */
ALWAYS_INLINE void group_scores(const int G, const float *q, int head_dim, int len, float scale,
                                const float *k_pool, const int64_t *req_slots, size_t slot_stride, size_t offset,
                                float *scores) {
    for (int t = 0; t < len; t++) {
        const float *kt = k_pool + req_slots[t] * slot_stride + offset;
        if (t + PREFETCH_AHEAD < len) {
            const char *ahead = (const char *)(k_pool + req_slots[t + PREFETCH_AHEAD] * slot_stride + offset);
            for (int byte = 0; byte < head_dim * (int)sizeof(float); byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
        }
        __m256 acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int i = 0; i < head_dim; i += 8) {
            const __m256 k = _mm256_loadu_ps(kt + i);
            for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + i), k, acc[g]);
        }
        for (int g = 0; g < G; g++) scores[g * len + t] = hsum(acc[g]) * scale;
    }
}

/* out_g = sum_t p_g[t] * v_t, a slice of `width` vectors of the head at a time with the G
 * heads' slices in registers (G * width <= 12 leaves room for the V vectors). */
ALWAYS_INLINE void group_values(const int G, const int width, const float *p, int head_dim, int len,
                                const float *v_pool, const int64_t *req_slots, size_t slot_stride, size_t offset,
                                float *out) {
    for (int c = 0; c < head_dim; c += 8 * width) {
        __m256 acc[MAX_GROUP][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++) acc[g][j] = _mm256_setzero_ps();
        for (int t = 0; t < len; t++) {
            const float *vt = v_pool + req_slots[t] * slot_stride + offset + c;
            if (t + PREFETCH_AHEAD < len)
                _mm_prefetch((const char *)(v_pool + req_slots[t + PREFETCH_AHEAD] * slot_stride + offset + c), _MM_HINT_T0);
            __m256 v[4];
            for (int j = 0; j < width; j++) v[j] = _mm256_loadu_ps(vt + 8 * j);
            for (int g = 0; g < G; g++) {
                const __m256 weight = _mm256_set1_ps(p[g * len + t]);
                for (int j = 0; j < width; j++) acc[g][j] = _mm256_fmadd_ps(weight, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++) _mm256_storeu_ps(out + g * head_dim + c + 8 * j, acc[g][j]);
    }
}

ALWAYS_INLINE void attend_group(const int G, const float *q, int kvh, int kv_heads, int head_dim, int len,
                                float scale, const float *k_pool, const float *v_pool, const int64_t *req_slots,
                                float *scores, float *out) {
    const size_t slot_stride = (size_t)kv_heads * head_dim, offset = (size_t)kvh * head_dim;
    group_scores(G, q, head_dim, len, scale, k_pool, req_slots, slot_stride, offset, scores);
    for (int g = 0; g < G; g++) softmax(scores + (size_t)g * len, len);
    /* The widest slice that divides head_dim and keeps the accumulators in registers. */
    const int width = G <= 3 && head_dim % 32 == 0 ? 4 : G <= 6 && head_dim % 16 == 0 ? 2 : 1;
    switch (width) {
    case 4: group_values(G, 4, scores, head_dim, len, v_pool, req_slots, slot_stride, offset, out); break;
    case 2: group_values(G, 2, scores, head_dim, len, v_pool, req_slots, slot_stride, offset, out); break;
    default: group_values(G, 1, scores, head_dim, len, v_pool, req_slots, slot_stride, offset, out); break;
    }
}

/* Any head_dim and group: one head at a time, scalar. */
static void attend_head_scalar(const float *qh, int kvh, int kv_heads, int head_dim, int len, float scale,
                               const float *k_pool, const float *v_pool, const int64_t *req_slots, float *scores,
                               float *oh) {
    const size_t slot_stride = (size_t)kv_heads * head_dim, offset = (size_t)kvh * head_dim;
    for (int t = 0; t < len; t++) {
        const float *kt = k_pool + req_slots[t] * slot_stride + offset;
        float dot = 0.0f;
        for (int i = 0; i < head_dim; i++) dot += qh[i] * kt[i];
        scores[t] = dot * scale;
    }
    softmax(scores, len);
    for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const float *vt = v_pool + req_slots[t] * slot_stride + offset;
        for (int i = 0; i < head_dim; i++) oh[i] += scores[t] * vt[i];
    }
}

#define GROUP_CASE(G) \
    case G: attend_group(G, q_group, kvh, kv_heads, head_dim, len, scale, k_pool, v_pool, req_slots, scores, out_group); break;

int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, long q_stride, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens, float *out) {
    const int group = heads / kv_heads;
    const int vectorized = head_dim % 8 == 0 && group <= MAX_GROUP;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_len > 0 ? max_len : 1));
        if (scores == NULL) failed = 1;
        /* One task per (query, KV head): the K/V rows of a group come from memory once. */
#pragma omp for schedule(dynamic) collapse(2)
        for (int r = 0; r < queries; r++) {
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                if (scores == NULL) continue;
                const int len = (int)seq_lens[r];
                const int64_t *req_slots = slots + (size_t)(slot_rows != NULL ? slot_rows[r] : r) * max_len;
                const float *q_group = q + (size_t)r * q_stride + (size_t)kvh * group * head_dim;
                float *out_group = out + ((size_t)r * heads + (size_t)kvh * group) * head_dim;
                if (!vectorized) {
                    for (int g = 0; g < group; g++)
                        attend_head_scalar(q_group + g * head_dim, kvh, kv_heads, head_dim, len, scale, k_pool,
                                           v_pool, req_slots, scores, out_group + g * head_dim);
                    continue;
                }
                switch (group) {
                    GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4)
                    GROUP_CASE(5) GROUP_CASE(6) GROUP_CASE(7) GROUP_CASE(8)
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
