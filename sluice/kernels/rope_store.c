/* The per-layer glue of a decoder step on float32 tensors, each in one pass:
 *
 * sluice_rope_store: rotate q and k in place (rotate-half / NeoX layout, with the cos and
 *   signed-sin rows of each token's position), then write k and v into the KV pool slots.
 *   qkv is [tokens, heads + 2 * kv_heads, head_dim]; cos and signed_sin are [tokens, head_dim]
 *   with signed_sin = [-sin | sin]; pools are [slots, kv_heads, head_dim].
 * sluice_silu_mul: out = silu(gate) * up for gate_up = [gate | up] of [rows, 2 * width].
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

static void rotate(float *x, const float *cos, const float *signed_sin, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * signed_sin[i];
        x[i + half] = b * cos[i + half] + a * signed_sin[i + half];
    }
}

void sluice_rope_store(int tokens, int heads, int kv_heads, int head_dim, float *qkv, const float *cos,
                       const float *signed_sin, float *k_pool, float *v_pool, const int64_t *slots) {
    const int row_heads = heads + 2 * kv_heads;
    const size_t kv_bytes = sizeof(float) * (size_t)kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int t = 0; t < tokens; t++) {
        float *row = qkv + (size_t)t * row_heads * head_dim;
        const float *c = cos + (size_t)t * head_dim, *s = signed_sin + (size_t)t * head_dim;
        for (int h = 0; h < heads + kv_heads; h++) rotate(row + (size_t)h * head_dim, c, s, head_dim / 2);
        const size_t slot = (size_t)slots[t] * kv_heads * head_dim;
        memcpy(k_pool + slot, row + (size_t)heads * head_dim, kv_bytes);
        memcpy(v_pool + slot, row + (size_t)(heads + kv_heads) * head_dim, kv_bytes);
    }
}

void sluice_silu_mul(int rows, int width, const float *gate_up, float *out) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (size_t)r * 2 * width, *up = gate + width;
        float *o = out + (size_t)r * width;
        int i = 0;
        for (; i + 8 <= width; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 sigmoid_denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, sigmoid_denominator), _mm256_loadu_ps(up + i)));
        }
        for (; i < width; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
