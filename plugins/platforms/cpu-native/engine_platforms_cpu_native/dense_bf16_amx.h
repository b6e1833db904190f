/* dense_bf16.c's product on AMX tiles: bf16 activations x [m, k] times a bf16 weight w [n, k]
 * as the checkpoint holds it (row-major, nothing packed at load). Included by dense_bf16.c only.
 *
 * The weight is the tiles' A operand: an A tile is 16 weight rows × 32 inputs, which tileloadd
 * reads straight from w with a row stride of 2k bytes. The activations are the B operand, packed
 * once a call into bf16 pairs (B row p of an activation block holds inputs 2p, 2p + 1 of its 16
 * rows), so a C tile holds outᵀ for 16 outputs × 16 activation rows and is transposed in
 * registers as it is stored. Whatever the batch, a weight byte is read once a pass, a pass being
 * every row of a decode step: at one row the tiles do 16 times the products needed, which costs
 * nothing beside the weight's stream (a tile product takes 16 cycles for 1 KiB of weights).
 *
 * Each output is one float sum over k in 32-input steps (tdpbf16ps's order), the same steps at
 * every row count and row position: a row's bits do not depend on its batch. A thread walks
 * panels of 32 weight rows (2 A tiles) against blocks of 32 activation rows (2 B tiles); a pass's
 * first block, which reads the panel from memory, asks for the weight ahead (prefetch_ahead).
 * Long chunks go in passes whose packed activations (~1 MiB) stay in L2. */

#include "amx_tiles.h"

#define AMX_TILE 16   /* rows of an A, B or C tile; columns of a C tile */
#define AMX_DEPTH 32  /* bf16 inputs an A tile row holds (64 bytes) */
#define AMX_PANEL 32  /* weight rows a panel holds: 2 A tiles */

/* A<i>: weight tile i of the panel; B<j>: activation block j (amx_tiles.h's registers) */

/* Every tile of these kernels is 16 rows of 64 bytes (the data is padded, not the tiles). */
static void configure_full_tiles(void) {
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = AMX_TILE, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* r[0..15] (16 × 16 32-bit lanes) transposed in place: lane j of r[i] moves to lane i of r[j] */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c]: 128-bit lane L holds column 4L + c of rows i…i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i low_a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), high_a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        __m512i low_b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i high_b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(low_a, low_b, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(low_a, low_b, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(high_a, high_b, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(high_a, high_b, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

static inline __mmask32 first32(int64_t count) {
    return count >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << count) - 1);
}

static inline __mmask16 first16(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

/* x's rows [row, row + 16) (zeros past m) as B tiles, one per 32 inputs (zeros past k), at b */
static void pack_block(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, int64_t row, uint16_t *b) {
    for (int64_t i = 0; i < k; i += AMX_DEPTH, b += AMX_TILE * AMX_DEPTH) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = row + j < m ? _mm512_maskz_loadu_epi16(first32(k - i), x + (row + j) * ldx + i) : _mm512_setzero_si512();
        transpose16(r);
        for (int p = 0; p < 16; p++) _mm512_store_si512(b + p * 32, r[p]);
    }
}

/* Where a panel's A tiles come from: the weight itself, or (past n, or a k that is not a
 * multiple of 32) a zero-padded copy of its rows in `scratch`. */
typedef struct {
    const uint16_t *a;
    int64_t stride; /* bytes */
    int tiles;      /* 1 or 2 */
} panel_source;

static panel_source panel_at(const uint16_t *w, int64_t n, int64_t k, int64_t kpad, int64_t col, uint16_t *scratch) {
    int64_t rows = n - col < AMX_PANEL ? n - col : AMX_PANEL;
    panel_source p = {w + col * k, 2 * k, rows > AMX_TILE ? 2 : 1};
    if (kpad == k && rows % AMX_TILE == 0) return p;
    memset(scratch, 0, sizeof(uint16_t) * (size_t)(AMX_PANEL * kpad));
    for (int64_t r = 0; r < rows; r++) memcpy(scratch + r * kpad, w + (col + r) * k, sizeof(uint16_t) * (size_t)k);
    p.a = scratch, p.stride = 2 * kpad;
    return p;
}

/* What a step of the current panel asks for ahead of its A tiles, 32 lines (the rate they read
 * them): a panel of up to NEXT_PANEL_STEPS steps (64 KiB) asks for the next panel this thread
 * walks, whole and in address order; a longer one asks for each row's line AHEAD_STEPS steps on,
 * past the row's end in the next panel's row (the whole next panel would not stay in L1). */
#define NEXT_PANEL_STEPS 32
#define AHEAD_STEPS 16
static inline void prefetch_ahead(const uint16_t *w, int64_t n, int64_t k, int64_t col, int64_t step, int64_t steps) {
    const char *end = (const char *)(w + n * k);
    for (int line = 0; line < AMX_PANEL; line++) {
        const char *at;
        if (steps <= NEXT_PANEL_STEPS) {
            at = (const char *)(w + (col + AMX_PANEL) * k) + (step * AMX_PANEL + line) * 64;
        } else {
            int64_t ahead = step + AHEAD_STEPS, row = col + line + (ahead >= steps ? AMX_PANEL : 0);
            at = (const char *)(w + row * k + (ahead % steps) * AMX_DEPTH);
        }
        if (at < end) _mm_prefetch(at, _MM_HINT_T0);
    }
}

/* A C tile's sums (16 outputs × 16 activation rows, stored at sums) into out's first `rows`
 * rows and columns [col, col + cols) as bf16, plus the bias */
static void store_transposed(const float *sums, const uint16_t *bias, int64_t rows, int64_t col, int64_t cols,
                             int64_t n, uint16_t *out) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(sums + i * AMX_TILE);
    transpose16(r);
    __mmask16 mask = first16(cols);
    __m512 b = bias ? bf16x16_load_masked(bias + col, mask) : _mm512_setzero_ps();
    for (int64_t j = 0; j < rows; j++) bf16x16_store_masked(out + j * n + col, _mm512_add_ps(_mm512_castsi512_ps(r[j]), b), mask);
}

/* One panel against one block of activation rows (1 or 2 B tiles of packed x at b): the float
 * sums into sums [2 weight tiles][2 activation tiles][16 × 16]. */
static void multiply_panel(const panel_source *p, const uint16_t *b, int64_t steps, int blocks, int fetch,
                           const uint16_t *w, int64_t n, int64_t k, int64_t col, float *sums) {
    const int two = p->tiles > 1;
    const int64_t b_stride = steps * AMX_TILE * AMX_DEPTH; /* elements between two blocks' tiles */
    _tile_zero(C00);
    if (blocks > 1) _tile_zero(C01);
    if (two) _tile_zero(C10);
    if (two && blocks > 1) _tile_zero(C11);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *a = p->a + s * AMX_DEPTH, *bs = b + s * AMX_TILE * AMX_DEPTH;
        if (fetch) prefetch_ahead(w, n, k, col, s, steps);
        _tile_loadd(B0, bs, 64);
        _tile_loadd(A0, a, p->stride);
        _tile_dpbf16ps(C00, A0, B0);
        if (two) {
            _tile_loadd(A1, (const char *)a + AMX_TILE * p->stride, p->stride);
            _tile_dpbf16ps(C10, A1, B0);
        }
        if (blocks > 1) {
            _tile_loadd(B1, bs + b_stride, 64);
            _tile_dpbf16ps(C01, A0, B1);
            if (two) _tile_dpbf16ps(C11, A1, B1);
        }
    }
    const int tile = AMX_TILE * AMX_TILE;
    _tile_stored(C00, sums, 64);
    if (blocks > 1) _tile_stored(C01, sums + tile, 64);
    if (two) _tile_stored(C10, sums + 2 * tile, 64);
    if (two && blocks > 1) _tile_stored(C11, sums + 3 * tile, 64);
}

static void amx_dense(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w,
                      const uint16_t *bias, int64_t n, uint16_t *out) {
    const int64_t kpad = (k + AMX_DEPTH - 1) / AMX_DEPTH * AMX_DEPTH, steps = kpad / AMX_DEPTH;
    const int64_t blocks = (m + AMX_TILE - 1) / AMX_TILE, panels = (n + AMX_PANEL - 1) / AMX_PANEL;
    const int64_t pass = pass_rows(kpad), block_elements = steps * AMX_TILE * AMX_DEPTH;
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * (size_t)(blocks * block_elements));
#pragma omp parallel if (m * n * k >= PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++)
            pack_block(x, ldx, m, k, block * AMX_TILE, packed + block * block_elements);
        uint16_t *scratch = aligned_alloc(64, sizeof(uint16_t) * (size_t)(AMX_PANEL * kpad));
        float *sums = aligned_alloc(64, sizeof(float) * 4 * AMX_TILE * AMX_TILE);
        configure_full_tiles();
        for (int64_t r0 = 0; r0 < m; r0 += pass) {
            const int64_t r1 = m - r0 < pass ? m : r0 + pass;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < panels; i++) {
                const int64_t col = i * AMX_PANEL;
                panel_source p = panel_at(w, n, k, kpad, col, scratch);
                for (int64_t r = r0; r < r1; r += 2 * AMX_TILE) {
                    const int64_t rows = r1 - r < 2 * AMX_TILE ? r1 - r : 2 * AMX_TILE;
                    const int pair = rows > AMX_TILE;
                    multiply_panel(&p, packed + r / AMX_TILE * block_elements, steps, 1 + pair, r == r0, w, n, k,
                                   col, sums);
                    for (int t = 0; t < p.tiles; t++)
                        for (int j = 0; j <= pair; j++) {
                            int64_t c0 = col + t * AMX_TILE, cols = n - c0, rj = rows - j * AMX_TILE;
                            store_transposed(sums + (2 * t + j) * AMX_TILE * AMX_TILE, bias, rj < AMX_TILE ? rj : AMX_TILE,
                                             c0, cols, n, out + (r + j * AMX_TILE) * n);
                        }
                }
            }
        }
        _tile_release();
        free(scratch);
        free(sums);
    }
    free(packed);
}
