/* quant_gemm.c's product on AMX tiles, for batched steps: x bf16 [m, k] times the packed weight,
 * dequantized on the fly. Included by quant_gemm.c only, after its layout helpers.
 *
 * Why dequantize rather than multiply int8 tiles: GGUF's scales change every 32 inputs, so an
 * int8 tile product (tdpbsud) must be stored and scaled per group and per 16 rows, which is
 * what the VNNI kernel spends its time on too (an int8 tile kernel gave ~1.1×, docs/decisions.md).
 * Dequantizing the weight instead costs the same whatever the number of rows: each thread turns
 * panels of 32 output columns × all k inputs into bf16 B tiles (in its L2, k · 64 bytes each) once
 * a pass of rows (pass_rows: every row of a decode step), a set of them at a time, then runs
 * those rows against the set with tdpbf16ps. Memory reads the 4-bit weight, a quarter
 * of the bf16 copy's bytes, which is what bounds a decode step of tens of rows.
 *
 * The weight values are affine_dequantize's, bf16(q · scale + offset) with the product and the
 * sum each rounded to float as the plain C does, so this is x times the dense bf16 weight, with
 * float sums in the tiles' order.
 *
 * B tile layout (bf16 "VNNI" pairs): a 32-input group of 16 columns is 16 rows of 64 bytes, row
 * p holding inputs 2p and 2p + 1 of each column c at words 2c and 2c + 1. The packed 4-bit step j
 * (quant_gemm.c) holds column c's inputs 8j…8j+3 in the low nibbles of bytes 4c…4c+3 and
 * 8j+4…8j+7 in the high ones (an 8-bit step: inputs 4j…4j+3 in bytes 4c…4c+3). One masked
 * vpermb gathers half a B row (8 columns × 2 inputs) into float lanes in the row's order, and
 * vcvtne2ps2bf16 joins two scaled halves into the row. */

#include "amx_tiles.h"
#include <omp.h>

#define PANEL_TILES 2                     /* B tiles (16 columns each) a panel holds */
#define B_TILE_BYTES (TILE * 64)          /* one group's B tile: 16 rows of 32 bf16 */

/* A<i>: row block i of x; B<j>: panel tile j of the dequantized weight (amx_tiles.h's registers) */

/* This thread's tiles for a row block of rows0 (1…16) and rows1 (0…16) rows. */
static void configure_tiles(int rows0, int rows1) {
    tile_config config = {.palette = 1};
    int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, TILE, TILE};
    for (int t = 0; t < 8; t++)
        if (rows[t]) config.rows[t] = (uint8_t)rows[t], config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* Lane l of half `half` of a B row holds column 8·half + l/2 (its two inputs in lanes 2c, 2c + 1). */
static inline __m512i lane_column(int half) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_epi32(_mm512_srli_epi32(lane, 1), _mm512_set1_epi32(8 * half));
}

/* The vpermb indices that gather B row `pair` (inputs 2·pair, 2·pair + 1 of a 4-input step)
 * for columns 8·half…8·half + 7 from a 64-byte step (byte 4c + i: column c, input i): dword l
 * takes byte 4(8·half + l/2) + 2·pair + l%2, into its byte `at` (the other bytes' indices are
 * never used: the permute is masked to byte `at`). */
static inline __m512i row_index(int half, int pair, int at) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i source = _mm512_add_epi32(_mm512_slli_epi32(lane_column(half), 2),
                                      _mm512_add_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(1)),
                                                       _mm512_set1_epi32(2 * pair)));
    return _mm512_slli_epi32(source, 8 * at);
}

/* 16 per-column values spread as the lanes of half `half` of a B row. */
static inline __m512 per_half(__m512 v, int half) { return _mm512_permutexvar_ps(lane_column(half), v); }

/* One group's scaling, per half of the tile's columns: w = q · scale + offset, the product and
 * the sum each rounded as affine_dequantize rounds them. A 4-bit q arrives as the float
 * 1 + q/128 (q in byte 2 of 1.0's bits: one masked vpermb, no conversion); minus 1 it is q/128
 * exactly, so its product with 128 · scale is q · scale rounded once. 8-bit ones are converted. */
typedef struct {
    __m512 multiplier[2], addend[2];
} group_scaling;

static inline group_scaling scaling(const void *sz, int64_t form, int64_t bits, int64_t at) {
    __m512 scale = load16_sz(sz, form, at), offset = load16_offset(sz, form, bits, at, scale);
    group_scaling g;
    for (int half = 0; half < 2; half++) {
        __m512 s = per_half(scale, half), o = per_half(offset, half);
        g.multiplier[half] = bits == 4 ? _mm512_mul_ps(s, _mm512_set1_ps(128.f)) : s;
        g.addend[half] = o;
    }
    return g;
}

/* The row indices, built once per call: [bits == 8][half][pair]. */
typedef struct {
    __m512i at[2][2][2];
} row_indices;

static row_indices make_row_indices(void) {
    row_indices r;
    for (int wide = 0; wide < 2; wide++)
        for (int half = 0; half < 2; half++)
            for (int pair = 0; pair < 2; pair++) r.at[wide][half][pair] = row_index(half, pair, wide ? 0 : 2);
    return r;
}

/* B row `pair` of a step's values (4-bit: one nibble's, each byte 0x80 | q) as 32 bf16 at row. */
static inline void b_row(__m512i values, const row_indices *index, const group_scaling *g, int bits, int pair,
                         uint16_t *row) {
    __m512 f[2];
    for (int half = 0; half < 2; half++) {
        if (bits == 4) {
            const __m512i one = _mm512_set1_epi32(0x3F800000);
            __m512i v = _mm512_mask_permutexvar_epi8(one, (__mmask64)0x4444444444444444ull, index->at[0][half][pair], values);
            __m512 q = _mm512_sub_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(1.f));  /* q/128, exact */
            f[half] = _mm512_add_ps(_mm512_mul_ps(q, g->multiplier[half]), g->addend[half]);
        } else {
            __m512i v = _mm512_maskz_permutexvar_epi8((__mmask64)0x1111111111111111ull, index->at[1][half][pair], values);
            f[half] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), g->multiplier[half]), g->addend[half]);
        }
    }
    _mm512_store_si512(row, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
}

/* One packed tile's group g as a B tile at b (aligned): 4 steps of 8 inputs (4-bit) or 8 of 4. */
static inline void dequantize_b_tile(const uint8_t *steps, const void *sz, int64_t form, int64_t bits, int64_t at,
                                     const row_indices *index, uint16_t *b) {
    group_scaling g = scaling(sz, form, bits, at);
    const __m512i low = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < GROUP / (int)step_bytes(bits); j++, steps += 64) {
        __m512i bytes = _mm512_loadu_si512((const void *)steps);
        if (bits == 4) {  /* each nibble with 1.0's byte-2 bit (the exponent's lowest): (a & b) | c */
            __m512i lo = _mm512_ternarylogic_epi32(bytes, low, exponent, 0xEA);
            __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 4), low, exponent, 0xEA);
            for (int pair = 0; pair < 2; pair++) {
                b_row(lo, index, &g, 4, pair, b + (4 * j + pair) * 32);
                b_row(hi, index, &g, 4, pair, b + (4 * j + 2 + pair) * 32);
            }
        } else {
            for (int pair = 0; pair < 2; pair++) b_row(bytes, index, &g, 8, pair, b + (2 * j + pair) * 32);
        }
    }
}

/* Where the weight's panel lies: its first tile, how many (1 or PANEL_TILES) and its B tiles,
 * group-major (group g's tile t at b + (g · PANEL_TILES + t) · B_TILE_BYTES / 2). */
typedef struct {
    const uint8_t *qw;
    const void *sz;
    int64_t form, bits, k, tile0;
    int tiles;
    const row_indices *index;
    uint16_t *b;
} panel;

/* Group g of the panel's tiles into its B tiles. */
static inline void dequantize_group(const panel *p, int64_t g) {
    int64_t groups = p->k / GROUP;
    for (int t = 0; t < p->tiles; t++) {
        const uint8_t *steps = p->qw + group_at(p->bits, groups, p->tile0 + t, g);
        dequantize_b_tile(steps, p->sz, p->form, p->bits, sz_index(p->form, groups, p->tile0 + t, g, 0), p->index,
                          p->b + (g * PANEL_TILES + t) * B_TILE_BYTES / 2);
    }
}

/* The float sums of one row block (rows0 + rows1 rows from x) against the panel into sums
 * [32 rows, 32 columns], the tiles configured for the block. A pass's first block dequantizes
 * each group just before its products (`fresh`: the fastest of the orders tried, against the
 * whole panel first or the next group after the products, docs/decisions.md); the later blocks
 * reread the B tiles from the cache. */
static void multiply_block(const uint16_t *x, int64_t ldx, const panel *p, int fresh, int rows1, float *sums) {
    const int64_t stride = ldx * 2, groups = p->k / GROUP, sums_stride = PANEL_TILES * TILE * 4;
    const int two = p->tiles > 1;
    _tile_zero(C00);
    if (two) _tile_zero(C01);
    if (rows1) {
        _tile_zero(C10);
        if (two) _tile_zero(C11);
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *b = p->b + g * PANEL_TILES * B_TILE_BYTES / 2;
        if (fresh) dequantize_group(p, g);
        _tile_loadd(B0, b, 64);
        _tile_loadd(A0, x + g * GROUP, stride);
        _tile_dpbf16ps(C00, A0, B0);
        if (rows1) {
            _tile_loadd(A1, x + TILE * ldx + g * GROUP, stride);
            _tile_dpbf16ps(C10, A1, B0);
        }
        if (two) {
            _tile_loadd(B1, b + B_TILE_BYTES / 2, 64);
            _tile_dpbf16ps(C01, A0, B1);
            if (rows1) _tile_dpbf16ps(C11, A1, B1);
        }
    }
    _tile_stored(C00, sums, sums_stride);
    if (two) _tile_stored(C01, sums + TILE, sums_stride);
    if (rows1) {
        _tile_stored(C10, sums + TILE * PANEL_TILES * TILE, sums_stride);
        if (two) _tile_stored(C11, sums + TILE * PANEL_TILES * TILE + TILE, sums_stride);
    }
}

/* rows of sums [.., 32] into out's columns [col, min(col + 32, n)) as bf16 or float32 */
static void store_sums(const float *sums, int64_t rows, int64_t col, int64_t n, int out_f32, void *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < PANEL_TILES && col + h * TILE < n; h++) {
            int64_t left = n - col - h * TILE;
            __mmask16 mask = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_loadu_ps(sums + r * PANEL_TILES * TILE + h * TILE);
            if (out_f32) _mm512_mask_storeu_ps((float *)out + r * n + col + h * TILE, mask, v);
            else store16_bf16((uint16_t *)out + r * n + col + h * TILE, mask, v);
        }
}

/* Panels a thread dequantizes together before its row blocks run against them: as many as fit
 * SET_BYTES of B tiles (k · 64 bytes a panel), so that a 32-row block of x (k · 64 bytes too),
 * read once for all of them, is reread from L1 for each, where a panel at a time reread every
 * block from L2 for every panel (what bounded the products of a step of hundreds of rows). Only
 * where a row block fits L1 (k up to 640: the default model's but its down projection); longer
 * rows keep a panel a set, which measured faster there. */
#define SET_BYTES (512 * 1024)
#define L1_BLOCK_BYTES (40 * 1024)

/* How many panel sets: whole multiples of `threads`, or one a panel (then each set's panels are
 * as even as the division gives). */
static int64_t panel_sets(int64_t panels, int64_t k, int threads) {
    if (k * 64 > L1_BLOCK_BYTES) return panels;
    int64_t per_set = SET_BYTES / (k * 64), sets = (panels + per_set - 1) / per_set;
    sets = (sets + threads - 1) / threads * threads;
    return sets < panels ? sets : panels;
}

static void amx_gemm(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                     int64_t form, int64_t bits, int64_t n, int out_f32, void *out) {
    /* passes of rows (amx_tiles.h): each dequantizes the panels again, cheap beside 256 rows' products */
    int64_t tiles = (n + TILE - 1) / TILE, panels = (tiles + PANEL_TILES - 1) / PANEL_TILES, pass = pass_rows(k);
    int64_t panel_bytes = k / GROUP * PANEL_TILES * B_TILE_BYTES;
    size_t out_size = out_f32 ? 4 : 2;
    const row_indices index = make_row_indices();
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
        int64_t sets = panel_sets(panels, k, omp_get_num_threads()), most = (panels + sets - 1) / sets;
        uint8_t *b = aligned_alloc(64, (size_t)(most * panel_bytes));
        float *sums = aligned_alloc(64, sizeof(float) * 2 * TILE * PANEL_TILES * TILE);
        int configured = -1;  /* the rows of the block the tiles are configured for */
        for (int64_t r0 = 0; r0 < m; r0 += pass) {
            int64_t r1 = m - r0 < pass ? m : r0 + pass;
#pragma omp for schedule(static)
            for (int64_t s = 0; s < sets; s++) {
                int64_t first = s * panels / sets, last = (s + 1) * panels / sets;
                for (int64_t r = r0; r < r1; r += 2 * TILE) {
                    int rows = r1 - r < 2 * TILE ? (int)(r1 - r) : 2 * TILE, rows1 = rows > TILE ? rows - TILE : 0;
                    if (rows != configured) configure_tiles(rows - rows1, rows1);
                    configured = rows;
                    for (int64_t i = first; i < last; i++) {
                        panel p = {qw, sz, form, bits, k, i * PANEL_TILES, i * PANEL_TILES + 1 < tiles ? PANEL_TILES : 1,
                                   &index, (uint16_t *)(b + (i - first) * panel_bytes)};
                        multiply_block(x + r * ldx, ldx, &p, r == r0, rows1, sums);
                        store_sums(sums, rows, p.tile0 * TILE, n, out_f32, (char *)out + r * n * out_size);
                    }
                }
            }
        }
        if (configured >= 0) _tile_release();
        free(b);
        free(sums);
    }
}
