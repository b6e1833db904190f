/* quant_gemm.c's GEMM on AVX2 (+ FMA, F16C), for CPUs without AVX512_VNNI: included by
 * quant_gemm.c only, after its layout helpers. quant_gemm.c explains the layout and why the
 * group's int16 sums cannot overflow; the float combination is VNNI's, op for op. */

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

/* One tile (16 columns, two halves of 8) of one 32-input group for R rows (≤ 4): the exact
 * int32 dot products Σ xq · q, dot[r][h] a lane per column of half h. ``w`` points at the
 * group's first step; each step's activations are broadcast once for both halves. */
static inline __attribute__((always_inline)) void
group_dots(const int R, const int bits, const int8_t *xq, int64_t k, const uint8_t *w, __m256i dot[4][2]) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i lo16[4][2], hi16[4][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) lo16[r][h] = hi16[r][h] = _mm256_setzero_si256();
    const int steps = bits == 4 ? 4 : 8;
    for (int j = 0; j < steps; j++) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; h++) {
            __m256i bytes = _mm256_loadu_si256((const void *)(w + j * 64 + h * 32));
            lo[h] = _mm256_and_si256(bytes, low);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *a = xq + r * k;
            if (bits == 4) { /* low nibbles: inputs 8j..8j+3, high nibbles: 8j+4..8j+7 */
                __m256i x_lo = bcast4_avx2(a + 8 * j), x_hi = bcast4_avx2(a + 8 * j + 4);
                for (int h = 0; h < 2; h++) {
                    lo16[r][h] = _mm256_add_epi16(lo16[r][h], _mm256_maddubs_epi16(lo[h], x_lo));
                    lo16[r][h] = _mm256_add_epi16(lo16[r][h], _mm256_maddubs_epi16(hi[h], x_hi));
                }
            } else { /* both nibbles of inputs 4j..4j+3: q = 16 · hi + lo */
                __m256i x = bcast4_avx2(a + 4 * j);
                for (int h = 0; h < 2; h++) {
                    lo16[r][h] = _mm256_add_epi16(lo16[r][h], _mm256_maddubs_epi16(lo[h], x));
                    hi16[r][h] = _mm256_add_epi16(hi16[r][h], _mm256_maddubs_epi16(hi[h], x));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            dot[r][h] = _mm256_madd_epi16(lo16[r][h], ones);
            if (bits == 8)
                dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_slli_epi32(_mm256_madd_epi16(hi16[r][h], ones), 4));
        }
}

/* R rows (≤ 4) × one tile of 16 columns, written to out (the columns below n). ``stream``: the
 * call reads each tile once (≤ 4 rows), so its stream is prefetched; with more rows the tile is
 * read again from cache for each 4, and the prefetches cost more than they save (1-2 % at 16). */
static inline __attribute__((always_inline)) void
tile_avx2(const int R, const int bits, const int8_t *xq, const float *d, const float *s, int64_t k,
          const uint8_t *qw, const void *sz, int64_t form, int64_t tile, int64_t n, int out_bf16, void *out,
          int stream) {
    const int64_t groups = k / GROUP, per_group = GROUP / step_bytes(bits) * 64;
    const uint8_t *w0 = qw + tile * (k / step_bytes(bits)) * 64;
    const int64_t rows = sz_rows(form), sz0 = tile * groups * rows * TILE, sz_bytes = form != SZ_F32 ? 2 : 4;
    const int64_t group_sz = rows * TILE * sz_bytes;
    const __m256 centred = _mm256_set1_ps(centre(bits));
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[4][2];
        if (stream) {
            prefetch_lines((const char *)w0 + g * per_group + PREFETCH_BYTES, per_group);
            prefetch_lines((const char *)sz + (sz0 + g * rows * TILE) * sz_bytes + PREFETCH_BYTES / per_group * group_sz,
                           group_sz);
        }
        group_dots(R, bits, xq + g * GROUP, k, w0 + g * per_group, dot);
        for (int h = 0; h < 2; h++) {
            int64_t at = sz0 + g * rows * TILE + h * 8;
            __m256 scale = load8_sz(sz, form, at);
            __m256 offset = rows == 1 ? _mm256_mul_ps(scale, centred) : load8_sz(sz, form, at + TILE);
            for (int r = 0; r < R; r++) {
                __m256 ds = _mm256_mul_ps(scale, _mm256_set1_ps(d[r * groups + g]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), ds, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * groups + g]), acc[r][h]);
            }
        }
    }
    int64_t col = tile * TILE, cols = n - col < TILE ? n - col : TILE;
    for (int r = 0; r < R; r++) {
        float sums[TILE];
        _mm256_storeu_ps(sums, acc[r][0]);
        _mm256_storeu_ps(sums + 8, acc[r][1]);
        for (int64_t c = 0; c < cols; c++) {
            if (out_bf16) ((uint16_t *)out)[r * n + col + c] = bf16_store(sums[c]);
            else ((float *)out)[r * n + col + c] = sums[c];
        }
    }
}

#define TILE_CASE(R, BITS)                                                                          \
    tile_avx2(R, BITS, xq + r * k, d + r * groups, s + r * groups, k, qw, sz, form, t, n, out_bf16,  \
              (char *)out + r * n * (out_bf16 ? 2 : 4), m <= 4)
#define TILE_ROWS(BITS)                                                                             \
    switch (r0 + rows - r >= 4 ? 4 : r0 + rows - r) {                                                \
    case 4: TILE_CASE(4, BITS); break;                                                              \
    case 3: TILE_CASE(3, BITS); break;                                                              \
    case 2: TILE_CASE(2, BITS); break;                                                              \
    default: TILE_CASE(1, BITS);                                                                    \
    }

static void gemm_avx2(const int8_t *xq, const float *d, const float *s, int64_t m, int64_t k,
                      const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16,
                      void *out) {
    int64_t tiles = (n + TILE - 1) / TILE, groups = k / GROUP;
    int64_t row_blocks = m > 64 ? (m + 63) / 64 : 1, rows_per = m > 64 ? 64 : m;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t job = 0; job < tiles * row_blocks; job++) {
        int64_t t = job / row_blocks, r0 = (job % row_blocks) * rows_per;  /* a thread's tiles stay in its cache */
        int64_t rows = m - r0 < rows_per ? m - r0 : rows_per;
        for (int64_t r = r0; r < r0 + rows; r += 4) {
            if (bits == 4) { TILE_ROWS(4) } else { TILE_ROWS(8) }
        }
    }
}
#undef TILE_CASE
#undef TILE_ROWS
