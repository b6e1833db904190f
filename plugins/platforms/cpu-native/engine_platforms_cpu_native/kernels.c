/* Fused layer ops for the CPU: (residual add +) RMSNorm, rotary tables looked up by position, rotary embedding (alone or after a
 * per-head RMSNorm of q and k, Qwen3's) in place, W8A8's activation quantization and int32
 * rescale in one pass each, SwiGLU (silu(gate) · up) in one pass, and LoRA's grouped shrink
 * and expand over a batch of mixed adapters (lora_generic.h).
 *
 * Each replaces several torch calls that, at small batches, cost more than their arithmetic.
 * Rounding follows the torch path step by step (bfloat16 results rounded to nearest even
 * where torch rounds), so the two agree to the last bit but for summation order.
 * The kernels are AVX-512 where the CPU has it, partly AVX2 + FMA where it has that (below), a
 * portable scalar path elsewhere, and split a big batch's rows over the OpenMP threads. Every kernel is written once, in kernels_generic.h,
 * which is included once per storage type (bf16, f32); kernels.h declares the entry points.
 */
#include "kernels.h"
#include "engine_bf16.h"
#include "engine_exp.h"
#include "engine_lanes.h"
#include "engine_split.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_DIM 1024
/* values from which a kernel's rows are split over threads: with the team spinning between
 * calls (engine.openmp) a split costs ~1 us, so a batch-64 step's norms (64 x 576 values) and
 * a batch-8 SwiGLU already gain (docs/decisions.md) */
#define PARALLEL_VALUES (1 << 13)
#define PARALLEL_WORK (1 << 18)   /* multiply-adds from which LoRA's tiles are split over threads */
#define LORA_TILE_ROWS 8          /* rows of one adapter that share each weight row loaded */
#define LORA_MAX_RANK 512

int64_t max_rotary_dim(void) { return MAX_DIM; }
int64_t lora_max_rank(void) { return LORA_MAX_RANK; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 vload_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 vload_bf16(const uint16_t *p, __mmask16 m) { return bf16x16_load_masked(p, m); }
static inline void vstore_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void vstore_bf16(uint16_t *p, __m512 v, __mmask16 m) { bf16x16_store_masked(p, v, m); }
static inline __m512 vround_f32(__m512 v) { return v; }
static inline __m512 vround_bf16(__m512 v) { return bf16x16_round(v); }
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
#define VECTOR_PASSES 1
#else
#define VECTOR_PASSES 0
#endif
/* without AVX-512, the norms (their sum of squares), W8A8's row quantization (its division and
 * rounding), SwiGLU (its exp: kernels_generic.h) and LoRA's shrink and expand (lora_generic.h)
 * have AVX2 + FMA passes of 8 lanes; the other loops the compiler vectorizes as well itself */
#if !VECTOR_PASSES && defined(__AVX2__) && defined(__FMA__)
#define AVX2_PASSES 1
static inline __m256 vload8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore8_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 vround8_f32(__m256 v) { return v; }
static inline __m256 vload8_bf16(const uint16_t *p) { return bf16x8_load(p); }
static inline void vstore8_bf16(uint16_t *p, __m256 v) { bf16x8_store(p, v); }
static inline __m256 vround8_bf16(__m256 v) { return bf16x8_round(v); }
#else
#define AVX2_PASSES 0
#endif

/* out[i] = table[ids[i]], rows of `row_bytes`; refused (nothing written) when an id is outside
 * [0, rows): the rotary tables' lookup by position. */
engine_status gather_rows(const char *table, int64_t rows, int64_t row_bytes, const int64_t *ids, int64_t count,
                          char *out) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= rows) return 1;
    for (int64_t i = 0; i < count; i++) memcpy(out + i * row_bytes, table + ids[i] * row_bytes, (size_t)row_bytes);
    return 0;
}

#define SUFFIX bf16
#define T uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#include "kernels_generic.h"

#define SUFFIX f32
#define T float
#define LOAD f32_load
#define STORE f32_store
#include "kernels_generic.h"

/* LoRA's rows in order of their slot (counting sort: rows of none, -1, left out) and the tiles
 * over that order: runs of up to LORA_TILE_ROWS rows of one slot, tile t being
 * order[tiles[t]:tiles[t + 1]]. One allocation, freed with free(*order). Refused (1) when an
 * index is outside [-1, slots); 2 without memory. */
static engine_status lora_tiles(const int64_t *indices, int64_t rows, int64_t slots, int64_t **order,
                                int64_t **tiles, int64_t *count) {
    for (int64_t r = 0; r < rows; r++)
        if (indices[r] < -1 || indices[r] >= slots) return 1;
    int64_t *memory = malloc((size_t)(2 * rows + 2 * slots + 2) * sizeof(int64_t));
    if (!memory) return 2;
    int64_t *start = memory + rows, *tile = start + slots + 1;
    memset(start, 0, (size_t)(slots + 1) * sizeof(int64_t));
    for (int64_t r = 0; r < rows; r++)
        if (indices[r] >= 0) start[indices[r] + 1]++;
    for (int64_t s = 0; s < slots; s++) start[s + 1] += start[s];
    int64_t n = 0;
    for (int64_t s = 0; s < slots; s++)
        for (int64_t at = start[s]; at < start[s + 1]; at += LORA_TILE_ROWS) tile[n++] = at;
    tile[n] = start[slots];
    for (int64_t r = 0; r < rows; r++)
        if (indices[r] >= 0) memory[start[indices[r]]++] = r;
    *order = memory, *tiles = tile, *count = n;
    return 0;
}

/* CASE(M) with M the literal m, 1 ≤ m ≤ LORA_TILE_ROWS: a LoRA pass's block functions inlined
 * with their row count a constant (lora_generic.h) */
#define LORA_BY_ROWS(m, CASE)                                                                                  \
    switch (m) {                                                                                               \
    case 1: CASE(1); break;                                                                                    \
    case 2: CASE(2); break;                                                                                    \
    case 3: CASE(3); break;                                                                                    \
    case 4: CASE(4); break;                                                                                    \
    case 5: CASE(5); break;                                                                                    \
    case 6: CASE(6); break;                                                                                    \
    case 7: CASE(7); break;                                                                                    \
    default: CASE(8); break;                                                                                   \
    }
_Static_assert(LORA_TILE_ROWS == 8, "LORA_BY_ROWS spells out every tile height");

#define SUFFIX bf16
#define T uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#include "lora_generic.h"

#define SUFFIX f32
#define T float
#define LOAD f32_load
#define STORE f32_store
#include "lora_generic.h"
