/* attention.c's math for a bf16 cache on AVX512_BF16 (vdpbf16ps: two bf16 products a lane,
 * exact, added to a float32 sum): included once, inside attention.c's AVX-512 section.
 *
 * Scores. Each 16-key group of a block is read once for a row's query vectors: four keys' rows
 * are interleaved within each 128-bit lane (two unpacks, lane_transpose4), so that lane L holds
 * the four keys' bf16 pair at one position of that lane, and vdpbf16ps against the query pair
 * of that position broadcast within the lane adds whole products per key. A vector's four
 * partial sums a key (one per lane) then meet in 9 cross-lane operations per 16 keys, where a
 * product per key needs a 16-lane reduction (sum16, ~45 operations per 16 keys): per vector,
 * half the instructions and no reduction chain per key.
 *
 * Values. A chunk's probabilities are rounded to bf16 by the softmax step, which sums the
 * rounded values, so that the output is a convex combination of the values whatever the
 * rounding (the values themselves are bf16 already). Two tokens' values are interleaved
 * (unpacklo/hi_epi16: pairs (v_t[d], v_t+1[d])) and added to the accumulators by vdpbf16ps
 * against the two tokens' probabilities broadcast as one pair: half the multiply-adds of the
 * float32 path (one FMA per token, vector and 16 dimensions) and no widening. The accumulators hold
 * each 32 dimensions in the unpacks' order (lo: 8L + 0..3, hi: 8L + 4..7 for lane L), put
 * back in order once, when a row is stored (store_row_bf16_pairs).
 *
 * head_dim a multiple of 16: a last 16 dimensions are read with masks, the rest of their
 * registers zeros. */

/* r0..r3: four keys' rows; x[k], lane L: the four keys' pair 4L + k */
static inline void lane_transpose4(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i x[4]) {
    __m512i a = _mm512_unpacklo_epi32(r0, r1), b = _mm512_unpackhi_epi32(r0, r1);
    __m512i c = _mm512_unpacklo_epi32(r2, r3), d = _mm512_unpackhi_epi32(r2, r3);
    x[0] = _mm512_unpacklo_epi64(a, c);
    x[1] = _mm512_unpackhi_epi64(a, c);
    x[2] = _mm512_unpacklo_epi64(b, d);
    x[3] = _mm512_unpackhi_epi64(b, d);
}

/* lane g, element e of the result: the sum of a_g's four lanes' element e (keys 4g + e) */
static inline __m512 lanes4_sum(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Up to ROW_SET vectors against one group of n (≤ 16) keys, 32 dimensions (16 pairs) at a time.
 * Three vectors' 12 sums, the 16 interleaved keys and a query register fit the 32 registers. */
#define ROW_SET 3
static inline __attribute__((always_inline)) void scores_pairs_group(const uint16_t *q, int64_t vn,
                                                                     const uint16_t *keys, int64_t n, int64_t dim,
                                                                     float scale, float *scores, int64_t stride) {
    __m512 acc[ROW_SET][4];
    for (int j = 0; j < ROW_SET; j++)
        for (int g = 0; g < 4; g++) acc[j][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 32) {
        __mmask32 words = c + 32 <= dim ? 0xFFFFFFFFu : 0xFFFFu;
        __m512i x[4][4];
        for (int g = 0; g < 4; g++) {
            __m512i r[4];
            for (int e = 0; e < 4; e++)
                r[e] = 4 * g + e < n ? _mm512_maskz_loadu_epi16(words, keys + (4 * g + e) * dim + c)
                                     : _mm512_setzero_si512();
            lane_transpose4(r[0], r[1], r[2], r[3], x[g]);
        }
        for (int j = 0; j < ROW_SET && j < vn; j++) {
            __m512i pairs = _mm512_maskz_loadu_epi16(words, q + j * dim + c);
            for (int k = 0; k < 4; k++) {
                __m512bh qk = (__m512bh)_mm512_shuffle_epi32(pairs, (_MM_PERM_ENUM)(k * 0x55));
                for (int g = 0; g < 4; g++) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], (__m512bh)x[g][k], qk);
            }
        }
    }
    for (int j = 0; j < ROW_SET && j < vn; j++)
        _mm512_mask_storeu_ps(scores + j * stride, first_lanes(n),
                              _mm512_mul_ps(lanes4_sum(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                                            _mm512_set1_ps(scale)));
}

static inline __attribute__((always_inline)) void scores_pairs_body(const uint16_t *q, int64_t nv,
                                                                    const uint16_t *keys, int64_t count,
                                                                    int64_t dim, float scale, float *scores,
                                                                    int64_t stride) {
    for (int64_t t0 = 0; t0 < count; t0 += 16)
        for (int64_t j = 0; j < nv; j += ROW_SET)
            scores_pairs_group(q + j * dim, nv - j, keys + t0 * dim, count - t0 < 16 ? count - t0 : 16, dim, scale,
                               scores + j * stride + t0, stride);
}

/* The scores of a row's nv query vectors (dim apart) against count keys (dim apart): vector
 * j's at scores + j · stride. dim a constant for the common head sizes, so the loops unroll. */
static void scores_row_bf16_pairs(const uint16_t *q, int64_t nv, const uint16_t *keys, int64_t count, int64_t dim,
                                  float scale, float *scores, int64_t stride) {
    if (dim == 64) scores_pairs_body(q, nv, keys, count, 64, scale, scores, stride);
    else if (dim == 128) scores_pairs_body(q, nv, keys, count, 128, scale, scores, stride);
    else scores_pairs_body(q, nv, keys, count, dim, scale, scores, stride);
}

/* softmax_step_simd that also writes the probabilities rounded to bf16 (probs16) and sums the
 * rounded values */
static float softmax_step_bf16_pairs(float *scores, uint16_t *probs16, int64_t count, float *max, float *sum) {
    float new_max = running_max_simd(scores, count, *max);
    float correction = expf(*max - new_max);
    __m512 shift = _mm512_set1_ps(new_max), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
        __mmask16 live = first_lanes(count - t);
        __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), shift)));
        __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
        _mm256_mask_storeu_epi16(probs16 + t, live, rounded);
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
    *sum = *sum * correction + _mm512_reduce_add_ps(total);
    *max = new_max;
    return correction;
}

/* nv (1-4) vectors of a row against `width` (64, 32 or 16) dimensions at d of count tokens'
 * values; for 16 the low 8 lanes of each of the two registers are kept (at acc + d, + d + 8) */
static inline __attribute__((always_inline)) void values_pairs_tile(float *acc, const float *correction,
                                                                    const uint16_t *probs, int64_t stride,
                                                                    const uint16_t *values, int64_t count,
                                                                    int64_t dim, int64_t d, const int nv,
                                                                    const int width) {
    const int halves = width == 64 ? 2 : 1, regs = 2 * halves, step = width == 16 ? 8 : 16;
    const __mmask16 kept = width == 16 ? 0x00FF : 0xFFFF;
    const __mmask32 words = width == 16 ? 0xFFFFu : 0xFFFFFFFFu;
    __m512 a[4][4];
    for (int j = 0; j < nv; j++)
        for (int r = 0; r < regs; r++)
            a[j][r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(kept, acc + j * dim + d + step * r),
                                    _mm512_set1_ps(correction[j]));
    for (int64_t t = 0; t < count; t += 2) {
        int pair = t + 1 < count; /* a last token alone is paired with zeros */
        __m512i u[4];
        for (int h = 0; h < halves; h++) {
            __m512i v0 = _mm512_maskz_loadu_epi16(words, values + t * dim + d + 32 * h);
            __m512i v1 = pair ? _mm512_maskz_loadu_epi16(words, values + (t + 1) * dim + d + 32 * h)
                              : _mm512_setzero_si512();
            u[2 * h] = _mm512_unpacklo_epi16(v0, v1);
            u[2 * h + 1] = _mm512_unpackhi_epi16(v0, v1);
        }
        for (int j = 0; j < nv; j++) {
            uint32_t p2 = probs[j * stride + t];
            if (pair) p2 |= (uint32_t)probs[j * stride + t + 1] << 16;
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)p2);
            for (int r = 0; r < regs; r++) a[j][r] = _mm512_dpbf16_ps(a[j][r], (__m512bh)u[r], p);
        }
    }
    for (int j = 0; j < nv; j++)
        for (int r = 0; r < regs; r++) _mm512_mask_storeu_ps(acc + j * dim + d + step * r, kept, a[j][r]);
}

static inline __attribute__((always_inline)) void values_pairs_piece(float *acc, const float *correction,
                                                                     const uint16_t *probs, int64_t stride,
                                                                     const uint16_t *values, int64_t count,
                                                                     int64_t dim, int64_t d, int64_t nv,
                                                                     const int width) {
    switch (nv) {
    case 4: values_pairs_tile(acc, correction, probs, stride, values, count, dim, d, 4, width); break;
    case 3: values_pairs_tile(acc, correction, probs, stride, values, count, dim, d, 3, width); break;
    case 2: values_pairs_tile(acc, correction, probs, stride, values, count, dim, d, 2, width); break;
    default: values_pairs_tile(acc, correction, probs, stride, values, count, dim, d, 1, width);
    }
}

/* acc[j] = acc[j] · correction[j] + Σ_t probs16[j · stride + t] · values[t] for a row's
 * vectors j < vectors (acc rows dim apart, in pair order) */
static void accumulate_row_bf16_pairs(float *acc, const float *correction, const uint16_t *probs, int64_t stride,
                                      const uint16_t *values, int64_t count, int64_t dim, int64_t vectors) {
    for (int64_t j = 0; j < vectors; j += 4) {
        int64_t nv = vectors - j < 4 ? vectors - j : 4, d = 0;
        float *a = acc + j * dim;
        const float *c = correction + j;
        const uint16_t *p = probs + j * stride;
        for (; d + 64 <= dim; d += 64) values_pairs_piece(a, c, p, stride, values, count, dim, d, nv, 64);
        if (d + 32 <= dim) values_pairs_piece(a, c, p, stride, values, count, dim, d, nv, 32), d += 32;
        if (d < dim) values_pairs_piece(a, c, p, stride, values, count, dim, d, nv, 16);
    }
}

/* store_row_bf16 of an accumulator row in pair order */
static inline void store_row_bf16_pairs(uint16_t *dst, const float *src, float inv, int64_t dim) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i last = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    float row[MAX_HEAD_DIM];
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {
        __m512 lo = _mm512_loadu_ps(src + d), hi = _mm512_loadu_ps(src + d + 16);
        _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
    if (d < dim) _mm512_storeu_ps(row + d, _mm512_permutexvar_ps(last, _mm512_loadu_ps(src + d)));
    store_row_bf16(dst, row, inv, dim);
}
