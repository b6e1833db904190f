/* Multi-head latent attention (MLA, DeepSeek-V2/V3) decode on the CPU, reading the paged latent
 * cache in place through the block table.
 *
 * Cache layout (mla-torch's): [blocks, block_size, rank + rope], one vector per token, the
 * normalized latent then the rotated key part every head shares. With the key up-projection
 * folded into the query (the absorbed form), a head's query is one rank + rope vector and its
 * score against a token one dot product with that token's whole cache vector; its output is the
 * softmax-weighted sum of the tokens' latents (the value up-projection is applied by the caller).
 * All heads read the same vectors (MQA over the latent), so a work item is one (row, tile of
 * heads): each block is read once (bf16 widened to float32 once) for all of the tile's heads,
 * with an online softmax per head (float32 running max and sum, the accumulator rescaled when
 * the max grows). A head's math does not depend on its tile, the tile size, the other rows or the
 * thread count, so a row's result is its own query's and context's alone.
 *
 * Items are spread over torch's OpenMP pool when the call is big enough to split; with fewer rows
 * than threads the heads are tiled finer so every thread has work. Each cache type (bf16, f32)
 * gets mla_decode_<type> on AVX2 + FMA where the compiler targets it (8 lanes: scores two heads by
 * four tokens at a time, the accumulation two heads by 32 latent lanes) and mla_decode_<type>_scalar,
 * portable C, which the tests also run (on a CPU without AVX2 both are the portable one). mla.h
 * declares them.
 */
#include "mla.h"
#include "engine_bf16.h"
#include "engine_exp.h"
#include "engine_lanes.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MLA_AVX2 1
#endif

#define MAX_BLOCK_SIZE 256
#define MAX_ENTRY_DIM 2048
/* heads of one row per work item: the tile's accumulators (HEAD_TILE x rank float32) stay in L2
 * beside one widened block */
#define HEAD_TILE 16
/* below this many multiply-adds (rows x heads x context x entry) a call stays on one thread */
#define MIN_PARALLEL_WORK (1 << 16)

int64_t mla_max_block_size(void) { return MAX_BLOCK_SIZE; }
int64_t mla_max_entry_dim(void) { return MAX_ENTRY_DIM; }

/* ---- a block as float32 vectors: bf16 widened into `scratch`, f32 read where it lies ---- */

static inline const float *block_bf16(const uint16_t *src, int64_t count, float *scratch) {
    int64_t i = 0;
#ifdef MLA_AVX2
    for (; i + 8 <= count; i += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(scratch + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; i < count; i++) scratch[i] = bf16_load(src[i]);
    return scratch;
}

static inline const float *block_f32(const float *src, int64_t count, float *scratch) {
    (void)count, (void)scratch;
    return src;
}

/* ---- the portable math ------------------------------------------------------------------ */

/* scores[h * stride + t] = scale · q_h · keys[t] for the tile's heads and the block's tokens */
static void scores_scalar(const float *q, int64_t heads, int64_t entry, const float *keys, int64_t count,
                          float scale, float *scores, int64_t stride) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < count; t++) {
            float dot = 0.f;
            for (int64_t d = 0; d < entry; d++) dot += q[h * entry + d] * keys[t * entry + d];
            scores[h * stride + t] = dot * scale;
        }
}

/* scores -> exp(scores - new max) in place; the running max and sum updated; returns the factor
 * the accumulator must be multiplied by (exp(old max - new max)) */
static float softmax_step_scalar(float *scores, int64_t count, float *max, float *sum) {
    float block_max = -INFINITY;
    for (int64_t t = 0; t < count; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    float new_max = block_max > *max ? block_max : *max, total = 0.f;
    float correction = expf(*max - new_max);
    for (int64_t t = 0; t < count; t++) {
        scores[t] = expf(scores[t] - new_max);
        total += scores[t];
    }
    *sum = *sum * correction + total;
    *max = new_max;
    return correction;
}

/* acc_h = acc_h · correction[h] + sum_t probs[h * stride + t] · latent_t, the latent the first
 * rank values of each entry-long vector */
static void accumulate_scalar(float *acc, int64_t heads, int64_t rank, const float *correction,
                              const float *probs, int64_t stride, const float *vectors, int64_t count,
                              int64_t entry) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < rank; d++) {
            float a = acc[h * rank + d] * correction[h];
            for (int64_t t = 0; t < count; t++) a += probs[h * stride + t] * vectors[t * entry + d];
            acc[h * rank + d] = a;
        }
}

/* ---- the same on AVX2 + FMA (rank and rope multiples of 8) ---------------------------------- */

#ifdef MLA_AVX2
/* lane t = the sum of a[t]'s lanes */
static inline __m256 sum8(const __m256 a[8]) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* two heads by four tokens a step: six loads per eight multiply-adds. Tokens outer, heads inner:
 * a group's eight key rows (18 KB) stay in L1 while the tile's queries stream past them, so a
 * block crosses from L2 once. An odd last head and a block's last tokens repeat a real row
 * (computed, never stored). */
static void scores_avx2(const float *q, int64_t heads, int64_t entry, const float *keys, int64_t count,
                        float scale, float *scores, int64_t stride) {
    for (int64_t group = 0; group < count; group += 8)
        for (int64_t h = 0; h < heads; h += 2) {
            const float *q0 = q + h * entry, *q1 = h + 1 < heads ? q0 + entry : q0;
            for (int64_t t = group; t < group + 8 && t < count; t += 4) {
                const float *k[4];
                for (int64_t i = 0; i < 4; i++) k[i] = keys + (t + i < count ? t + i : count - 1) * entry;
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int64_t d = 0; d < entry; d += 8) {
                    __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
                    for (int i = 0; i < 4; i++) {
                        __m256 y = _mm256_loadu_ps(k[i] + d);
                        a[i] = _mm256_fmadd_ps(x0, y, a[i]);
                        a[4 + i] = _mm256_fmadd_ps(x1, y, a[4 + i]);
                    }
                }
                float lanes[8];
                _mm256_storeu_ps(lanes, _mm256_mul_ps(sum8(a), _mm256_set1_ps(scale)));
                int64_t n = count - t < 4 ? count - t : 4;
                for (int64_t i = 0; i < n; i++) {
                    scores[h * stride + t + i] = lanes[i];
                    if (h + 1 < heads) scores[(h + 1) * stride + t + i] = lanes[4 + i];
                }
            }
        }
}

/* softmax_step_scalar on 8 lanes (exp8), the block's tail in scalar code */
static float softmax_step_avx2(float *scores, int64_t count, float *max, float *sum) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    int64_t whole = count / 8 * 8;
    for (int64_t t = 0; t < whole; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + t));
    float block_max = hmax8(top);
    for (int64_t t = whole; t < count; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    float new_max = block_max > *max ? block_max : *max;
    float correction = expf(*max - new_max);
    __m256 shift = _mm256_set1_ps(new_max), total = _mm256_setzero_ps();
    for (int64_t t = 0; t < whole; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
        _mm256_storeu_ps(scores + t, p);
        total = _mm256_add_ps(total, p);
    }
    float tail = 0.f;
    for (int64_t t = whole; t < count; t++) {
        scores[t] = expf(scores[t] - new_max);
        tail += scores[t];
    }
    *sum = *sum * correction + hsum8(total) + tail;
    *max = new_max;
    return correction;
}

/* acc_h += p_h,t · latent_t over 32 latent lanes of two heads (8 accumulators in registers) */
static inline void accumulate_pair_avx2(float *acc0, float *acc1, __m256 c0, __m256 c1, const float *p0,
                                        const float *p1, const float *vectors, int64_t count, int64_t entry,
                                        int64_t lanes) {
    __m256 a[4], b[4];
    for (int i = 0; i < lanes; i++) {
        a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc0 + 8 * i), c0);
        b[i] = _mm256_mul_ps(_mm256_loadu_ps(acc1 + 8 * i), c1);
    }
    for (int64_t t = 0; t < count; t++) {
        const float *v = vectors + t * entry;
        __m256 w0 = _mm256_broadcast_ss(p0 + t), w1 = _mm256_broadcast_ss(p1 + t);
        for (int i = 0; i < lanes; i++) {
            __m256 x = _mm256_loadu_ps(v + 8 * i);
            a[i] = _mm256_fmadd_ps(w0, x, a[i]);
            b[i] = _mm256_fmadd_ps(w1, x, b[i]);
        }
    }
    for (int i = 0; i < lanes; i++) {
        _mm256_storeu_ps(acc0 + 8 * i, a[i]);
        _mm256_storeu_ps(acc1 + 8 * i, b[i]);
    }
}

/* two heads by 32 latent lanes at a time, four loads and two broadcasts per eight multiply-adds;
 * lanes outer, heads inner, so a 32-lane column of the block (2 KB) stays in L1 for every head
 * and the block crosses from L2 once. An odd last head is paired with itself (the same values
 * computed twice, stored twice). */
static void accumulate_avx2(float *acc, int64_t heads, int64_t rank, const float *correction,
                            const float *probs, int64_t stride, const float *vectors, int64_t count,
                            int64_t entry) {
    for (int64_t d = 0; d < rank; d += 32) {
        int64_t lanes = rank - d < 32 ? (rank - d) / 8 : 4;
        for (int64_t h = 0; h < heads; h += 2) {
            int64_t h1 = h + 1 < heads ? h + 1 : h;
            __m256 c0 = _mm256_set1_ps(correction[h]), c1 = _mm256_set1_ps(correction[h1]);
            if (lanes == 4)
                accumulate_pair_avx2(acc + h * rank + d, acc + h1 * rank + d, c0, c1, probs + h * stride,
                                     probs + h1 * stride, vectors + d, count, entry, 4);
            else
                accumulate_pair_avx2(acc + h * rank + d, acc + h1 * rank + d, c0, c1, probs + h * stride,
                                     probs + h1 * stride, vectors + d, count, entry, lanes);
        }
    }
}
#define scores_simd scores_avx2
#define softmax_step_simd softmax_step_avx2
#define accumulate_simd accumulate_avx2
#else
#define scores_simd scores_scalar
#define softmax_step_simd softmax_step_scalar
#define accumulate_simd accumulate_scalar
#endif

/* ---- the driver, once per (cache type, math variant) --------------------------------------- */

/* Per-thread scratch: a tile's accumulators, running max, sum and correction, one block's scores
 * per head and one block widened to float32 (bf16 caches). */
typedef struct {
    float *acc, *max, *sum, *correction, *scores, *block;
} Workspace;

static int workspace_alloc(Workspace *w, int64_t rank, int64_t entry, int64_t block_size) {
    size_t floats = (size_t)HEAD_TILE * (rank + 3 + block_size) + (size_t)block_size * entry;
    float *base = malloc(floats * sizeof(float));
    if (!base) return 0;
    w->acc = base;
    w->max = w->acc + HEAD_TILE * rank;
    w->sum = w->max + HEAD_TILE;
    w->correction = w->sum + HEAD_TILE;
    w->scores = w->correction + HEAD_TILE;
    w->block = w->scores + HEAD_TILE * block_size;
    return 1;
}

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot see the next one coming. */
static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)block + b);
}

/* the heads of a tile per item: HEAD_TILE, or fewer when there are fewer rows than threads */
static int64_t head_tile(int64_t rows, int64_t heads) {
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t per_row = rows >= threads ? 1 : (threads + rows - 1) / rows;
    int64_t tile = (heads + per_row - 1) / per_row;
    return tile < HEAD_TILE ? (tile > 0 ? tile : 1) : HEAD_TILE;
}

#define SUFFIX bf16
#define C uint16_t
#define BLOCK block_bf16
#define SCORES scores_simd
#define SOFTMAX_STEP softmax_step_simd
#define ACCUMULATE accumulate_simd
#include "mla_generic.h"

#define SUFFIX bf16_scalar
#define C uint16_t
#define BLOCK block_bf16
#define SCORES scores_scalar
#define SOFTMAX_STEP softmax_step_scalar
#define ACCUMULATE accumulate_scalar
#include "mla_generic.h"

#define SUFFIX f32
#define C float
#define BLOCK block_f32
#define SCORES scores_simd
#define SOFTMAX_STEP softmax_step_simd
#define ACCUMULATE accumulate_simd
#include "mla_generic.h"

#define SUFFIX f32_scalar
#define C float
#define BLOCK block_f32
#define SCORES scores_scalar
#define SOFTMAX_STEP softmax_step_scalar
#define ACCUMULATE accumulate_scalar
#include "mla_generic.h"
