/* FP4 (e2m1) weights with a float32 scale per block of inputs times float activations: NVFP4
 * (blocks of 16, scale = e4m3 / global) and MXFP4 (blocks of 32, scale = 2^e) as checkpoints
 * store them, the codes never widened in memory (0.5 B a weight, plus 4 B a block).
 *
 * An e2m1 value doubled is an integer in −12…12, so a code decodes by one byte shuffle
 * (vpshufb on a 16-entry table), then widens to float32; each block's dot product with the
 * activations is taken in float32 and scaled by scale / 2 (exact: a power of two). The
 * activations are used as they are (bfloat16 widened exactly): the result is the weight's exact
 * values times x, but for float32 summation order. That is the point against the group-affine
 * kernel (quant_gemm.c): an e4m3 block scale is no power of two, so NVFP4 does not fold into
 * its integer weights (the values would need 9 bits), and blocks of 16 are not its groups.
 *
 * Layout: the checkpoint's own, row by row, so packing is a copy. The GEMM walks 4 output
 * columns at a time (each a row of codes), decoding a column's 16 inputs once for up to 2
 * activation rows; columns are split over OpenMP threads when the work is big enough. Built
 * without AVX2 and FMA, the same sums run in plain C (the tests compare the builds).
 */
#include "fp4_gemm.h"
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

#define COLUMNS 4             /* output columns a job walks together */
#define PARALLEL_WORK (1 << 18) /* multiply-adds from which a call is split over threads (quant_gemm.c's) */

static const int8_t DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

int64_t fp4_simd_width(void) { return HAVE_AVX2 ? 256 : 0; }

#if HAVE_AVX2
/* 16 consecutive codes (8 bytes) as doubled values in two float32 vectors, times half */
static inline void decode16(const uint8_t *p, __m128i table, __m256 half, __m256 *w0, __m256 *w1) {
    const __m128i low = _mm_set1_epi8(15);
    __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    __m128i v = _mm_shuffle_epi8(table, codes);
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), half);
    *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), half);
}

/* R activation rows (≤ 2) × NC columns (≤ COLUMNS) from column col: out[r * n + col + c] */
static inline __attribute__((always_inline)) void
block_avx2(const int R, const int NC, const float *x, int64_t k, const uint8_t *codes, const float *scale,
           int64_t block, int64_t col, int64_t n, float *out) {
    const __m128i table = _mm_loadu_si128((const __m128i *)DOUBLED);
    const int64_t blocks = k / block;
    __m256 acc[2][COLUMNS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = b * block; i < (b + 1) * block; i += 16)
            for (int c = 0; c < NC; c++) {
                __m256 w0, w1, half = _mm256_set1_ps(0.5f * scale[(col + c) * blocks + b]);
                decode16(codes + (col + c) * (k / 2) + i / 2, table, half, &w0, &w1);
                for (int r = 0; r < R; r++) {
                    acc[r][c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc[r][c]);
                    acc[r][c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc[r][c]);
                }
            }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) out[r * n + col + c] = hsum8(acc[r][c]);
}

#define FP4_CASE(R, NC, COL) block_avx2(R, NC, x + r * k, k, codes, scale, block, COL, n, out + r * n)
static void columns(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scale, int64_t block,
                    int64_t col, int64_t cols, int64_t n, float *out) {
    for (int64_t r = 0; r < m; r += 2) {
        int two = r + 1 < m;
        if (cols == COLUMNS) {
            if (two) FP4_CASE(2, COLUMNS, col); else FP4_CASE(1, COLUMNS, col);
        } else {
            for (int64_t c = col; c < col + cols; c++) {
                if (two) FP4_CASE(2, 1, c); else FP4_CASE(1, 1, c);
            }
        }
    }
}
#undef FP4_CASE
#else
/* Plain C: per block, the doubled values' dot product in float32, times scale / 2. */
static void columns(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scale, int64_t block,
                    int64_t col, int64_t cols, int64_t n, float *out) {
    const int64_t blocks = k / block;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = col; c < col + cols; c++) {
            float acc = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                float dot = 0.f;
                for (int64_t i = b * block; i < (b + 1) * block; i++) {
                    uint8_t byte = codes[c * (k / 2) + i / 2];
                    dot += (float)DOUBLED[i % 2 ? byte >> 4 : byte & 15] * x[r * k + i];
                }
                acc += dot * (0.5f * scale[c * blocks + b]);
            }
            out[r * n + c] = acc;
        }
}
#endif

/* out [m, n] in float32 from float32 activations [m, k] (contiguous) */
static void gemm(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scale, int64_t block,
                 int64_t n, float *out) {
    int64_t jobs = (n + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t col = job * COLUMNS, cols = n - col < COLUMNS ? n - col : COLUMNS;
        columns(x, m, k, codes, scale, block, col, cols, n, out);
    }
}

/* ---- the per-type entry points ----------------------------------------------------------- */

void fp4_matmul_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *codes, const float *scale,
                    int64_t block, int64_t n, float *out) {
    if (ldx == k) {
        gemm(x, m, k, codes, scale, block, n, out);
        return;
    }
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t r = 0; r < m; r++) memcpy(xf + r * k, x + r * ldx, sizeof(float) * (size_t)k);
    gemm(xf, m, k, codes, scale, block, n, out);
    free(xf);
}

void fp4_matmul_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *codes, const float *scale,
                     int64_t block, int64_t n, uint16_t *out) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * n)), *of = xf + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_load(x[r * ldx + i]);
    gemm(xf, m, k, codes, scale, block, n, of);
    for (int64_t i = 0; i < m * n; i++) out[i] = bf16_store(of[i]);
    free(xf);
}

#define DEQUANTIZE(STORE)                                                                      \
    const int64_t blocks = k / block;                                                            \
    _Pragma("omp parallel for schedule(static) if (n * k >= (1 << 18))")                         \
    for (int64_t c = 0; c < n; c++)                                                               \
        for (int64_t i = 0; i < k; i++) {                                                         \
            uint8_t byte = codes[c * (k / 2) + i / 2];                                            \
            float half = 0.5f * scale[c * blocks + i / block];                                    \
            out[c * k + i] = STORE((float)DOUBLED[i % 2 ? byte >> 4 : byte & 15] * half);         \
        }

void fp4_dequantize_bf16(const uint8_t *codes, const float *scale, int64_t block, int64_t k, int64_t n,
                         uint16_t *out) {
    DEQUANTIZE(bf16_store)
}

void fp4_dequantize_f32(const uint8_t *codes, const float *scale, int64_t block, int64_t k, int64_t n, float *out) {
    DEQUANTIZE(f32_store)
}
#undef DEQUANTIZE
