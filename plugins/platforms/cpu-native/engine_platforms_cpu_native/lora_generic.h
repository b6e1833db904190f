/* LoRA's grouped shrink and expand for one storage type (included by kernels.c like
 * kernels_generic.h, with SUFFIX, T, LOAD and STORE defined; lora_tiles and LORA_TILE_ROWS come
 * from kernels.c). A batch's rows are put in order of their adapter slot, in tiles of up to
 * LORA_TILE_ROWS rows of one slot: each weight row loaded serves every row of its tile, and a
 * slot's A and B are read once per tile (once per step for a decode batch of a few rows per
 * adapter) where a row-by-row kernel would read them once per row. Tiles own disjoint rows, so
 * they split over the OpenMP threads when the batch is big enough, and a row's result does not
 * depend on the batch it is in. Sums are float32; results round once to the storage type. */

#if VECTOR_PASSES
/* acc[t] = Σ_k xr[t][k] · w[k] for the m ≤ LORA_TILE_ROWS rows of a tile */
static void TYPED(lora_dots)(const T *const *xr, int64_t m, const T *w, int64_t cols, float *acc) {
    __m512 sum[LORA_TILE_ROWS];
    for (int64_t t = 0; t < m; t++) sum[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k += 16) {
        __mmask16 mask = tail_mask(cols - k);
        __m512 wv = TYPED(vload)(w + k, mask);
        for (int64_t t = 0; t < m; t++) sum[t] = _mm512_fmadd_ps(TYPED(vload)(xr[t] + k, mask), wv, sum[t]);
    }
    for (int64_t t = 0; t < m; t++) acc[t] = _mm512_reduce_add_ps(sum[t]);
}

/* yr[t][lo:hi] += Σ_k hv[t][k] · b[k][lo:hi] (b's rows `width` apart), ranks k where `live`
 * (some row's hv is non-zero there) */
static void TYPED(lora_axpys)(T *const *yr, int64_t m, const float (*hv)[LORA_MAX_RANK], const uint8_t *live,
                              const T *b, int64_t rank, int64_t width, int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; j += 16) {
        __mmask16 mask = tail_mask(hi - j);
        __m512 acc[LORA_TILE_ROWS];
        for (int64_t t = 0; t < m; t++) acc[t] = TYPED(vload)(yr[t] + j, mask);
        for (int64_t k = 0; k < rank; k++) {
            if (!live[k]) continue;
            __m512 bv = TYPED(vload)(b + k * width + j, mask);
            for (int64_t t = 0; t < m; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(hv[t][k]), bv, acc[t]);
        }
        for (int64_t t = 0; t < m; t++) TYPED(vstore)(yr[t] + j, acc[t], mask);
    }
}
#elif AVX2_PASSES
/* acc[t] = Σ_k xr[t][k] · w[k]: 8 lanes of FMA, each w chunk loaded once for the tile's rows
 * (8 accumulators, a weight and an input vector fit AVX2's 16 registers); the last cols % 8 in C */
static void TYPED(lora_dots)(const T *const *xr, int64_t m, const T *w, int64_t cols, float *acc) {
    __m256 sum[LORA_TILE_ROWS];
    for (int64_t t = 0; t < m; t++) sum[t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        __m256 wv = TYPED(vload8)(w + k);
        for (int64_t t = 0; t < m; t++) sum[t] = _mm256_fmadd_ps(TYPED(vload8)(xr[t] + k), wv, sum[t]);
    }
    for (int64_t t = 0; t < m; t++) {
        acc[t] = hsum8(sum[t]);
        for (int64_t c = k; c < cols; c++) acc[t] += LOAD(xr[t][c]) * LOAD(w[c]);
    }
}

/* yr[t][lo:hi] += Σ_k hv[t][k] · b[k][lo:hi] over the live ranks, 8 columns at a time held in
 * registers for every row of the tile (each B chunk loaded once per tile); the last columns in C */
static void TYPED(lora_axpys)(T *const *yr, int64_t m, const float (*hv)[LORA_MAX_RANK], const uint8_t *live,
                              const T *b, int64_t rank, int64_t width, int64_t lo, int64_t hi) {
    int64_t j = lo;
    for (; j + 8 <= hi; j += 8) {
        __m256 acc[LORA_TILE_ROWS];
        for (int64_t t = 0; t < m; t++) acc[t] = TYPED(vload8)(yr[t] + j);
        for (int64_t k = 0; k < rank; k++) {
            if (!live[k]) continue;
            __m256 bv = TYPED(vload8)(b + k * width + j);
            for (int64_t t = 0; t < m; t++) acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&hv[t][k]), bv, acc[t]);
        }
        for (int64_t t = 0; t < m; t++) TYPED(vstore8)(yr[t] + j, acc[t]);
    }
    for (int64_t t = 0; t < m; t++)
        for (int64_t c = j; c < hi; c++) {
            float sum = LOAD(yr[t][c]);
            for (int64_t k = 0; k < rank; k++)
                if (live[k]) sum += hv[t][k] * LOAD(b[k * width + c]);
            yr[t][c] = STORE(sum);
        }
}
#else
static void TYPED(lora_dots)(const T *const *xr, int64_t m, const T *w, int64_t cols, float *acc) {
    for (int64_t t = 0; t < m; t++) acc[t] = 0.f;
    for (int64_t k = 0; k < cols; k++) {
        float wk = LOAD(w[k]);
        for (int64_t t = 0; t < m; t++) acc[t] += LOAD(xr[t][k]) * wk;
    }
}

static void TYPED(lora_axpys)(T *const *yr, int64_t m, const float (*hv)[LORA_MAX_RANK], const uint8_t *live,
                              const T *b, int64_t rank, int64_t width, int64_t lo, int64_t hi) {
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = lo; j < hi; j++) {
            float acc = LOAD(yr[t][j]);
            for (int64_t k = 0; k < rank; k++)
                if (live[k]) acc += hv[t][k] * LOAD(b[k * width + j]);
            yr[t][j] = STORE(acc);
        }
}
#endif

/* h[r, i, :] = scale[s, i] · a[s, i] · x[r] for row r of slot s = indices[r]; zero for a row of
 * none (-1), for a shard its adapter leaves out (scale 0, its A not read) and past the adapter's
 * rank ranks[s, i] (those zero rows of A not read: an adapter of rank 8 in rank-16 slots reads
 * half of A, whatever else the batch holds). */
engine_status TYPED(lora_shrink)(const T *x, int64_t rows, int64_t x_stride, int64_t cols, const T *a,
                                 int64_t slots, int64_t shards, int64_t rank, const float *scale,
                                 const int64_t *ranks, const int64_t *indices, T *h) {
    for (int64_t i = 0; i < slots * shards; i++)
        if (ranks[i] < 0 || ranks[i] > rank) return 1;
    int64_t *order, *tiles, count;
    engine_status status = lora_tiles(indices, rows, slots, &order, &tiles, &count);
    if (status) return status;
    memset(h, 0, (size_t)(rows * shards * rank) * sizeof(T));
#pragma omp parallel for schedule(dynamic) if (rows * shards * rank * cols >= PARALLEL_WORK)
    for (int64_t tile = 0; tile < count; tile++) {
        const int64_t *members = order + tiles[tile];
        int64_t m = tiles[tile + 1] - tiles[tile], slot = indices[members[0]];
        const T *xr[LORA_TILE_ROWS];
        for (int64_t t = 0; t < m; t++) xr[t] = x + members[t] * x_stride;
        for (int64_t i = 0; i < shards; i++) {
            float s = scale[slot * shards + i], acc[LORA_TILE_ROWS];
            if (s == 0.f) continue;
            for (int64_t k = 0; k < ranks[slot * shards + i]; k++) {
                TYPED(lora_dots)(xr, m, a + ((slot * shards + i) * rank + k) * cols, cols, acc);
                for (int64_t t = 0; t < m; t++) h[(members[t] * shards + i) * rank + k] = STORE(acc[t] * s);
            }
        }
    }
    free(order);
    return 0;
}

/* y[r, bounds[i]:bounds[i+1]] += h[r, i] · b[s, :, bounds[i]:bounds[i+1]] for row r of slot s
 * (b [slots, rank, width], B transposed); rows of none (-1) are left as they are. */
engine_status TYPED(lora_expand)(T *y, int64_t rows, int64_t y_stride, const T *h, const T *b, int64_t slots,
                                 int64_t shards, int64_t rank, int64_t width, const int64_t *bounds,
                                 const int64_t *indices) {
    if (rank > LORA_MAX_RANK) return 1;
    int64_t *order, *tiles, count;
    engine_status status = lora_tiles(indices, rows, slots, &order, &tiles, &count);
    if (status) return status;
#pragma omp parallel for schedule(dynamic) if (rows * rank * width >= PARALLEL_WORK)
    for (int64_t tile = 0; tile < count; tile++) {
        const int64_t *members = order + tiles[tile];
        int64_t m = tiles[tile + 1] - tiles[tile], slot = indices[members[0]];
        T *yr[LORA_TILE_ROWS];
        float hv[LORA_TILE_ROWS][LORA_MAX_RANK];
        uint8_t live[LORA_MAX_RANK];
        for (int64_t t = 0; t < m; t++) yr[t] = y + members[t] * y_stride;
        for (int64_t i = 0; i < shards; i++) {
            int any = 0;
            for (int64_t k = 0; k < rank; k++) {
                live[k] = 0;
                for (int64_t t = 0; t < m; t++) {
                    hv[t][k] = LOAD(h[(members[t] * shards + i) * rank + k]);
                    live[k] |= hv[t][k] != 0.f;
                }
                any |= live[k];
            }
            if (any)
                TYPED(lora_axpys)(yr, m, (const float (*)[LORA_MAX_RANK])hv, live, b + slot * rank * width, rank,
                                  width, bounds[i], bounds[i + 1]);
        }
    }
    free(order);
    return 0;
}

#undef SUFFIX
#undef T
#undef LOAD
#undef STORE
