/* The per-layer glue of a decoder step on float32 tensors, each in one pass:
 *
 * sluice_rope_store: rotate q and k in place (rotate-half / NeoX layout, with the cos and
 *   signed-sin rows of each token's position), then write k and v into the KV pool slots.
 *   qkv is [tokens, heads + 2 * kv_heads, head_dim]; cos and signed_sin are [tokens, head_dim]
 *   with signed_sin = [-sin | sin]; pools are [slots, kv_heads, head_dim] of kv_dtype
 *   (float32, or float16 / bfloat16 / fp8 e5m2 rounded to nearest even, as torch's .to() rounds).
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

/* fp8 e5m2 bits of x (torch.float8_e5m2's rounding): to nearest even with the float16
 * exponent range; magnitudes from 65,536 (or rounding up to it) become infinity, NaN stays
 * NaN. Below 2^-14 (e5m2's subnormals) adding 2^7 makes the float add round at e5m2's last
 * place: the low bits of the sum are the result. */
#define E5M2_SUBNORMAL_BELOW (113u << 23) /* 2^-14 */
#define E5M2_OVERFLOW_FROM (143u << 23)   /* 65,536 */
#define E5M2_SUBNORMAL_BIAS (134u << 23)  /* 2^7 */
#define E5M2_REBIAS (((uint32_t)(15 - 127) << 23) + 0xFFFFFu)

static inline uint8_t e5m2_bits(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    const uint32_t sign = bits & 0x80000000u, magnitude = bits ^ sign;
    uint32_t result;
    if (magnitude >= E5M2_OVERFLOW_FROM) {
        result = magnitude > 0x7F800000u ? 0x7F : 0x7C;
    } else if (magnitude < E5M2_SUBNORMAL_BELOW) {
        float shifted;
        __builtin_memcpy(&shifted, &magnitude, 4);
        shifted += 128.0f;
        uint32_t shifted_bits;
        __builtin_memcpy(&shifted_bits, &shifted, 4);
        result = shifted_bits - E5M2_SUBNORMAL_BIAS;
    } else {
        result = (magnitude + E5M2_REBIAS + ((magnitude >> 21) & 1u)) >> 21;
    }
    return (uint8_t)(result | (sign >> 24));
}

/* e5m2_bits of 8 floats at once, the same steps lane by lane. */
static inline void store_e5m2x8(const float *src, uint8_t *out) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(src));
    const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u));
    const __m256i magnitude = _mm256_xor_si256(bits, sign);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, 21), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32((int)(E5M2_REBIAS))), odd), 21);
    const __m256i subnormal =
        _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(128.0f))),
                         _mm256_set1_epi32((int)E5M2_SUBNORMAL_BIAS));
    const __m256i special = _mm256_blendv_epi8(_mm256_set1_epi32(0x7C), _mm256_set1_epi32(0x7F),
                                               _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000)));
    __m256i result = _mm256_blendv_epi8(
        normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)E5M2_SUBNORMAL_BELOW), magnitude));
    result = _mm256_blendv_epi8(result, special,
                                _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32((int)E5M2_OVERFLOW_FROM - 1)));
    result = _mm256_or_si256(result, _mm256_srli_epi32(sign, 24));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(words, words));
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
    case SLUICE_KV_FP8_E5M2: {
        uint8_t *out = dst;
        int i = 0;
        for (; i + 8 <= n; i += 8) store_e5m2x8(src + i, out + i);
        for (; i < n; i++) out[i] = e5m2_bits(src[i]);
        break;
    }
    default: memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

void sluice_rope_store(int tokens, int heads, int kv_heads, int head_dim, float *qkv, const float *cos,
                       const float *signed_sin, void *k_pool, void *v_pool, int kv_dtype, const int64_t *slots) {
    const int row_heads = heads + 2 * kv_heads;
    const int kv_width = kv_heads * head_dim;
    const size_t slot_bytes = (size_t)kv_width * sluice_kv_element_bytes(kv_dtype);
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
