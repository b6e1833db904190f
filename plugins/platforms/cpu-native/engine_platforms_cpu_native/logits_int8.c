/* A vocabulary's logits on AMX int8 tiles, for batched steps: the LM head with no dequantization.
 *
 * Why: the group-affine product on bf16 tiles (quant_gemm_amx.h) spends about half of the LM
 * head's time turning the table's values into bf16 B tiles, work the tiles cannot overlap. A
 * GGUF table's scales change every 32 inputs, so int8 tiles over its own blocks would have to be
 * stored and scaled per group. This keeps a second copy of the table instead, rounded to int8
 * with one scale a row (absmax / 127: k bytes a row, 28 MB for a 49 152 × 576 table), whose
 * products need one scaling each at the end. The activations are split per row into two int8
 * halves, x ≈ a · (hi + lo / 254) with a = absmax / 127 (hi = round(x / a), lo the rounded
 * remainder), about 16 bits of each value: two tdpbssd a tile, the tile time of one bf16
 * product of the same inputs, and no rounding of x coarser than bf16's. What remains is the
 * table's rounding to its per-row grid; the caller recomputes each row's largest logits exactly
 * (quant_gemm.c's affine_refine_logits), so sampling sees exact values where it looks.
 *
 * Layout (logits_int8_pack): columns in tiles of 16, inputs in chunks of 64; tile t's chunk c is
 * one B tile of 1 KiB at w8 + (t · chunks + c) · 1024, row p holding inputs 4p…4p + 3 of column
 * c at bytes 4c…4c + 3, columns padded to a panel of 32; the padding (columns past n, inputs past
 * k) stays as the caller zeroed it. The int32 sums are exact, then out = (hi_sum + lo_sum ·
 * (1/254)) · a · scale in float, the same operations in the plain C built without AMX, so both
 * builds give the same bits.
 */
#include "logits_int8.h"
#include "engine_bf16.h"
#include "top_candidates.h"
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define HAVE_AMX_INT8 1
#include "amx_tiles.h"
#else
#define HAVE_AMX_INT8 0
#endif

#define TILE 16
#define CHUNK 64                       /* inputs of one int8 B tile */
#define PANEL (2 * TILE)               /* columns a thread takes at a time: two B tiles */
#define LO_STEPS 254.f                 /* lo counts the remainder in 1/254ths of a */
#define PARALLEL_WORK (1 << 18)        /* quant_gemm.c's: multiply-adds from which a call splits */

static int64_t chunks(int64_t k) { return (k + CHUNK - 1) / CHUNK; }
static int64_t padded_columns(int64_t n) { return (n + PANEL - 1) / PANEL * PANEL; }

int64_t logits_int8_bytes(int64_t n, int64_t k) { return padded_columns(n) * chunks(k) * CHUNK; }

int64_t logits_int8_amx(void) {
#if HAVE_AMX_INT8
    return amx_permitted();
#else
    return 0;
#endif
}

/* Where column col's input `input` lies in w8 (the layout above). */
static int64_t tile_offset(int64_t k, int64_t col, int64_t input) {
    return ((col / TILE) * chunks(k) + input / CHUNK) * TILE * CHUNK + (input % CHUNK / 4) * 64 + (col % TILE) * 4 +
           input % 4;
}

void logits_int8_pack(const float *w, int64_t row0, int64_t rows, int64_t k, int8_t *w8, float *scale) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = w + r * k;
        float most = 0.f;
        for (int64_t i = 0; i < k; i++) most = fmaxf(most, fabsf(row[i]));
        float s = most / 127.f, inverse = most > 0.f ? 127.f / most : 0.f;
        scale[row0 + r] = s;
        for (int64_t i = 0; i < k; i++) w8[tile_offset(k, row0 + r, i)] = (int8_t)lrintf(row[i] * inverse);
    }
}

/* Row r of x as hi and lo [chunks · 64] (zero past k) and its scale. */
static float split_row(const uint16_t *x, int64_t k, int8_t *hi, int8_t *lo) {
    float most = 0.f;
    for (int64_t i = 0; i < k; i++) most = fmaxf(most, fabsf(bf16_load(x[i])));
    float inverse = most > 0.f ? 127.f / most : 0.f;
    memset(hi + k, 0, (size_t)(chunks(k) * CHUNK - k));
    memset(lo + k, 0, (size_t)(chunks(k) * CHUNK - k));
    for (int64_t i = 0; i < k; i++) {
        float v = bf16_load(x[i]) * inverse, h = rintf(v);
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)rintf((v - h) * LO_STEPS);
    }
    return most / 127.f;
}

/* The float logit of a row (scale a) and a column (scale s) from its two exact int32 sums. */
static inline float logit(int32_t hi_sum, int32_t lo_sum, float a, float s) {
    return ((float)hi_sum + (float)lo_sum * (1.f / LO_STEPS)) * a * s;
}

/* Logits of more bytes than this go past the caches (non-temporal stores): a 256-row step's 50 MB
 * would not stay there for the refinement that reads them next, and a plain store reads each
 * line in before writing it (9 against 12 ms a step). Fewer stay partly cached, which the
 * refinement's read-back gains from (64 rows' 12.6 MB: 2 % more throughput with plain stores). */
#define STREAM_BYTES (32 << 20)

/* Where a product's logits go: into out (row stride n), streamed past the caches where `stream`
 * says (whole, aligned vectors), or, where kept.rows is not NULL, to a thread's candidates for
 * each row's top (top_candidates.h) and nowhere else. */
typedef struct {
    float *out;
    int stream;
    const top_candidates *all;
    candidate_rows kept; /* the calling thread's share of all */
} logit_sink;

#if HAVE_AMX_INT8
/* Tile registers (amx_tiles.h's names): C0<j> = hi · B<j>, C1<j> = lo · B<j>; A0 the rows' hi,
 * A1 their lo. */
static void configure(int rows) {
    tile_config config = {.palette = 1};
    int tile_rows[8] = {rows, rows, rows, rows, rows, rows, TILE, TILE};
    for (int t = 0; t < 8; t++) config.rows[t] = (uint8_t)tile_rows[t], config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* 16 logits of row r at columns [col, col + 16) (mask: those below n) into the sink */
static inline void sink_logits(const logit_sink *sink, int64_t r, int64_t n, int64_t col, __mmask16 mask, __m512 v) {
    if (sink->kept.rows) {
        offer16(sink->kept.rows + r, sink->kept.floor + r, sink->kept.top, col, mask, v);
        return;
    }
    float *to = sink->out + r * n + col;
    if (sink->stream && mask == 0xFFFF && ((uintptr_t)to & 63) == 0) _mm512_stream_ps(to, v);
    else _mm512_mask_storeu_ps(to, mask, v);
}

/* rows r0… (≤ 16) of hi/lo (row stride kp) against the panel of tiles b0, b1: the logits of
 * columns [col, col + 32) ∩ [0, n) into the sink */
static void panel_block(const int8_t *hi, const int8_t *lo, int64_t kp, int64_t r0, int rows, const int8_t *b0,
                        const int8_t *b1, const float *a, const float *scale, int64_t col, int64_t n,
                        const logit_sink *sink) {
    _tile_zero(C00);
    _tile_zero(C01);
    _tile_zero(C10);
    _tile_zero(C11);
    for (int64_t c = 0; c < kp / CHUNK; c++) {
        _tile_loadd(B0, b0 + c * TILE * CHUNK, 64);
        _tile_loadd(A0, hi + c * CHUNK, kp);
        _tile_dpbssd(C00, A0, B0);
        _tile_loadd(A1, lo + c * CHUNK, kp);
        _tile_dpbssd(C10, A1, B0);
        _tile_loadd(B1, b1 + c * TILE * CHUNK, 64);
        _tile_dpbssd(C01, A0, B1);
        _tile_dpbssd(C11, A1, B1);
    }
    int32_t sums[2][TILE][PANEL];
    _tile_stored(C00, sums[0][0], PANEL * 4);
    _tile_stored(C01, sums[0][0] + TILE, PANEL * 4);
    _tile_stored(C10, sums[1][0], PANEL * 4);
    _tile_stored(C11, sums[1][0] + TILE, PANEL * 4);
    const __m512 steps = _mm512_set1_ps(1.f / LO_STEPS);
    for (int h = 0; h < 2 && col + h * TILE < n; h++) {
        int64_t left = n - col - h * TILE;
        __mmask16 mask = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 s = _mm512_maskz_loadu_ps(mask, scale + col + h * TILE);
        for (int r = 0; r < rows; r++) {
            __m512 hs = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[0][r] + h * TILE));
            __m512 ls = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[1][r] + h * TILE));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(hs, _mm512_mul_ps(ls, steps)), _mm512_set1_ps(a[r])), s);
            sink_logits(sink, r0 + r, n, col + h * TILE, mask, v);
        }
    }
}

static void product_amx(const int8_t *hi, const int8_t *lo, const float *a, int64_t m, int64_t k, const int8_t *w8,
                        const float *scale, int64_t n, const logit_sink *sink) {
    int64_t kp = chunks(k) * CHUNK, panels = padded_columns(n) / PANEL, tile_bytes = chunks(k) * TILE * CHUNK;
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
        int configured = -1;
        logit_sink own = *sink;
        own.kept = thread_rows(sink->all, omp_get_thread_num());
#pragma omp for schedule(static)
        for (int64_t i = 0; i < panels; i++)
            for (int64_t r = 0; r < m; r += TILE) {
                int rows = m - r < TILE ? (int)(m - r) : TILE;
                if (rows != configured) configure(rows);
                configured = rows;
                const int8_t *b0 = w8 + 2 * i * tile_bytes;
                panel_block(hi + r * kp, lo + r * kp, kp, r, rows, b0, b0 + tile_bytes, a + r, scale, i * PANEL, n,
                            &own);
            }
        if (configured >= 0) _tile_release();
        _mm_sfence();
    }
}
#endif

/* The same sums in plain C, a row at a time in rising columns: column col of the table against
 * the row's hi and lo. */
static void product_c(const int8_t *hi, const int8_t *lo, const float *a, int64_t m, int64_t k, const int8_t *w8,
                      const float *scale, int64_t n, const logit_sink *sink) {
    int64_t kp = chunks(k) * CHUNK;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t r = 0; r < m; r++)
        for (int64_t col = 0; col < n; col++) {
            int32_t hs = 0, ls = 0;
            for (int64_t i = 0; i < kp; i++) {
                int8_t w = w8[tile_offset(k, col, i)];
                hs += hi[r * kp + i] * w;
                ls += lo[r * kp + i] * w;
            }
            float v = logit(hs, ls, a[r], scale[col]);
            if (!sink->kept.rows) sink->out[r * n + col] = v;
            else offer_one(sink->kept.rows + r, sink->kept.floor + r, sink->kept.top, v, col);
        }
}

/* x's rows split (split_row) and multiplied by the table into the sink */
static void product(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                    int64_t n, const logit_sink *sink) {
    int64_t kp = chunks(k) * CHUNK;
    int8_t *hi = malloc((size_t)(m * kp)), *lo = malloc((size_t)(m * kp));
    float *a = malloc(sizeof(float) * (size_t)m);
    for (int64_t r = 0; r < m; r++) a[r] = split_row(x + r * ldx, k, hi + r * kp, lo + r * kp);
#if HAVE_AMX_INT8
    if (amx_permitted()) product_amx(hi, lo, a, m, k, w8, scale, n, sink);
    else
#endif
        product_c(hi, lo, a, m, k, w8, scale, n, sink);
    free(hi);
    free(lo);
    free(a);
}

void logits_int8(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                 int64_t n, float *out) {
    logit_sink sink = {out, m * n * (int64_t)sizeof(float) > STREAM_BYTES, NULL, thread_rows(NULL, 0)};
    product(x, ldx, m, k, w8, scale, n, &sink);
}

/* Each thread keeps candidates a row over its own columns, merged after (top_candidates.h). */
void logits_int8_top(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                     int64_t n, int64_t top, int64_t *best, float *approx) {
    top_candidates all = top_candidates_new(m, top);
    logit_sink sink = {NULL, 0, &all, thread_rows(&all, 0)};
    product(x, ldx, m, k, w8, scale, n, &sink);
    top_candidates_merge(all, best, approx, m * n * k >= PARALLEL_WORK);
}

/* A row's product is the same alone as in any batch (exact int32 sums, one scaling a logit), so
 * each such row is multiplied alone: none in nearly every step, where this costs a pass over the
 * tokens. */
void logits_int8_unsettled(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8,
                           const float *scale, int64_t n, const int64_t *tokens, float *out) {
    for (int64_t r = 0; r < m; r++)
        if (tokens[r] < 0) logits_int8(x + r * ldx, ldx, 1, k, w8, scale, n, out + r * n);
}
