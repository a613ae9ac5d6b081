/* The per-layer glue of a decoder step on float32 tensors, each in one pass:
 *
 * sluice_rope_store: rotate q and k in place (rotate-half / NeoX layout, with the cos and
 *   signed-sin rows of each token's position), then write k and v into the KV pool slots.
 *   qkv is [tokens, heads + 2 * kv_heads, head_dim]; cos and signed_sin are [tokens, head_dim]
 *   with signed_sin = [-sin | sin]; pools are [slots, kv_heads, head_dim] of kv_dtype
 *   (float32, or float16 / bfloat16 rounded to nearest even, as torch's .to() rounds).
 * sluice_silu_mul: out = silu(gate) * up for gate_up = [gate | up] of [rows, 2 * width].
 * sluice_gelu_tanh_mul: out = gelu(gate) * up, GELU's tanh form (Gemma's GeGLU), likewise.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

static void rotate(float *x, const float *cos, const float *signed_sin, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * signed_sin[i];
        x[i + half] = b * cos[i + half] + a * signed_sin[i + half];
    }
}

static inline uint16_t bfloat16_bits(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Copy n floats into a pool row of kv_dtype. */
static void store_row(const float *src, int n, int kv_dtype, void *dst) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: {
        uint16_t *out = dst;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        break;
    }
    case SLUICE_KV_BFLOAT16: {
        uint16_t *out = dst;
        for (int i = 0; i < n; i++) out[i] = bfloat16_bits(src[i]);
        break;
    }
    default: memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

void sluice_rope_store(int tokens, int heads, int kv_heads, int head_dim, float *qkv, const float *cos,
                       const float *signed_sin, void *k_pool, void *v_pool, int kv_dtype, const int64_t *slots) {
    const int row_heads = heads + 2 * kv_heads;
    const int kv_width = kv_heads * head_dim;
    const size_t slot_bytes = (size_t)kv_width * (kv_dtype == SLUICE_KV_FLOAT32 ? 4 : 2);
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int t = 0; t < tokens; t++) {
        float *row = qkv + (size_t)t * row_heads * head_dim;
        const float *c = cos + (size_t)t * head_dim, *s = signed_sin + (size_t)t * head_dim;
        for (int h = 0; h < heads + kv_heads; h++) rotate(row + (size_t)h * head_dim, c, s, head_dim / 2);
        const size_t slot = (size_t)slots[t] * slot_bytes;
        store_row(row + (size_t)heads * head_dim, kv_width, kv_dtype, (char *)k_pool + slot);
        store_row(row + (size_t)(heads + kv_heads) * head_dim, kv_width, kv_dtype, (char *)v_pool + slot);
    }
}

/* out = gate * sigmoid(a) * up, a = gate for silu; for GELU's tanh form gelu(x) = x (1 +
 * tanh(u)) / 2 with u = sqrt(2 / pi) (x + 0.044715 x^3), which is x sigmoid(2u), a = 2u.
 * exp's argument is clamped as exp256 does, in the scalar tail too. */
static void gated_product(int rows, int width, const float *gate_up, float *out, const int gelu) {
    const float c1 = 1.5957691216f, c3 = 0.0713548162f; /* 2 sqrt(2 / pi) and that times 0.044715 */
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (size_t)r * 2 * width, *up = gate + width;
        float *o = out + (size_t)r * width;
        int i = 0;
        for (; i + 8 <= width; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 a = gelu ? _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(c3), _mm256_set1_ps(c1))) : g;
            const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), a)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, denominator), _mm256_loadu_ps(up + i)));
        }
        for (; i < width; i++) {
            const float a = gelu ? gate[i] * fmaf(gate[i] * gate[i], c3, c1) : gate[i];
            o[i] = gate[i] / (1.0f + expf(fminf(-a, 88.0f))) * up[i];
        }
    }
}

void sluice_silu_mul(int rows, int width, const float *gate_up, float *out) { gated_product(rows, width, gate_up, out, 0); }

void sluice_gelu_tanh_mul(int rows, int width, const float *gate_up, float *out) {
    gated_product(rows, width, gate_up, out, 1);
}
