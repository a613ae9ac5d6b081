/* Attention of query tokens over their cached K/V, read in place from the token-granular
 * pool through each request's slot list (no gather copy); float32 arithmetic over K/V
 * stored as float32, float16, bfloat16 or fp8 e5m2 (kv_dtype, enum sluice_kv_dtype).
 *
 * q   [queries] rows of q_stride floats, each holding [heads, head_dim] first
 * out [queries, heads, head_dim]
 * k/v pool [slots, kv_heads, head_dim]     slots [requests, max_len] (int64, padded)
 * slot_rows [queries]: the row of `slots` each query reads (NULL: query i reads row i, one
 * query per request, a decode step); seq_lens [queries]: how many of those slots it sees.
 * Query heads h * group .. h * group + group - 1 share KV head h (grouped-query attention).
 * window > 0: a query sees only the last `window` of its slots (a sliding-window layer: keys
 * at positions > its own - window); softcap > 0: each score s becomes softcap * tanh(s /
 * softcap) before the softmax (Gemma 2's attention logit soft-capping).
 *
 * Every query is computed the same way, whatever else is in the call: its slots in tiles of
 * KV_TILE from position 0 (from the tile holding its window's first slot, the slots before
 * that masked out), each tile's scores, an online softmax (the running maximum and
 * sum rescale what came before, as in flash attention), and its values accumulated token
 * by token. A prompt token at position p is thus computed exactly as a decode step at p
 * would be, so a request's results do not depend on how its prompt was split into chunks,
 * on its cached prefix or on its batch neighbours.
 *
 * What is shared is memory traffic and widening. A decode step reads all of its requests'
 * cached K/V, so it is bound by memory: the query heads of a group are done together, each K
 * and V row read once for all of them, and a 16-bit pool halves the bytes (an fp8 one quarters them). A prompt's
 * consecutive tokens go in blocks of up to QUERY_BLOCK queries that walk the K/V rows in
 * tiles of KV_TILE: a tile comes from memory once, is widened to float32 once (K transposed,
 * so that a vector holds the scores of VLEN keys and no score needs a horizontal sum) and
 * serves the whole block from cache. Both ways sum each score's dot product in the same
 * order (see group_scores), which is what keeps a prompt token's bits those of a decode step.
 */
#define _GNU_SOURCE /* syscall() for the AMX permission */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_vectors.h"
#include "kernels.h"
#include "vector_math.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUP 8
#define QUERY_BLOCK 32 /* consecutive queries of one request sharing each K/V tile */
/* The same on bf16 tiles (prompt_attention_amx.h), which widen each K/V tile for more: up to
 * 256 (a Qwen3-0.6B layer's 4,096-token prompt attention took 67 ms against 89 ms at 64), but
 * no fewer blocks than keep every thread busy, down to 64. A row's bits do not depend on the
 * block it is in. */
#define TILE_QUERY_BLOCK 256
#define MIN_TILE_QUERY_BLOCK 64
#define KV_TILE 64     /* K/V rows a block walks together: 16 KB of float32 at head_dim 64 */
static const int64_t TILE_ROWS[KV_TILE] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                           16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                           32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                           48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
#define TRANSPOSED_KEYS_FROM 4 /* queries in a block from which its K tiles are transposed once */
/* Decode queries of different requests go in one block when their slot lists start with at
 * least this many identical slots (a shared prompt prefix in the radix cache). */
#define MIN_SHARED_SLOTS KV_TILE
/* Tokens ahead whose K/V rows are prefetched: a slot list is not a stream the hardware
 * prefetcher follows across pages (measured: -30% time at 128 cached tokens). */
#define PREFETCH_AHEAD 8
#define PREFETCH_TASK_BYTES (256 * 1024) /* of K/V rows a task sends to L2 before it starts */

/* Sums of up to 4 vectors, each by the same tree (its halves added lane by lane down to 8
 * lanes, then ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7))): a vector's sum does not depend on how
 * many others are reduced beside it. */
ALWAYS_INLINE __m128 vsum4(vec a, vec b, vec c, vec d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a), half_sum(b)), _mm256_hadd_ps(half_sum(c), half_sum(d)));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

static inline float vsum(vec v) { return _mm_cvtss_f32(vsum4(v, v, v, v)); }

/* One tile of a query head's online softmax: s[0..n) = exp(s - m) with m the running
 * maximum after this tile; the running sum is rescaled and extended. Returns the factor
 * exp(old m - new m) by which the values accumulated so far must be rescaled. */
ALWAYS_INLINE float softmax_tile(float *s, int n, float *running_max, float *running_sum) {
    vec maxes = vset1(-INFINITY);
    int t = 0;
    for (; t + VLEN <= n; t += VLEN) maxes = vmax(maxes, vload(s + t));
    float tile_max = vreduce_max(maxes);
    for (; t < n; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
    const float new_max = tile_max > *running_max ? tile_max : *running_max;
    /* 0 for the first tile (exp of -inf, clamped, is 0 when multiplied by a running sum of 0). */
    const float correction = _mm_cvtss_f32(_mm256_castps256_ps128(exp256(_mm256_set1_ps(*running_max - new_max))));
    const vec max_vec = vset1(new_max);
    vec sums = vzero();
    t = 0;
    for (; t + VLEN <= n; t += VLEN) {
        const vec e = vexp(vsub(vload(s + t), max_vec));
        vstore(s + t, e);
        sums = vadd(sums, e);
    }
    float total = vsum(sums);
    for (; t < n; t++) {
        s[t] = expf(s[t] - new_max);
        total += s[t];
    }
    *running_sum = *running_sum * correction + total;
    *running_max = new_max;
    return correction;
}

/* s[0..len) = exp(s - max(s)) / sum, for the scalar path. */
static void softmax(float *s, int len) {
    float max_score = -INFINITY, total = 0.0f;
    softmax_tile(s, len, &max_score, &total);
    const float inv_total = 1.0f / total;
    for (int t = 0; t < len; t++) s[t] *= inv_total;
}

/* The first slot a query that sees `len` slots attends to. */
static inline int window_start(int len, int window) { return window > 0 && len > window ? len - window : 0; }

/* s[0..n) = softcap * tanh(s / softcap), whole vectors at a time (the tile has room up to
 * the next multiple of VLEN; lanes past n are not read), tanh(x) as 1 - 2 / (exp(2x) + 1). */
ALWAYS_INLINE void softcap_tile(float *s, int n, float softcap) {
    const vec to_x2 = vset1(2.0f / softcap), one = vset1(1.0f), two = vset1(2.0f), cap = vset1(softcap);
    for (int t = 0; t < n; t += VLEN) {
        const vec e = vexp(vmul(vload(s + t), to_x2));
        vstore(s + t, vmul(cap, vsub(one, vdiv(two, vadd(e, one)))));
    }
}


ALWAYS_INLINE float load_kv1(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _cvtsh_ss(*(const uint16_t *)p);
    case SLUICE_KV_FP8_E5M2: return _cvtsh_ss((uint16_t)(*(const uint8_t *)p << 8));
    case SLUICE_KV_BFLOAT16: {
        const uint32_t bits = (uint32_t)(*(const uint16_t *)p) << 16;
        float value;
        __builtin_memcpy(&value, &bits, 4);
        return value;
    }
    default: return *(const float *)p;
    }
}

/* Where one KV head's rows of one pool live: row t of a request is
 * base + req_slots[t] * slot_bytes (its head_dim elements of kv_dtype). */
typedef struct {
    const char *base; /* the pool, offset to this KV head */
    size_t slot_bytes;
} kv_rows;

ALWAYS_INLINE const char *kv_row(kv_rows rows, const int64_t *req_slots, int t) {
    return rows.base + (size_t)req_slots[t] * rows.slot_bytes;
}

ALWAYS_INLINE void prefetch_row(const char *row, size_t bytes) {
    for (size_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
}

/* The bytes [offset, offset + bytes) of the K and V rows of slots [t0, t1) of a request
 * (the KV heads a task reads), towards this core's L2. */
ALWAYS_INLINE void prefetch_rows(const void *k_pool, const void *v_pool, size_t slot_bytes, size_t offset,
                                 size_t bytes, const int64_t *req_slots, int t0, int t1) {
    /* At most PREFETCH_TASK_BYTES: a long prompt's rows would push each other out of L2. */
    if ((size_t)(t1 - t0) * 2 * bytes > PREFETCH_TASK_BYTES) t1 = t0 + (int)(PREFETCH_TASK_BYTES / (2 * bytes));
    for (int t = t0; t < t1; t++) {
        const size_t at = (size_t)req_slots[t] * slot_bytes + offset;
        for (size_t byte = 0; byte < bytes; byte += 64) {
            _mm_prefetch((const char *)k_pool + at + byte, _MM_HINT_T1);
            _mm_prefetch((const char *)v_pool + at + byte, _MM_HINT_T1);
        }
    }
}

/* scores[g * stride + t - t0] = scale * q_g . k_t for t in [t0, t1), the G heads of one
 * group (head_dim % 8 == 0), with the partial sums in the lanes of a vector. Rows up to
 * `len` may be prefetched. */
ALWAYS_INLINE void group_scores(const int G, const int kv_dtype, const float *q, int head_dim, int t0, int t1, int len,
                                float scale, kv_rows keys, const int64_t *req_slots, float *scores, size_t stride) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    int t = t0;
    /* Runs of SCORE_KEYS keys first, while the group's chains fit in registers: each slice of
     * q is loaded once for all the run, SCORE_KEYS * G chains hide the latency of the fused
     * multiply-adds, and a head's run of sums is reduced together and stored as one vector. */
    if (G <= SCORE_KEYS_MAX_GROUP)
        for (; t + SCORE_KEYS <= t1; t += SCORE_KEYS) {
            const char *rows[SCORE_KEYS];
            for (int j = 0; j < SCORE_KEYS; j++) rows[j] = kv_row(keys, req_slots, t + j);
            for (int ahead = t + PREFETCH_AHEAD; ahead < t + PREFETCH_AHEAD + SCORE_KEYS && ahead < len; ahead++)
                prefetch_row(kv_row(keys, req_slots, ahead), head_dim * elem);
            run_scores(G, kv_dtype, q, head_dim, scale, rows, elem, scores + (t - t0), stride);
        }
#ifdef SLUICE_AVX512_VNNI
    /* Two keys at once, one in each half of a 512-bit vector: the same chains, half the ops. */
    for (; t + 2 <= t1; t += 2) {
        const char *ka = kv_row(keys, req_slots, t), *kb = kv_row(keys, req_slots, t + 1);
        for (int ahead = t + PREFETCH_AHEAD; ahead < t + PREFETCH_AHEAD + 2 && ahead < len; ahead++)
            prefetch_row(kv_row(keys, req_slots, ahead), head_dim * elem);
        __m512 acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
        for (int i = 0; i < head_dim; i += 8) {
            const __m512 k = load_kv8_pair(ka + i * elem, kb + i * elem, kv_dtype);
            for (int g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * head_dim + i)), k, acc[g]);
        }
        for (int g0 = 0; g0 < G; g0 += 2) {
            const int n = G - g0 < 2 ? G - g0 : 2;
            const __m512 other = n > 1 ? acc[g0 + 1] : _mm512_setzero_ps();
            float sums[4]; /* g0 at t, g0 at t + 1, g0 + 1 at t, g0 + 1 at t + 1 */
            _mm_storeu_ps(sums, _mm_mul_ps(sum8x4(_mm512_castps512_ps256(acc[g0]), _mm512_extractf32x8_ps(acc[g0], 1),
                                                  _mm512_castps512_ps256(other), _mm512_extractf32x8_ps(other, 1)),
                                           _mm_set1_ps(scale)));
            for (int g = 0; g < n; g++) {
                scores[(size_t)(g0 + g) * stride + (t - t0)] = sums[2 * g];
                scores[(size_t)(g0 + g) * stride + (t + 1 - t0)] = sums[2 * g + 1];
            }
        }
    }
#endif
    for (; t < t1; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        if (t + PREFETCH_AHEAD < len) prefetch_row(kv_row(keys, req_slots, t + PREFETCH_AHEAD), head_dim * elem);
        __m256 acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int i = 0; i < head_dim; i += 8) {
            const __m256 k = load_kv8(kt + i * elem, kv_dtype);
            for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + i), k, acc[g]);
        }
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int n = G - g0 < 4 ? G - g0 : 4;
            const __m256 zero = _mm256_setzero_ps();
            float sums[4];
            _mm_storeu_ps(sums, _mm_mul_ps(sum8x4(acc[g0], n > 1 ? acc[g0 + 1] : zero, n > 2 ? acc[g0 + 2] : zero,
                                                  n > 3 ? acc[g0 + 3] : zero),
                                           _mm_set1_ps(scale)));
            for (int g = 0; g < n; g++) scores[(size_t)(g0 + g) * stride + (t - t0)] = sums[g];
        }
    }
}

/* The K rows [t0, t0 + n) of one head widened and transposed: kt[d * KV_TILE + t - t0]; the
 * rows from n up to the next multiple of VLEN are zero. Rows up to `len` may be prefetched. */
ALWAYS_INLINE void transpose_keys(const int kv_dtype, int head_dim, int t0, int n, int len, kv_rows keys,
                                  const int64_t *req_slots, float *kt) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    for (int tb = 0; tb < n; tb += VLEN) {
        const char *rows[VLEN];
        for (int r = 0; r < VLEN; r++) {
            const int t = t0 + tb + r;
            rows[r] = tb + r < n ? kv_row(keys, req_slots, t) : NULL;
            if (t + KV_TILE < len) prefetch_row(kv_row(keys, req_slots, t + KV_TILE), head_dim * elem);
        }
        for (int i = 0; i < head_dim; i += VLEN) {
            vec square[VLEN];
            for (int r = 0; r < VLEN; r++) square[r] = rows[r] != NULL ? load_kv(rows[r] + i * elem, kv_dtype) : vzero();
            transpose_square(square);
            for (int r = 0; r < VLEN; r++) vstore(kt + (size_t)(i + r) * KV_TILE + tb, square[r]);
        }
    }
}

/* The V rows [t0, t0 + n) of one head widened to float32: vt[(t - t0) * head_dim + d]. Rows
 * up to `len` may be prefetched. */
ALWAYS_INLINE void widen_values(const int kv_dtype, int head_dim, int t0, int n, int len, kv_rows values,
                                const int64_t *req_slots, float *vt) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    for (int t = 0; t < n; t++) {
        const char *row = kv_row(values, req_slots, t0 + t);
        if (t0 + t + KV_TILE < len) prefetch_row(kv_row(values, req_slots, t0 + t + KV_TILE), head_dim * elem);
        for (int i = 0; i < head_dim; i += VLEN) vstore(vt + (size_t)t * head_dim + i, load_kv(row + i * elem, kv_dtype));
    }
}

#ifdef CHAIN_KEY_VECTORS
/* scores of NQ queries (q_stride apart, their scores query_stride apart) against KB vectors
 * of transposed keys, summed as group_scores_transposed sums them, but one chain at a time:
 * chain l of every (query, key vector) pair is accumulated over the head (NQ * KB
 * independent sums: each K load serves NQ queries, each broadcast of q KB vectors) and set
 * aside, and the 8 chains then meet by the same tree. For AVX2, whose 16 registers cannot
 * hold 8 chains of more than one query: there each K load served one fused multiply-add. */
ALWAYS_INLINE void chain_scores(const int NQ, const int KB, const float *q, long q_stride, int head_dim, const float *kt,
                                float scale, float *scores, size_t query_stride) {
    vec chains[8][SCORE_QUERIES][CHAIN_KEY_VECTORS];
    for (int l = 0; l < 8; l++) {
        vec acc[SCORE_QUERIES][CHAIN_KEY_VECTORS];
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < KB; b++) acc[j][b] = vzero();
        for (int i = 0; i < head_dim; i += 8) {
            vec k[CHAIN_KEY_VECTORS];
            for (int b = 0; b < KB; b++) k[b] = vload(kt + (size_t)(i + l) * KV_TILE + b * VLEN);
            for (int j = 0; j < NQ; j++) {
                const vec x = vset1(q[(size_t)j * q_stride + i + l]);
                for (int b = 0; b < KB; b++) acc[j][b] = vfmadd(x, k[b], acc[j][b]);
            }
        }
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < KB; b++) chains[l][j][b] = acc[j][b];
    }
    for (int j = 0; j < NQ; j++)
        for (int b = 0; b < KB; b++) {
            const vec sum = vadd(vadd(vadd(chains[0][j][b], chains[1][j][b]), vadd(chains[2][j][b], chains[3][j][b])),
                                 vadd(vadd(chains[4][j][b], chains[5][j][b]), vadd(chains[6][j][b], chains[7][j][b])));
            vstore(scores + (size_t)j * query_stride + b * VLEN, vmul(sum, vset1(scale)));
        }
}

/* chain_scores over a tile's n keys (rounded up to VLEN) for the G heads of SCORE_QUERIES
 * queries. Out of line: inlined beside the decode path, it slowed decode steps by 5-7% (the
 * register allocation of the one large function). */
static __attribute__((noinline)) void chain_scores_tile(int G, const float *q, long q_stride, int head_dim, int n,
                                                        float scale, const float *kt, float *scores,
                                                        size_t query_stride) {
    for (int g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * head_dim;
        float *sg = scores + (size_t)g * KV_TILE;
        int tb = 0;
        for (; tb + (CHAIN_KEY_VECTORS - 1) * VLEN < n; tb += CHAIN_KEY_VECTORS * VLEN)
            chain_scores(SCORE_QUERIES, CHAIN_KEY_VECTORS, qg, q_stride, head_dim, kt + tb, scale, sg + tb,
                         query_stride);
        for (; tb < n; tb += VLEN)
            chain_scores(SCORE_QUERIES, 1, qg, q_stride, head_dim, kt + tb, scale, sg + tb, query_stride);
    }
}
#endif

/* group_scores over keys transposed by transpose_keys, VLEN keys to a vector, for NQ
 * consecutive queries at once (q_stride apart; their scores query_stride apart) which share
 * each load of K: n keys, rounded up to VLEN. Each key's dot product is summed as
 * group_scores sums it (its partial sum l is chain p[l] here, then the same tree), so a
 * query's scores are the same bits whichever of the two computed them. What this saves is
 * the horizontal sums per key and the widening of K per query. */
ALWAYS_INLINE void group_scores_transposed(const int NQ, const int G, const float *q, long q_stride, int head_dim,
                                           int n, float scale, const float *kt, float *scores, size_t query_stride) {
#ifdef CHAIN_KEY_VECTORS
    if (NQ == SCORE_QUERIES) {
        chain_scores_tile(G, q, q_stride, head_dim, n, scale, kt, scores, query_stride);
        return;
    }
#endif
    for (int g = 0; g < G; g++) {
        for (int tb = 0; tb < n; tb += VLEN) {
            vec p[SCORE_QUERIES][8];
            for (int j = 0; j < NQ; j++)
                for (int l = 0; l < 8; l++) p[j][l] = vzero();
            for (int i = 0; i < head_dim; i += 8)
                for (int l = 0; l < 8; l++) {
                    const vec k = vload(kt + (size_t)(i + l) * KV_TILE + tb);
                    for (int j = 0; j < NQ; j++)
                        p[j][l] = vfmadd(vset1(q[(size_t)j * q_stride + (size_t)g * head_dim + i + l]), k, p[j][l]);
                }
            for (int j = 0; j < NQ; j++) {
                const vec sum = vadd(vadd(vadd(p[j][0], p[j][1]), vadd(p[j][2], p[j][3])),
                                     vadd(vadd(p[j][4], p[j][5]), vadd(p[j][6], p[j][7])));
                vstore(scores + (size_t)j * query_stride + (size_t)g * KV_TILE + tb, vmul(sum, vset1(scale)));
            }
        }
    }
}

/* out_g = out_g * correction_g + sum_t p_g[t - t0] * v_t over t in [t0, t1) (out_g starts
 * at zero when t0 is 0), a slice of `width` vectors of the head at a time with the G heads'
 * slices in registers (G * width <= MAX_ACCUMULATORS leaves room for the V vectors). */
ALWAYS_INLINE void group_values(const int G, const int width, const int kv_dtype, const float *p, size_t stride,
                                const float *correction, int head_dim, int first_tile, int t0, int t1, int len,
                                kv_rows values, const int64_t *req_slots, float *out) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    for (int c = 0; c < head_dim; c += VLEN * width) {
        vec acc[MAX_GROUP][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++)
                acc[g][j] = first_tile ? vzero() : vmul(vload(out + g * head_dim + c + VLEN * j), vset1(correction[g]));
        for (int t = t0; t < t1; t++) {
            const char *vt = kv_row(values, req_slots, t) + c * elem;
            if (t + PREFETCH_AHEAD < len)
                prefetch_row(kv_row(values, req_slots, t + PREFETCH_AHEAD) + c * elem, (size_t)VLEN * width * elem);
            vec v[4];
            for (int j = 0; j < width; j++) v[j] = load_kv(vt + VLEN * j * elem, kv_dtype);
            for (int g = 0; g < G; g++) {
                const vec weight = vset1(p[(size_t)g * stride + (t - t0)]);
                for (int j = 0; j < width; j++) acc[g][j] = vfmadd(weight, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++) vstore(out + g * head_dim + c + VLEN * j, acc[g][j]);
    }
}

/* A block of `count` queries against `kv_heads` consecutive KV heads (keys, values, q and
 * out at the first; each next head head_dim elements on in the pool's rows, G query heads on
 * in q and out), tile by tile: for each tile, each head's scores, online softmax and values;
 * then each query head's values divided by its softmax sum. The heads take each tile in turn
 * (each head's sums are those it gets alone), so a tile's K/V rows, which hold every head,
 * come from memory once, in whole rows: a decode step of many requests reads its tiles in
 * rows of kv_heads * head_dim instead of one head's slice of each row per pass (Qwen3-0.6B's
 * 8 heads of 128: 16 requests of 160 tokens, 17.2 against 18.0 ms for 28 layers; of 500
 * tokens, 53.5 against 58.3). Query i reads the slots slot_lists[i] up to lens[i]; the
 * first shared_len slots are the same for all of them. Either the block is consecutive tokens of one request (lens[i] = lens[0] + i, one slot
 * list, shared_len its longest) or decode steps of requests with a common prefix (no window).
 * A block of TRANSPOSED_KEYS_FROM queries or more widens and transposes each K tile its
 * queries share once for all of them; the others each query reads from the pool. scratch:
 * count * G * KV_TILE floats, then the transposed tile (head_dim * KV_TILE), then 2 *
 * QUERY_BLOCK * kv_heads * G floats of softmax state. */
ALWAYS_INLINE void attend_block(const int G, const int width, const int kv_dtype, int count, const float *q,
                                long q_stride, int head_dim, const int64_t *lens, const int64_t *const *slot_lists,
                                int shared_len, float scale, int window, float softcap, kv_rows keys,
                                kv_rows values, int kv_heads, float *scratch, float *out, size_t out_stride) {
    float *kt = scratch + (size_t)QUERY_BLOCK * G * KV_TILE, *vt = kt + (size_t)head_dim * KV_TILE;
    /* The running maximum and sum of query i's head h * G + g at [(i * kv_heads + h) * G + g]. */
    float *running_max = vt + (size_t)head_dim * KV_TILE, *running_sum = running_max + (size_t)QUERY_BLOCK * kv_heads * G;
    int longest = 0;
    for (int i = 0; i < count; i++) {
        for (int s = 0; s < kv_heads * G; s++)
            running_max[i * kv_heads * G + s] = -INFINITY, running_sum[i * kv_heads * G + s] = 0.0f;
        longest = (int)lens[i] > longest ? (int)lens[i] : longest;
    }
    const int shared_reach = shared_len < longest ? shared_len : longest;
    const size_t elem = sluice_kv_element_bytes(kv_dtype), head_bytes = (size_t)head_dim * elem;
    const kv_rows widened_values = {(const char *)vt, sizeof(float) * head_dim};
    /* Over the widened tile in cache the slice's accumulators, its V vectors and a broadcast
     * weight must fit in registers: a spilled accumulator makes every key wait on a store and
     * a reload (SmolLM2's 3 heads a group at width 4 on AVX2, 17 of 16 registers: 40% of a
     * long prompt's attention time went there). The width changes no sum's order. */
    const int tile_width = (G + 1) * width + 1 <= VECTOR_REGISTERS || width == 1 ? width : width / 2;
    /* The first query of the block has the earliest window. */
    for (int t0 = window_start((int)lens[0], window) / KV_TILE * KV_TILE; t0 < longest; t0 += KV_TILE) {
        const int transposed =
            count >= TRANSPOSED_KEYS_FROM && (t0 + KV_TILE <= shared_len || longest <= shared_len);
        /* The next tile's rows, every head of them, towards L2 while this one is computed. */
        if (kv_heads > 1 && count == 1 && t0 + KV_TILE < longest)
            prefetch_rows(keys.base, values.base, keys.slot_bytes, 0, kv_heads * head_bytes, slot_lists[0],
                          t0 + KV_TILE, t0 + 2 * KV_TILE < longest ? t0 + 2 * KV_TILE : longest);
        for (int h = 0; h < kv_heads; h++) {
            const kv_rows head_keys = {keys.base + h * head_bytes, keys.slot_bytes};
            const kv_rows head_values = {values.base + h * head_bytes, values.slot_bytes};
            const float *head_q = q + (size_t)h * G * head_dim;
            float *head_out = out + (size_t)h * G * head_dim;
            if (transposed) {
                const int n = t0 + KV_TILE < longest ? KV_TILE : longest - t0;
                transpose_keys(kv_dtype, head_dim, t0, n, shared_reach, head_keys, slot_lists[0], kt);
                widen_values(kv_dtype, head_dim, t0, n, shared_reach, head_values, slot_lists[0], vt);
                int i = 0;
                for (; i + SCORE_QUERIES <= count; i += SCORE_QUERIES) {
                    const int last = (int)lens[i + SCORE_QUERIES - 1], n = t0 + KV_TILE < last ? KV_TILE : last - t0;
                    if (n > 0)
                        group_scores_transposed(SCORE_QUERIES, G, head_q + (size_t)i * q_stride, q_stride, head_dim, n,
                                                scale, kt, scratch + (size_t)i * G * KV_TILE, (size_t)G * KV_TILE);
                }
                for (; i < count; i++) {
                    const int len = (int)lens[i], n = t0 + KV_TILE < len ? KV_TILE : len - t0;
                    if (n > 0)
                        group_scores_transposed(1, G, head_q + (size_t)i * q_stride, q_stride, head_dim, n, scale, kt,
                                                scratch + (size_t)i * G * KV_TILE, (size_t)G * KV_TILE);
                }
            }
            for (int i = 0; i < count; i++) {
                const int len = (int)lens[i], t1 = t0 + KV_TILE < len ? t0 + KV_TILE : len;
                const int start = window_start(len, window);
                if (t1 <= t0 || t0 + KV_TILE <= start) continue;
                float *tile = scratch + (size_t)i * G * KV_TILE, correction[MAX_GROUP];
                float *head_max = running_max + ((size_t)i * kv_heads + h) * G;
                float *head_sum = running_sum + ((size_t)i * kv_heads + h) * G;
                if (!transposed)
                    group_scores(G, kv_dtype, head_q + (size_t)i * q_stride, head_dim, t0, t1, len, scale, head_keys,
                                 slot_lists[i], tile, KV_TILE);
                for (int g = 0; g < G; g++) {
                    float *head_tile = tile + (size_t)g * KV_TILE;
                    if (softcap > 0.0f) softcap_tile(head_tile, t1 - t0, softcap);
                    for (int t = t0; t < start; t++) head_tile[t - t0] = -INFINITY; /* before the window */
                    correction[g] = softmax_tile(head_tile, t1 - t0, &head_max[g], &head_sum[g]);
                }
                const int first_tile = t0 <= start; /* the tile holding the window's first slot (0 without one) */
                if (transposed)
                    group_values(G, tile_width, SLUICE_KV_FLOAT32, tile, KV_TILE, correction, head_dim, first_tile, 0,
                                 t1 - t0, 0, widened_values, TILE_ROWS, head_out + (size_t)i * out_stride);
                else
                    group_values(G, width, kv_dtype, tile, KV_TILE, correction, head_dim, first_tile, t0, t1, len,
                                 head_values, slot_lists[i], head_out + (size_t)i * out_stride);
            }
        }
    }
    for (int i = 0; i < count; i++)
        for (int s = 0; s < kv_heads * G; s++) {
            const vec inv_sum = vset1(1.0f / running_sum[i * kv_heads * G + s]);
            float *o = out + (size_t)i * out_stride + (size_t)s * head_dim;
            for (int c = 0; c < head_dim; c += VLEN) vstore(o + c, vmul(vload(o + c), inv_sum));
        }
}

#include "prompt_attention_amx.h"

/* Any head_dim and group: one head of one query at a time, scalar. */
static void attend_head_scalar(const float *qh, int kv_dtype, int head_dim, int len, float scale, int window,
                               float softcap, kv_rows keys, kv_rows values, const int64_t *req_slots, float *scores,
                               float *oh) {
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    const int start = window_start(len, window);
    for (int t = start; t < len; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        float dot = 0.0f;
        for (int i = 0; i < head_dim; i++) dot += qh[i] * load_kv1(kt + i * elem, kv_dtype);
        scores[t - start] = softcap > 0.0f ? softcap * tanhf(dot * scale / softcap) : dot * scale;
    }
    softmax(scores, len - start);
    for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
    for (int t = start; t < len; t++) {
        const char *vt = kv_row(values, req_slots, t);
        for (int i = 0; i < head_dim; i++) oh[i] += scores[t - start] * load_kv1(vt + i * elem, kv_dtype);
    }
}

/* Splits the queries into blocks: runs of consecutive positions of one request, at most
 * QUERY_BLOCK long (a decode step, slot_rows NULL, is one query per block), all on tiles or
 * none (tile_rows: NULL, or a flag a query; tile_block long on tiles). */
static int query_blocks(int queries, const int64_t *slot_rows, const int64_t *seq_lens, const uint8_t *tile_rows,
                        int tile_block, int *starts) {
    int blocks = 0;
    for (int r = 0; r < queries;) {
        int count = 1;
        const int cap = tile_rows != NULL && tile_rows[r] ? tile_block : QUERY_BLOCK;
        while (slot_rows != NULL && count < cap && r + count < queries &&
               slot_rows[r + count] == slot_rows[r] && seq_lens[r + count] == seq_lens[r] + count &&
               (tile_rows == NULL || !tile_rows[r + count] == !tile_rows[r]))
            count++;
        starts[blocks++] = r;
        r += count;
    }
    starts[blocks] = queries;
    return blocks;
}

/* The row of `slots` that query i reads. */
static inline const int64_t *query_slots(const int64_t *slots, const int64_t *slot_rows, int max_len, int i) {
    return slots + (size_t)(slot_rows != NULL ? slot_rows[i] : i) * max_len;
}

/* How many slots two slot lists have in common from the start, in whole tiles, up to `len`. */
static int common_tiles(const int64_t *a, const int64_t *b, int len) {
    int t = 0;
    while (t + KV_TILE <= len && memcmp(a + t, b + t, KV_TILE * sizeof(int64_t)) == 0) t += KV_TILE;
    return t;
}

/* Runs of one-query blocks (decode steps of different requests) whose slot lists start with
 * MIN_SHARED_SLOTS or more of the same slots (their prompts' common prefix in the radix
 * cache) become one block of at most `cap` queries, so the tiles they share are read and
 * widened once for all of them. shared[b]: the slots from 0 that every query of block b
 * reads in common (all of them for one request's consecutive tokens). Returns the number of
 * blocks; starts as query_blocks'. Blocks on tiles stay as they are. */
static int share_prefixes(int blocks, int *starts, int *shared, const int64_t *slots, const int64_t *slot_rows,
                          int max_len, const int64_t *seq_lens, const uint8_t *tile_rows, int cap) {
    int merged = 0;
    for (int b = 0; b < blocks;) {
        const int first = starts[b], count = starts[b + 1] - first;
        int members = 1, common = (int)seq_lens[first + count - 1];
        if (count == 1 && (tile_rows == NULL || !tile_rows[first])) {
            const int64_t *mine = query_slots(slots, slot_rows, max_len, first);
            while (b + members < blocks && members < cap && starts[b + members + 1] - starts[b + members] == 1 &&
                   (tile_rows == NULL || !tile_rows[starts[b + members]])) {
                const int other = starts[b + members];
                const int limit = common < seq_lens[other] ? common : (int)seq_lens[other];
                const int together = common_tiles(mine, query_slots(slots, slot_rows, max_len, other), limit);
                if (together < MIN_SHARED_SLOTS) break;
                common = together;
                members++;
            }
        }
        starts[merged] = first;
        shared[merged++] = common;
        b += members;
    }
    starts[merged] = starts[blocks];
    return merged;
}

/* The widest slice (in vectors) of the values that divides head_dim with at most
 * MAX_ACCUMULATORS accumulators. Reading V rows from the pool (bound by memory) the fewest
 * passes over them are fastest, even where some accumulators spill (attend_block narrows
 * the slice for rows in cache). */
static int value_width(int group, int head_dim) {
    if (group * 4 <= MAX_ACCUMULATORS && head_dim % (4 * VLEN) == 0) return 4;
    if (group * 2 <= MAX_ACCUMULATORS && head_dim % (2 * VLEN) == 0) return 2;
    return 1;
}

/* attend_block with its constants (G, value width, K/V dtype), each a function of its own (96
 * of them): the 72 of three dtypes inlined into the parallel loop below made one function of
 * 570 KB of code that took gcc 100-170 s to compile, on every build. */
typedef void (*block_function)(int count, const float *q, long q_stride, int head_dim, const int64_t *lens,
                               const int64_t *const *slot_lists, int shared_len, float scale, int window,
                               float softcap, kv_rows keys, kv_rows values, int kv_heads, float *scratch, float *out,
                               size_t out_stride);

#define BLOCK_FUNCTION(DTYPE, G, W)                                                                          \
    static __attribute__((noinline)) void block_##DTYPE##_##G##_##W(                                         \
        int count, const float *q, long q_stride, int head_dim, const int64_t *lens,                         \
        const int64_t *const *slot_lists, int shared_len, float scale, int window, float softcap, kv_rows keys, \
        kv_rows values, int kv_heads, float *scratch, float *out, size_t out_stride) {                        \
        attend_block(G, W, DTYPE, count, q, q_stride, head_dim, lens, slot_lists, shared_len, scale, window, \
                     softcap, keys, values, kv_heads, scratch, out, out_stride);                             \
    }
#define WIDTH_FUNCTIONS(DTYPE, G) BLOCK_FUNCTION(DTYPE, G, 1) BLOCK_FUNCTION(DTYPE, G, 2) BLOCK_FUNCTION(DTYPE, G, 4)
#define GROUP_FUNCTIONS(DTYPE)                                                                               \
    WIDTH_FUNCTIONS(DTYPE, 1) WIDTH_FUNCTIONS(DTYPE, 2) WIDTH_FUNCTIONS(DTYPE, 3) WIDTH_FUNCTIONS(DTYPE, 4)  \
    WIDTH_FUNCTIONS(DTYPE, 5) WIDTH_FUNCTIONS(DTYPE, 6) WIDTH_FUNCTIONS(DTYPE, 7) WIDTH_FUNCTIONS(DTYPE, 8)
GROUP_FUNCTIONS(SLUICE_KV_FLOAT32)
GROUP_FUNCTIONS(SLUICE_KV_FLOAT16)
GROUP_FUNCTIONS(SLUICE_KV_BFLOAT16)
GROUP_FUNCTIONS(SLUICE_KV_FP8_E5M2)

#define WIDTH_ROW(DTYPE, G) {block_##DTYPE##_##G##_1, block_##DTYPE##_##G##_2, block_##DTYPE##_##G##_4}
#define GROUP_ROWS(DTYPE)                                                                                    \
    {WIDTH_ROW(DTYPE, 1), WIDTH_ROW(DTYPE, 2), WIDTH_ROW(DTYPE, 3), WIDTH_ROW(DTYPE, 4),                     \
     WIDTH_ROW(DTYPE, 5), WIDTH_ROW(DTYPE, 6), WIDTH_ROW(DTYPE, 7), WIDTH_ROW(DTYPE, 8)}
/* By enum sluice_kv_dtype, G - 1 and the value width (1, 2, 4 at 0, 1, 2). */
static const block_function BLOCK_FUNCTIONS[4][MAX_GROUP][3] = {
    GROUP_ROWS(SLUICE_KV_FLOAT32), GROUP_ROWS(SLUICE_KV_FLOAT16), GROUP_ROWS(SLUICE_KV_BFLOAT16),
    GROUP_ROWS(SLUICE_KV_FP8_E5M2)};

int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale, int window,
                            float softcap, const float *q, long q_stride, const void *k_pool, const void *v_pool,
                            int kv_dtype, const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens,
                            const uint8_t *prompt_rows, float *out) {
    const int group = heads / kv_heads;
    const int vectorized = head_dim % VLEN == 0 && group >= 1 && group <= MAX_GROUP;
    const int width = value_width(group, head_dim);
    const int dtype_row = kv_dtype >= SLUICE_KV_FLOAT32 && kv_dtype <= SLUICE_KV_FP8_E5M2 ? kv_dtype : SLUICE_KV_FLOAT32;
    const block_function attend = vectorized ? BLOCK_FUNCTIONS[dtype_row][group - 1][width == 4 ? 2 : width - 1] : NULL;
    const size_t elem = sluice_kv_element_bytes(kv_dtype);
    const size_t slot_bytes = (size_t)kv_heads * head_dim * elem;
    /* Per thread: a block's tile scores and its transposed K tile, or one head's scores on the scalar path. */
    const size_t scratch_floats = vectorized ? (size_t)(QUERY_BLOCK * group + 2 * head_dim) * KV_TILE +
                                                   (size_t)2 * QUERY_BLOCK * heads
                                             : (size_t)(max_len > 0 ? max_len : 1);
    const size_t scratch_bytes = (sizeof(float) * scratch_floats + 63) / 64 * 64;
    /* The queries on tiles: the prompt rows, on a build that has them, for heads they fit. */
    const uint8_t *tile_rows = NULL;
    size_t tile_scratch = 0;
#ifdef SLUICE_AMX_BF16
    if (prompt_rows != NULL && vectorized && prompt_tiles_fit(head_dim) && amx_permitted())
        for (int i = 0; i < queries && tile_rows == NULL; i++)
            if (prompt_rows[i]) {
                prompt_tile_buffers sizes;
                tile_rows = prompt_rows, tile_scratch = prompt_tile_layout(NULL, group, head_dim, &sizes);
            }
#else
    (void)prompt_rows;
#endif
    int *starts = malloc(sizeof(int) * ((size_t)queries + 1)), *shared = malloc(sizeof(int) * (size_t)queries);
    if (starts == NULL || shared == NULL) {
        free(starts), free(shared);
        return -1;
    }
    /* Blocks on tiles as long as leaves each thread eight tasks (blocks x KV heads) or more. */
    int tile_queries = 0;
    for (int i = 0; tile_rows != NULL && i < queries; i++) tile_queries += tile_rows[i] != 0;
    int tile_block = tile_queries * kv_heads / (8 * omp_get_max_threads());
    tile_block = tile_block < MIN_TILE_QUERY_BLOCK ? MIN_TILE_QUERY_BLOCK
                 : tile_block > TILE_QUERY_BLOCK   ? TILE_QUERY_BLOCK
                                                   : tile_block;
    int blocks = query_blocks(queries, slot_rows, seq_lens, tile_rows, tile_block, starts);
    /* Requests sharing a prefix: blocks of about blocks * kv_heads / (3 * threads) queries,
     * so that each thread still gets a few tasks. */
    int cap = blocks * kv_heads / (3 * omp_get_max_threads());
    cap = cap < QUERY_BLOCK ? cap : QUERY_BLOCK;
    if (vectorized && window <= 0 && cap >= TRANSPOSED_KEYS_FROM)
        blocks = share_prefixes(blocks, starts, shared, slots, slot_rows, max_len, seq_lens, tile_rows, cap);
    else
        for (int b = 0; b < blocks; b++) shared[b] = (int)seq_lens[starts[b + 1] - 1];
    /* A task is one KV head of a block or, with blocks enough to keep every thread busy (a
     * decode step of many requests), all of its KV heads, tile by tile (attend_block): a
     * slot's row holds every head, so a tile's rows come from memory once. Each task
     * first sends the K/V rows it will read to its core's L2 at once: many misses in flight
     * instead of a few rows ahead of the arithmetic. */
    const int heads_per_task = blocks >= 4 * omp_get_max_threads() ? kv_heads : 1;
    const int head_tasks = kv_heads / heads_per_task;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = aligned_alloc(64, scratch_bytes + tile_scratch);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef SLUICE_AMX_BF16
        prompt_tile_buffers tile_buffers = {0};
        if (tile_rows != NULL && scores != NULL) {
            configure_bf16_tiles();
            prompt_tile_layout((char *)scores + scratch_bytes, group, head_dim, &tile_buffers);
        }
#endif
        /* One task per (block, KV head), or per block with all its KV heads where blocks are
         * many: the K/V rows of a group come from memory once. */
#pragma omp for schedule(dynamic) collapse(2)
        for (int b = 0; b < blocks; b++) {
            for (int task = 0; task < head_tasks; task++) {
                const int first = starts[b], count = starts[b + 1] - starts[b];
                const int64_t *lists[TILE_QUERY_BLOCK];
                for (int i = 0; i < count; i++) lists[i] = query_slots(slots, slot_rows, max_len, first + i);
                prefetch_rows(k_pool, v_pool, slot_bytes, (size_t)task * heads_per_task * head_dim * elem,
                              (size_t)heads_per_task * head_dim * elem, lists[0],
                              window_start((int)seq_lens[first], window), shared[b]);
                /* The vectorized path takes the task's heads in one call (tile by tile, every
                 * head of a tile in turn); the others one head at a time. */
                const int on_tiles = tile_rows != NULL && tile_rows[first];
                const int heads_a_call = vectorized && !on_tiles ? heads_per_task : 1;
                for (int kvh = task * heads_per_task; kvh < (task + 1) * heads_per_task; kvh += heads_a_call) {
                    if (scores == NULL) continue;
                    const float *q_first = q + (size_t)first * q_stride + (size_t)kvh * group * head_dim;
                    float *out_first = out + ((size_t)first * heads + (size_t)kvh * group) * head_dim;
                    const size_t head_offset = (size_t)kvh * head_dim * elem;
                    const kv_rows keys = {(const char *)k_pool + head_offset, slot_bytes};
                    const kv_rows values = {(const char *)v_pool + head_offset, slot_bytes};
#ifdef SLUICE_AMX_BF16
                    if (on_tiles) {
                        attend_block_tiles(group, kv_dtype, count, q_first, q_stride, head_dim, seq_lens + first,
                                           lists[0], scale, window, softcap, keys, values, tile_buffers, out_first,
                                           (size_t)heads * head_dim);
                        continue;
                    }
#endif
                    if (!vectorized) {
                        for (int i = 0; i < count; i++)
                            for (int g = 0; g < group; g++)
                                attend_head_scalar(q_first + (size_t)i * q_stride + g * head_dim, kv_dtype, head_dim,
                                                   (int)seq_lens[first + i], scale, window, softcap, keys, values,
                                                   lists[i], scores,
                                                   out_first + (size_t)i * heads * head_dim + g * head_dim);
                        continue;
                    }
                    attend(count, q_first, q_stride, head_dim, seq_lens + first, lists, shared[b], scale, window,
                           softcap, keys, values, heads_a_call, scores, out_first, (size_t)heads * head_dim);
                }
            }
        }
#ifdef SLUICE_AMX_BF16
        if (tile_rows != NULL) _tile_release();
#endif
        free(scores);
    }
    free(starts), free(shared);
    return failed ? -1 : 0;
}
