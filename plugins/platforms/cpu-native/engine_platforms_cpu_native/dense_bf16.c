/* bfloat16 weights times float activations on a CPU that cannot compute bfloat16 (AVX2 + FMA,
 * no AVX512_BF16 or AMX): each weight widened to float32 as it is read (a bfloat16 is the high
 * half of a float32: one 16-bit shift), the products summed in float32 by FMA. The weight stays
 * 2 B a parameter in memory, so a decode step streams half the bytes a float32 copy would, and
 * nothing is rounded but the output.
 *
 * Each job walks COLUMNS output columns (rows of w) for every activation row, two rows at a
 * time, so a column's weights come from memory once and from cache for the other rows; jobs are
 * split over OpenMP threads. The first two rows' pass, the one that reads the columns from
 * memory, prefetches: a job of up to NEXT_JOB_BYTES (576 inputs: 4.5 KiB) asks for the whole of
 * the next job this thread walks, in address order (one read stream to the hardware's
 * prefetchers, not COLUMNS short ones: a plain read of that pattern ran 15 GB/s, of the next
 * job in address order 20, one long array 20); a longer job asks for each column's weights
 * PREFETCH_BYTES ahead (quant_gemm_avx2.h's distance and reason), near a row's end in the row
 * this thread reads next. From memory at one row, one thread, the default model's shapes ran
 * 14-17 GB/s against 10-16 before (benchmarks/dense_stream.c, RESULTS.md 2026-12-05), 4 rows
 * 1.2-1.7x and 16 rows 1.1-1.2x faster than without prefetching past two rows. Each (row,
 * column)'s float32 sums run in one order at every row count (batch-invariant). Built without
 * AVX2 and FMA, the same sums run in plain C (the tests compare the builds).
 *
 * From TILED_MIN_ROWS rows (prompt chunks: compute-bound) register tiles of 4 rows × 3 columns
 * take over, every sum in the same order as above, so the bits do not depend on the batch
 * (gemm_tiled).
 */
#include "dense_bf16.h"
#include "engine_bf16.h"
#include "engine_lanes.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define COLUMNS 4               /* output columns a job walks together */
#define PARALLEL_WORK (1 << 18) /* multiply-adds from which a call is split over threads (quant_gemm.c's) */
#define PREFETCH_BYTES 2048
#define NEXT_JOB_BYTES 8192    /* a job's weights up to which it prefetches the next job's whole */
#define TILED_MIN_ROWS 32      /* rows from which a call takes the register tiles (gemm_tiled) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
#include "dense_bf16_amx.h"
#else
#define HAVE_AMX 0
#endif

int64_t dense_simd_width(void) { return HAVE_AVX2 ? 256 : 0; }

int64_t dense_tiled_min_rows(void) { return HAVE_AVX2 ? TILED_MIN_ROWS : 0; }

#if HAVE_AVX2
/* 8 bfloat16 weights at p as float32 lanes */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}

/* Where column c's stream asks for a line while the job reads weights [i, i + 32) of its
 * columns from column col: a job of up to NEXT_JOB_BYTES asks for the next job's weights (the
 * COLUMNS columns this thread walks next), COLUMNS lines a step in address order, c the c-th;
 * a longer one asks for its own column's weights PREFETCH_BYTES ahead, or past the row's end
 * for the row at the same place in the next job, not the neighbouring row another accumulator
 * is reading already. */
static inline const char *prefetch_target(const uint16_t *w, int64_t col, int c, int64_t i, int64_t k) {
    if (COLUMNS * k * 2 <= NEXT_JOB_BYTES) return (const char *)(w + (col + COLUMNS) * k) + (i * COLUMNS + c * 32) * 2;
    const int64_t distance = PREFETCH_BYTES / 2, ahead = i + distance < k ? distance : distance + (COLUMNS - 1) * k;
    return (const char *)(w + (col + c) * k + i + ahead);
}

/* R activation rows (≤ 2) × NC columns (≤ COLUMNS) from column col: out[r * n + col + c] */
static inline __attribute__((always_inline)) void
block_avx2(const int R, const int NC, const float *x, int64_t k, const uint16_t *w, int64_t col, int64_t n,
           int stream, float *out) {
    const int64_t whole = k & ~(int64_t)7;
    __m256 acc[2][COLUMNS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) {
        for (int c = 0; c < NC; c++) {
            const uint16_t *wc = w + (col + c) * k + i;
            if (stream && (i & 31) == 0) _mm_prefetch(prefetch_target(w, col, c, i, k), _MM_HINT_T0);
            __m256 wv = widen8(wc);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + i), acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) {
            float sum = hsum8(acc[r][c]);
            for (int64_t i = whole; i < k; i++) sum += bf16_load(w[(col + c) * k + i]) * x[r * k + i];
            out[r * n + col + c] = sum;
        }
}

#define DENSE_CASE(R, NC, COL) block_avx2(R, NC, x + r * k, k, w, COL, n, stream, out + r * n)
static void columns(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t col, int64_t cols, int64_t n,
                    float *out) {
    for (int64_t r = 0; r < m; r += 2) {
        const int two = r + 1 < m, stream = r == 0; /* the pass that reads the columns from memory */
        if (cols == COLUMNS) {
            if (two) DENSE_CASE(2, COLUMNS, col); else DENSE_CASE(1, COLUMNS, col);
        } else {
            for (int64_t c = col; c < col + cols; c++) {
                if (two) DENSE_CASE(2, 1, c); else DENSE_CASE(1, 1, c);
            }
        }
    }
}
#undef DENSE_CASE

/* ---- many rows (prefill): register tiles ---------------------------------------------------
 * From TILED_MIN_ROWS rows the call is compute-bound, and the 2-row blocks above spend 6 loads
 * and 4 widenings on every 8 FMAs. Here a tile holds TILE_ROWS rows × TILE_COLUMNS columns of
 * sums in registers (12 FMAs on 3 widenings and 7 loads). A job walks a block of ROW_BLOCK rows
 * and PANEL_COLUMNS columns DEPTH inputs at a time, so a tile's rows stay in L1 and the panel in
 * L2; between passes the sums wait in a scratch as the same 8 lanes. Every output's float32
 * order is the 2-row blocks' own: 8 lanes summed along k in order, hsum8, then the tail in
 * order, so a row gives the same bits alone, in a decode batch or in a prompt chunk. Widening
 * the panel into a float32 scratch once for all rows, 6 × 2 tiles and smaller blocks or passes
 * were no faster on an AVX2 EPYC (benchmarks/RESULTS.md, 2026-12-05). */
#define TILE_ROWS 4
#define TILE_COLUMNS 3
#define ROW_BLOCK 64      /* multiple of TILE_ROWS */
#define PANEL_COLUMNS 48  /* multiple of TILE_COLUMNS */
#define DEPTH 2048        /* multiple of 8 */

/* R rows (≤ TILE_ROWS) × NC columns (≤ TILE_COLUMNS) over inputs [from, to): x its first row,
 * w its first column, sums its first sum (stride PANEL_COLUMNS a row) */
static inline __attribute__((always_inline)) void
tile_avx2(const int R, const int NC, const float *x, int64_t k, const uint16_t *w, int64_t from, int64_t to,
          __m256 *sums) {
    __m256 acc[TILE_ROWS][TILE_COLUMNS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = sums[r * PANEL_COLUMNS + c];
    for (int64_t i = from; i < to; i += 8) {
        __m256 wv[TILE_COLUMNS];
        for (int c = 0; c < NC; c++) wv[c] = widen8(w + c * k + i);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * k + i);
            __asm__("" : "+x"(xv)); /* one load in a register, not one per column (1.1-1.6× measured) */
            for (int c = 0; c < NC; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) sums[r * PANEL_COLUMNS + c] = acc[r][c];
}

#define TILE_CASE(R, NC)                                                                                       \
    case (R) * 4 + (NC):                                                                                       \
        tile_avx2(R, NC, x, k, w, from, to, sums);                                                             \
        break;
/* tile_avx2 with R and NC as constants (the accumulators in registers) */
static void tile_any(int R, int NC, const float *x, int64_t k, const uint16_t *w, int64_t from, int64_t to,
                     __m256 *sums) {
    switch (R * 4 + NC) {
        TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    }
}
#undef TILE_CASE

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* out's rows [row, row + ROW_BLOCK) × columns [col, col + PANEL_COLUMNS), clipped to m × n */
static void tiled_block(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int64_t row,
                        int64_t col, __m256 *sums, float *out) {
    const int64_t rows = min64(ROW_BLOCK, m - row), cols = min64(PANEL_COLUMNS, n - col);
    const int64_t whole = k & ~(int64_t)7;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) sums[r * PANEL_COLUMNS + c] = _mm256_setzero_ps();
    for (int64_t from = 0; from < whole; from += DEPTH) {
        const int64_t to = min64(from + DEPTH, whole);
        for (int64_t r = 0; r < rows; r += TILE_ROWS)
            for (int64_t c = 0; c < cols; c += TILE_COLUMNS)
                tile_any((int)min64(TILE_ROWS, rows - r), (int)min64(TILE_COLUMNS, cols - c), x + (row + r) * k, k,
                         w + (col + c) * k, from, to, sums + r * PANEL_COLUMNS + c);
    }
    for (int64_t r = row; r < row + rows; r++)
        for (int64_t c = col; c < col + cols; c++) {
            float sum = hsum8(sums[(r - row) * PANEL_COLUMNS + c - col]);
            for (int64_t i = whole; i < k; i++) sum += bf16_load(w[c * k + i]) * x[r * k + i];
            out[r * n + c] = sum;
        }
}

/* gemm's many-row path: jobs of one block each, a thread's consecutive jobs sharing a panel */
static void gemm_tiled(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *out) {
    const int64_t row_blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK, panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
        __m256 *sums = aligned_alloc(sizeof(__m256), sizeof(__m256) * ROW_BLOCK * PANEL_COLUMNS);
        /* nowait: one barrier a call, as the 2-row path has (a loaded machine's wait is per barrier) */
#pragma omp for schedule(static) nowait
        for (int64_t job = 0; job < row_blocks * panels; job++)
            tiled_block(x, m, k, w, n, job % row_blocks * ROW_BLOCK, job / row_blocks * PANEL_COLUMNS, sums, out);
        free(sums);
    }
}
#else
static void columns(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t col, int64_t cols, int64_t n,
                    float *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = col; c < col + cols; c++) {
            float sum = 0.f;
            for (int64_t i = 0; i < k; i++) sum += bf16_load(w[c * k + i]) * x[r * k + i];
            out[r * n + c] = sum;
        }
}
#endif

/* out [m, n] in float32 from float32 activations [m, k] (contiguous), without the bias */
static void gemm(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *out) {
#if HAVE_AVX2
    if (m >= TILED_MIN_ROWS) {
        gemm_tiled(x, m, k, w, n, out);
        return;
    }
#endif
    int64_t jobs = (n + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t col = job * COLUMNS, cols = n - col < COLUMNS ? n - col : COLUMNS;
        columns(x, m, k, w, col, cols, n, out);
    }
}

/* ---- the per-type entry points ----------------------------------------------------------- */

void dense_matmul_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, const float *bias,
                      int64_t n, float *out) {
    float *xf = NULL;
    if (ldx != k) {
        xf = malloc(sizeof(float) * (size_t)(m * k));
        for (int64_t r = 0; r < m; r++) memcpy(xf + r * k, x + r * ldx, sizeof(float) * (size_t)k);
    }
    gemm(xf ? xf : x, m, k, w, n, out);
    free(xf);
    if (bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < n; c++) out[r * n + c] += bias[c];
}

void dense_matmul_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w,
                       const uint16_t *bias, int64_t n, uint16_t *out) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * n)), *of = xf + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_load(x[r * ldx + i]);
    gemm(xf, m, k, w, n, of);
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) out[r * n + c] = bf16_store(of[r * n + c] + (bias ? bf16_load(bias[c]) : 0.f));
    free(xf);
}

/* ---- the product on AMX tiles (dense_bf16_amx.h) -------------------------------------------- */

int64_t dense_amx(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

void dense_matmul_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, const uint16_t *bias,
                      int64_t n, uint16_t *out) {
#if HAVE_AMX
    if (amx_permitted()) {
        amx_dense(x, ldx, m, k, w, bias, n, out);
        return;
    }
#endif
    dense_matmul_bf16(x, ldx, m, k, w, bias, n, out);
}
