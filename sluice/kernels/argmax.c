/* The index of each row's largest value: the first of equal ones, a NaN counting as the
 * largest (the first NaN's index), as torch.argmax gives it.
 *
 * Greedy sampling takes the argmax of every row of the logits; torch's CPU argmax over 32
 * rows of a 49,152-token vocabulary takes 2-3 ms (a scalar reduction), ten times its max.
 * Here: one vector pass for the maximum (and whether a NaN is there), one for where it is.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

static int64_t argmax_row(const float *x, int n) {
    __m256 best = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        best = _mm256_max_ps(best, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float largest = lanes[0];
    for (int lane = 1; lane < 8; lane++) largest = lanes[lane] > largest ? lanes[lane] : largest;
    int has_nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < n; i++) {
        if (isnan(x[i])) has_nan = 1;
        else if (x[i] > largest) largest = x[i];
    }
    if (has_nan) {
        for (i = 0; i < n; i++)
            if (isnan(x[i])) return i;
    }
    const __m256 target = _mm256_set1_ps(largest);
    for (i = 0; i + 8 <= n; i += 8) {
        const int equal = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (equal) return i + __builtin_ctz(equal);
    }
    for (; i < n; i++)
        if (x[i] == largest) return i;
    return 0; /* not reached: some value equals the largest */
}

/* out[r] = argmax of x[r * cols .. r * cols + cols) for r < rows. */
void sluice_argmax_rows(int rows, int cols, const float *x, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * cols, cols);
}
