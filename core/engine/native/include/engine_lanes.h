/* Reductions across one AVX2 vector's 8 float32 lanes, for C kernels built with
 * engine.native.load_source (#include "engine_lanes.h"): lanes i and i+4 first, then i and i+2,
 * then 0 and 1 — one fixed order, so every kernel that sums this way gets the same bits. */
#ifndef ENGINE_LANES_H
#define ENGINE_LANES_H

#if defined(__AVX2__)
#include <immintrin.h>

/* the sum of a vector's 8 lanes */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* the largest of a vector's 8 lanes */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#endif
