/* The kernels' exported functions, for the C files that chain them (decode_layers.c). */
#ifndef SLUICE_KERNELS_H
#define SLUICE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

size_t sluice_qgemm_scratch_bytes(int M, int K);
int sluice_qgemm(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                 void *scratch);
void sluice_rmsnorm(int rows, int dim, const float *x, const float *w, float eps, float *out);
void sluice_add_rmsnorm(int rows, int dim, float *hidden, const float *delta, const float *w, float eps, float *out);
void sluice_rope_store(int tokens, int heads, int kv_heads, int head_dim, float *qkv, const float *cos,
                       const float *signed_sin, float *k_pool, float *v_pool, const int64_t *slots);
void sluice_silu_mul(int rows, int width, const float *gate_up, float *out);
int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, long q_stride, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens, float *out);

#endif
