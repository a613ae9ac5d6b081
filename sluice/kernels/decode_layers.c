/* Every decoder layer of a forward step in one call, for a model whose four projections per
 * layer are all block-quantized (float32 activations): Llama's layers and Gemma's (norms
 * around attention and MLP outputs, GeGLU, soft-capped scores, local and global RoPE).
 * Every token, prompt or generated, attends through decode_attention.c at its own position.
 *
 * At batch 1 a layer is ~10 small kernels of 5-30 us each; called one by one from Python,
 * the interpreter and ctypes cost about as much as the kernels. Here the same kernels run
 * back to back, with the same arithmetic as the per-op path, so results are identical.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

static size_t qkv_width(const sluice_model_dims *d) { return (size_t)(d->heads + 2 * d->kv_heads) * d->head_dim; }

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

/* out[M, N] = x[M, K] @ p^T: the rows before p's tail, then the tail's beside them. */
static int project(int M, int N, int K, const float *x, const sluice_projection *p, float *out, void *scratch) {
    const int head_rows = p->tail != NULL ? N - p->tail_rows : N;
    int status = sluice_qgemm(M, head_rows, K, x, p->format, p->packed, out, N, scratch, NULL);
    if (p->tail != NULL) status |= sluice_qgemm(M, p->tail_rows, K, x, p->tail_format, p->tail, out + head_rows, N, scratch, NULL);
    return status;
}

/* Bytes of scratch sluice_decode_layers needs for M tokens. */
size_t sluice_decode_layers_scratch_bytes(const sluice_model_dims *d, int M) {
    const size_t widest_input = max_size((size_t)d->hidden, max_size((size_t)d->heads * d->head_dim, (size_t)d->intermediate));
    const size_t floats = (size_t)M * (2 * (size_t)d->hidden + qkv_width(d) + (size_t)d->heads * d->head_dim +
                                       3 * (size_t)d->intermediate);
    const size_t qgemm_bytes = sluice_qgemm_scratch_bytes(M, (int)widest_input);
    return floats * sizeof(float) + qgemm_bytes;
}

/* hidden [M, hidden]: the token embeddings in, the residual stream after the last layer out
 * (before the final norm). k_pools/v_pools: each layer's pool [slots, kv_heads, head_dim] of dims->kv_dtype.
 * cos/signed_sin [M, head_dim], and local_cos/local_signed_sin for layers with local_rope
 * (else NULL); out_slots [M]: where each token's K/V go; attn_slots
 * [requests, max_len], slot_rows [M] (or NULL) and seq_lens [M] as for sluice_decode_attention;
 * window_out_slots and window_attn_slots: the same for the sliding-window layers where their
 * K/V have slots of their own (else NULL: they use out_slots and attn_slots). */
int sluice_decode_layers(const sluice_model_dims *d, const sluice_layer_weights *layers, void *const *k_pools,
                         void *const *v_pools, int M, float *hidden, const float *cos, const float *signed_sin,
                         const float *local_cos, const float *local_signed_sin, const int64_t *out_slots,
                         const int64_t *attn_slots, const int64_t *window_out_slots, const int64_t *window_attn_slots,
                         const int64_t *slot_rows, const int64_t *seq_lens, int max_len, void *scratch) {
    const int D = d->hidden, I = d->intermediate, attn_width = d->heads * d->head_dim;
    const int qkv_cols = (int)qkv_width(d);
    float *normed = (float *)scratch;
    float *pending = normed + (size_t)M * D; /* the last projection's output, not yet added */
    float *qkv = pending + (size_t)M * D;
    float *attn = qkv + (size_t)M * qkv_cols;
    float *gate_up = attn + (size_t)M * attn_width;
    float *activated = gate_up + (size_t)M * 2 * I;
    void *qgemm_scratch = activated + (size_t)M * I;

    for (int l = 0; l < d->num_layers; l++) {
        const sluice_layer_weights *w = &layers[l];
        if (l == 0)
            sluice_rmsnorm(M, D, hidden, w->input_norm, d->eps, normed);
        else
            sluice_add_rmsnorm(M, D, hidden, pending, w->input_norm, d->eps, normed);
        int status = project(M, qkv_cols, D, normed, &w->qkv, qkv, qgemm_scratch);
        if (w->qkv_bias != NULL)
            for (int r = 0; r < M; r++)
                for (int c = 0; c < qkv_cols; c++) qkv[(size_t)r * qkv_cols + c] += w->qkv_bias[c];
        if (w->q_norm != NULL) { /* each head's row normalized in place, as the per-op path does */
            sluice_rmsnorm_heads(M, d->heads, d->head_dim, qkv, qkv_cols, w->q_norm, d->eps);
            sluice_rmsnorm_heads(M, d->kv_heads, d->head_dim, qkv + (size_t)d->heads * d->head_dim, qkv_cols, w->k_norm,
                                 d->eps);
        }
        if (w->local_rope && local_cos == NULL) return -1;
        const int own_slots = w->sliding_window > 0 && window_out_slots != NULL;
        sluice_rope_store(M, d->heads, d->kv_heads, d->head_dim, qkv, w->local_rope ? local_cos : cos,
                          w->local_rope ? local_signed_sin : signed_sin, k_pools[l], v_pools[l], d->kv_dtype,
                          own_slots ? window_out_slots : out_slots);
        status |= sluice_decode_attention(M, d->heads, d->kv_heads, d->head_dim, max_len, d->attention_scale,
                                          w->sliding_window, d->attn_softcap, qkv, qkv_cols, k_pools[l], v_pools[l],
                                          d->kv_dtype, own_slots ? window_attn_slots : attn_slots, slot_rows,
                                          seq_lens, NULL, attn);
        status |= project(M, D, attn_width, attn, &w->o, pending, qgemm_scratch);
        if (w->pre_feedforward_norm != NULL) { /* Gemma: the attention output is normed before it is added */
            sluice_rmsnorm(M, D, pending, w->post_attention_norm, d->eps, pending);
            sluice_add_rmsnorm(M, D, hidden, pending, w->pre_feedforward_norm, d->eps, normed);
        } else {
            sluice_add_rmsnorm(M, D, hidden, pending, w->post_attention_norm, d->eps, normed);
        }
        status |= project(M, 2 * I, D, normed, &w->gate_up, gate_up, qgemm_scratch);
        if (d->mlp_activation == SLUICE_GELU_TANH)
            sluice_gelu_tanh_mul(M, I, gate_up, activated);
        else
            sluice_silu_mul(M, I, gate_up, activated);
        status |= project(M, D, I, activated, &w->down, pending, qgemm_scratch);
        if (w->post_feedforward_norm != NULL) sluice_rmsnorm(M, D, pending, w->post_feedforward_norm, d->eps, pending);
        if (status != 0) return -1;
    }
    for (size_t i = 0; i < (size_t)M * D; i++) hidden[i] += pending[i];
    return 0;
}
