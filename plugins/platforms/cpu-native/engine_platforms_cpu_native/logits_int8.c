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
#include "top_heap.h"
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

/* One thread's candidates for a row's `top` largest logits over its columns: every value not
 * below the row's floor (kept apart, logit_sink.floor: the one thing each vector reads), a bound
 * that stays at most the row's top-th largest, so no entry of the row's top is ever left out.
 * When a vector more would not fit, the floor rises (raise_floor) and the values below it go;
 * `full` marks a row whose ties leave no room (its top cannot be told: nothing enters after).
 * NaN never enters. Why not a heap: a row's scan lets ~500 values in (its threshold starts low
 * and rises slowly), and a sift-down for each took 9 ms at 256 rows where storing every logit
 * took 7; an exact top-th largest (quickselect) at each rise took as long. */
#define CANDIDATES 256
typedef struct {
    float value[CANDIDATES + 16];
    int32_t column[CANDIDATES + 16];
    int64_t size;
    int full;
} candidates;

/* The least of the maxima of `top` groups of c's values (value i in group i mod top): `top`
 * values lie at or above it, so it is at most their top-th largest (size ≥ top). On AVX-512, for
 * a `top` of whole vectors, group g's maximum builds in lane g mod 16 of accumulator g / 16. */
static float group_floor(const candidates *c, int64_t top) {
#if defined(__AVX512F__)
    if (top % 16 == 0 && top <= 64) {
        __m512 most[4];
        int64_t vectors = top / 16;
        for (int64_t j = 0; j < 4; j++) most[j] = _mm512_loadu_ps(c->value + 16 * (j < vectors ? j : 0));
        for (int64_t i = top; i < c->size; i += 16) {
            __mmask16 live = c->size - i >= 16 ? 0xFFFF : (__mmask16)((1u << (c->size - i)) - 1);
            int64_t j = i % top / 16;
            most[j] = _mm512_mask_max_ps(most[j], live, most[j], _mm512_maskz_loadu_ps(live, c->value + i));
        }
        for (int64_t j = 1; j < vectors; j++) most[0] = _mm512_min_ps(most[0], most[j]);
        return _mm512_reduce_min_ps(most[0]);
    }
#endif
    float least = INFINITY;
    for (int64_t g = 0; g < top; g++) {
        float most = c->value[g];
        for (int64_t i = g + top; i < c->size; i += top) most = c->value[i] > most ? c->value[i] : most;
        least = most < least ? most : least;
    }
    return least;
}

/* *floor up to group_floor (where c holds `top` values), the values below it dropped, order kept */
static void raise_floor(candidates *c, int64_t top, float *floor) {
    if (c->size < top) return;
    float least = group_floor(c, top);
    *floor = least > *floor ? least : *floor;
    int64_t kept = 0;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < c->size; i += 16) {
        __mmask16 live = c->size - i >= 16 ? 0xFFFF : (__mmask16)((1u << (c->size - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(live, c->value + i);
        __mmask16 keep = _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(*floor), _CMP_GE_OQ);
        _mm512_mask_compressstoreu_ps(c->value + kept, keep, v);
        _mm512_mask_compressstoreu_epi32(c->column + kept, keep, _mm512_maskz_loadu_epi32(live, c->column + i));
        kept += __builtin_popcount(keep);
    }
#else
    for (int64_t i = 0; i < c->size; i++)
        if (c->value[i] >= *floor) c->value[kept] = c->value[i], c->column[kept++] = c->column[i];
#endif
    c->size = kept;
}

/* room for `more` values (0 where the row is full) */
static inline int make_room(candidates *c, int64_t more, int64_t top, float *floor) {
    if (c->size + more > CANDIDATES) raise_floor(c, top, floor);
    if (c->size + more > CANDIDATES) c->full = 1, *floor = INFINITY;
    return !c->full;
}

/* Where a product's logits go: into out (row stride n), streamed past the caches where `stream`
 * says (whole, aligned vectors), or, where rows is not NULL, to each row's candidates (rows[r],
 * floor[r], for their `top` largest) and nowhere else. */
typedef struct {
    float *out;
    int stream;
    candidates *rows;
    float *floor;
    int64_t top;
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
    if (sink->rows) {
        candidates *c = sink->rows + r;
        float *floor = sink->floor + r;
        mask &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(*floor), _CMP_GE_OQ);
        if (!mask || !make_room(c, TILE, sink->top, floor)) return;
        mask &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(*floor), _CMP_GE_OQ);
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        _mm512_mask_compressstoreu_ps(c->value + c->size, mask, v);
        _mm512_mask_compressstoreu_epi32(c->column + c->size, mask, _mm512_add_epi32(lane, _mm512_set1_epi32((int)col)));
        c->size += __builtin_popcount(mask);
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
        logit_sink own = *sink; /* a thread's own candidates */
        if (sink->rows) own.rows += (int64_t)omp_get_thread_num() * m, own.floor += (int64_t)omp_get_thread_num() * m;
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
            candidates *c = sink->rows ? sink->rows + r : NULL;
            if (!c) sink->out[r * n + col] = v;
            else if (v >= sink->floor[r] && make_room(c, 1, sink->top, sink->floor + r))
                c->value[c->size] = v, c->column[c->size++] = (int32_t)col;
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
    logit_sink sink = {out, m * n * (int64_t)sizeof(float) > STREAM_BYTES, NULL, NULL, 0};
    product(x, ldx, m, k, w8, scale, n, &sink);
}

/* Each thread keeps candidates a row over its own columns; a row's then merge into one heap
 * (top_heap.h), whose total order keeps the entries a single pass keeps. A row whose candidates
 * are too few (NaN) or too many (ties) to tell its top gets NaN values. */
void logits_int8_top(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                     int64_t n, int64_t top, int64_t *best, float *approx) {
    int64_t threads = omp_get_max_threads();
    candidates *rows = malloc(sizeof(candidates) * (size_t)(threads * m));
    float *floor = malloc(sizeof(float) * (size_t)(threads * m));
    for (int64_t i = 0; i < threads * m; i++) rows[i].size = 0, rows[i].full = 0, floor[i] = -INFINITY;
    logit_sink sink = {NULL, 0, rows, floor, top};
    product(x, ldx, m, k, w8, scale, n, &sink);
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t r = 0; r < m; r++) {
        top_heap merged = {best + r * top, approx + r * top, 0, top};
        int full = 0;
        for (int64_t t = 0; t < threads; t++) {
            candidates *c = rows + t * m + r;
            full |= c->full;
            for (int64_t i = 0; i < c->size; i++) top_offer(&merged, c->value[i], c->column[i]);
        }
        if (full || merged.size < top)
            for (int64_t i = 0; i < top; i++) best[r * top + i] = 0, approx[r * top + i] = NAN;
    }
    free(rows);
    free(floor);
}
