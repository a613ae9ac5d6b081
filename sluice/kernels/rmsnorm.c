/* RMSNorm over the last axis of a float32 [rows, dim] matrix, optionally adding a residual
 * first (the step between attention and MLP: h += delta; out = norm(h) * w).
 *
 * torch's rms_norm on CPU is several small ops (~40 us for one 576-wide row); this is one
 * pass. Accumulates in double so the result matches torch's float32 reference closely.
 */
#include <math.h>
#include <stddef.h>

#define LANES 8 /* independent partial sums of squares: one AVX-512 register of doubles, two AVX2 ones */

static void norm_row(const float *x, const float *w, float eps, int dim, float *out) {
    /* One running sum would be a chain of dependent double adds, ~4 cycles an element (a
     * prompt step of Qwen3-0.6B spent ~8% of its time here, on its per-head q/k norms). Eight
     * lanes summed in a fixed order vectorize, with the same bits on every build (ISO C: no
     * contraction into FMAs). */
    double lanes[LANES] = {0.0};
    int i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += (double)x[i + j] * x[i + j];
    double sum_sq = 0.0;
    for (int j = 0; j < LANES; j++) sum_sq += lanes[j];
    for (; i < dim; i++) sum_sq += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(sum_sq / dim + eps));
    for (int i = 0; i < dim; i++) out[i] = x[i] * inv * w[i];
}

/* out = rmsnorm(x) * w */
void sluice_rmsnorm(int rows, int dim, const float *x, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) norm_row(x + (size_t)r * dim, w, eps, dim, out + (size_t)r * dim);
}

/* Each head's row of dim floats, x + t * token_stride + h * dim for t < tokens and h < heads,
 * normalized in place: a layer's q or k heads inside its qkv rows (Qwen3's per-head norms),
 * with no copy of them in or out. Threads only for a prompt's many tokens, as rope_store: a
 * decode step's few tokens of heads are less work than starting them. */
void sluice_rmsnorm_heads(int tokens, int heads, int dim, float *x, long token_stride, const float *w, float eps) {
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            float *row = x + (size_t)t * (size_t)token_stride + (size_t)h * dim;
            norm_row(row, w, eps, dim, row);
        }
}

/* hidden += delta (in place); out = rmsnorm(hidden) * w */
void sluice_add_rmsnorm(int rows, int dim, float *hidden, const float *delta, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        float *h = hidden + (size_t)r * dim;
        const float *d = delta + (size_t)r * dim;
        for (int i = 0; i < dim; i++) h[i] += d[i];
        norm_row(h, w, eps, dim, out + (size_t)r * dim);
    }
}
