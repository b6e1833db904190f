/* Group-affine weights (w = q · scale + offset, one scale/offset per 32 inputs, q unsigned)
 * times int8 activations, llama.cpp's q4_1 × q8_1 scheme on AVX512_VNNI.
 *
 * Activations are quantized per row and per 32-group: d = absmax / 127, xq = round(x / d), and
 * the group's sum s = d · Σ xq (llama.cpp's q8_1 sums). Then for output column n
 *     out[m, n] = Σ_g  d[m, g] · scale[n, g] · Σ_{k∈g} xq[m, k] · q[n, k]  +  offset[n, g] · s[m, g]
 * where the inner sum is one int32 VNNI dot product (q as the unsigned operand, xq signed). That
 * is exactly the rounded activations times the weight, so the rounding error meets w itself.
 * With the group's exact float sum instead, the offset term would be exact but the error would
 * meet w − offset = q · scale (all of one sign, 0…15 · scale for 4 bits) instead of w (centred):
 * 3.6 times the error variance, 5 times the mean KL divergence on the default model (measured,
 * benchmarks/quality.py).
 *
 * Packed layout (made once at load by pack_affine): output columns in tiles of 16, inputs in
 * 4-byte steps, so one 64-byte load feeds a vpdpbusd for 16 columns × 4 inputs; the tiles go in
 * pairs (the GEMM's unit of work), each pair's two tiles interleaved group by group, so that a
 * thread reads its columns' weights as one stream of q and one of scales (two tiles side by side
 * were four streams: 1.07-1.18x slower at one row from memory where a tile's run of a group is
 * short, 4-bit values up to 2048 inputs; level on 8-bit values and 8192 inputs,
 * benchmarks/affine_ab.c).
 *   4-bit q: qw [pairs, K/32, 2, 4, 64]: group g of tile t of a pair, its 4 steps of 8 inputs;
 *            byte 4c + i of step j holds column c's q[8j + i] in its low nibble and q[8j + 4 + i]
 *            in its high nibble (j counting the steps of the whole column).
 *   8-bit q (also 5- and 6-bit values): qw [pairs, K/32, 2, 8, 64]; byte 4c + i = q[4j + i].
 *   sz [pairs, K/32, 2, 2, 16]: per group and tile, its 16 scales, then its 16 offsets; float32
 *            (form SZ_F32), or float16 (SZ_F16) where every value is exactly a float16 (GGUF's
 *            legacy formats store them so); or sz [pairs, K/32, 2, 16], float16 scales alone
 *            (SZ_F16_CENTRED) where every offset is -2^(bits-1) · scale: GGUF's q4_0 and q8_0,
 *            symmetric values stored unsigned, whose packed weight is then the file's 18 or 34
 *            bytes a block, not 20 or 36.
 * Columns past N (the last tile's padding, and a whole tile where the tiles are odd) hold q = 0,
 * scale = offset = 0.
 *
 * The GEMM is register-blocked 4 rows × 32 columns (a pair) and split over OpenMP threads by
 * pairs (work big enough to split only). On AVX2 without AVX512_VNNI (AMD EPYC before Zen 4,
 * Intel before Ice Lake), the same layout runs on vpmaddubsw: one 32-byte half of a step holds
 * 8 columns, each multiply-add pair of u8 × s8 lands in int16 lanes, and a whole group of 32
 * inputs is summed in int16 before one vpmaddwd widens it (4-bit: at most 4 steps × 2 × 2 ×
 * 15 × 127 = 30480; 8-bit values are split into nibbles, q = 16·hi + lo, each summed so, which
 * bounds them alike) — the same exact integers, then the same float combination, as VNNI.
 * Built without either, the entry points compute the same integers in plain C (the tests
 * compare the builds). quant_gemm.h declares the entry points; quant_gemm_generic.h holds those
 * written once for both activation types; quant_gemm_amx.h the bf16 product on AMX tiles that
 * batched steps take where the CPU has them (affine_matmul_amx, plain C elsewhere).
 */
#include "quant_gemm.h"
#include "engine_bf16.h"
#include "engine_lanes.h"
#include "engine_split.h"
#include "top_candidates.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#define HAVE_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_VNNI 0
#define HAVE_AVX2 1
#else
#define HAVE_VNNI 0
#define HAVE_AVX2 0
#endif

#define GROUP 32
#define TILE 16
/* Multiply-adds from which a call is split over threads: every projection of a decoded token
 * (576 x 960 and up). Replayed from a native tape, where no Python runs between calls, splitting
 * them all decoded 1.2x faster single-stream than 1 << 20 (only gate|up and the LM head split);
 * called from Python one by one, waking the second thread for the small ones cost more than it
 * saved (0.85x). */
#define PARALLEL_WORK (1 << 18)

int64_t affine_simd_width(void) { return HAVE_VNNI ? 512 : HAVE_AVX2 ? 256 : 0; }

/* A float16 bit pattern as float (the scalar paths). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    float f;
    if (exponent == 0) {
        f = ldexpf((float)mantissa, -24);  /* zero or subnormal */
        return sign ? -f : f;
    }
    bits = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define SZ_F32 0
#define SZ_F16 1
#define SZ_F16_CENTRED 2

/* 16-value rows of sz per group: scales and offsets, or scales alone */
static inline int64_t sz_rows(int64_t form) { return form == SZ_F16_CENTRED ? 1 : 2; }

/* what a centred form's offsets are, in scales: -2^(bits-1) (exact, so -8 · scale is the very
 * offset a two-row form would hold) */
static inline float centre(int64_t bits) { return -(float)(1 << (bits - 1)); }

/* The place of tile t's group g among the packed groups, qw's and sz's alike: a pair's two tiles
 * interleaved group by group. */
static inline int64_t group_slot(int64_t groups, int64_t t, int64_t g) {
    return ((t / 2) * groups + g) * 2 + t % 2;
}

/* where column c's scale in group g of tile t lies in sz (a two-row form's offset: TILE further) */
static inline int64_t sz_index(int64_t form, int64_t groups, int64_t t, int64_t g, int64_t c) {
    return group_slot(groups, t, g) * sz_rows(form) * TILE + c;
}

/* the scale and the offset at sz_index's index */
static inline float scale_at(const void *sz, int64_t form, int64_t index) {
    return form != SZ_F32 ? half_to_float(((const uint16_t *)sz)[index]) : ((const float *)sz)[index];
}
static inline float offset_at(const void *sz, int64_t form, int64_t bits, int64_t index) {
    return form == SZ_F16_CENTRED ? centre(bits) * scale_at(sz, form, index) : scale_at(sz, form, index + TILE);
}

/* ---- packing: q uint8 [N, K] (< 2**bits), scale/offset float32 [N, K/32] ---------------- */

static int64_t step_bytes(int64_t bits) { return bits == 4 ? 8 : 4; } /* inputs per 64-byte step */

/* bytes of one tile's group in qw: its 64-byte steps */
static inline int64_t group_bytes(int64_t bits) { return GROUP / step_bytes(bits) * 64; }

/* where group g of tile t starts in qw */
static inline int64_t group_at(int64_t bits, int64_t groups, int64_t t, int64_t g) {
    return group_slot(groups, t, g) * group_bytes(bits);
}

/* the tiles the packed buffers hold for n columns: whole pairs */
static inline int64_t packed_tiles(int64_t n) { return (n + 2 * TILE - 1) / (2 * TILE) * 2; }

/* where step j (of the column's k / step_bytes) of tile t starts in qw */
static inline int64_t step_at(int64_t bits, int64_t groups, int64_t t, int64_t j) {
    int64_t per_group = GROUP / step_bytes(bits);
    return group_at(bits, groups, t, j / per_group) + j % per_group * 64;
}

/* Column col's q row, scales and offsets into the packed qw and sz (zeroed before). */
static void pack_column(const uint8_t *row, const float *scale, const float *offset, int64_t col, int64_t k,
                        int64_t bits, uint8_t *qw, float *sz) {
    int64_t t = col / TILE, c = col % TILE, groups = k / GROUP, steps = k / step_bytes(bits);
    for (int64_t j = 0; j < steps; j++) {
        uint8_t *dst = qw + step_at(bits, groups, t, j) + 4 * c;
        for (int64_t i = 0; i < 4; i++)
            dst[i] = bits == 4 ? (uint8_t)(row[8 * j + i] | (row[8 * j + 4 + i] << 4)) : row[4 * j + i];
    }
    for (int64_t g = 0; g < groups; g++) {
        sz[sz_index(SZ_F32, groups, t, g, c)] = scale[g];
        sz[sz_index(SZ_F32, groups, t, g, c) + TILE] = offset[g];
    }
}

static void zero_packed(int64_t n, int64_t k, int64_t bits, uint8_t *qw, float *sz) {
    int64_t tiles = packed_tiles(n);
    memset(qw, 0, (size_t)(tiles * (k / step_bytes(bits)) * 64));
    memset(sz, 0, sizeof(float) * (size_t)(tiles * (k / GROUP) * 2 * TILE));
}

void pack_affine(const uint8_t *q, const float *scale, const float *offset, int64_t n, int64_t k,
                 int64_t bits, uint8_t *qw, float *sz) {
    int64_t groups = k / GROUP;
    zero_packed(n, k, bits, qw, sz);
    for (int64_t col = 0; col < n; col++)
        pack_column(q + col * k, scale + col * groups, offset + col * groups, col, k, bits, qw, sz);
}

/* One ggml block of 32 values (type 0: q4_0, 1: q4_1, 2: q8_0) as q, scale and offset, the values
 * the gguf plugin's readers give: q4 blocks hold 16 bytes of nibbles, the low ones the first 16
 * values; w = q · scale + offset with offset -8d (q4_0), m (q4_1), -128d (q8_0, q = int8 + 128). */
static const uint8_t *unpack_ggml_block(const uint8_t *b, int64_t type, uint8_t *q, float *scale, float *offset) {
    uint16_t d, m;
    memcpy(&d, b, 2);
    *scale = half_to_float(d);
    if (type == 2) {
        for (int i = 0; i < 32; i++)
            q[i] = (uint8_t)((int8_t)b[2 + i] + 128);
        *offset = -128.0f * *scale;
        return b + 34;
    }
    if (type == 1)
        memcpy(&m, b + 2, 2);
    *offset = type == 1 ? half_to_float(m) : -8.0f * *scale;
    const uint8_t *qs = b + (type == 1 ? 4 : 2);
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 15;
        q[16 + i] = qs[i] >> 4;
    }
    return qs + 16;
}

void pack_ggml_blocks(const uint8_t *raw, int64_t type, int64_t n, int64_t k, uint8_t *qw, float *sz) {
    int64_t groups = k / GROUP, bits = type == 2 ? 8 : 4;
    uint8_t *q = malloc((size_t)k);
    float *scale = malloc(sizeof(float) * (size_t)(2 * groups)), *offset = scale + groups;
    zero_packed(n, k, bits, qw, sz);
    const uint8_t *b = raw;
    for (int64_t col = 0; col < n; col++) {
        for (int64_t g = 0; g < groups; g++)
            b = unpack_ggml_block(b, type, q + g * GROUP, scale + g, offset + g);
        pack_column(q, scale, offset, col, k, bits, qw, sz);
    }
    free(q);
    free(scale);
}

/* q of (column col, input kk) read back from the packed layout. */
static inline int packed_q(const uint8_t *qw, int64_t bits, int64_t groups, int64_t col, int64_t kk) {
    int64_t t = col / TILE, c = col % TILE, per_step = step_bytes(bits);
    int64_t j = kk / per_step, i = kk % per_step;
    uint8_t byte = qw[step_at(bits, groups, t, j) + 4 * c + (i & 3)];
    return bits == 4 ? (i < 4 ? byte & 15 : byte >> 4) : byte;
}

#if HAVE_VNNI
static inline __m512 load16_bf16(const uint16_t *p) { return bf16x16_load(p); }
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
#elif HAVE_AVX2
static inline __m256 load8_bf16(const uint16_t *p) { return bf16x8_load(p); }
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
/* the sum of 8 int32 lanes (the activation quantizer's group; hmax8 is engine_lanes.h's) */
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

/* ---- the GEMM ---------------------------------------------------------------------------- */

#if HAVE_VNNI || HAVE_AVX2
/* How far ahead of the group being multiplied its pair's stream is prefetched, in weight bytes
 * (the scales and offsets as many groups ahead), while the first rows to read a pair (from
 * memory) multiply it: the hardware prefetchers alone keep too few lines in flight. Past the
 * pair's end the stream runs on into the next pair, the thread's next job. Measured before the
 * pairs were interleaved (one stream a tile, benchmarks/affine_stream.c, one row): on AVX2
 * (Zen 3) ~16.5 GB/s a thread without it, ~20.5 with it (the triad ~23); on AVX-512 (Zen 5)
 * 21-25 without, 29-33 with (the triad ~42). The pairs' one stream, two threads at one row
 * (Zen 5, benchmarks/affine_ab.c): 4096 bytes 1.05-1.08x 2048, 8192 level with 4096; against
 * the tiles' own streams (medians, 4-bit shapes) 1.07-1.18x at 1 row, 1.02-1.15x at 4, level
 * from 16. At 8 / 16 / 64 rows the first 4 rows of a pair's first row block prefetch (the rows
 * after read the pair from cache). */
#define PREFETCH_BYTES 4096

/* Ask for the cache lines [p, p + bytes) */
static inline __attribute__((always_inline)) void prefetch_lines(const char *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
}
#endif

#if !HAVE_VNNI && !HAVE_AVX2
/* Plain C: the same int32 group sums, the same float combination. */
static void gemm_scalar(const int8_t *xq, const float *d, const float *s, int64_t m, int64_t k,
                        const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16,
                        void *out) {
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < m; r++)
        for (int64_t col = 0; col < n; col++) {
            int64_t t = col / TILE, c = col % TILE;
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                int64_t at = sz_index(form, groups, t, g, c);
                for (int64_t i = 0; i < GROUP; i++)
                    dot += (int32_t)xq[r * k + g * GROUP + i] * packed_q(qw, bits, groups, col, g * GROUP + i);
                acc += (float)dot * (scale_at(sz, form, at) * d[r * groups + g])
                       + offset_at(sz, form, bits, at) * s[r * groups + g];
            }
            if (out_bf16) ((uint16_t *)out)[r * n + col] = bf16_store(acc);
            else ((float *)out)[r * n + col] = acc;
        }
}

#elif HAVE_AVX2
#include "quant_gemm_avx2.h"
#else
static inline __m512 load16_sz(const void *sz, int64_t form, int64_t index) {
    return form != SZ_F32 ? _mm512_cvtph_ps(_mm256_loadu_si256((const void *)((const uint16_t *)sz + index)))
                : _mm512_loadu_ps((const float *)sz + index);
}

/* the 16 offsets beside the scales at index (offset_at's lanes): a centred form's from its scales */
static inline __m512 load16_offset(const void *sz, int64_t form, int64_t bits, int64_t index, __m512 scale) {
    return form == SZ_F16_CENTRED ? _mm512_mul_ps(scale, _mm512_set1_ps(centre(bits))) : load16_sz(sz, form, index + TILE);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* R rows (≤ 4) × NT tiles (≤ 2) of 16 columns, a pair's (its q at qw0, its scales at index sz0):
 * float sums into acc[R][NT]. ``stream``: these are the first rows to read the pair, from memory,
 * so its stream ahead is prefetched. */
static inline __attribute__((always_inline)) void
block(const int R, const int NT, const int bits, const int8_t *xq, const float *d, const float *s,
      int64_t k, const uint8_t *qw0, const void *sz, int64_t form, int64_t sz0,
      int stream, __m512 acc[4][2]) {
    const int64_t groups = k / GROUP, per_group = group_bytes(bits), rows = sz_rows(form);
    const int64_t sz_bytes = form != SZ_F32 ? 2 : 4, group_sz = rows * TILE * sz_bytes;
    const __m512i low = _mm512_set1_epi8(15);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[4][2];
        if (stream) {
            prefetch_lines((const char *)qw0 + 2 * g * per_group + PREFETCH_BYTES, 2 * per_group);
            prefetch_lines((const char *)sz + (sz0 + 2 * g * rows * TILE) * sz_bytes
                               + PREFETCH_BYTES / per_group * group_sz,
                           2 * group_sz);
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < NT; t++) dot[r][t] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int j = 0; j < 4; j++) {
                __m512i lo[2], hi[2];
                for (int t = 0; t < NT; t++) {
                    __m512i w = _mm512_loadu_si512((const void *)(qw0 + (2 * g + t) * per_group + j * 64));
                    lo[t] = _mm512_and_si512(w, low);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *a = xq + r * k + g * GROUP + 8 * j;
                    __m512i a_lo = bcast4(a), a_hi = bcast4(a + 4);
                    for (int t = 0; t < NT; t++) {
                        dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], a_lo);
                        dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], a_hi);
                    }
                }
            }
        } else {
            for (int j = 0; j < 8; j++) {
                __m512i w[2];
                for (int t = 0; t < NT; t++)
                    w[t] = _mm512_loadu_si512((const void *)(qw0 + (2 * g + t) * per_group + j * 64));
                for (int r = 0; r < R; r++) {
                    __m512i a = bcast4(xq + r * k + g * GROUP + 4 * j);
                    for (int t = 0; t < NT; t++) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], w[t], a);
                }
            }
        }
        for (int t = 0; t < NT; t++) {
            int64_t at = sz0 + (2 * g + t) * rows * TILE;
            __m512 scale = load16_sz(sz, form, at), offset = load16_offset(sz, form, bits, at, scale);
            for (int r = 0; r < R; r++) {
                __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g]));
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), ds, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * groups + g]), acc[r][t]);
            }
        }
    }
}

static inline void store16_bf16(uint16_t *p, __mmask16 mask, __m512 v) {
#if defined(__AVX512BF16__)
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
    bf16x16_store_masked(p, v, mask);
#endif
}

/* R rows from row r × NT tiles from tile into out (row stride n), or where kept->rows is not
 * NULL, to the thread's candidates for each row's top (top_candidates.h) and nowhere else */
static inline __attribute__((always_inline)) void
block_store(const int R, const int NT, const int bits, const int8_t *xq, const float *d, const float *s,
            int64_t k, const uint8_t *qw, const void *sz, int64_t form, int64_t tile, int64_t n, int out_bf16,
            int stream, void *out, int64_t r, const candidate_rows *kept) {
    int64_t groups = k / GROUP;
    __m512 acc[4][2];
    block(R, NT, bits, xq, d, s, k, qw + group_at(bits, groups, tile, 0), sz, form, sz_index(form, groups, tile, 0, 0),
          stream, acc);
    for (int t = 0; t < NT; t++) {
        int64_t col = (tile + t) * TILE, left = n - col;
        __mmask16 mask = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int i = 0; i < R; i++) {
            if (kept->rows) offer16(kept->rows + r + i, kept->floor + r + i, kept->top, col, mask, acc[i][t]);
            else if (out_bf16) store16_bf16((uint16_t *)out + (r + i) * n + col, mask, acc[i][t]);
            else _mm512_mask_storeu_ps((float *)out + (r + i) * n + col, mask, acc[i][t]);
        }
    }
}

/* Rows [r0, r0 + rows) × tiles [t0, t0 + nt) with every (R, NT) shape instantiated. */
#define CASE(R, NT, BITS)                                                                       \
    block_store(R, NT, BITS, xq + r * k, d + r * groups, s + r * groups, k, qw, sz, form, t, n, out_bf16, \
                stream && r == r0, out, r, kept)
#define ROWS(NT, BITS)                                                                          \
    switch (rows - (r - r0) >= 4 ? 4 : rows - (r - r0)) {                                       \
    case 4: CASE(4, NT, BITS); break;                                                           \
    case 3: CASE(3, NT, BITS); break;                                                           \
    case 2: CASE(2, NT, BITS); break;                                                           \
    default: CASE(1, NT, BITS);                                                                 \
    }
static void gemm_range(const int8_t *xq, const float *d, const float *s, int64_t r0, int64_t rows, int64_t k,
                       const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int64_t t0,
                       int64_t nt, int out_bf16, int stream, void *out, const candidate_rows *kept) {
    int64_t groups = k / GROUP;
    for (int64_t r = r0; r < r0 + rows; r += 4)
        for (int64_t t = t0; t < t0 + nt; t += 2) {
            int two = t + 1 < t0 + nt;
            if (bits == 4) {
                if (two) { ROWS(2, 4) } else { ROWS(1, 4) }
            } else {
                if (two) { ROWS(2, 8) } else { ROWS(1, 8) }
            }
        }
}

/* The product into out, or where `all` is not NULL, each thread's candidates for each row's top */
static void gemm_into(const int8_t *xq, const float *d, const float *s, int64_t m, int64_t k, const uint8_t *qw,
                      const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16, void *out,
                      const top_candidates *all) {
    int64_t tiles = (n + TILE - 1) / TILE, pairs = (tiles + 1) / 2;
    int64_t row_blocks = m > 64 ? (m + 63) / 64 : 1, rows_per = m > 64 ? 64 : m;
    int64_t jobs = pairs * row_blocks;
#pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_WORK)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t p = job / row_blocks, b = job % row_blocks;  /* a thread's pairs stay in its cache */
        int64_t r0 = b * rows_per, rows = m - r0 < rows_per ? m - r0 : rows_per;
        int64_t t0 = 2 * p, nt = tiles - t0 < 2 ? tiles - t0 : 2;
        candidate_rows kept = thread_rows(all, omp_get_thread_num());
        gemm_range(xq, d, s, r0, rows, k, qw, sz, form, bits, n, t0, nt, out_bf16, r0 == 0, out, &kept);
    }
}

static void gemm_avx(const int8_t *xq, const float *d, const float *s, int64_t m, int64_t k,
                     const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16,
                     void *out) {
    gemm_into(xq, d, s, m, k, qw, sz, form, bits, n, out_bf16, out, NULL);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include "quant_gemm_amx.h"
#endif
#endif
#ifndef HAVE_AMX
#define HAVE_AMX 0
#endif

/* ---- entry points ----------------------------------------------------------------------- */

typedef void (*quantize_fn)(const void *, int64_t, int8_t *, float *, float *);
typedef void (*gemm_fn)(const int8_t *, const float *, const float *, int64_t, int64_t, const uint8_t *,
                        const void *, int64_t, int64_t, int64_t, int, void *);

static void quantize_rows(quantize_fn quantize, const char *x, int64_t ldx_bytes, int64_t m, int64_t k,
                          int8_t *xq, float *d, float *s) {
    int64_t groups = k / GROUP;
    FOR_ROWS(m * k >= PARALLEL_WORK / 16, r, m,
             quantize(x + r * ldx_bytes, k, xq + r * k, d + r * groups, s + r * groups));
}

static void run(quantize_fn quantize, gemm_fn gemm, const void *x, int64_t ldx_bytes, int64_t m, int64_t k,
                const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int out_bf16, void *out) {
    int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(m * k));
    float *ds = malloc(sizeof(float) * (size_t)(2 * m * groups));
    quantize_rows(quantize, x, ldx_bytes, m, k, xq, ds, ds + m * groups);
    gemm(xq, ds, ds + m * groups, m, k, qw, sz, form, bits, n, out_bf16, out);
    free(xq);
    free(ds);
}

#if HAVE_VNNI
#define GEMM gemm_avx
#elif HAVE_AVX2
#define GEMM gemm_avx2
#else
#define GEMM gemm_scalar
#endif

/* ---- the product on AMX tiles (quant_gemm_amx.h) --------------------------------------------- */

int64_t affine_amx(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Without AMX tiles, the same product in plain C: each weight value rounded to bf16 as
 * affine_dequantize makes it, times x, summed in float. */
static void dense_product(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                          int64_t form, int64_t bits, int64_t n, int out_f32, void *out) {
    int64_t groups = k / GROUP;
    float *w = malloc(sizeof(float) * (size_t)k);
    for (int64_t col = 0; col < n; col++) {
        int64_t t = col / TILE, c = col % TILE;
        for (int64_t i = 0; i < k; i++) {
            int64_t at = sz_index(form, groups, t, i / GROUP, c);
            float product = (float)packed_q(qw, bits, groups, col, i) * scale_at(sz, form, at);
            w[i] = bf16_load(bf16_store(product + offset_at(sz, form, bits, at)));
        }
        for (int64_t r = 0; r < m; r++) {
            float sum = 0.f;
            for (int64_t i = 0; i < k; i++) sum += bf16_load(x[r * ldx + i]) * w[i];
            if (out_f32) ((float *)out)[r * n + col] = sum;
            else ((uint16_t *)out)[r * n + col] = bf16_store(sum);
        }
    }
    free(w);
}

void affine_matmul_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, int64_t out_f32, void *out) {
#if HAVE_AMX
    if (amx_permitted()) {
        amx_gemm(x, ldx, m, k, qw, sz, form, bits, n, (int)out_f32, out);
        return;
    }
#endif
    dense_product(x, ldx, m, k, qw, sz, form, bits, n, (int)out_f32, out);
}

/* ---- a vocabulary's top logits recomputed --------------------------------------------------- */

/* One column of the packed weight, unpacked: its q in input order and each group's scale and
 * offset. A refinement gathers a column once for every row whose top logits hold it. */
typedef struct {
    uint8_t *q;    /* [k] */
    float *scale;  /* [k / GROUP] */
    float *offset; /* [k / GROUP] */
    int64_t bits;  /* the packing's: the portable column_dot sums in its steps' order */
} column_copy;

static column_copy column_alloc(int64_t k, int64_t bits) {
    column_copy c = {malloc((size_t)k), malloc(sizeof(float) * (size_t)(k / GROUP)),
                     malloc(sizeof(float) * (size_t)(k / GROUP)), bits};
    return c;
}

static void column_free(column_copy c) {
    free(c.q);
    free(c.scale);
    free(c.offset);
}

/* Column col's q, scales and offsets. Its q sit 4 bytes a 64-byte step (packed_q's layout),
 * 4 inputs a step at 8 bits, 8 at 4 bits (the low nibbles the first 4): one cache line a step,
 * 9 KiB for a 576-input column, read once here (in rising address order, its tile's half of
 * each group of the pair: the hardware prefetches it; asking for the next column's lines ahead
 * measured no different). */
static void gather_column(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k, int64_t col,
                          column_copy into) {
    int64_t t = col / TILE, c = col % TILE, groups = k / GROUP, per_step = step_bytes(bits), steps = k / per_step;
    for (int64_t j = 0; j < steps; j++)
        for (int64_t i = 0; i < 4; i++) {
            uint8_t b = qw[step_at(bits, groups, t, j) + 4 * c + i];
            if (bits == 4) {
                into.q[j * 8 + i] = b & 15;
                into.q[j * 8 + 4 + i] = b >> 4;
            } else {
                into.q[j * 4 + i] = b;
            }
        }
    for (int64_t g = 0; g < groups; g++) {
        int64_t at = sz_index(form, groups, t, g, c);
        into.scale[g] = scale_at(sz, form, at);
        into.offset[g] = offset_at(sz, form, bits, at);
    }
}

/* A gathered column times x (float32 [k], xsum[g] its group sums) in float32:
 * Σ_g scale_g · Σ_{i∈g} q_i · x_i + offset_g · xsum_g, the weight exact. */
#if defined(__AVX2__) && defined(__FMA__)
static float column_dot(column_copy w, int64_t k, const float *x, const float *xsum) {
    __m256 total = _mm256_setzero_ps();
    float offsets = 0.f;
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 dot = _mm256_setzero_ps();
        for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i += 8) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(w.q + i));
            dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_loadu_ps(x + i), dot);
        }
        total = _mm256_fmadd_ps(dot, _mm256_set1_ps(w.scale[g]), total);
        offsets += w.offset[g] * xsum[g];
    }
    return hsum8(total) + offsets;
}
#else
static float column_dot(column_copy w, int64_t k, const float *x, const float *xsum) {
    float total = 0.f;
    for (int64_t g = 0; g < k / GROUP; g++) {
        float dot = 0.f;
        if (w.bits == 4)  /* a step's two nibbles of the same byte at once */
            for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i += 8)
                for (int64_t j = i; j < i + 4; j++) dot += (float)w.q[j] * x[j] + (float)w.q[j + 4] * x[j + 4];
        else
            for (int64_t j = g * GROUP; j < (g + 1) * GROUP; j++) dot += (float)w.q[j] * x[j];
        total += w.scale[g] * dot + w.offset[g] * xsum[g];
    }
    return total;
}
#endif

#if defined(__AVX2__)
/* whether any of row[0, 32) is above least (NaN never is) */
static inline int any_above(const float *row, float least) {
    const __m256 l = _mm256_set1_ps(least);
    __m256 a = _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row), l, _CMP_GT_OQ),
                            _mm256_cmp_ps(_mm256_loadu_ps(row + 8), l, _CMP_GT_OQ));
    __m256 b = _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + 16), l, _CMP_GT_OQ),
                            _mm256_cmp_ps(_mm256_loadu_ps(row + 24), l, _CMP_GT_OQ));
    return _mm256_movemask_ps(_mm256_or_ps(a, b));
}
#endif

/* The row's `top` largest entries (top_heap.h's order) into h, emptied first: once the heap is
 * full, 32 entries at a time are passed over when none ranks above the root (nearly all of a
 * vocabulary's). */
static void largest(const float *row, int64_t n, top_heap *h) {
    h->size = 0;
    for (int64_t i = 0; i < n; i++) {
#if defined(__AVX2__)
        if (h->size == h->top && i % 32 == 0 && i + 32 <= n && !any_above(row + i, h->value[0])) {
            i += 31;
            continue;
        }
#endif
        top_offer(h, row[i], i);
    }
}

/* pairs (column << 32 | row) sorted by column, least significant byte first: 256 buckets a
 * pass, as many passes as the columns' bytes (n < 2^32) */
static void sort_by_column(uint64_t *pairs, int64_t count, int64_t n) {
    uint64_t *spare = malloc(sizeof(uint64_t) * (size_t)count);
    for (int shift = 32; shift < 64 && (n - 1) >> (shift - 32) > 0; shift += 8) {
        int64_t start[257] = {0};
        for (int64_t i = 0; i < count; i++) start[((pairs[i] >> shift) & 255) + 1]++;
        for (int b = 0; b < 256; b++) start[b + 1] += start[b];
        for (int64_t i = 0; i < count; i++) spare[start[(pairs[i] >> shift) & 255]++] = pairs[i];
        memcpy(pairs, spare, sizeof(uint64_t) * (size_t)count);
    }
    free(spare);
}

/* The exact logit of each (column << 32 | row) pair, by column_dot from x [m, k] as float32 (xf,
 * row stride k), into values (values[i] for pairs[i] as they are left: sorted by column). Rows'
 * top columns overlap (in text most rows rank the same frequent tokens high: 64 rows' top 20 held
 * ~340 distinct columns of 1 280), so each column is gathered once for all its rows: a column's q
 * lie 16 columns to a cache line, and reading one per pair read ~16 times the bytes used. A
 * pair's arithmetic is the same whatever its batch and whatever other pairs come with it, so the
 * columns split over the threads from 16 384 multiply-adds, a single row's 32 columns of 512
 * inputs (each column gathers 9-16 KB of a table just streamed past the caches: the default
 * model's head call 1.01-1.08x at one row on two threads, benchmarks/RESULTS.md 2026-12-07). */
static void recompute(const float *xf, int64_t m, int64_t k, const uint8_t *qw, const void *sz, int64_t form,
                      int64_t bits, int64_t n, uint64_t *pairs, int64_t count, float *values) {
    int64_t groups = k / GROUP, nruns = 0;
    float *xsum = malloc(sizeof(float) * (size_t)(m * groups));
    int64_t *runs = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* where each column's pairs start */
#pragma omp parallel if (count * k >= PARALLEL_WORK / 16)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                float sum = 0.f;
                for (int64_t i = 0; i < GROUP; i++) sum += xf[r * k + g * GROUP + i];
                xsum[r * groups + g] = sum;
            }
#pragma omp single
        {
            sort_by_column(pairs, count, n);
            for (int64_t i = 0; i < count; i++)
                if (i == 0 || pairs[i] >> 32 != pairs[i - 1] >> 32) runs[nruns++] = i;
            runs[nruns] = count;
        }
        column_copy w = column_alloc(k, bits);
#pragma omp for schedule(dynamic, 4)
        for (int64_t c = 0; c < nruns; c++) {
            int64_t col = (int64_t)(pairs[runs[c]] >> 32);
            gather_column(qw, sz, form, bits, k, col, w);
            for (int64_t i = runs[c]; i < runs[c + 1]; i++) {
                int64_t r = (int64_t)(pairs[i] & 0xFFFFFFFFu);
                values[i] = column_dot(w, k, xf + r * k, xsum + r * groups);
            }
        }
        column_free(w);
    }
    free(xsum);
    free(runs);
}

/* Each row of out [m, n] (that row's one-pass logits) gets its `top` largest entries
 * (largest's) recomputed exactly from xf. */
static void refine_top(const float *xf, int64_t m, int64_t k, const uint8_t *qw, const void *sz, int64_t form,
                       int64_t bits, int64_t n, int64_t top, float *out) {
    if (top > n) top = n;
    int64_t count = m * top;
    uint64_t *pairs = malloc(sizeof(uint64_t) * (size_t)count);
    float *values = malloc(sizeof(float) * (size_t)count);
#pragma omp parallel if (m > 1 && count * k >= PARALLEL_WORK)
    {
        top_heap h = {malloc(sizeof(int64_t) * (size_t)top), malloc(sizeof(float) * (size_t)top), 0, top};
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            largest(out + r * n, n, &h);
            for (int64_t i = 0; i < top; i++) pairs[r * top + i] = (uint64_t)h.column[i] << 32 | (uint64_t)r;
        }
        free(h.column);
        free(h.value);
    }
    recompute(xf, m, k, qw, sz, form, bits, n, pairs, count, values);
    for (int64_t i = 0; i < count; i++) {
        int64_t r = (int64_t)(pairs[i] & 0xFFFFFFFFu), col = (int64_t)(pairs[i] >> 32);
        out[r * n + col] = values[i];
    }
    free(pairs);
    free(values);
}

/* Each row's greedy token, the first maximum of the logits refine_top would leave, from its `top`
 * candidates (columns best, their one-pass logits approx: the row's `top` largest in largest's
 * order, made without the row's other logits) recomputed exactly: the largest exact value (the
 * lowest column on a tie) is the row's maximum where it lies above every one-pass logit left
 * out, which none of the candidates' one-pass values lies under; -1 (the caller makes the row's
 * logits) where it does not, where an exact value is NaN, or where a one-pass value is (the
 * product could not rank the row). */
static void greedy_top(const float *xf, int64_t m, int64_t k, const uint8_t *qw, const void *sz, int64_t form,
                       int64_t bits, int64_t n, int64_t top, const int64_t *best, const float *approx,
                       int64_t *tokens) {
    int64_t count = m * top;
    uint64_t *pairs = malloc(sizeof(uint64_t) * (size_t)count);
    float *values = malloc(sizeof(float) * (size_t)count), *most = malloc(sizeof(float) * (size_t)m);
    for (int64_t i = 0; i < count; i++) pairs[i] = (uint64_t)best[i] << 32 | (uint64_t)(i / top);
    recompute(xf, m, k, qw, sz, form, bits, n, pairs, count, values);
    for (int64_t r = 0; r < m; r++) tokens[r] = -1, most[r] = -INFINITY;
    /* rising columns, so the first of equal values stays; a NaN exact value sticks in most[r] */
    for (int64_t i = 0; i < count; i++) {
        int64_t r = (int64_t)(pairs[i] & 0xFFFFFFFFu);
        if (isnan(most[r])) continue;
        if (isnan(values[i])) most[r] = NAN;
        else if (tokens[r] < 0 || values[i] > most[r]) tokens[r] = (int64_t)(pairs[i] >> 32), most[r] = values[i];
    }
    for (int64_t r = 0; r < m; r++) {
        float floor = INFINITY; /* the least candidate's one-pass value: no logit left out lies above it */
        int unranked = 0;       /* a NaN one-pass value: the product could not rank the row */
        for (int64_t i = 0; i < top; i++) {
            float v = approx[r * top + i];
            unranked |= isnan(v);
            floor = v < floor ? v : floor;
        }
        if (isnan(most[r]) || unranked || (top < n && !(most[r] > floor))) tokens[r] = -1;
    }
    free(pairs);
    free(values);
    free(most);
}

/* The index of row[0, n)'s first maximum, a NaN counting as the maximum (its first NaN): the
 * sampler's argmax, for the rows greedy_top cannot settle. */
static int64_t first_max_row(const float *row, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n && !isnan(row[best]); i++)
        if (isnan(row[i]) || row[i] > row[best]) best = i;
    return best;
}

/* Each row's `top` largest logits of affine_logits's one-pass product (best [m, top] columns,
 * approx [m, top] values: top_heap.h's entries), as greedy_top takes them. On VNNI the product
 * keeps each row's candidates as it goes (top_candidates.h), writing no logit; a row it cannot
 * rank (NaN, ties past its room) gets NaN values. Elsewhere the logits are written and each row
 * passed over (largest), as refine_top does. */
static void logits_top(quantize_fn quantize, const void *x, int64_t ldx_bytes, int64_t m, int64_t k,
                       const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t n, int64_t top,
                       int64_t *best, float *approx) {
#if HAVE_VNNI
    int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(m * k));
    float *ds = malloc(sizeof(float) * (size_t)(2 * m * groups));
    quantize_rows(quantize, x, ldx_bytes, m, k, xq, ds, ds + m * groups);
    top_candidates all = top_candidates_new(m, top);
    gemm_into(xq, ds, ds + m * groups, m, k, qw, sz, form, bits, n, 0, NULL, &all);
    top_candidates_merge(all, best, approx, m * n * k >= PARALLEL_WORK);
    free(xq);
    free(ds);
#else
    float *out = malloc(sizeof(float) * (size_t)(m * n));
    run(quantize, GEMM, x, ldx_bytes, m, k, qw, sz, form, bits, n, 0, out);
#pragma omp parallel for schedule(static) if (m * n >= PARALLEL_WORK / 64)
    for (int64_t r = 0; r < m; r++) {
        top_heap h = {best + r * top, approx + r * top, 0, top};
        largest(out + r * n, n, &h);
    }
    free(out);
#endif
}

/* ---- the per-type functions: quantizers, matmul, rows, dequantization (quant_gemm_generic.h) ---- */

#define SUFFIX bf16
#define T uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#define OUT_BF16 1
#include "quant_gemm_generic.h"

#define SUFFIX f32
#define T float
#define LOAD f32_load
#define STORE f32_store
#define OUT_BF16 0
#include "quant_gemm_generic.h"
