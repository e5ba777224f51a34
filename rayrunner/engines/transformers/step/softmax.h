/* The softmax's numerators in float32 on AVX-512, for the attention kernels beside this file (each includes it;
   native_build rebuilds them when it changes): the decode rows' with a Cephes exponential, prompts' as PyTorch's
   flash attention computes them. Include after <immintrin.h>, <math.h> and <stdint.h>, where
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

/* The first `left` lanes of 16 (all of them from 16 on). */
static inline __mmask16 first_lanes(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

/* The largest of `n` scores (-inf for none). */
static inline float row_peak(const float *scores, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(n - t), scores + t));
    return _mm512_reduce_max_ps(top);
}

/* softmax's numerators in place over `n` scores (their maximum subtracted first); their sum. */
static float exponentiate(float *scores, int64_t n) {
    float peak = row_peak(scores, n);
    if (peak == -INFINITY) peak = 0.f; /* nothing attended: every weight 0 */
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(peak);
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = first_lanes(n - t);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + t, m, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}

/* exp(x) of 16 lanes as PyTorch's `Vectorized<float>::fexp_u20` computes it on AVX-512 (its flash attention's
   softmax on CPU): 2^(x log2 e) from the float32 bits, a cubic in the fraction of the power; lanes below ln(FLT_MIN)
   (-inf included) 0. */
static inline __m512 exp_as_sdpa(__m512 x) {
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32((int)0xc2aeac50)), _CMP_LT_OS);
    __mmask16 huge = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m512 power = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)));
    __m512 fraction = _mm512_sub_ps(power, _mm512_floor_ps(power));
    __m512 p = _mm512_fmadd_ps(fraction, _mm512_set1_ps(-0.079204240219773236f), _mm512_set1_ps(-0.22433836478672356f));
    p = _mm512_fmadd_ps(fraction, p, _mm512_set1_ps(0.30354260500649682f));
    p = _mm512_fmadd_ps(fraction, p, _mm512_set1_ps(0.00010703434948458272f));
    __m512 bits = _mm512_fmadd_ps(_mm512_set1_ps(8388608.f), _mm512_sub_ps(power, p), _mm512_set1_ps(1065353216.f));
    __m512i out = _mm512_cvttps_epi32(bits);
    out = _mm512_mask_mov_epi32(out, tiny, _mm512_setzero_si512());
    out = _mm512_mask_mov_epi32(out, huge, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(out);
}

/* softmax's numerators in place over the first `seen` of a row of `length` scores (the rest masked: weight 0), as
   PyTorch's flash attention on CPU computes them for a block of keys: `exp_as_sdpa` over the row's whole vectors of
   16, their lanes summed and reduced, then glibc's expf over the row's last `length % 16` positions, added in order;
   their sum. */
static float exponentiate_as_sdpa(float *scores, int64_t seen, int64_t length) {
    int64_t whole = length / 16 * 16, vectors = seen < whole ? seen : whole;
    float peak = row_peak(scores, seen);
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(peak);
    for (int64_t t = 0; t < vectors; t += 16) {
        __mmask16 m = first_lanes(vectors - t);
        __m512 e = _mm512_maskz_mov_ps(m, exp_as_sdpa(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift)));
        _mm512_mask_storeu_ps(scores + t, m, e);
        total = _mm512_add_ps(total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    for (int64_t t = whole; t < seen; t++) {
        scores[t] = expf(scores[t] - peak);
        sum += scores[t];
    }
    return sum;
}

#endif
