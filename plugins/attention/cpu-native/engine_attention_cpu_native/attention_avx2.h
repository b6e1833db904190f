/* attention.c's per-block math on AVX2 + FMA (8 lanes), for CPUs without AVX-512: included by
 * attention.c only. The same order of operations as the AVX-512 math, on half the lanes; head_dim
 * is a multiple of 16 (the backend checks), so every row is whole vectors. Scores read float32
 * only: the driver widens an item's query vectors and each block's keys once (WIDEN), as it
 * does the values, rather than once for every query vector that reads them (products and sums
 * as before, so the same bits). fp8 blocks are widened 8 lanes at a time through F16C's
 * half-precision converter where the compiler targets it (every AVX2 CPU has it), else by the
 * portable conversion. */

/* lane t = the sum of a[t]'s lanes */
static inline __m256 sum8(const __m256 a[8]) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* lanes below n set: a mask for maskload / maskstore */
static inline __m256i first_lanes8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* scores[t] = scale · q · keys[t], all float32, 8 lanes a load */
static void scores_f32_avx2(const float *q, const float *keys, int64_t count, int64_t dim, float scale,
                            float *scores) {
    for (int64_t t0 = 0; t0 < count; t0 += 8) {
        __m256 acc[8];
        int64_t n = count - t0 < 8 ? count - t0 : 8;
        for (int64_t t = 0; t < 8; t++) {
            acc[t] = _mm256_setzero_ps();
            if (t >= n) continue;
            const float *k = keys + (t0 + t) * dim;
            for (int64_t d = 0; d < dim; d += 8)
                acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc[t]);
        }
        _mm256_maskstore_ps(scores + t0, first_lanes8(n), _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
    }
}

#ifdef __F16C__
/* a block of fp8 (or f16) keys or values widened into `scratch`, 8 at a time (count is whole rows of 16s) */
#define DEFINE_BLOCK_FP8_AVX2(FP8, C, OVER)                                                         \
static inline const float *block_##FP8##_avx2(const C *src, int64_t count, float *scratch) {        \
    for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(scratch + i, FP8##x8_load_##OVER(src + i)); \
    return scratch;                                                                                 \
}
DEFINE_BLOCK_FP8_AVX2(e4m3, uint8_t, over256)
DEFINE_BLOCK_FP8_AVX2(e5m2, uint8_t, over1)
DEFINE_BLOCK_FP8_AVX2(f16, uint16_t, over1)
#endif

static float softmax_step_avx2(float *scores, int64_t count, float *max, float *sum) {
    const __m256 none = _mm256_set1_ps(-INFINITY);
    __m256 top = none;
    for (int64_t t = 0; t < count; t += 8) {
        __m256i live = first_lanes8(count - t);
        top = _mm256_max_ps(top, _mm256_blendv_ps(none, _mm256_maskload_ps(scores + t, live), _mm256_castsi256_ps(live)));
    }
    float block_max = hmax8(top);
    float new_max = block_max > *max ? block_max : *max;
    float correction = expf(*max - new_max);
    __m256 shift = _mm256_set1_ps(new_max), total = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; t += 8) {
        __m256i live = first_lanes8(count - t);
        __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + t, live), shift)),
                                 _mm256_castsi256_ps(live));
        _mm256_maskstore_ps(scores + t, live, p);
        total = _mm256_add_ps(total, p);
    }
    *sum = *sum * correction + hsum8(total);
    *max = new_max;
    return correction;
}

/* head_dim in chunks of 32 (4 registers) with the tokens inner, as the AVX-512 math in 64 */
static void accumulate_avx2(float *acc, float correction, const float *probs, const float *values, int64_t count,
                            int64_t dim) {
    __m256 c = _mm256_set1_ps(correction);
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8), c);
        __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 16), c);
        __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 24), c);
        for (int64_t t = 0; t < count; t++) {
            const float *v = values + t * dim + d;
            __m256 p = _mm256_set1_ps(probs[t]);
            a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < dim; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        for (int64_t t = 0; t < count; t++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(probs[t]), _mm256_loadu_ps(values + t * dim + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
}
