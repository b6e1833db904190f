/* quant_gemm.c's functions for one activation type: included once per type, with SUFFIX (bf16,
 * f32), T (its C type), LOAD and STORE (the type to and from float) and OUT_BF16 (1 for
 * bfloat16) defined, which it undefines again; TYPED(name) is name_<SUFFIX>. A file rather
 * than a macro, so that compiler messages and debuggers see its own lines. */

/* ---- activation quantization: a row's groups of 32 inputs to int8 ---------------------- */
/* d[g] = absmax / 127, xq = round(x / d[g]), s[g] = d[g] · Σ xq: the sum of the group as rounded,
 * so the offset term sees the same rounded activations as the scale term (quant_gemm.c) */

#if HAVE_VNNI
static void TYPED(quantize_row)(const T *x, int64_t k, int8_t *xq, float *d, float *s) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m512 a = TYPED(load16)(x + g * GROUP), b = TYPED(load16)(x + g * GROUP + 16);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a),
                                                       _mm512_andnot_ps(sign, b)));
        float inv = top > 0.f ? 127.f / top : 0.f;
        d[g] = top / 127.f;
        __m512 scale = _mm512_set1_ps(inv);
        __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
        /* the sum of the int8 values stored: the same lanes for finite x, and no int32 overflow
         * for a NaN or infinite one (whose lanes convert to INT_MIN) */
        const __m512i most = _mm512_set1_epi32(127), least = _mm512_set1_epi32(-128);
        __m512i sa = _mm512_max_epi32(_mm512_min_epi32(ia, most), least);
        __m512i sb = _mm512_max_epi32(_mm512_min_epi32(ib, most), least);
        s[g] = d[g] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(sa, sb));
        _mm_storeu_si128((void *)(xq + g * GROUP), _mm512_cvtsepi32_epi8(ia));
        _mm_storeu_si128((void *)(xq + g * GROUP + 16), _mm512_cvtsepi32_epi8(ib));
    }
}
#elif HAVE_AVX2
/* VNNI's quantizer in four vectors of 8: the same values (int8 saturation by two packs, whose
 * per-lane order one permute undoes) */
static void TYPED(quantize_row)(const T *x, int64_t k, int8_t *xq, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = TYPED(load8)(x + g * GROUP + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
        }
        float most = hmax8(top), inv = most > 0.f ? 127.f / most : 0.f;
        d[g] = most / 127.f;
        __m256 scale = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        s[g] = d[g] * (float)hsum8_epi32(sum);
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((void *)(xq + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
    }
}
#else
static void TYPED(quantize_row)(const T *x, int64_t k, int8_t *xq, float *d, float *s) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        float top = 0.f;
        for (int64_t i = 0; i < GROUP; i++) top = fmaxf(top, fabsf(LOAD(x[g * GROUP + i])));
        float inv = top > 0.f ? 127.f / top : 0.f;
        int32_t sum = 0;
        for (int64_t i = 0; i < GROUP; i++) {
            xq[g * GROUP + i] = (int8_t)nearbyintf(LOAD(x[g * GROUP + i]) * inv);
            sum += xq[g * GROUP + i];
        }
        d[g] = top / 127.f;
        s[g] = d[g] * (float)sum;
    }
}
#endif

/* ---- the matmul -------------------------------------------------------------------------- */

/* x [m, k] (row stride ldx) in the storage type -> out [m, n] in the same type. */
void TYPED(affine_matmul)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                          int64_t form, int64_t bits, int64_t n, T *out) {
    run((quantize_fn)TYPED(quantize_row), GEMM, x, ldx * (int64_t)sizeof(T), m, k, qw, sz, form, bits, n, OUT_BF16,
        out);
}

/* x [m, k] (row stride ldx) as float32 rows, k apart (malloc'd: the caller frees them) */
static float *TYPED(float_rows)(const T *x, int64_t ldx, int64_t m, int64_t k) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = LOAD(x[r * ldx + i]);
    return xf;
}

/* Each row of out [m, n] (logits of x [m, k] from any product) gets its `top` largest
 * recomputed from the activations unrounded (refine_top). */
void TYPED(affine_refine_logits)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw,
                                 const void *sz, int64_t form, int64_t bits, int64_t n, int64_t top,
                                 float *out) {
    float *xf = TYPED(float_rows)(x, ldx, m, k);
    refine_top(xf, m, k, qw, sz, form, bits, n, top, out);
    free(xf);
}

/* Each row's greedy token from its `top` candidates (greedy_top). */
void TYPED(affine_greedy)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                          int64_t form, int64_t bits, int64_t n, int64_t top, const int64_t *best,
                          const float *approx, int64_t *tokens) {
    float *xf = TYPED(float_rows)(x, ldx, m, k);
    greedy_top(xf, m, k, qw, sz, form, bits, n, top, best, approx, tokens);
    free(xf);
}

/* Each row's `top` largest logits of affine_logits's product, without its logits where the build
 * can (logits_top) */
void TYPED(affine_logits_top)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                              int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *best, float *approx) {
    logits_top((quantize_fn)TYPED(quantize_row), x, ldx * (int64_t)sizeof(T), m, k, qw, sz, form, bits, n, top, best,
               approx);
}

/* The int8 product of affine_matmul as float32 logits out [m, n], before any refinement */
static void TYPED(one_pass_logits)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                                   int64_t form, int64_t bits, int64_t n, float *out) {
    run((quantize_fn)TYPED(quantize_row), GEMM, x, ldx * (int64_t)sizeof(T), m, k, qw, sz, form, bits, n, 0, out);
}

/* A vocabulary's logits: x [m, k] -> float32 out [m, n], the int8 product of affine_matmul,
 * refined (affine_refine_logits): the int8 rounding's error reaches the logits with no
 * normalization after, and the distribution's mass sits in its top entries. On AMX the dense
 * copy's bf16 GEMM makes the product instead and affine.py refines it the same way. */
void TYPED(affine_logits)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                          int64_t form, int64_t bits, int64_t n, int64_t top, float *out) {
    TYPED(one_pass_logits)(x, ldx, m, k, qw, sz, form, bits, n, out);
    TYPED(affine_refine_logits)(x, ldx, m, k, qw, sz, form, bits, n, top, out);
}

/* The tokens affine_greedy could not settle, from their rows' logits refined. A call whatever
 * the tokens (the loop skips settled rows), so that a native tape records it after affine_greedy
 * and replays it for every step's tokens. */
void TYPED(affine_settle)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                          int64_t form, int64_t bits, int64_t n, int64_t top, float *logits, int64_t *tokens) {
    for (int64_t r = 0; r < m; r++) {
        if (tokens[r] >= 0) continue;
        TYPED(affine_refine_logits)(x + r * ldx, ldx, 1, k, qw, sz, form, bits, n, top, logits + r * n);
        tokens[r] = first_max_row(logits + r * n, n);
    }
}

/* Each row's greedy token, the first maximum of affine_logits's logits: from the row's `top`
 * candidates (affine_logits_top, affine_greedy), without its logits; a row they cannot settle
 * (flat, NaN) gets its logits made and settled (affine_settle). One call, no result Python acts
 * on, so a native tape can record it. */
void TYPED(affine_greedy_rows)(const T *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                               int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *tokens) {
    int64_t *best = malloc(sizeof(int64_t) * (size_t)(m * top));
    float *approx = malloc(sizeof(float) * (size_t)(m * top)), *row = NULL;
    TYPED(affine_logits_top)(x, ldx, m, k, qw, sz, form, bits, n, top, best, approx);
    TYPED(affine_greedy)(x, ldx, m, k, qw, sz, form, bits, n, top, best, approx, tokens);
    for (int64_t r = 0; r < m; r++) {
        if (tokens[r] >= 0) continue;
        if (row == NULL) row = malloc(sizeof(float) * (size_t)n);
        TYPED(one_pass_logits)(x + r * ldx, ldx, 1, k, qw, sz, form, bits, n, row);
        TYPED(affine_settle)(x + r * ldx, ldx, 1, k, qw, sz, form, bits, n, top, row, tokens + r);
    }
    free(best);
    free(approx);
    free(row);
}

/* ---- rows of the weight (embedding lookups): out [len(ids), k] = q · scale + offset ------ */
/* refused (nothing written) when an id is outside [0, n). */

engine_status TYPED(affine_rows)(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k,
                                 int64_t n, const int64_t *ids, int64_t count, T *out) {
    int64_t groups = k / GROUP;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return 1;
#pragma omp parallel for schedule(static) if (count * k >= (1 << 18))
    for (int64_t i = 0; i < count; i++) {
        int64_t col = ids[i], t = col / TILE, c = col % TILE;
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = sz_index(form, groups, t, g, c);
            float scale = scale_at(sz, form, at), offset = offset_at(sz, form, bits, at);
            for (int64_t j = 0; j < GROUP; j++)
                out[i * k + g * GROUP + j] =
                    STORE((float)packed_q(qw, bits, groups, col, g * GROUP + j) * scale + offset);
        }
    }
    return 0;
}

/* ---- the whole weight, out [n, k] = q · scale + offset: walked in packed order ----------- */
/* What the dense path of a long prefill chunk multiplies (affine.py): each 64-byte step gives
 * 16 columns' next 4 (8-bit) or 8 (4-bit) inputs; the threads take whole column tiles. */

void TYPED(affine_dequantize)(const uint8_t *qw, const void *sz, int64_t form, int64_t bits,
                              int64_t k, int64_t n, T *out) {
    int64_t groups = k / GROUP, per_step = step_bytes(bits);
#pragma omp parallel for schedule(static) if (n * k >= (1 << 18))
    for (int64_t t = 0; t < (n + TILE - 1) / TILE; t++) {
        int64_t cols = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int64_t g = 0; g < groups; g++) {
            float scale[TILE], offset[TILE];
            for (int64_t c = 0; c < cols; c++) {
                scale[c] = scale_at(sz, form, sz_index(form, groups, t, g, c));
                offset[c] = offset_at(sz, form, bits, sz_index(form, groups, t, g, c));
            }
            for (int64_t j = g * GROUP / per_step; j < (g + 1) * GROUP / per_step; j++) {
                const uint8_t *step = qw + step_at(bits, groups, t, j);
                for (int64_t c = 0; c < cols; c++) {
                    T *row = out + (t * TILE + c) * k + j * per_step;
                    for (int64_t i = 0; i < 4; i++) {
                        uint8_t byte = step[4 * c + i];
                        if (bits == 4) {
                            row[i] = STORE((float)(byte & 15) * scale[c] + offset[c]);
                            row[4 + i] = STORE((float)(byte >> 4) * scale[c] + offset[c]);
                        } else {
                            row[i] = STORE((float)byte * scale[c] + offset[c]);
                        }
                    }
                }
            }
        }
    }
}

#undef SUFFIX
#undef T
#undef LOAD
#undef STORE
#undef OUT_BF16
