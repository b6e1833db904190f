/* exp(x) on 16 float32 lanes (8 on AVX2: exp8) for C kernels built with engine.native.load_source
 * (#include "engine_exp.h"): 2^(x·log2 e) as 2^round · 2^frac, 2^frac by its degree-6 Taylor
 * polynomial on [-0.5, 0.5] (relative error ~1e-7). Below -87 it is 0; above 88 it stays at
 * exp(88) (~1.6e38), so 1 / (1 + exp(x)) and the like never meet an infinity. */
#ifndef ENGINE_EXP_H
#define ENGINE_EXP_H

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 y = _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.540353e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}
#endif

/* on AVX-512 machines too: a kernel with an 8-lane path (mla.c) builds it there as well */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the same on 8 lanes: the same polynomial, 2^n built in the exponent bits (n in [-126, 127]) */
static inline __m256 exp8(__m256 x) {
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 y = _mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f));
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(1.540353e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.333355e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550411e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}
#endif

#endif
