/* kernels.c's kernels for one storage type: included once per type, with SUFFIX (bf16, f32),
 * T (its C type), LOAD and STORE (the type to and from float) defined, which it undefines
 * again; TYPED(name) is name_<SUFFIX>. A file rather than a macro, so that compiler messages
 * and debuggers see its own lines. */

/* ---- (residual add +) RMSNorm, rotary embedding ----------------------------------------- */

/* The norm and rotary rows in 16 lanes, where the CPU has AVX-512, and the norms in 8 on AVX2 +
 * FMA (each returns how many of the row's values it handled: all of them on AVX-512, the whole
 * vectors on AVX2, none in the portable build); the same roundings as the scalar loops, in the
 * same order but for the sum of squares. */
#if VECTOR_PASSES
/* residual += x (rounded); *sum_sq = Σ residual² */
static int64_t TYPED(add_sum_sq_vector)(const T *xr, T *rr, int64_t hidden, float *sum_sq) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        __mmask16 m = tail_mask(hidden - i);
        __m512 v = TYPED(vround)(_mm512_add_ps(TYPED(vload)(xr + i, m), TYPED(vload)(rr + i, m)));
        TYPED(vstore)(rr + i, v, m);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    *sum_sq = _mm512_reduce_add_ps(acc);
    return hidden;
}
static int64_t TYPED(sum_sq_vector)(const T *xr, int64_t hidden, float *sum_sq) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        __m512 v = TYPED(vload)(xr + i, tail_mask(hidden - i));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    *sum_sq = _mm512_reduce_add_ps(acc);
    return hidden;
}
/* out = src · inv · weight */
static int64_t TYPED(scale_vector)(const T *src, float inv, const T *weight, int64_t hidden, T *out) {
    __m512 s = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < hidden; i += 16) {
        __mmask16 m = tail_mask(hidden - i);
        TYPED(vstore)(out + i, _mm512_mul_ps(_mm512_mul_ps(TYPED(vload)(src + i, m), s),
                                             TYPED(vload)(weight + i, m)), m);
    }
    return hidden;
}
/* a head's values as float32 into x */
static int64_t TYPED(widen_vector)(const T *head, int64_t dim, float *x) {
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = tail_mask(dim - i);
        _mm512_mask_storeu_ps(x + i, m, TYPED(vload)(head + i, m));
    }
    return dim;
}
/* the rotation, when each half of the head is whole vectors */
static int64_t TYPED(rotate_vector)(T *head, const float *x, int64_t dim, const T *c, const T *s) {
    int64_t half = dim / 2;
    if (half % 16) return 0;
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i), rolled = _mm512_loadu_ps(x + (i < half ? i + half : i - half));
        __m512 scaled = TYPED(vround)(_mm512_mul_ps(v, TYPED(vload)(c + i, 0xFFFF)));
        TYPED(vstore)(head + i, _mm512_add_ps(scaled, _mm512_mul_ps(rolled, TYPED(vload)(s + i, 0xFFFF))), 0xFFFF);
    }
    return dim;
}
#else
#if AVX2_PASSES
/* The norms in 8 lanes, whole vectors only: each returns the prefix it handled, the caller's
 * scalar loop takes the rest (3x the scalar loops, whose sum of squares the compiler leaves
 * scalar). */
static int64_t TYPED(add_sum_sq_vector)(const T *xr, T *rr, int64_t hidden, float *sum_sq) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8) {
        __m256 v = TYPED(vround8)(_mm256_add_ps(TYPED(vload8)(xr + i), TYPED(vload8)(rr + i)));
        TYPED(vstore8)(rr + i, v);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    *sum_sq = hsum8(acc);
    return i;
}
static int64_t TYPED(sum_sq_vector)(const T *xr, int64_t hidden, float *sum_sq) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8) {
        __m256 v = TYPED(vload8)(xr + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    *sum_sq = hsum8(acc);
    return i;
}
static int64_t TYPED(scale_vector)(const T *src, float inv, const T *weight, int64_t hidden, T *out) {
    __m256 s = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8)
        TYPED(vstore8)(out + i, _mm256_mul_ps(_mm256_mul_ps(TYPED(vload8)(src + i), s), TYPED(vload8)(weight + i)));
    return i;
}
#else
static int64_t TYPED(add_sum_sq_vector)(const T *xr, T *rr, int64_t n, float *sum) {
    (void)xr; (void)rr; (void)n; *sum = 0.f; return 0;
}
static int64_t TYPED(sum_sq_vector)(const T *xr, int64_t n, float *sum) {
    (void)xr; (void)n; *sum = 0.f; return 0;
}
static int64_t TYPED(scale_vector)(const T *src, float inv, const T *w, int64_t n, T *out) {
    (void)src; (void)inv; (void)w; (void)n; (void)out; return 0;
}
#endif
/* the rotary without AVX-512: the compiler vectorizes its scalar loops as well itself (an AVX2
 * pass measured no faster) */
static int64_t TYPED(widen_vector)(const T *head, int64_t dim, float *x) {
    (void)head; (void)dim; (void)x; return 0;
}
static int64_t TYPED(rotate_vector)(T *head, const float *x, int64_t dim, const T *c, const T *s) {
    (void)head; (void)x; (void)dim; (void)c; (void)s; return 0;
}
#endif

/* Rows are independent: a batch of at least PARALLEL_VALUES values is split over the OpenMP
 * threads by rows (FOR_ROWS, engine_split.h: a smaller one runs without a parallel region), so a
 * row's result does not depend on the batch it is in. */

/* residual += x; x = residual / rms(residual) * weight, one row of `hidden` values. */
static void TYPED(add_rms_norm_row)(T *xr, T *rr, const T *weight, int64_t hidden, float eps) {
    float sum_sq;
    int64_t i = TYPED(add_sum_sq_vector)(xr, rr, hidden, &sum_sq);
    for (; i < hidden; i++) {
        rr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));
        float s = LOAD(rr[i]);
        sum_sq += s * s;
    }
    float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);
    for (i = TYPED(scale_vector)(rr, inv, weight, hidden, xr); i < hidden; i++)
        xr[i] = STORE(LOAD(rr[i]) * inv * LOAD(weight[i]));
}

void TYPED(add_rms_norm)(T *x, T *residual, const T *weight, int64_t rows, int64_t hidden,
                         float eps) {
    FOR_ROWS(rows * hidden >= PARALLEL_VALUES, r, rows,
             TYPED(add_rms_norm_row)(x + r * hidden, residual + r * hidden, weight, hidden, eps));
}

/* out = x / rms(x) * weight, x left as it is (a model's first norm: no residual yet), one row. */
static void TYPED(rms_norm_row)(const T *xr, const T *weight, int64_t hidden, float eps, T *out) {
    float sum_sq;
    int64_t i = TYPED(sum_sq_vector)(xr, hidden, &sum_sq);
    for (; i < hidden; i++) sum_sq += LOAD(xr[i]) * LOAD(xr[i]);
    float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);
    for (i = TYPED(scale_vector)(xr, inv, weight, hidden, out); i < hidden; i++)
        out[i] = STORE(LOAD(xr[i]) * inv * LOAD(weight[i]));
}

void TYPED(rms_norm)(const T *x, const T *weight, int64_t rows, int64_t hidden, float eps,
                     T *out) {
    FOR_ROWS(rows * hidden >= PARALLEL_VALUES, r, rows,
             TYPED(rms_norm_row)(x + r * hidden, weight, hidden, eps, out + r * hidden));
}

/* Rotate-half RoPE of one head in place from its values x (float): out = x·cos +
 * roll(x, dim/2)·sin, x·cos rounded to the storage type first, as torch's addcmul path does. */
static void TYPED(rotate_head)(T *head, const float *x, int64_t dim, const T *c, const T *s) {
    int64_t half = dim / 2;
    for (int64_t i = TYPED(rotate_vector)(head, x, dim, c, s); i < dim; i++) {
        float scaled = LOAD(STORE(x[i] * LOAD(c[i])));
        head[i] = STORE(scaled + x[i < half ? i + half : i - half] * LOAD(s[i]));
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of one row (cos, sin: its [dim]). Inlined
 * by force, as qk_norm_rotary_row: GCC keeps a function with a 4 KiB frame out of line, which
 * cost bf16's rotary 6 % a row at 32 rows (benchmarks/layer_kernels.py). */
static inline __attribute__((always_inline)) void TYPED(rotary_row)(T *row, int64_t heads, int64_t dim,
                                                                   const T *cos, const T *sin) {
    float x[MAX_DIM];
    for (int64_t h = 0; h < heads; h++) {
        T *head = row + h * dim;
        for (int64_t i = TYPED(widen_vector)(head, dim, x); i < dim; i++) x[i] = LOAD(head[i]);
        TYPED(rotate_head)(head, x, dim, cos, sin);
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of `qkv` (row stride
 * `stride`); cos, sin: [tokens, dim] as [c, c] and [-s, s]. */
void TYPED(rotary)(T *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,
                   const T *cos, const T *sin) {
    FOR_ROWS(tokens * heads * dim >= PARALLEL_VALUES, t, tokens,
             TYPED(rotary_row)(qkv + t * stride, heads, dim, cos + t * dim, sin + t * dim));
}

/* Qwen3's q/k: each of the first q_heads heads of a row RMS-normed with q_weight (q_eps),
 * the next k_heads with k_weight (k_eps), the norm rounded to the storage type, then rotated
 * as rotary_ does; in place, rows of stride `stride`. */
static inline __attribute__((always_inline)) void TYPED(qk_norm_rotary_row)(T *row, int64_t q_heads, int64_t k_heads,
                                                                           int64_t dim, const T *q_weight,
                                                                           const T *k_weight, float q_eps,
                                                                           float k_eps, const T *cos, const T *sin) {
    float x[MAX_DIM];
    for (int64_t h = 0; h < q_heads + k_heads; h++) {
        T *head = row + h * dim;
        const T *weight = h < q_heads ? q_weight : k_weight;
        float sum_sq = 0.f;
        for (int64_t i = 0; i < dim; i++) {
            x[i] = LOAD(head[i]);
            sum_sq += x[i] * x[i];
        }
        float inv = 1.f / sqrtf(sum_sq / (float)dim + (h < q_heads ? q_eps : k_eps));
        for (int64_t i = 0; i < dim; i++) x[i] = LOAD(STORE(x[i] * inv * LOAD(weight[i])));
        TYPED(rotate_head)(head, x, dim, cos, sin);
    }
}

void TYPED(qk_norm_rotary)(T *qkv, int64_t tokens, int64_t stride, int64_t q_heads,
                           int64_t k_heads, int64_t dim, const T *q_weight, const T *k_weight,
                           float q_eps, float k_eps, const T *cos, const T *sin) {
    FOR_ROWS(tokens * (q_heads + k_heads) * dim >= PARALLEL_VALUES, t, tokens,
             TYPED(qk_norm_rotary_row)(qkv + t * stride, q_heads, k_heads, dim, q_weight, k_weight, q_eps, k_eps,
                                       cos + t * dim, sin + t * dim));
}

/* ---- W8A8 ------------------------------------------------------------------------------- */

#if VECTOR_PASSES
/* The vector parts: each handles a prefix of the row (all of it here) and returns its length. */
static void TYPED(flag_outliers)(const T *x, int64_t rows, int64_t cols, float threshold,
                                 uint8_t *outlier) {
    for (int64_t k = 0; k < cols; k += 16) {
        __mmask16 m = tail_mask(cols - k), over = 0;
        __m512 limit = _mm512_set1_ps(threshold), sign = _mm512_set1_ps(-0.f);
        for (int64_t r = 0; r < rows; r++)
            over |= _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, TYPED(vload)(x + r * cols + k, m)), limit, _CMP_GT_OQ);
        _mm_mask_storeu_epi8(outlier + k, m, _mm_maskz_set1_epi8(over, 1));
    }
}
static int64_t TYPED(row_absmax_vector)(const T *xr, int64_t cols, const uint8_t *outlier, float *top) {
    __m512 best = _mm512_setzero_ps(), sign = _mm512_set1_ps(-0.f);
    for (int64_t k = 0; k < cols; k += 16) {
        __mmask16 m = tail_mask(cols - k);
        m &= ~_mm_test_epi8_mask(_mm_maskz_loadu_epi8(m, outlier + k), _mm_set1_epi8(1));
        best = _mm512_max_ps(best, _mm512_andnot_ps(sign, TYPED(vload)(xr + k, m)));
    }
    *top = _mm512_reduce_max_ps(best);
    return cols;
}
static int64_t TYPED(quantize_row_vector)(const T *xr, int64_t cols, float s, const uint8_t *outlier,
                                          int8_t *qr) {
    __m512 scale = _mm512_set1_ps(s);
    for (int64_t k = 0; k < cols; k += 16) {
        __mmask16 m = tail_mask(cols - k);
        __mmask16 keep = m & ~_mm_test_epi8_mask(_mm_maskz_loadu_epi8(m, outlier + k), _mm_set1_epi8(1));
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(TYPED(vload)(xr + k, keep), scale));
        _mm_mask_storeu_epi8(qr + k, m, _mm512_cvtsepi32_epi8(q));
    }
    return cols;
}
static int64_t TYPED(rescale_row_vector)(const int32_t *acc, int64_t cols, float row_scale,
                                         const float *col_scale, T *out) {
    __m512 rs = _mm512_set1_ps(row_scale);
    for (int64_t n = 0; n < cols; n += 16) {
        __mmask16 m = tail_mask(cols - n);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + n)), rs);
        TYPED(vstore)(out + n, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, col_scale + n)), m);
    }
    return cols;
}
#else
/* Without AVX-512: scalar outlier flags (one pass over the batch, as the compiler vectorizes
 * it), and on AVX2 a row's abs-max and quantization in 8 lanes (whole vectors; the scalar loops
 * take the rest): 4-7x the scalar loops, whose division and rounding the compiler leaves scalar. */
static void TYPED(flag_outliers)(const T *x, int64_t rows, int64_t cols, float threshold,
                                 uint8_t *outlier) {
    memset(outlier, 0, cols);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) outlier[k] |= fabsf(LOAD(x[r * cols + k])) > threshold;
}
#if AVX2_PASSES
/* x[k..k+8) with flagged columns zeroed */
static inline __m256 TYPED(kept8)(const T *xr, int64_t k, const uint8_t *outlier) {
    __m256i flags = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(outlier + k)));
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(flags, _mm256_setzero_si256()));
    return _mm256_and_ps(TYPED(vload8)(xr + k), keep);
}
static int64_t TYPED(row_absmax_vector)(const T *xr, int64_t cols, const uint8_t *outlier, float *top) {
    __m256 best = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) best = _mm256_max_ps(best, _mm256_andnot_ps(sign, TYPED(kept8)(xr, k, outlier)));
    *top = hmax8(best);
    return k;
}
static int64_t TYPED(quantize_row_vector)(const T *xr, int64_t cols, float s, const uint8_t *outlier,
                                          int8_t *qr) {
    __m256 scale = _mm256_set1_ps(s);
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(TYPED(kept8)(xr, k, outlier), scale));
        __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((void *)(qr + k), _mm_packs_epi16(words, words));
    }
    return k;
}
#else
static int64_t TYPED(row_absmax_vector)(const T *xr, int64_t cols, const uint8_t *o, float *top) {
    (void)xr; (void)cols; (void)o; (void)top; return 0;
}
static int64_t TYPED(quantize_row_vector)(const T *xr, int64_t cols, float s, const uint8_t *o, int8_t *q) {
    (void)xr; (void)cols; (void)s; (void)o; (void)q; return 0;
}
#endif
/* the rescale without AVX-512: the compiler vectorizes its scalar loop as well itself */
static int64_t TYPED(rescale_row_vector)(const int32_t *a, int64_t cols, float r, const float *c, T *out) {
    (void)a; (void)cols; (void)r; (void)c; (void)out; return 0;
}
#endif

/* W8A8 activations: per-row int8 of x [rows, cols]. Columns where some |x| > threshold are
 * flagged in `outlier` and left out (0 in xq, not in a row's abs-max). scale[r] =
 * max(abs-max, 1e-12) / 127; xq = x / scale rounded half to even. Returns the flagged count. */
static float TYPED(row_absmax)(const T *xr, int64_t cols, const uint8_t *outlier) {
    float top = 0.f;
    int64_t k = 0;
    if (VECTOR_PASSES || AVX2_PASSES) k = TYPED(row_absmax_vector)(xr, cols, outlier, &top);
    for (; k < cols; k++) {
        float a = outlier[k] ? 0.f : fabsf(LOAD(xr[k]));
        top = a > top ? a : top;
    }
    return top;
}

static void TYPED(quantize_row)(const T *xr, int64_t cols, float s, const uint8_t *outlier,
                                int8_t *qr) {
    int64_t k = 0;
    if (VECTOR_PASSES || AVX2_PASSES) k = TYPED(quantize_row_vector)(xr, cols, s, outlier, qr);
    for (; k < cols; k++) qr[k] = outlier[k] ? 0 : (int8_t)nearbyintf(LOAD(xr[k]) / s);
}

/* one row: its scale (written to *scale) and its int8 values */
static void TYPED(quantize_int8_row)(const T *xr, int64_t cols, const uint8_t *outlier, int8_t *qr, float *scale) {
    float top = TYPED(row_absmax)(xr, cols, outlier);
    *scale = (top > 1e-12f ? top : 1e-12f) / 127.f;
    TYPED(quantize_row)(xr, cols, *scale, outlier, qr);
}

int64_t TYPED(quantize_rows_int8)(const T *x, int64_t rows, int64_t cols, float threshold,
                                  int8_t *xq, float *scale, uint8_t *outlier) {
    int64_t flagged = 0;
    TYPED(flag_outliers)(x, rows, cols, threshold, outlier);
    for (int64_t k = 0; k < cols; k++) flagged += outlier[k];
    FOR_ROWS(rows * cols >= PARALLEL_VALUES, r, rows,
             TYPED(quantize_int8_row)(x + r * cols, cols, outlier, xq + r * cols, scale + r));
    return flagged;
}

/* out[n] = acc[n] · row_scale · col_scale[n] in the storage type, one row. */
static void TYPED(rescale_int32_row)(const int32_t *acc, int64_t cols, float row_scale, const float *col_scale,
                                     T *out) {
    int64_t n = 0;
    if (VECTOR_PASSES || AVX2_PASSES) n = TYPED(rescale_row_vector)(acc, cols, row_scale, col_scale, out);
    for (; n < cols; n++) out[n] = STORE((float)acc[n] * row_scale * col_scale[n]);
}

/* out[m, n] = acc[m, n] · row_scale[m] · col_scale[n] in the storage type. */
void TYPED(rescale_int32)(const int32_t *acc, int64_t rows, int64_t cols,
                          const float *row_scale, const float *col_scale, T *out) {
    FOR_ROWS(rows * cols >= PARALLEL_VALUES, m, rows,
             TYPED(rescale_int32_row)(acc + m * cols, cols, row_scale[m], col_scale, out + m * cols));
}

/* ---- SwiGLU ----------------------------------------------------------------------------- */

#if VECTOR_PASSES
static int64_t TYPED(silu_and_mul_vector)(const T *gate, const T *up, int64_t width, T *out) {
    __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < width; i += 16) {
        __mmask16 m = tail_mask(width - i);
        __m512 g = TYPED(vload)(gate + i, m);
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        TYPED(vstore)(out + i, _mm512_mul_ps(TYPED(vround)(silu), TYPED(vload)(up + i, m)), m);
    }
    return width;
}
#elif AVX2_PASSES
/* whole 8-lane chunks; the caller's scalar loop takes the rest */
static int64_t TYPED(silu_and_mul_vector)(const T *gate, const T *up, int64_t width, T *out) {
    __m256 one = _mm256_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        __m256 g = TYPED(vload8)(gate + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        TYPED(vstore8)(out + i, _mm256_mul_ps(TYPED(vround8)(silu), TYPED(vload8)(up + i)));
    }
    return i;
}
#else
static int64_t TYPED(silu_and_mul_vector)(const T *g, const T *u, int64_t width, T *out) {
    (void)g; (void)u; (void)width; (void)out; return 0;
}
#endif

/* out[r, i] = silu(x[r, i]) · x[r, width + i] for rows of x (row stride `stride`), out [rows,
 * width] contiguous; silu is rounded to the storage type before the product, as torch's
 * F.silu(gate) * up rounds it. */
static void TYPED(silu_and_mul_row)(const T *gate, int64_t width, T *o) {
    const T *up = gate + width;
    int64_t i = VECTOR_PASSES || AVX2_PASSES ? TYPED(silu_and_mul_vector)(gate, up, width, o) : 0;
    for (; i < width; i++) {
        float g = LOAD(gate[i]);
        o[i] = STORE(LOAD(STORE(g / (1.f + expf(-g)))) * LOAD(up[i]));
    }
}

void TYPED(silu_and_mul)(const T *x, int64_t rows, int64_t stride, int64_t width, T *out) {
    FOR_ROWS(rows * width >= PARALLEL_VALUES, r, rows,
             TYPED(silu_and_mul_row)(x + r * stride, width, out + r * width));
}

#undef SUFFIX
#undef T
#undef LOAD
#undef STORE
