/* Row reductions the sampler runs on every step's logits, over OpenMP's threads: a greedy step
 * of 256 rows scans 50 MB of float32 logits, which numpy's argmax does on one thread (~3.5 ms,
 * 4 % of the default model's decode step). Each row is one thread's, so its result never
 * depends on the batch. A bfloat16 head's logits are scanned as they are (a native tape cannot
 * record torch's widening of them to float32). */
#include "rows.h"
#include "engine_bf16.h"
#include "engine_split.h"
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* below this many values a call stays on one thread */
#define PARALLEL_VALUES (1 << 20)

/* value i of a float32 row, or of a bfloat16 one where `bf16` (widened exactly: the same order,
 * the same NaNs, so a bfloat16 row's first maximum is its float32 copy's) */
static inline float value_at(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline __attribute__((always_inline)) int64_t argmax_row_scalar(const void *x, int bf16, int64_t from,
                                                                       int64_t n, int64_t best) {
    float top = value_at(x, bf16, best);
    for (int64_t i = from; i < n && !isnan(top); i++) {
        float v = value_at(x, bf16, i);
        if (v > top || isnan(v)) best = i, top = v;
    }
    return best;
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* The row's first maximum from LANES lanes, lane l having kept the first maximum of positions l,
 * l + LANES, ... (a NaN replacing a number, never another NaN): the lowest index among the lanes
 * that hold the largest value, or hold a NaN where any does; then the tail from ``from`` on. */
static inline __attribute__((always_inline)) int64_t merge_lanes(const void *x, int bf16, const float *values,
                                                                 const int32_t *indices, int lanes, int64_t from,
                                                                 int64_t n) {
    int64_t result = indices[0];
    for (int l = 1; l < lanes; l++) {
        float v = values[l], b = value_at(x, bf16, result);
        int64_t index = indices[l];
        int better = isnan(v) ? (!isnan(b) || index < result) : (!isnan(b) && (v > b || (v == b && index < result)));
        if (better) result = index;
    }
    return argmax_row_scalar(x, bf16, from, n, result);
}
#endif

#if defined(__AVX512F__)
static inline __m512 lanes16(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16x16_load((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int bf16, int64_t n) {
    /* no whole vector, or indices past the lanes' int32 */
    if (n < 16 || n >= (int64_t)1 << 31) return argmax_row_scalar(x, bf16, 1, n, 0);
    const __m512i step = _mm512_set1_epi32(16);
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), where = at;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
        __m512 v = lanes16(x, bf16, i);
        __mmask16 take = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                         (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
        best = _mm512_mask_mov_ps(best, take, v);
        where = _mm512_mask_mov_epi32(where, take, at);
    }
    float values[16];
    int32_t indices[16];
    _mm512_storeu_ps(values, best);
    _mm512_storeu_si512(indices, where);
    return merge_lanes(x, bf16, values, indices, 16, i, n);
}
#elif defined(__AVX2__)
static inline __m256 lanes8(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16x8_load((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* AVX-512's loop on 8 lanes: one row of 49 152 logits from cache in ~18 us, not the scalar
 * loop's ~130 (Zen 3) */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int bf16, int64_t n) {
    if (n < 8 || n >= (int64_t)1 << 31) return argmax_row_scalar(x, bf16, 1, n, 0);
    const __m256i step = _mm256_set1_epi32(8);
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = at;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8, at = _mm256_add_epi32(at, step)) {
        __m256 v = lanes8(x, bf16, i);
        __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                                   _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q)));
        best = _mm256_blendv_ps(best, v, take);
        where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), take));
    }
    float values[8];
    int32_t indices[8];
    _mm256_storeu_ps(values, best);
    _mm256_storeu_si256((__m256i *)indices, where);
    return merge_lanes(x, bf16, values, indices, 8, i, n);
}
#else
static inline int64_t argmax_row(const void *x, int bf16, int64_t n) { return argmax_row_scalar(x, bf16, 1, n, 0); }
#endif

void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    FOR_ROWS(rows > 1 && rows * n >= PARALLEL_VALUES, r, rows, out[r] = argmax_row(x + r * stride, 0, n));
}

void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    FOR_ROWS(rows > 1 && rows * n >= PARALLEL_VALUES, r, rows, out[r] = argmax_row(x + r * stride, 1, n));
}
