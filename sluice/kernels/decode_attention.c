/* Attention of one new token per request over its cached K/V, read in place from the
 * token-granular pool through the request's slot list (no gather copy), float32.
 *
 * q   [requests, heads, head_dim]          out [requests, heads, head_dim]
 * k/v pool [slots, kv_heads, head_dim]     slots [requests, max_len] (int64, padded)
 * seq_lens [requests]: how many of a request's slots are real.
 * Query heads h * group .. h * group + group - 1 share KV head h (grouped-query attention).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* s[0..len) = exp(s - max(s)); returns their sum. */
static float softmax_numerators(float *s, int len) {
    float max_score = -INFINITY;
    for (int t = 0; t < len; t++) max_score = s[t] > max_score ? s[t] : max_score;
    const __m256 max_vec = _mm256_set1_ps(max_score);
    __m256 sums = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), max_vec));
        _mm256_storeu_ps(s + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = 0.0f;
    for (; t < len; t++) {
        s[t] = expf(s[t] - max_score);
        total += s[t];
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return total + _mm_cvtss_f32(h);
}

/* out[0..D) = sum_t p[t] * v_t, with the 8-float slices of the output held in registers
 * while the rows stream past (D a multiple of 8, at most 128). */
static void weighted_sum_rows(const float *p, int len, const float *v_pool, const int64_t *req_slots,
                              size_t slot_stride, size_t offset, int head_dim, float *out) {
    __m256 acc[16];
    const int lanes = head_dim / 8;
    for (int j = 0; j < lanes; j++) acc[j] = _mm256_setzero_ps();
    for (int t = 0; t < len; t++) {
        const float *vt = v_pool + req_slots[t] * slot_stride + offset;
        const __m256 weight = _mm256_set1_ps(p[t]);
        for (int j = 0; j < lanes; j++) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(vt + 8 * j), acc[j]);
    }
    for (int j = 0; j < lanes; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

/* One query head of one request over its len cached tokens. scores: len floats of scratch. */
static void attend_head(const float *qh, int kvh, int kv_heads, int head_dim, int len, float scale,
                        const float *k_pool, const float *v_pool, const int64_t *req_slots, float *scores,
                        float *oh) {
    const size_t slot_stride = (size_t)kv_heads * head_dim, offset = (size_t)kvh * head_dim;
    for (int t = 0; t < len; t++) scores[t] = dot(qh, k_pool + req_slots[t] * slot_stride + offset, head_dim) * scale;
    const float inv_total = 1.0f / softmax_numerators(scores, len);
    for (int t = 0; t < len; t++) scores[t] *= inv_total;
    if (head_dim % 8 == 0 && head_dim <= 128) {
        weighted_sum_rows(scores, len, v_pool, req_slots, slot_stride, offset, head_dim, oh);
        return;
    }
    for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const float *vt = v_pool + req_slots[t] * slot_stride + offset;
        for (int i = 0; i < head_dim; i++) oh[i] += scores[t] * vt[i];
    }
}

int sluice_decode_attention(int requests, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const int64_t *seq_lens, float *out) {
    const int group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic) collapse(2)
        for (int r = 0; r < requests; r++) {
            for (int h = 0; h < heads; h++) {
                if (scores == NULL) continue;
                const size_t row = (size_t)r * heads + h;
                attend_head(q + row * head_dim, h / group, kv_heads, head_dim, (int)seq_lens[r], scale, k_pool, v_pool,
                            slots + (size_t)r * max_len, scores, out + row * head_dim);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
