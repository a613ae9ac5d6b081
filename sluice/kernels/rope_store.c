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

/* out = act(gate) * up, row by row (gated_row). */
static void gated_product(int rows, int width, const float *gate_up, float *out, const int gelu) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (size_t)r * 2 * width;
        gated_row(width, gate, gate + width, out + (size_t)r * width, gelu);
    }
}

void sluice_silu_mul(int rows, int width, const float *gate_up, float *out) { gated_product(rows, width, gate_up, out, 0); }

void sluice_gelu_tanh_mul(int rows, int width, const float *gate_up, float *out) {
    gated_product(rows, width, gate_up, out, 1);
}
