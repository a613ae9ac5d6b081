/* The contract between sluice's C kernels and their Python callers, in one place.
 *
 * - Every exported function is declared here and nowhere else: the loader
 *   (sluice/kernels/contract.py) reads the declarations below to bind the functions.
 * - The shared structs and constants are checked when a library loads: Python asks
 *   sluice_contract_value() for every size, field offset and constant it relies on and
 *   refuses a library that answers differently.
 *
 * The same sources are compiled once per instruction set (see build.py); a build's row
 * group (how many output rows qgemm interleaves) follows its vector width.
 */
#ifndef SLUICE_KERNELS_H
#define SLUICE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define SLUICE_BLOCK 32 /* weights per quantized block, along K */
#define SLUICE_SUPER_BLOCK 256 /* weights per q4_k / q5_k / q6_k super-block, along K */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SLUICE_AVX512_VNNI 1
#define SLUICE_ROW_GROUP 16 /* one 512-bit register: 4 weights of each of 16 rows */
#define SLUICE_ISA_NAME "avx512_vnni"
#else
#define SLUICE_ROW_GROUP 8 /* one 256-bit register: 4 weights of each of 8 rows */
#define SLUICE_ISA_NAME "avx2"
#endif

/* AMX-INT8 on top of AVX-512 VNNI: batches of 16+ activation rows through tile multiplies.
 * A 16-row group's q8_0 block is exactly an AMX B tile (8 rows of 64 bytes). */
#if defined(SLUICE_AVX512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SLUICE_AMX 1
#undef SLUICE_ISA_NAME
#define SLUICE_ISA_NAME "amx_int8"
#endif
/* AMX-BF16 on top of that: prompt rows through bf16 tile multiplies (see qgemm.c). */
#if defined(SLUICE_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SLUICE_AMX_BF16 1
#undef SLUICE_ISA_NAME
#define SLUICE_ISA_NAME "amx_bf16"
#endif

/* Bytes of one row group's block: the quants of every row, then float16 scales (and q4_1's
 * float16 minimums), one per row. */
#define SLUICE_Q8_0_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * (SLUICE_BLOCK + 2))
#define SLUICE_Q4_1_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * (SLUICE_BLOCK / 2 + 4))
/* q5_1 (GGUF's Q5_1, and its Q5_0 with m = -16 d): q4_1 with a fifth bit a weight, one word of
 * high bits a row after the nibbles (as q5_k's), then the float16 d and m: 24 bytes a row. */
#define SLUICE_Q5_1_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * (SLUICE_BLOCK / 2 + 4 + 4))
/* q6_k goes by super-blocks of 256: eight 32-weight blocks of 24 bytes a row (16 of low
 * nibbles, 8 of 2-bit highs), then 16 int8 sub-block scales and a float16 d a row: the
 * 210 bytes a row of GGUF's Q6_K. */
#define SLUICE_Q6_K_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * 24)
#define SLUICE_Q6_K_GROUP_SUPER_BYTES (SLUICE_ROW_GROUP * 210)
/* q4_k (GGUF's Q4_K) too: eight blocks of q4_1's 16 nibble bytes a row, then the 6-bit block
 * scales and minimums unpacked to bytes, uint8 [8][G] each, then G float16 d and G dmin:
 * 148 bytes a row where the file has 144. */
#define SLUICE_Q4_K_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * 16)
#define SLUICE_Q4_K_GROUP_SUPER_BYTES (SLUICE_ROW_GROUP * 148)
/* q5_k (GGUF's Q5_K): q4_k with a fifth bit a weight, one word of high bits a row after each
 * block's nibbles: 180 bytes a row where the file has 176. */
#define SLUICE_Q5_K_GROUP_BLOCK_BYTES (SLUICE_ROW_GROUP * 20)
#define SLUICE_Q5_K_GROUP_SUPER_BYTES (SLUICE_ROW_GROUP * 180)

enum sluice_block_format { SLUICE_Q8_0 = 0, SLUICE_Q4_1 = 1, SLUICE_Q6_K = 2, SLUICE_Q4_K = 3, SLUICE_Q5_K = 4, SLUICE_Q5_1 = 5 };
/* The formats stored by 256-weight super-blocks (the others by 32-weight blocks). */
#define SLUICE_SUPER_BLOCK_FORMAT(format) ((format) == SLUICE_Q6_K || (format) == SLUICE_Q4_K || (format) == SLUICE_Q5_K)

/* Element type of the KV pools. FP8_E5M2: the high byte of a float16 (5 exponent bits, 2 of
 * mantissa), rounded to nearest even as torch.float8_e5m2 rounds, no scales. */
enum sluice_kv_dtype { SLUICE_KV_FLOAT32 = 0, SLUICE_KV_FLOAT16 = 1, SLUICE_KV_BFLOAT16 = 2, SLUICE_KV_FP8_E5M2 = 3 };
/* Bytes of one element of a KV pool of that dtype (any other value is read as float32, as
 * the kernels' loads and stores take it). */
static inline size_t sluice_kv_element_bytes(int kv_dtype) {
    return kv_dtype == SLUICE_KV_FLOAT16 || kv_dtype == SLUICE_KV_BFLOAT16 ? 2 : kv_dtype == SLUICE_KV_FP8_E5M2 ? 1 : 4;
}

/* One projection's weights in qgemm's row-group layout: every output row in one block format,
 * or, for a fused projection whose sources came in two (a Q4_K_M file's q and k in q4_k above
 * a v in q6_k), the last tail_rows rows apart in their own format, each part at the file's
 * precision. */
typedef struct {
    const uint8_t *packed; /* the rows before the tail */
    const uint8_t *tail;   /* NULL: no tail */
    int format, tail_format, tail_rows;
} sluice_projection;

/* One decoder layer's weights for sluice_decode_layers. */
typedef struct {
    const float *input_norm, *post_attention_norm;
    sluice_projection qkv, o, gate_up, down;
    const float *qkv_bias;       /* NULL when the model has none */
    const float *q_norm, *k_norm; /* per-head RMSNorm weights [head_dim] (Qwen3); NULL when none */
    int sliding_window;           /* keys this layer's queries see, their own included; 0: all */
    /* Gemma's norms around the MLP, NULL when none (Llama): with them, post_attention_norm
     * normalizes the attention output before it is added, pre_feedforward_norm is the norm
     * before the MLP and post_feedforward_norm that of the MLP's output. */
    const float *pre_feedforward_norm, *post_feedforward_norm;
    int local_rope; /* 1: rotated by the local tables (Gemma 3's sliding-window layers) */
} sluice_layer_weights;

/* The gated MLP's activation: silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU). */
enum sluice_activation { SLUICE_SILU = 0, SLUICE_GELU_TANH = 1 };

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, attention_scale;
    int kv_dtype;       /* enum sluice_kv_dtype */
    int mlp_activation; /* enum sluice_activation */
    float attn_softcap; /* attention scores soft-capped at it (Gemma 2); 0: none */
} sluice_model_dims;

/* What this build is: sizes, field offsets and constants by name ("sizeof sluice_model_dims",
 * "sluice_model_dims.eps", "SLUICE_ROW_GROUP", ...); LONG_MIN for a name it does not know. */
long sluice_contract_value(const char *name);
/* Runs every kernel on small fixed inputs against plain scalar code: 0 when all agree, else
 * the number of the first check that failed. Run in a child process before a build is
 * trusted, so that an instruction the CPU refuses kills the child, not the server. */
int sluice_self_test(void);

/* qgemm.c: out[M, N] = x[M, K] @ W^T with W in row groups, out's rows out_stride floats apart
 * (N for a whole matrix; more to fill some columns of a wider one). K must be a multiple of 32
 * (of 256 for the super-block formats); returns 0, or -1 for a K, a stride or a format it
 * cannot take. On an AMX build, -2 when the OS refuses this process the tile registers.
 * prompt_rows: NULL, or M flags, non-zero for the rows of prompt tokens: an AMX-BF16 build
 * multiplies those on bf16 tiles (other builds ignore the flags). */
size_t sluice_qgemm_scratch_bytes(int M, int K);
int sluice_qgemm(int M, int N, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                 int out_stride, void *scratch, const uint8_t *prompt_rows);
/* A gated MLP's first projection and its activation in one call: out[M, I] = act(x @ gate^T)
 * * (x @ up^T) (activation: enum sluice_activation), W = [gate; up] in row groups (2 I rows, I
 * a multiple of SLUICE_ROW_GROUP), the same bits as sluice_qgemm then sluice_silu_mul (or
 * sluice_gelu_tanh_mul). The prompt rows of an AMX-BF16 build never store [gate | up]. */
size_t sluice_qgemm_gated_scratch_bytes(int M, int I, int K);
int sluice_qgemm_gated(int M, int I, int K, const float *x, int weight_type, const uint8_t *packed, float *out,
                       int out_stride, void *scratch, const uint8_t *prompt_rows, int activation);

/* rmsnorm.c */
void sluice_rmsnorm(int rows, int dim, const float *x, const float *w, float eps, float *out);
void sluice_add_rmsnorm(int rows, int dim, float *hidden, const float *delta, const float *w, float eps, float *out);
/* In place: rows x + t * token_stride + h * dim (t < tokens, h < heads) of dim floats each. */
void sluice_rmsnorm_heads(int tokens, int heads, int dim, float *x, long token_stride, const float *w, float eps);

/* argmax.c: torch.argmax over each row (first of equal values; a NaN is the largest). */
void sluice_argmax_rows(int rows, int cols, const float *x, int64_t *out);

/* rope_store.c: pools hold kv_dtype elements. */
void sluice_rope_store(int tokens, int heads, int kv_heads, int head_dim, float *qkv, const float *cos,
                       const float *signed_sin, void *k_pool, void *v_pool, int kv_dtype, const int64_t *slots);
void sluice_silu_mul(int rows, int width, const float *gate_up, float *out);
void sluice_gelu_tanh_mul(int rows, int width, const float *gate_up, float *out);

/* decode_attention.c: returns 0, or -1 when its score buffers could not be allocated. window: how
 * many of its last slots a query sees (0: all); softcap: scores soft-capped at it (0: none).
 * prompt_rows: NULL, or a flag a query, non-zero for prompt tokens: an AMX-BF16 build attends
 * those on bf16 tiles (other builds ignore the flags). */
int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale, int window,
                            float softcap, const float *q, long q_stride, const void *k_pool, const void *v_pool,
                            int kv_dtype, const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens,
                            const uint8_t *prompt_rows, float *out);

/* decode_layers.c: every decoder layer of a step in one call; returns 0 or -1 as above. */
size_t sluice_decode_layers_scratch_bytes(const sluice_model_dims *dims, int M);
int sluice_decode_layers(const sluice_model_dims *dims, const sluice_layer_weights *layers, void *const *k_pools,
                         void *const *v_pools, int M, float *hidden, const float *cos, const float *signed_sin,
                         const float *local_cos, const float *local_signed_sin, const int64_t *out_slots,
                         const int64_t *attn_slots, const int64_t *window_out_slots, const int64_t *window_attn_slots,
                         const int64_t *slot_rows, const int64_t *seq_lens, int max_len, void *scratch);

#endif
