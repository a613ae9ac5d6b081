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

int sluice_decode_attention(int requests, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const int64_t *seq_lens, float *out) {
    const int group = heads / kv_heads;
    const size_t slot_stride = (size_t)kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) collapse(2)
    for (int r = 0; r < requests; r++) {
        for (int kvh = 0; kvh < kv_heads; kvh++) {
            const int len = (int)seq_lens[r];
            const int64_t *req_slots = slots + (size_t)r * max_len;
            float *scores = malloc(sizeof(float) * (size_t)group * len);
            if (scores == NULL) {
                failed = 1;
                continue;
            }
            for (int g = 0; g < group; g++) {
                const int h = kvh * group + g;
                const float *qh = q + ((size_t)r * heads + h) * head_dim;
                float *s = scores + (size_t)g * len;
                float max_score = -INFINITY;
                for (int t = 0; t < len; t++) {
                    s[t] = dot(qh, k_pool + req_slots[t] * slot_stride + (size_t)kvh * head_dim, head_dim) * scale;
                    if (s[t] > max_score) max_score = s[t];
                }
                float total = 0.0f;
                for (int t = 0; t < len; t++) {
                    s[t] = expf(s[t] - max_score);
                    total += s[t];
                }
                float *oh = out + ((size_t)r * heads + h) * head_dim;
                for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
                const float inv_total = 1.0f / total;
                for (int t = 0; t < len; t++) {
                    const float p = s[t] * inv_total;
                    const float *vt = v_pool + req_slots[t] * slot_stride + (size_t)kvh * head_dim;
                    for (int i = 0; i < head_dim; i++) oh[i] += p * vt[i];
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
