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
static void TYPED(lora_dot_rows)(const T *const *xr, int64_t m, const T *w, int64_t cols, float *acc) {
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
/* The AVX2 passes work on blocks whose row count m and block width are compile-time constants
 * (each block function is inlined into a switch over m, lora_by_rows): their accumulators then
 * live in registers, where loops over a run-time m kept them on the stack (a store and a load
 * around every FMA), and a block holds several independent FMA chains when m is small. Each
 * output's sum is taken in the same order whatever the block, so a row's result does not
 * depend on the rows beside it. */

/* weight rows per shrink block: m · nw accumulators, nw weight vectors and one input vector fit
 * AVX2's 16 registers */
#define LORA_DOT_WIDTH(m) ((m) <= 2 ? 4 : (m) <= 4 ? 2 : 1)
/* 8-column chunks per expand block, alike */
#define LORA_AXPY_WIDTH(m) ((m) <= 2 ? 4 : (m) <= 4 ? 2 : 1)

/* The shrink's input rows are widened to float32 once per call (into `buffer`, cols values) and
 * the dots read them so: an FMA then takes its input straight from memory, where a bf16 row
 * was widened again for every row of A it met (two more instructions per FMA). */
#define LORA_INPUT float
#define LORA_WIDE_INPUT 1
static const float *TYPED(lora_input_row)(const T *row, int64_t cols, float *buffer) {
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) _mm256_storeu_ps(buffer + k, TYPED(vload8)(row + k));
    for (; k < cols; k++) buffer[k] = LOAD(row[k]);
    return buffer;
}

/* out[t][r] = Σ_k xr[t][k] · w[r · cols + k] for t < m, r < nw: each 8 values of a weight row
 * loaded once for the block's m rows, each 8 of an input row once for its nw weight rows */
static inline __attribute__((always_inline)) void TYPED(lora_dot_block)(const float *const *xr, int m, const T *w,
                                                                      int nw, int64_t cols,
                                                                      float (*out)[LORA_MAX_RANK]) {
    __m256 sum[LORA_TILE_ROWS][4];
    for (int t = 0; t < m; t++)
        for (int r = 0; r < nw; r++) sum[t][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        __m256 wv[4];
        for (int r = 0; r < nw; r++) wv[r] = TYPED(vload8)(w + r * cols + k);
        for (int t = 0; t < m; t++) {
            __m256 xv = _mm256_loadu_ps(xr[t] + k);
            for (int r = 0; r < nw; r++) sum[t][r] = _mm256_fmadd_ps(xv, wv[r], sum[t][r]);
        }
    }
    for (int t = 0; t < m; t++)
        for (int r = 0; r < nw; r++) {
            float acc = hsum8(sum[t][r]);
            for (int64_t c = k; c < cols; c++) acc += xr[t][c] * LOAD(w[r * cols + c]);
            out[t][r] = acc;
        }
}

/* out[t][r] for the `count` weight rows of w, in blocks of LORA_DOT_WIDTH(m) rows, then one */
static inline __attribute__((always_inline)) void TYPED(lora_dots_fixed)(const float *const *xr, int m, const T *w,
                                                                       int64_t count, int64_t cols,
                                                                       float (*out)[LORA_MAX_RANK]) {
    const int width = LORA_DOT_WIDTH(m);
    int64_t r = 0;
    for (; r + width <= count; r += width)
        TYPED(lora_dot_block)(xr, m, w + r * cols, width, cols, (float (*)[LORA_MAX_RANK])(&out[0][r]));
    for (; r < count; r++)
        TYPED(lora_dot_block)(xr, m, w + r * cols, 1, cols, (float (*)[LORA_MAX_RANK])(&out[0][r]));
}

static void TYPED(lora_dots)(const float *const *xr, int64_t m, const T *w, int64_t count, int64_t cols,
                             float (*out)[LORA_MAX_RANK]) {
#define LORA_DOTS_CASE(M) TYPED(lora_dots_fixed)(xr, M, w, count, cols, out)
    LORA_BY_ROWS(m, LORA_DOTS_CASE)
#undef LORA_DOTS_CASE
}

/* How far ahead of a block's columns the expand asks for each rank's row of B, in elements (two
 * cache lines of bf16, four of float32). A block walks every rank's row, `width` apart, 16 to 32
 * bytes of each: too many short streams for the hardware prefetcher, so without it each row's
 * next line is a miss the FMAs wait on (a third of the expand's time in a decode step's
 * profile). */
#define LORA_AHEAD 64

/* yr[t][j : j + 8 · nc] += Σ_k hv[t][k] · b[k · width + j ...] over the live ranks: the block's
 * m · nc output vectors held in registers across the ranks, each B vector loaded once */
static inline __attribute__((always_inline)) void TYPED(lora_axpy_block)(T *const *yr, int m,
                                                                       const float (*hv)[LORA_MAX_RANK],
                                                                       const uint8_t *live, const T *b,
                                                                       int64_t rank, int64_t width, int64_t j,
                                                                       int nc) {
    __m256 acc[LORA_TILE_ROWS][4];
    for (int t = 0; t < m; t++)
        for (int c = 0; c < nc; c++) acc[t][c] = TYPED(vload8)(yr[t] + j + 8 * c);
    for (int64_t k = 0; k < rank; k++) {
        if (!live[k]) continue;
        __m256 bv[4];
        _mm_prefetch((const char *)(b + k * width + j + LORA_AHEAD), _MM_HINT_T0);
        for (int c = 0; c < nc; c++) bv[c] = TYPED(vload8)(b + k * width + j + 8 * c);
        for (int t = 0; t < m; t++) {
            __m256 hk = _mm256_broadcast_ss(&hv[t][k]);
            for (int c = 0; c < nc; c++) acc[t][c] = _mm256_fmadd_ps(hk, bv[c], acc[t][c]);
        }
    }
    for (int t = 0; t < m; t++)
        for (int c = 0; c < nc; c++) TYPED(vstore8)(yr[t] + j + 8 * c, acc[t][c]);
}

static inline __attribute__((always_inline)) void TYPED(lora_axpys_fixed)(T *const *yr, int m,
                                                                        const float (*hv)[LORA_MAX_RANK],
                                                                        const uint8_t *live, const T *b,
                                                                        int64_t rank, int64_t width, int64_t lo,
                                                                        int64_t hi) {
    const int nc = LORA_AXPY_WIDTH(m);
    int64_t j = lo;
    for (; j + 8 * nc <= hi; j += 8 * nc) TYPED(lora_axpy_block)(yr, m, hv, live, b, rank, width, j, nc);
    for (; j + 8 <= hi; j += 8) TYPED(lora_axpy_block)(yr, m, hv, live, b, rank, width, j, 1);
    for (int t = 0; t < m; t++)
        for (int64_t c = j; c < hi; c++) {
            float sum = LOAD(yr[t][c]);
            for (int64_t k = 0; k < rank; k++)
                if (live[k]) sum += hv[t][k] * LOAD(b[k * width + c]);
            yr[t][c] = STORE(sum);
        }
}

/* yr[t][lo:hi] += Σ_k hv[t][k] · b[k][lo:hi] (b's rows `width` apart), ranks k where `live` */
static void TYPED(lora_axpys)(T *const *yr, int64_t m, const float (*hv)[LORA_MAX_RANK], const uint8_t *live,
                              const T *b, int64_t rank, int64_t width, int64_t lo, int64_t hi) {
#define LORA_AXPYS_CASE(M) TYPED(lora_axpys_fixed)(yr, M, hv, live, b, rank, width, lo, hi)
    LORA_BY_ROWS(m, LORA_AXPYS_CASE)
#undef LORA_AXPYS_CASE
}
#else
static void TYPED(lora_dot_rows)(const T *const *xr, int64_t m, const T *w, int64_t cols, float *acc) {
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

#if !AVX2_PASSES
/* these passes read the input rows as they are */
#define LORA_INPUT T
#define LORA_WIDE_INPUT 0
static const T *TYPED(lora_input_row)(const T *row, int64_t cols, T *buffer) {
    (void)cols, (void)buffer;
    return row;
}

/* out[t][r] = Σ_k xr[t][k] · w[r · cols + k] for the tile's m rows and `count` weight rows */
static void TYPED(lora_dots)(const T *const *xr, int64_t m, const T *w, int64_t count, int64_t cols,
                             float (*out)[LORA_MAX_RANK]) {
    float acc[LORA_TILE_ROWS];
    for (int64_t r = 0; r < count; r++) {
        TYPED(lora_dot_rows)(xr, m, w + r * cols, cols, acc);
        for (int64_t t = 0; t < m; t++) out[t][r] = acc[t];
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
    LORA_INPUT *wide = NULL; /* each row's input as the dots read it, where they widen it */
    if (LORA_WIDE_INPUT && count && !(wide = malloc((size_t)(rows * cols) * sizeof(LORA_INPUT)))) {
        free(order);
        return 2;
    }
    memset(h, 0, (size_t)(rows * shards * rank) * sizeof(T));
#pragma omp parallel for schedule(dynamic) if (rows * shards * rank * cols >= PARALLEL_WORK)
    for (int64_t tile = 0; tile < count; tile++) {
        const int64_t *members = order + tiles[tile];
        int64_t m = tiles[tile + 1] - tiles[tile], slot = indices[members[0]];
        const LORA_INPUT *xr[LORA_TILE_ROWS];
        for (int64_t t = 0; t < m; t++)
            xr[t] = TYPED(lora_input_row)(x + members[t] * x_stride, cols, wide ? wide + members[t] * cols : NULL);
        float acc[LORA_TILE_ROWS][LORA_MAX_RANK];
        for (int64_t i = 0; i < shards; i++) {
            float s = scale[slot * shards + i];
            int64_t live = ranks[slot * shards + i];
            if (s == 0.f) continue;
            TYPED(lora_dots)(xr, m, a + (slot * shards + i) * rank * cols, live, cols, acc);
            for (int64_t t = 0; t < m; t++)
                for (int64_t k = 0; k < live; k++) h[(members[t] * shards + i) * rank + k] = STORE(acc[t][k] * s);
        }
    }
    free(wide);
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

#undef LORA_AHEAD
#undef LORA_INPUT
#undef LORA_WIDE_INPUT
#undef SUFFIX
#undef T
#undef LOAD
#undef STORE
