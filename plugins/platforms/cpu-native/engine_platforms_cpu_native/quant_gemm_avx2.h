/* quant_gemm.c's GEMM on AVX2 (+ FMA, F16C), for CPUs without AVX512_VNNI: included by
 * quant_gemm.c only, after its layout helpers. quant_gemm.c explains the layout and why the
 * group's int16 sums cannot overflow; the float combination is VNNI's, op for op. */

/* PREFETCH_BYTES for this kernel: on Zen 3 (AVX2 only), two threads at one row, weights from
 * memory (benchmarks/affine_ab.c), 2048 bytes ran 0.99-1.16x 4096 on the default and 1B-class
 * models' shapes with a pair's tiles in chunks, 0.93-1.11x once one row took the pair in order,
 * and 8192 no better than 4096 (the tiles' own streams, before the pairs: 2048 and 4096 alike,
 * 1024 and 8192 less). */
#define PREFETCH_AVX2_BYTES 2048

/* 8 scales (or offsets) of one half-tile as float32 lanes */
static inline __m256 load8_sz(const void *sz, int64_t form, int64_t index) {
    return form != SZ_F32 ? _mm256_cvtph_ps(_mm_loadu_si128((const void *)((const uint16_t *)sz + index)))
                : _mm256_loadu_ps((const float *)sz + index);
}

static inline __m256i bcast4_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* NT tiles (≤ 2, a pair's, side by side in the packed group) of 16 columns, two halves of 8,
 * of one 32-input group for R rows (≤ 4): the exact int32 dot products Σ xq · q, dot[r][t][h]
 * a lane per column of half h. ``w`` points at the first tile's first step; each step's
 * activations are broadcast once for every half. */
static inline __attribute__((always_inline)) void
group_dots(const int R, const int NT, const int bits, const int8_t *xq, int64_t k, const uint8_t *w,
           __m256i dot[4][2][2]) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int64_t per_group = group_bytes(bits);
    __m256i lo16[4][2][2], hi16[4][2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) lo16[r][t][h] = hi16[r][t][h] = _mm256_setzero_si256();
    const int steps = bits == 4 ? 4 : 8;
    for (int j = 0; j < steps; j++) {
        __m256i lo[2][2], hi[2][2];
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) {
                __m256i bytes = _mm256_loadu_si256((const void *)(w + t * per_group + j * 64 + h * 32));
                lo[t][h] = _mm256_and_si256(bytes, low);
                hi[t][h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
        for (int r = 0; r < R; r++) {
            const int8_t *a = xq + r * k;
            if (bits == 4) { /* low nibbles: inputs 8j..8j+3, high nibbles: 8j+4..8j+7 */
                __m256i x_lo = bcast4_avx2(a + 8 * j), x_hi = bcast4_avx2(a + 8 * j + 4);
                for (int t = 0; t < NT; t++)
                    for (int h = 0; h < 2; h++) {
                        lo16[r][t][h] = _mm256_add_epi16(lo16[r][t][h], _mm256_maddubs_epi16(lo[t][h], x_lo));
                        lo16[r][t][h] = _mm256_add_epi16(lo16[r][t][h], _mm256_maddubs_epi16(hi[t][h], x_hi));
                    }
            } else { /* both nibbles of inputs 4j..4j+3: q = 16 · hi + lo */
                __m256i x = bcast4_avx2(a + 4 * j);
                for (int t = 0; t < NT; t++)
                    for (int h = 0; h < 2; h++) {
                        lo16[r][t][h] = _mm256_add_epi16(lo16[r][t][h], _mm256_maddubs_epi16(lo[t][h], x));
                        hi16[r][t][h] = _mm256_add_epi16(hi16[r][t][h], _mm256_maddubs_epi16(hi[t][h], x));
                    }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) {
                dot[r][t][h] = _mm256_madd_epi16(lo16[r][t][h], ones);
                if (bits == 8)
                    dot[r][t][h] = _mm256_add_epi32(dot[r][t][h],
                                                    _mm256_slli_epi32(_mm256_madd_epi16(hi16[r][t][h], ones), 4));
            }
}

/* Groups [g0, g1) of NT tiles (≤ 2, a pair's from tile) for R rows (≤ 4), added to the float
 * sums acc_sums[t][r] (16 columns each). ``prefetch``: these rows are the first to read the
 * pair, from memory, so its stream ahead is prefetched. */
static inline __attribute__((always_inline)) void
tile_groups(const int R, const int NT, const int bits, const int8_t *xq, const float *d, const float *s, int64_t k,
            const uint8_t *qw, const void *sz, int64_t form, int64_t tile, int64_t g0, int64_t g1, int prefetch,
            float acc_sums[][4][TILE]) {
    const int64_t groups = k / GROUP, per_group = group_bytes(bits);
    const int64_t rows = sz_rows(form), sz_bytes = form != SZ_F32 ? 2 : 4;
    const int64_t group_sz = rows * TILE * sz_bytes;
    const __m256 centred = _mm256_set1_ps(centre(bits));
    __m256 acc[4][2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) acc[r][t][h] = _mm256_loadu_ps(acc_sums[t][r] + 8 * h);
    for (int64_t g = g0; g < g1; g++) {
        __m256i dot[4][2][2];
        const uint8_t *w = qw + group_at(bits, groups, tile, g);
        if (prefetch) {
            prefetch_lines((const char *)w + PREFETCH_AVX2_BYTES, 2 * per_group);
            prefetch_lines((const char *)sz + sz_index(form, groups, tile, g, 0) * sz_bytes
                               + PREFETCH_AVX2_BYTES / per_group * group_sz,
                           2 * group_sz);
        }
        group_dots(R, NT, bits, xq + g * GROUP, k, w, dot);
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) {
                int64_t at = sz_index(form, groups, tile + t, g, h * 8);
                __m256 scale = load8_sz(sz, form, at);
                __m256 offset = rows == 1 ? _mm256_mul_ps(scale, centred) : load8_sz(sz, form, at + TILE);
                for (int r = 0; r < R; r++) {
                    __m256 ds = _mm256_mul_ps(scale, _mm256_set1_ps(d[r * groups + g]));
                    acc[r][t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][t][h]), ds, acc[r][t][h]);
                    acc[r][t][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * groups + g]), acc[r][t][h]);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc_sums[t][r] + 8 * h, acc[r][t][h]);
}

/* Groups a pair's tiles take in turn while the pair comes from memory: one tile at a time holds
 * every register for 4 rows, and a whole tile then the other would read the pair's one stream
 * in bursts (the first tile's pass asking for all of it, the second's for none). Zen 5 built for
 * AVX2, two threads, weights from memory, against the earlier layout (one stream a tile, whole
 * tiles): at 1 / 16 / 64 rows 0.98-1.10 / 1.10-1.14 / 1.00-1.03x, at 2-4 rows 0.91-1.04x
 * (chunks of 2 or 8 groups, or whole tiles, no better there; 4 groups is 2 KiB of a 4-bit pair).
 * From cache (the rows after the first 4) the tiles go whole. A single row has the registers
 * for both tiles, so it takes the pair group by group, the stream in order, as the VNNI kernel
 * does: on Zen 3, two threads, 1.08-1.20x the chunks (benchmarks/affine_ab.c, every shape of
 * the default and 1B-class models; the one-stream-a-tile layout's speed again, 0.92-1.07x). */
#define PAIR_CHUNK 4

/* R rows (≤ 4) × the nt (≤ 2) tiles of the pair from tile, written to out (the columns below
 * n). ``stream``: these are the call's first rows, which read the pair from memory, so its
 * stream is prefetched (the rows after read it from cache). */
static inline __attribute__((always_inline)) void
pair_avx2(const int R, const int bits, const int8_t *xq, const float *d, const float *s, int64_t k,
          const uint8_t *qw, const void *sz, int64_t form, int64_t tile, int nt, int64_t n, int out_bf16, void *out,
          int stream) {
    const int64_t groups = k / GROUP;
    float sums[2][4][TILE] = {0};
    const int64_t chunk = stream ? PAIR_CHUNK : groups;
    if (R == 1 && nt == 2) /* registers for both tiles at once: the pair's one stream in order */
        tile_groups(1, 2, bits, xq, d, s, k, qw, sz, form, tile, 0, groups, stream, sums);
    else
        for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
            int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
            for (int t = 0; t < nt; t++)
                tile_groups(R, 1, bits, xq, d, s, k, qw, sz, form, tile + t, g0, g1, stream && t == 0, sums + t);
        }
    for (int t = 0; t < nt; t++) {
        int64_t col = (tile + t) * TILE, cols = n - col < TILE ? n - col : TILE;
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++) {
                if (out_bf16) ((uint16_t *)out)[r * n + col + c] = bf16_store(sums[t][r][c]);
                else ((float *)out)[r * n + col + c] = sums[t][r][c];
            }
    }
}

#define PAIR_CASE(R, BITS)                                                                          \
    pair_avx2(R, BITS, xq + r * k, d + r * groups, s + r * groups, k, qw, sz, form, t0, nt, n, out_bf16,  \
              (char *)out + r * n * (out_bf16 ? 2 : 4), r == 0)
#define PAIR_ROWS(BITS)                                                                             \
    switch (r0 + rows - r >= 4 ? 4 : r0 + rows - r) {                                                \
    case 4: PAIR_CASE(4, BITS); break;                                                              \
    case 3: PAIR_CASE(3, BITS); break;                                                              \
    case 2: PAIR_CASE(2, BITS); break;                                                              \
    default: PAIR_CASE(1, BITS);                                                                    \
    }

static void gemm_avx2(const int8_t *xq, const float *d, const float *s, int64_t m, int64_t k,
                      const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16,
                      void *out) {
    int64_t tiles = (n + TILE - 1) / TILE, pairs = (tiles + 1) / 2, groups = k / GROUP;
    int64_t row_blocks = m > 64 ? (m + 63) / 64 : 1, rows_per = m > 64 ? 64 : m;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t job = 0; job < pairs * row_blocks; job++) {
        int64_t t0 = job / row_blocks * 2, r0 = (job % row_blocks) * rows_per;  /* a thread's pairs stay in its cache */
        int64_t rows = m - r0 < rows_per ? m - r0 : rows_per;
        int nt = tiles - t0 < 2 ? 1 : 2;
        for (int64_t r = r0; r < r0 + rows; r += 4) {
            if (bits == 4) { PAIR_ROWS(4) } else { PAIR_ROWS(8) }
        }
    }
}
#undef PAIR_CASE
#undef PAIR_ROWS
