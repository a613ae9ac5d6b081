/* What a build of the kernels is (sluice_contract_value), and a self-test that proves this
 * CPU runs it correctly (sluice_self_test). See kernels.h. */
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels.h"

#define SIZE(type) {"sizeof " #type, (long)sizeof(type)}
#define FIELD(type, field) {#type "." #field, (long)offsetof(type, field)}
#define CONSTANT(name) {#name, (long)(name)}

static const struct {
    const char *name;
    long value;
} contract[] = {
    SIZE(sluice_projection),
    FIELD(sluice_projection, packed),
    FIELD(sluice_projection, tail),
    FIELD(sluice_projection, format),
    FIELD(sluice_projection, tail_format),
    FIELD(sluice_projection, tail_rows),
    SIZE(sluice_layer_weights),
    FIELD(sluice_layer_weights, input_norm),
    FIELD(sluice_layer_weights, post_attention_norm),
    FIELD(sluice_layer_weights, qkv),
    FIELD(sluice_layer_weights, o),
    FIELD(sluice_layer_weights, gate_up),
    FIELD(sluice_layer_weights, down),
    FIELD(sluice_layer_weights, qkv_bias),
    FIELD(sluice_layer_weights, q_norm),
    FIELD(sluice_layer_weights, k_norm),
    FIELD(sluice_layer_weights, sliding_window),
    FIELD(sluice_layer_weights, pre_feedforward_norm),
    FIELD(sluice_layer_weights, post_feedforward_norm),
    FIELD(sluice_layer_weights, local_rope),
    SIZE(sluice_model_dims),
    FIELD(sluice_model_dims, num_layers),
    FIELD(sluice_model_dims, hidden),
    FIELD(sluice_model_dims, heads),
    FIELD(sluice_model_dims, kv_heads),
    FIELD(sluice_model_dims, head_dim),
    FIELD(sluice_model_dims, intermediate),
    FIELD(sluice_model_dims, eps),
    FIELD(sluice_model_dims, attention_scale),
    FIELD(sluice_model_dims, kv_dtype),
    FIELD(sluice_model_dims, mlp_activation),
    FIELD(sluice_model_dims, attn_softcap),
    CONSTANT(SLUICE_BLOCK),
    CONSTANT(SLUICE_SUPER_BLOCK),
    CONSTANT(SLUICE_ROW_GROUP),
    CONSTANT(SLUICE_Q8_0),
    CONSTANT(SLUICE_Q4_1),
    CONSTANT(SLUICE_Q6_K),
    CONSTANT(SLUICE_Q4_K),
    CONSTANT(SLUICE_Q5_K),
    CONSTANT(SLUICE_Q5_1),
    CONSTANT(SLUICE_KV_FLOAT32),
    CONSTANT(SLUICE_KV_FLOAT16),
    CONSTANT(SLUICE_KV_BFLOAT16),
    CONSTANT(SLUICE_KV_FP8_E5M2),
    CONSTANT(SLUICE_SILU),
    CONSTANT(SLUICE_GELU_TANH),
};

long sluice_contract_value(const char *name) {
    for (size_t i = 0; i < sizeof(contract) / sizeof(contract[0]); i++)
        if (strcmp(contract[i].name, name) == 0) return contract[i].value;
    return LONG_MIN;
}

/* ---------------------------------------------------------------- self-test */

static uint32_t next_random(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* Uniform in [-1, 1). */
static float random_float(uint32_t *state) { return (float)next_random(state) / (float)(1u << 23) - 1.0f; }

/* `count` values of x as the kernels round them to int8 with one scale (a 32-value block, or
 * for the super-block formats a 256-value super-block): the quants into xq, the scale
 * returned. */
static float reference_x_block(const float *xb, int count, int *xq) {
    float max_abs = 0.0f;
    for (int k = 0; k < count; k++) max_abs = fmaxf(max_abs, fabsf(xb[k]));
    const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
    for (int k = 0; k < count; k++) xq[k] = (int)nearbyintf(xb[k] * inv);
    return max_abs / 127.0f;
}

/* Scalar qgemm over the packed layout described in qgemm.c: the integer dot of each block,
 * then the same float operations in the same order as the vector code. */
static float reference_output(int format, const uint8_t *packed, int n, int K, const float *x) {
    const int nb = K / SLUICE_BLOCK, group = n / SLUICE_ROW_GROUP, lane = n % SLUICE_ROW_GROUP;
    const int five_bits = format == SLUICE_Q5_1;
    const int block_bytes = format == SLUICE_Q8_0 ? SLUICE_Q8_0_GROUP_BLOCK_BYTES
                            : five_bits           ? SLUICE_Q5_1_GROUP_BLOCK_BYTES
                                                  : SLUICE_Q4_1_GROUP_BLOCK_BYTES;
    const int quant_bytes = format == SLUICE_Q8_0 ? SLUICE_BLOCK : SLUICE_BLOCK / 2;
    const int scales_at = SLUICE_ROW_GROUP * (quant_bytes + (five_bits ? 4 : 0));
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = packed + ((size_t)group * nb + b) * block_bytes;
        int xq[SLUICE_BLOCK];
        const float xd = reference_x_block(x + b * SLUICE_BLOCK, SLUICE_BLOCK, xq);
        int dot = 0, qsum = 0;
        for (int k = 0; k < SLUICE_BLOCK; k++) {
            const int word = (k % (quant_bytes)) / 4, byte = word * 4 * SLUICE_ROW_GROUP + lane * 4 + k % 4;
            int wq = format == SLUICE_Q8_0 ? (int)(int8_t)block[byte] : (k < 16 ? block[byte] & 0x0F : block[byte] >> 4);
            if (five_bits) wq |= (block[16 * SLUICE_ROW_GROUP + lane * 4 + k % 4] >> (k / 4) & 1) << 4;
            dot += wq * xq[k];
            qsum += xq[k];
        }
        uint16_t half;
        memcpy(&half, block + scales_at + 2 * lane, 2);
        const float d = _cvtsh_ss(half);
        acc = fmaf((float)dot, d * xd, acc);
        if (format != SLUICE_Q8_0) {
            memcpy(&half, block + scales_at + 2 * SLUICE_ROW_GROUP + 2 * lane, 2);
            acc = fmaf(_cvtsh_ss(half), xd * (float)qsum, acc);
        }
    }
    return acc;
}

/* Scalar q6_k over its packed layout (see qgemm.c), in the vector code's order. */
static float reference_q6_k_output(const uint8_t *packed, int n, int K, const float *x) {
    enum { G = SLUICE_ROW_GROUP };
    const int supers = K / SLUICE_SUPER_BLOCK, lane = n % G;
    float acc = 0.0f;
    for (int s = 0; s < supers; s++) {
        const uint8_t *super = packed + ((size_t)(n / G) * supers + s) * SLUICE_Q6_K_GROUP_SUPER_BYTES;
        const int8_t *scales = (const int8_t *)(super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES);
        uint16_t half;
        memcpy(&half, super + 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES + 16 * G + 2 * lane, 2);
        const float d = _cvtsh_ss(half);
        int xq[SLUICE_SUPER_BLOCK];
        const float xd = reference_x_block(x + s * SLUICE_SUPER_BLOCK, SLUICE_SUPER_BLOCK, xq);
        float part = 0.0f;
        for (int k = 0; k < 8; k++) {
            const uint8_t *block = super + k * SLUICE_Q6_K_GROUP_BLOCK_BYTES;
            int dots[2] = {0, 0};
            for (int w = 0; w < SLUICE_BLOCK; w++) {
                const int within = w % 16, t = w % 4, g = within / 4;
                const uint8_t nibbles = block[g * 4 * G + lane * 4 + t];
                const uint8_t highs = block[(4 + w / 16) * 4 * G + lane * 4 + t];
                const int q = (w < 16 ? nibbles & 0x0F : nibbles >> 4) | ((highs >> (2 * g)) & 3) << 4;
                dots[w / 16] += (q - 32) * xq[k * SLUICE_BLOCK + w];
            }
            part = fmaf((float)dots[0], d * (float)scales[2 * k * G + lane], part);
            part = fmaf((float)dots[1], d * (float)scales[(2 * k + 1) * G + lane], part);
        }
        acc = fmaf(part, xd, acc);
    }
    return acc;
}

/* Scalar q4_k or q5_k over its packed layout (see qgemm.c), in the vector code's order. */
static float reference_k_quant_output(int format, const uint8_t *packed, int n, int K, const float *x) {
    enum { G = SLUICE_ROW_GROUP };
    const int five_bits = format == SLUICE_Q5_K;
    const int block_bytes = five_bits ? SLUICE_Q5_K_GROUP_BLOCK_BYTES : SLUICE_Q4_K_GROUP_BLOCK_BYTES;
    const int super_bytes = five_bits ? SLUICE_Q5_K_GROUP_SUPER_BYTES : SLUICE_Q4_K_GROUP_SUPER_BYTES;
    const int supers = K / SLUICE_SUPER_BLOCK, lane = n % G;
    float acc = 0.0f;
    for (int s = 0; s < supers; s++) {
        const uint8_t *super = packed + ((size_t)(n / G) * supers + s) * super_bytes;
        const uint8_t *scales = super + 8 * block_bytes, *minimums = scales + 8 * G;
        uint16_t half;
        memcpy(&half, minimums + 8 * G + 2 * lane, 2);
        const float d = _cvtsh_ss(half);
        memcpy(&half, minimums + 10 * G + 2 * lane, 2);
        const float dmin = _cvtsh_ss(half);
        int xq[SLUICE_SUPER_BLOCK];
        const float xd = reference_x_block(x + s * SLUICE_SUPER_BLOCK, SLUICE_SUPER_BLOCK, xq);
        float part = 0.0f;
        for (int k = 0; k < 8; k++) {
            const uint8_t *block = super + k * block_bytes;
            int dot = 0, qsum = 0;
            for (int w = 0; w < SLUICE_BLOCK; w++) {
                const uint8_t nibbles = block[(w % 16) / 4 * 4 * G + lane * 4 + w % 4];
                int q = w < 16 ? nibbles & 0x0F : nibbles >> 4;
                if (five_bits) q |= (block[16 * G + lane * 4 + w % 4] >> (w / 4) & 1) << 4;
                dot += q * xq[k * SLUICE_BLOCK + w];
                qsum += xq[k * SLUICE_BLOCK + w];
            }
            part = fmaf((float)dot, d * (float)scales[k * G + lane], part);
            part = fmaf(-(dmin * (float)minimums[k * G + lane]), (float)qsum, part);
        }
        acc = fmaf(part, xd, acc);
    }
    return acc;
}

/* Random weights of `groups` row groups in `format` (K weights a row), in qgemm's layout, with
 * finite float16 scales; NULL where memory runs out. */
static uint8_t *random_packed(int format, int groups, int K, uint32_t *state) {
    const int super_blocks = SLUICE_SUPER_BLOCK_FORMAT(format);
    /* A unit whose float16 scales are set after the random bytes: a block, or q6_k's super-block. */
    int unit_bytes, unit_weights, scale_offset, scale_count;
    if (format == SLUICE_Q6_K) {
        unit_bytes = SLUICE_Q6_K_GROUP_SUPER_BYTES, unit_weights = SLUICE_SUPER_BLOCK;
        scale_offset = 8 * SLUICE_Q6_K_GROUP_BLOCK_BYTES + 16 * SLUICE_ROW_GROUP, scale_count = SLUICE_ROW_GROUP;
    } else if (super_blocks) { /* q4_k, q5_k: d and dmin after the blocks and the 6-bit scales and minimums */
        const int five_bits = format == SLUICE_Q5_K;
        unit_bytes = five_bits ? SLUICE_Q5_K_GROUP_SUPER_BYTES : SLUICE_Q4_K_GROUP_SUPER_BYTES;
        unit_weights = SLUICE_SUPER_BLOCK, scale_count = 2 * SLUICE_ROW_GROUP;
        scale_offset = 8 * (five_bits ? SLUICE_Q5_K_GROUP_BLOCK_BYTES : SLUICE_Q4_K_GROUP_BLOCK_BYTES) + 16 * SLUICE_ROW_GROUP;
    } else {
        const int quant_bytes = format == SLUICE_Q8_0 ? SLUICE_BLOCK : format == SLUICE_Q5_1 ? SLUICE_BLOCK / 2 + 4 : SLUICE_BLOCK / 2;
        unit_bytes = format == SLUICE_Q8_0   ? SLUICE_Q8_0_GROUP_BLOCK_BYTES
                     : format == SLUICE_Q5_1 ? SLUICE_Q5_1_GROUP_BLOCK_BYTES
                                             : SLUICE_Q4_1_GROUP_BLOCK_BYTES;
        unit_weights = SLUICE_BLOCK, scale_offset = SLUICE_ROW_GROUP * quant_bytes;
        scale_count = SLUICE_ROW_GROUP * (format == SLUICE_Q8_0 ? 1 : 2);
    }
    const size_t packed_bytes = (size_t)groups * (K / unit_weights) * unit_bytes;
    uint8_t *packed = malloc(packed_bytes);
    for (size_t i = 0; packed != NULL && i < packed_bytes; i++) packed[i] = (uint8_t)next_random(state);
    for (size_t unit = 0; packed != NULL && unit < packed_bytes / unit_bytes; unit++) {
        uint8_t *scales = packed + unit * unit_bytes + scale_offset;
        for (int i = 0; i < scale_count; i++) {
            const uint16_t half = _cvtss_sh(0.01f * random_float(state), 0);
            memcpy(scales + 2 * i, &half, 2);
        }
    }
    return packed;
}

/* Every tile height (and two 16-row AMX tiles plus a remainder), a partial row group and every
 * format: the result must be exact. */
static int check_qgemm(int format) {
    enum { M = 37, N = 2 * SLUICE_ROW_GROUP + 3 }; /* M: every tile height, and AMX's 16-row tiles */
    const int super_blocks = SLUICE_SUPER_BLOCK_FORMAT(format);
    const int K = super_blocks ? 2 * SLUICE_SUPER_BLOCK : 96; /* 96: three blocks, no power of two */
    const int groups = (N + SLUICE_ROW_GROUP - 1) / SLUICE_ROW_GROUP;
    uint32_t state = 12345u + (uint32_t)format;
    uint8_t *packed = random_packed(format, groups, K, &state);
    float *x = malloc(sizeof(float) * M * K), *out = malloc(sizeof(float) * M * N);
    void *scratch = malloc(sluice_qgemm_scratch_bytes(M, K));
    int failed = packed == NULL || x == NULL || out == NULL || scratch == NULL;
    for (int i = 0; !failed && i < M * K; i++) x[i] = 3.0f * random_float(&state);
    for (int r = 1; r <= M && !failed; r++) {
        if (sluice_qgemm(r, N, K, x, format, packed, out, N, scratch, NULL) != 0) failed = 1;
        for (int i = 0; i < r && !failed; i++)
            for (int n = 0; n < N; n++) {
                const float *row = x + (size_t)i * K;
                const float expected = format == SLUICE_Q6_K ? reference_q6_k_output(packed, n, K, row)
                                       : super_blocks        ? reference_k_quant_output(format, packed, n, K, row)
                                                             : reference_output(format, packed, n, K, row);
                if (out[i * N + n] != expected) failed = 1;
            }
    }
#ifdef SLUICE_AMX_BF16
    /* Prompt rows (two of every three) on bf16 tiles: near the int8 results (bf16 rounds
     * activations and weights to 8 bits, int8 the activations to 7), the other rows exactly
     * the int8 results, and each prompt row the same bits alone as among the others. */
    uint8_t flags[M], one = 1;
    float alone[N];
    for (int i = 0; i < M; i++) flags[i] = i % 3 != 0;
    if (!failed && sluice_qgemm(M, N, K, x, format, packed, out, N, scratch, flags) != 0) failed = 1;
    for (int i = 0; i < M && !failed; i++) {
        const float *row = x + (size_t)i * K;
        float expected[N], largest = 0.0f;
        for (int n = 0; n < N; n++) {
            expected[n] = format == SLUICE_Q6_K ? reference_q6_k_output(packed, n, K, row)
                          : super_blocks        ? reference_k_quant_output(format, packed, n, K, row)
                                                : reference_output(format, packed, n, K, row);
            largest = fmaxf(largest, fabsf(expected[n]));
        }
        if (flags[i] && sluice_qgemm(1, N, K, row, format, packed, alone, N, scratch, &one) != 0) failed = 1;
        for (int n = 0; n < N && !failed; n++) {
            const float got = out[i * N + n];
            if (flags[i] ? fabsf(got - expected[n]) > 0.02f * largest || got != alone[n] : got != expected[n]) failed = 1;
        }
    }
#endif
    free(x);
    free(out);
    free(packed);
    free(scratch);
    return failed;
}

/* expected[DIM] = softmax(scale * qh . k_t) v over the first len slots of one KV head, in
 * double: the scalar reference of the attention checks. */
static void reference_head(const float *qh, const float *k, const float *v, const int64_t *slots, int len, int kv_heads,
                           int kvh, int dim, float scale, double *expected) {
    double p[256], max_score = -INFINITY, total = 0.0;
    for (int t = 0; t < len; t++) {
        double dot = 0.0;
        for (int i = 0; i < dim; i++) dot += (double)qh[i] * k[(slots[t] * kv_heads + kvh) * dim + i];
        p[t] = dot * scale;
        max_score = p[t] > max_score ? p[t] : max_score;
    }
    for (int t = 0; t < len; t++) total += p[t] = exp(p[t] - max_score);
    for (int i = 0; i < dim; i++) {
        expected[i] = 0.0;
        for (int t = 0; t < len; t++) expected[i] += p[t] / total * v[(slots[t] * kv_heads + kvh) * dim + i];
    }
}

/* Attention over a pool of each KV dtype, against a scalar softmax(q.k) v. */
static int check_attention(int kv_dtype) {
    enum { HEADS = 6, KV_HEADS = 2, DIM = 64, SLOTS = 20, LEN = 11 };
    float q[HEADS * DIM], k[SLOTS * KV_HEADS * DIM], v[SLOTS * KV_HEADS * DIM], out[HEADS * DIM];
    uint16_t k16[SLOTS * KV_HEADS * DIM], v16[SLOTS * KV_HEADS * DIM];
    uint8_t k8[SLOTS * KV_HEADS * DIM], v8[SLOTS * KV_HEADS * DIM];
    int64_t slots[LEN], seq_len = LEN;
    uint32_t state = 777u;
    for (int i = 0; i < HEADS * DIM; i++) q[i] = random_float(&state);
    for (int i = 0; i < SLOTS * KV_HEADS * DIM; i++) {
        k[i] = random_float(&state);
        v[i] = random_float(&state);
        if (kv_dtype == SLUICE_KV_FLOAT16) {
            k16[i] = _cvtss_sh(k[i], 0);
            v16[i] = _cvtss_sh(v[i], 0);
            k[i] = _cvtsh_ss(k16[i]);
            v[i] = _cvtsh_ss(v16[i]);
        } else if (kv_dtype == SLUICE_KV_FP8_E5M2) { /* a float16's high byte, the low one dropped */
            k8[i] = (uint8_t)(_cvtss_sh(k[i], 0) >> 8);
            v8[i] = (uint8_t)(_cvtss_sh(v[i], 0) >> 8);
            k[i] = _cvtsh_ss((uint16_t)(k8[i] << 8));
            v[i] = _cvtsh_ss((uint16_t)(v8[i] << 8));
        } else if (kv_dtype == SLUICE_KV_BFLOAT16) {
            uint32_t kb, vb;
            memcpy(&kb, &k[i], 4);
            memcpy(&vb, &v[i], 4);
            k16[i] = (uint16_t)(kb >> 16);
            v16[i] = (uint16_t)(vb >> 16);
            kb = (uint32_t)k16[i] << 16;
            vb = (uint32_t)v16[i] << 16;
            memcpy(&k[i], &kb, 4);
            memcpy(&v[i], &vb, 4);
        }
    }
    for (int t = 0; t < LEN; t++) slots[t] = (t * 7) % SLOTS;
    const void *k_pool = kv_dtype == SLUICE_KV_FLOAT32 ? (const void *)k
                         : kv_dtype == SLUICE_KV_FP8_E5M2 ? (const void *)k8
                                                          : (const void *)k16;
    const void *v_pool = kv_dtype == SLUICE_KV_FLOAT32 ? (const void *)v
                         : kv_dtype == SLUICE_KV_FP8_E5M2 ? (const void *)v8
                                                          : (const void *)v16;
    const float scale = 0.125f;
    if (sluice_decode_attention(1, HEADS, KV_HEADS, DIM, LEN, scale, 0, 0.0f, q, HEADS * DIM, k_pool, v_pool, kv_dtype,
                                slots, NULL, &seq_len, NULL, out) != 0)
        return 1;
    for (int h = 0; h < HEADS; h++) {
        double expected[DIM];
        reference_head(q + h * DIM, k, v, slots, LEN, KV_HEADS, h / (HEADS / KV_HEADS), DIM, scale, expected);
        for (int i = 0; i < DIM; i++)
            if (fabs(out[h * DIM + i] - expected[i]) > 1e-4) return 1;
    }
    return 0;
}

/* A prompt of LEN tokens attending causally, every query flagged as a prompt row (the tile
 * path of an AMX-BF16 build): within bf16's rounding of a double reference, and each query
 * alone the same bits as in the whole block. */
static int check_prompt_attention(void) {
    enum { HEADS = 6, KV_HEADS = 2, DIM = 64, LEN = 150 }; /* LEN: at most reference_head's 256 */
    const int stride = HEADS * DIM, kv_floats = LEN * KV_HEADS * DIM;
    float *q = malloc(sizeof(float) * LEN * stride), *out = malloc(sizeof(float) * LEN * stride);
    float *k = malloc(sizeof(float) * kv_floats), *v = malloc(sizeof(float) * kv_floats);
    int64_t slots[LEN], rows[LEN], lens[LEN];
    uint8_t flags[LEN];
    int failed = q == NULL || out == NULL || k == NULL || v == NULL;
    uint32_t state = 4242u;
    for (int i = 0; !failed && i < LEN * stride; i++) q[i] = 2.0f * random_float(&state);
    for (int i = 0; !failed && i < kv_floats; i++) k[i] = random_float(&state), v[i] = random_float(&state);
    for (int t = 0; t < LEN; t++) slots[t] = (t * 37) % LEN, rows[t] = 0, lens[t] = t + 1, flags[t] = 1;
    const float scale = 0.125f;
    if (!failed)
        failed = sluice_decode_attention(LEN, HEADS, KV_HEADS, DIM, LEN, scale, 0, 0.0f, q, stride, k, v,
                                         SLUICE_KV_FLOAT32, slots, rows, lens, flags, out) != 0;
    for (int i = 0; !failed && i < LEN; i++)
        for (int h = 0; h < HEADS; h++) {
            double expected[DIM];
            reference_head(q + i * stride + h * DIM, k, v, slots, i + 1, KV_HEADS, h / (HEADS / KV_HEADS), DIM, scale,
                           expected);
            for (int d = 0; d < DIM; d++)
                if (fabs(out[i * stride + h * DIM + d] - expected[d]) > 0.03) failed = 1;
        }
    float alone[HEADS * DIM];
    for (int i = 0; !failed && i < LEN; i += 37) {
        failed = sluice_decode_attention(1, HEADS, KV_HEADS, DIM, LEN, scale, 0, 0.0f, q + i * stride, stride, k, v,
                                         SLUICE_KV_FLOAT32, slots, rows, lens + i, flags, alone) != 0;
        failed = failed || memcmp(alone, out + i * stride, sizeof(alone)) != 0;
    }
    free(q), free(out), free(k), free(v);
    return failed;
}

/* The gated matmul: the bits of the matmul then silu * mul, for decode rows, for prompt rows
 * (gated on the way out of the bf16 tiles of an AMX-BF16 build) and for both in one call. */
static int check_qgemm_gated(void) {
    enum { M = 37, I = 2 * SLUICE_ROW_GROUP, K = 96 };
    uint32_t state = 777u;
    uint8_t *packed = random_packed(SLUICE_Q4_1, 2 * I / SLUICE_ROW_GROUP, K, &state);
    float *x = malloc(sizeof(float) * M * K), *gate_up = malloc(sizeof(float) * M * 2 * I);
    float *expected = malloc(sizeof(float) * M * I), *out = malloc(sizeof(float) * M * I);
    void *scratch = malloc(sluice_qgemm_gated_scratch_bytes(M, I, K));
    int failed = packed == NULL || x == NULL || gate_up == NULL || expected == NULL || out == NULL || scratch == NULL;
    for (int i = 0; !failed && i < M * K; i++) x[i] = 3.0f * random_float(&state);
    uint8_t flags[M];
    for (int i = 0; i < M; i++) flags[i] = i % 3 != 0;
    for (int pass = 0; pass < 2 && !failed; pass++) {
        const uint8_t *prompt_rows = pass == 0 ? NULL : flags;
        if (sluice_qgemm(M, 2 * I, K, x, SLUICE_Q4_1, packed, gate_up, 2 * I, scratch, prompt_rows) != 0 ||
            sluice_qgemm_gated(M, I, K, x, SLUICE_Q4_1, packed, out, I, scratch, prompt_rows, SLUICE_SILU) != 0) {
            failed = 1;
            break;
        }
        sluice_silu_mul(M, I, gate_up, expected);
        if (memcmp(out, expected, sizeof(float) * M * I) != 0) failed = 1;
    }
    free(packed), free(x), free(gate_up), free(expected), free(out), free(scratch);
    return failed;
}

/* The glue kernels: norm with the residual add, rotary + store, silu * mul. */
static int check_glue(void) {
    enum { ROWS = 3, DIM = 40, HEADS = 2, KV_HEADS = 1, HEAD_DIM = 16, SLOTS = 4 };
    float x[ROWS * DIM], delta[ROWS * DIM], w[DIM], out[ROWS * DIM], hidden[ROWS * DIM];
    uint32_t state = 99u;
    for (int i = 0; i < ROWS * DIM; i++) hidden[i] = x[i] = 2.0f * random_float(&state), delta[i] = random_float(&state);
    for (int i = 0; i < DIM; i++) w[i] = 1.0f + random_float(&state);
    sluice_add_rmsnorm(ROWS, DIM, hidden, delta, w, 1e-5f, out);
    for (int r = 0; r < ROWS; r++) {
        double sum_sq = 0.0;
        for (int i = 0; i < DIM; i++) sum_sq += (double)(x[r * DIM + i] + delta[r * DIM + i]) * (x[r * DIM + i] + delta[r * DIM + i]);
        const double inv = 1.0 / sqrt(sum_sq / DIM + 1e-5);
        for (int i = 0; i < DIM; i++) {
            const double h = x[r * DIM + i] + delta[r * DIM + i];
            if (hidden[r * DIM + i] != (float)h || fabs(out[r * DIM + i] - h * inv * w[i]) > 1e-5) return 1;
        }
    }
    sluice_silu_mul(ROWS, DIM / 2, x, out);
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < DIM / 2; i++) {
            const double gate = x[r * DIM + i], up = x[r * DIM + DIM / 2 + i];
            if (fabs(out[r * DIM / 2 + i] - gate / (1.0 + exp(-gate)) * up) > 1e-5) return 1;
        }
    sluice_gelu_tanh_mul(ROWS, DIM / 2, x, out);
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < DIM / 2; i++) {
            const double gate = x[r * DIM + i], up = x[r * DIM + DIM / 2 + i];
            const double gelu = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)));
            if (fabs(out[r * DIM / 2 + i] - gelu * up) > 1e-5) return 1;
        }
    float qkv[(HEADS + 2 * KV_HEADS) * HEAD_DIM], before[(HEADS + 2 * KV_HEADS) * HEAD_DIM], cos_row[HEAD_DIM],
        sin_row[HEAD_DIM], k_pool[SLOTS * HEAD_DIM] = {0}, v_pool[SLOTS * HEAD_DIM] = {0};
    for (int i = 0; i < (HEADS + 2 * KV_HEADS) * HEAD_DIM; i++) before[i] = qkv[i] = random_float(&state);
    for (int i = 0; i < HEAD_DIM / 2; i++) {
        cos_row[i] = cos_row[i + HEAD_DIM / 2] = cosf(0.3f * i);
        sin_row[i + HEAD_DIM / 2] = sinf(0.3f * i);
        sin_row[i] = -sin_row[i + HEAD_DIM / 2];
    }
    const int64_t slot = 2;
    sluice_rope_store(1, HEADS, KV_HEADS, HEAD_DIM, qkv, cos_row, sin_row, k_pool, v_pool, SLUICE_KV_FLOAT32, &slot);
    for (int h = 0; h < HEADS + KV_HEADS; h++)
        for (int i = 0; i < HEAD_DIM; i++) {
            const int partner = i < HEAD_DIM / 2 ? i + HEAD_DIM / 2 : i - HEAD_DIM / 2;
            const float expected = before[h * HEAD_DIM + i] * cos_row[i] + before[h * HEAD_DIM + partner] * sin_row[i];
            if (fabsf(qkv[h * HEAD_DIM + i] - expected) > 1e-6f) return 1;
        }
    if (memcmp(k_pool + slot * HEAD_DIM, qkv + HEADS * HEAD_DIM, sizeof(float) * HEAD_DIM) != 0) return 1;
    if (memcmp(v_pool + slot * HEAD_DIM, qkv + (HEADS + 1) * HEAD_DIM, sizeof(float) * HEAD_DIM) != 0) return 1;
    return 0;
}

int sluice_self_test(void) {
    if (check_qgemm(SLUICE_Q8_0)) return 1;
    if (check_qgemm(SLUICE_Q4_1)) return 2;
    if (check_attention(SLUICE_KV_FLOAT32)) return 3;
    if (check_attention(SLUICE_KV_FLOAT16)) return 4;
    if (check_attention(SLUICE_KV_BFLOAT16)) return 5;
    if (check_glue()) return 6;
    if (check_qgemm(SLUICE_Q6_K)) return 7;
    if (check_qgemm(SLUICE_Q4_K)) return 8;
    if (check_qgemm(SLUICE_Q5_K)) return 9;
    if (check_qgemm(SLUICE_Q5_1)) return 10;
    if (check_prompt_attention()) return 11;
    if (check_qgemm_gated()) return 12;
    if (check_attention(SLUICE_KV_FP8_E5M2)) return 13;
    return 0;
}
