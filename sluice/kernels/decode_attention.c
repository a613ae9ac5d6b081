/* Attention of query tokens over their cached K/V, read in place from the token-granular
 * pool through each request's slot list (no gather copy); float32 arithmetic over K/V
 * stored as float32, float16 or bfloat16 (kv_dtype, enum sluice_kv_dtype).
 *
 * q   [queries] rows of q_stride floats, each holding [heads, head_dim] first
 * out [queries, heads, head_dim]
 * k/v pool [slots, kv_heads, head_dim]     slots [requests, max_len] (int64, padded)
 * slot_rows [queries]: the row of `slots` each query reads (NULL: query i reads row i, one
 * query per request, a decode step); seq_lens [queries]: how many of those slots it sees.
 * Query heads h * group .. h * group + group - 1 share KV head h (grouped-query attention).
 *
 * Every query is computed the same way, whatever else is in the call: its slots in tiles of
 * KV_TILE from position 0, each tile's scores, an online softmax (the running maximum and
 * sum rescale what came before, as in flash attention), and its values accumulated token
 * by token. A prompt token at position p is thus computed exactly as a decode step at p
 * would be, so a request's results do not depend on how its prompt was split into chunks,
 * on its cached prefix or on its batch neighbours.
 *
 * What is shared is memory traffic. A decode step reads all of its requests' cached K/V, so
 * it is bound by memory: the query heads of a group are done together, each K and V row read
 * once for all of them, and a 16-bit pool halves the bytes. A prompt's consecutive tokens go
 * in blocks of up to QUERY_BLOCK queries that walk the K/V rows in tiles of KV_TILE: a tile
 * comes from memory once and serves the whole block from L1, where one query at a time
 * would stream a long prompt's K/V from L3 once per token.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUP 8
#define QUERY_BLOCK 16 /* consecutive queries of one request sharing each K/V tile */
#define KV_TILE 64     /* K/V rows a block walks together: 16 KB of float32 at head_dim 64 */
/* Tokens ahead whose K/V rows are prefetched: a slot list is not a stream the hardware
 * prefetcher follows across pages (measured: -30% time at 128 cached tokens). */
#define PREFETCH_AHEAD 8

/* The vector width of this build: 16 floats with AVX-512, 8 with AVX2. A head's dot products
 * and value sums run VLEN lanes at a time, so the two builds sum in different orders (their
 * attention agrees to rounding, not bit for bit; within a build every query is computed the
 * same way). */
#ifdef SLUICE_AVX512_VNNI
#define VLEN 16
#define MAX_ACCUMULATORS 24 /* of 32 registers */
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vfmadd _mm512_fmadd_ps
#define vexp exp512
ALWAYS_INLINE __m256 half_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
ALWAYS_INLINE float vreduce_max(__m512 v) { return _mm512_reduce_max_ps(v); }
ALWAYS_INLINE __m512 load_kv(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case SLUICE_KV_BFLOAT16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    default: return _mm512_loadu_ps((const float *)p);
    }
}
#else
#define VLEN 8
#define MAX_ACCUMULATORS 12 /* of 16 registers */
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vfmadd _mm256_fmadd_ps
#define vexp exp256
ALWAYS_INLINE __m256 half_sum(__m256 v) { return v; }
ALWAYS_INLINE float vreduce_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
ALWAYS_INLINE __m256 load_kv(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case SLUICE_KV_BFLOAT16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    default: return _mm256_loadu_ps((const float *)p);
    }
}
#endif

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
static float softmax_tile(float *s, int n, float *running_max, float *running_sum) {
    vec maxes = vset1(-INFINITY);
    int t = 0;
    for (; t + VLEN <= n; t += VLEN) maxes = vmax(maxes, vload(s + t));
    float tile_max = vreduce_max(maxes);
    for (; t < n; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
    const float new_max = tile_max > *running_max ? tile_max : *running_max;
    const float correction = expf(*running_max - new_max); /* 0 for the first tile (-inf) */
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

/* Element size of a KV pool's dtype. */
static inline size_t kv_element_bytes(int kv_dtype) { return kv_dtype == SLUICE_KV_FLOAT32 ? 4 : 2; }

ALWAYS_INLINE float load_kv1(const char *p, const int kv_dtype) {
    switch (kv_dtype) {
    case SLUICE_KV_FLOAT16: return _cvtsh_ss(*(const uint16_t *)p);
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

/* scores[g * stride + t - t0] = scale * q_g . k_t for t in [t0, t1), the G heads of one
 * group (head_dim % VLEN == 0). Rows up to `len` may be prefetched. */
ALWAYS_INLINE void group_scores(const int G, const int kv_dtype, const float *q, int head_dim, int t0, int t1, int len,
                                float scale, kv_rows keys, const int64_t *req_slots, float *scores, size_t stride) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int t = t0; t < t1; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        if (t + PREFETCH_AHEAD < len) prefetch_row(kv_row(keys, req_slots, t + PREFETCH_AHEAD), head_dim * elem);
        vec acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = vzero();
        for (int i = 0; i < head_dim; i += VLEN) {
            const vec k = load_kv(kt + i * elem, kv_dtype);
            for (int g = 0; g < G; g++) acc[g] = vfmadd(vload(q + g * head_dim + i), k, acc[g]);
        }
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int n = G - g0 < 4 ? G - g0 : 4;
            const vec zero = vzero();
            float sums[4];
            _mm_storeu_ps(sums, _mm_mul_ps(vsum4(acc[g0], n > 1 ? acc[g0 + 1] : zero, n > 2 ? acc[g0 + 2] : zero,
                                                 n > 3 ? acc[g0 + 3] : zero),
                                           _mm_set1_ps(scale)));
            for (int g = 0; g < n; g++) scores[(size_t)(g0 + g) * stride + (t - t0)] = sums[g];
        }
    }
}

/* out_g = out_g * correction_g + sum_t p_g[t - t0] * v_t over t in [t0, t1) (out_g starts
 * at zero when t0 is 0), a slice of `width` vectors of the head at a time with the G heads'
 * slices in registers (G * width <= MAX_ACCUMULATORS leaves room for the V vectors). */
ALWAYS_INLINE void group_values(const int G, const int width, const int kv_dtype, const float *p, size_t stride,
                                const float *correction, int head_dim, int t0, int t1, int len, kv_rows values,
                                const int64_t *req_slots, float *out) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int c = 0; c < head_dim; c += VLEN * width) {
        vec acc[MAX_GROUP][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < width; j++)
                acc[g][j] = t0 == 0 ? vzero() : vmul(vload(out + g * head_dim + c + VLEN * j), vset1(correction[g]));
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

/* A block of `count` consecutive queries of one request (lens[i] = lens[0] + i) against one
 * KV head, tile by tile: scores, online softmax, values; then each head's values divided by
 * its softmax sum. scratch: count * G * KV_TILE floats. */
ALWAYS_INLINE void attend_block(const int G, const int width, const int kv_dtype, int count, const float *q,
                                long q_stride, int head_dim, const int64_t *lens, float scale, kv_rows keys,
                                kv_rows values, const int64_t *req_slots, float *scratch, float *out,
                                size_t out_stride) {
    float running_max[QUERY_BLOCK][MAX_GROUP], running_sum[QUERY_BLOCK][MAX_GROUP];
    for (int i = 0; i < count; i++)
        for (int g = 0; g < G; g++) running_max[i][g] = -INFINITY, running_sum[i][g] = 0.0f;
    const int longest = (int)lens[count - 1];
    for (int t0 = 0; t0 < longest; t0 += KV_TILE) {
        for (int i = 0; i < count; i++) {
            const int len = (int)lens[i], t1 = t0 + KV_TILE < len ? t0 + KV_TILE : len;
            if (t1 <= t0) continue;
            float *tile = scratch + (size_t)i * G * KV_TILE, correction[MAX_GROUP];
            group_scores(G, kv_dtype, q + (size_t)i * q_stride, head_dim, t0, t1, len, scale, keys, req_slots, tile,
                         KV_TILE);
            for (int g = 0; g < G; g++)
                correction[g] = softmax_tile(tile + (size_t)g * KV_TILE, t1 - t0, &running_max[i][g], &running_sum[i][g]);
            group_values(G, width, kv_dtype, tile, KV_TILE, correction, head_dim, t0, t1, len, values, req_slots,
                         out + (size_t)i * out_stride);
        }
    }
    for (int i = 0; i < count; i++)
        for (int g = 0; g < G; g++) {
            const vec inv_sum = vset1(1.0f / running_sum[i][g]);
            float *o = out + (size_t)i * out_stride + (size_t)g * head_dim;
            for (int c = 0; c < head_dim; c += VLEN) vstore(o + c, vmul(vload(o + c), inv_sum));
        }
}

/* Any head_dim and group: one head of one query at a time, scalar. */
static void attend_head_scalar(const float *qh, int kv_dtype, int head_dim, int len, float scale, kv_rows keys,
                               kv_rows values, const int64_t *req_slots, float *scores, float *oh) {
    const size_t elem = kv_element_bytes(kv_dtype);
    for (int t = 0; t < len; t++) {
        const char *kt = kv_row(keys, req_slots, t);
        float dot = 0.0f;
        for (int i = 0; i < head_dim; i++) dot += qh[i] * load_kv1(kt + i * elem, kv_dtype);
        scores[t] = dot * scale;
    }
    softmax(scores, len);
    for (int i = 0; i < head_dim; i++) oh[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const char *vt = kv_row(values, req_slots, t);
        for (int i = 0; i < head_dim; i++) oh[i] += scores[t] * load_kv1(vt + i * elem, kv_dtype);
    }
}

/* Splits the queries into blocks: runs of consecutive positions of one request, at most
 * QUERY_BLOCK long (a decode step, slot_rows NULL, is one query per block). */
static int query_blocks(int queries, const int64_t *slot_rows, const int64_t *seq_lens, int *starts) {
    int blocks = 0;
    for (int r = 0; r < queries;) {
        int count = 1;
        while (slot_rows != NULL && count < QUERY_BLOCK && r + count < queries &&
               slot_rows[r + count] == slot_rows[r] && seq_lens[r + count] == seq_lens[r] + count)
            count++;
        starts[blocks++] = r;
        r += count;
    }
    starts[blocks] = queries;
    return blocks;
}

/* The widest slice (in vectors) that divides head_dim and keeps the accumulators in registers. */
static int value_width(int group, int head_dim) {
    if (group * 4 <= MAX_ACCUMULATORS && head_dim % (4 * VLEN) == 0) return 4;
    if (group * 2 <= MAX_ACCUMULATORS && head_dim % (2 * VLEN) == 0) return 2;
    return 1;
}

/* One block of the group's query heads, with G, the value width and the dtype constants. */
#define BLOCK_CALL(G, W, DTYPE)                                                                             \
    attend_block(G, W, DTYPE, count, q_first, q_stride, head_dim, seq_lens + first, scale, keys, values,   \
                 req_slots, scores, out_first, (size_t)heads * head_dim)
#define WIDTH_SWITCH(G, DTYPE)                                                                              \
    case G:                                                                                                 \
        if (width == 4) BLOCK_CALL(G, 4, DTYPE);                                                            \
        else if (width == 2) BLOCK_CALL(G, 2, DTYPE);                                                       \
        else BLOCK_CALL(G, 1, DTYPE);                                                                       \
        break;
#define GROUP_SWITCH(DTYPE)                                                                                 \
    switch (group) {                                                                                        \
        WIDTH_SWITCH(1, DTYPE) WIDTH_SWITCH(2, DTYPE) WIDTH_SWITCH(3, DTYPE) WIDTH_SWITCH(4, DTYPE)         \
        WIDTH_SWITCH(5, DTYPE) WIDTH_SWITCH(6, DTYPE) WIDTH_SWITCH(7, DTYPE) WIDTH_SWITCH(8, DTYPE)         \
    }

int sluice_decode_attention(int queries, int heads, int kv_heads, int head_dim, int max_len, float scale,
                            const float *q, long q_stride, const void *k_pool, const void *v_pool, int kv_dtype,
                            const int64_t *slots, const int64_t *slot_rows, const int64_t *seq_lens, float *out) {
    const int group = heads / kv_heads;
    const int vectorized = head_dim % VLEN == 0 && group <= MAX_GROUP;
    const int width = value_width(group, head_dim);
    const size_t elem = kv_element_bytes(kv_dtype);
    const size_t slot_bytes = (size_t)kv_heads * head_dim * elem;
    /* Per thread: a block's tile scores, or one head's scores on the scalar path. */
    const size_t scratch_floats = vectorized ? (size_t)QUERY_BLOCK * group * KV_TILE : (size_t)(max_len > 0 ? max_len : 1);
    int *starts = malloc(sizeof(int) * ((size_t)queries + 1));
    if (starts == NULL) return -1;
    const int blocks = query_blocks(queries, slot_rows, seq_lens, starts);
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * scratch_floats);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* One task per (block, KV head): the K/V rows of a group come from memory once. */
#pragma omp for schedule(dynamic) collapse(2)
        for (int b = 0; b < blocks; b++) {
            for (int kvh = 0; kvh < kv_heads; kvh++) {
                if (scores == NULL) continue;
                const int first = starts[b], count = starts[b + 1] - starts[b];
                const int64_t *req_slots = slots + (size_t)(slot_rows != NULL ? slot_rows[first] : first) * max_len;
                const float *q_first = q + (size_t)first * q_stride + (size_t)kvh * group * head_dim;
                float *out_first = out + ((size_t)first * heads + (size_t)kvh * group) * head_dim;
                const size_t head_offset = (size_t)kvh * head_dim * elem;
                const kv_rows keys = {(const char *)k_pool + head_offset, slot_bytes};
                const kv_rows values = {(const char *)v_pool + head_offset, slot_bytes};
                if (!vectorized) {
                    for (int i = 0; i < count; i++)
                        for (int g = 0; g < group; g++)
                            attend_head_scalar(q_first + (size_t)i * q_stride + g * head_dim, kv_dtype, head_dim,
                                               (int)seq_lens[first + i], scale, keys, values, req_slots, scores,
                                               out_first + (size_t)i * heads * head_dim + g * head_dim);
                    continue;
                }
                switch (kv_dtype) {
                case SLUICE_KV_FLOAT16: GROUP_SWITCH(SLUICE_KV_FLOAT16) break;
                case SLUICE_KV_BFLOAT16: GROUP_SWITCH(SLUICE_KV_BFLOAT16) break;
                default: GROUP_SWITCH(SLUICE_KV_FLOAT32) break;
                }
            }
        }
        free(scores);
    }
    free(starts);
    return failed ? -1 : 0;
}
