/* The softmax's numerators in float32 on AVX-512, for the attention kernels beside this file (each includes it;
   native_build rebuilds them when it changes). Include after <immintrin.h>, <math.h> and <stdint.h>, where
   __AVX512F__ is defined. */
#ifndef RAYRUNNER_SOFTMAX_H
#define RAYRUNNER_SOFTMAX_H

/* exp(x) of 16 lanes, x <= 0 (scores less their maximum): Cephes' expf polynomial (~1 ulp), lanes below -87.3
   (masked positions included) 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

/* softmax's numerators in place over `n` scores (their maximum subtracted first); their sum. */
static float exponentiate(float *scores, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, scores + t));
    }
    float peak = _mm512_reduce_max_ps(top);
    if (peak == -INFINITY) peak = 0.f; /* nothing attended: every weight 0 */
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(peak);
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + t, m, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}

#endif
