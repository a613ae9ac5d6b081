/* Vector math shared by the kernels (AVX2 + FMA; 512-bit forms where the build has AVX-512). */
#ifndef SLUICE_VECTOR_MATH_H
#define SLUICE_VECTOR_MATH_H

#include <immintrin.h>
#include <math.h>

#define LOG2E 1.44269504f

/* exp of 8 floats: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 Taylor
 * polynomial (relative error ~1e-7 there), then scaling by 2^n through the exponent bits.
 * Inputs are clamped to [-87, 88]: below, the result is ~0 instead of a denormal. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

#ifdef __AVX512F__
/* exp of 16 floats, the same steps as exp256. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

/* 2^x of 16 floats, x <= 0 (clamped at -126; -inf gives 2^-126, which only ever multiplies
 * sums of 0): 2^n 2^f with n = round(x), |f| <= 1/2 and 2^f by its degree-5 Taylor
 * polynomial in f ln 2 (relative error under 3.3e-6: for weights rounded to bf16 after, as the
 * prompt softmax on tiles rounds them). */
static inline __m512 exp2_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* The gated MLP's product of one row: out[i] = gate[i] * sigmoid(a) * up[i], a = gate for silu;
 * for GELU's tanh form gelu(x) = x (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (x + 0.044715 x^3),
 * which is x sigmoid(2u), a = 2u. Eight at a time, the last width % 8 one by one (exp's
 * argument clamped as exp256 does): an element's bits depend on its own two inputs and on
 * whether it falls in the row's scalar tail, so callers that keep the row's width agree. */
static inline void gated_row(int width, const float *gate, const float *up, float *out, int gelu) {
    const float c1 = 1.5957691216f, c3 = 0.0713548162f; /* 2 sqrt(2 / pi) and that times 0.044715 */
    int i = 0;
    for (; i + 8 <= width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 a = gelu ? _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(c3), _mm256_set1_ps(c1))) : g;
        const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), a)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, denominator), _mm256_loadu_ps(up + i)));
    }
    for (; i < width; i++) {
        const float a = gelu ? gate[i] * fmaf(gate[i] * gate[i], c3, c1) : gate[i];
        out[i] = gate[i] / (1.0f + expf(fminf(-a, 88.0f))) * up[i];
    }
}

#endif
