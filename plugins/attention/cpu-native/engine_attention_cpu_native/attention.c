/* Paged attention for the CPU, reading KV blocks in place through the block table.
 *
 * Cache layout (the torch backend's): [2, kv_heads, blocks, block_size, head_dim], so one
 * (kv head, block) is block_size x head_dim contiguous values. One work item is one
 * (request, kv head, tile of query rows): its n query rows x g grouped query heads (M = n·g query vectors)
 * walk the request's blocks once, in chunks of CHUNK_TOKENS keys (whole blocks, on a grid fixed
 * by position): every vector's scores of the chunk's keys, then one online softmax step per
 * vector and chunk (float32 running max and sum, the accumulator rescaled when the max grows),
 * then the chunk's values, each block read once for all M vectors. A bf16 cache on AVX512_BF16
 * goes by bf16 pairs (attention_bf16_pairs.h: a row's vectors' scores of a block at once, the
 * probabilities rounded to bf16 for the values' products); without AVX512_BF16 bf16 values are
 * widened in registers once for up to four vectors of a row (AVX-512); other types once a
 * block into float32 scratch. Blocks sit anywhere in the pool, so each is prefetched
 * PREFETCH_AHEAD blocks before it is used. Query row i of a request sits at
 * position seq_len - n + i and sees keys up to its own position (causal within the chunk).
 * With a sliding window (window > 0) it sees the window keys ending at its own only: the walk
 * starts at the block of the first key the earliest row sees (earlier table entries may be the
 * null block) and each row skips its block's keys before its window. softcap > 0 caps each
 * score as softcap · tanh(score / softcap) before the softmax (Gemma 2). With `sinks` (not
 * NULL) each query head h adds exp(sinks[h]) to its rows' softmax denominators (gpt-oss): one
 * term more in each row's final 1 / sum, so the walk over the keys is the same.
 *
 * A work item is ROW_TILE query rows of one (request, kv head); items are spread over torch's
 * OpenMP pool when the call is big enough to split. A row's math depends on its own query and
 * context only: never on the chunk it came in, its start or length, or the other requests.
 * Each storage type (bf16, f32) gets two symbols: paged_attention_<type> on AVX-512 where
 * the compiler targets it (else on AVX2 + FMA, attention_avx2.h: 8 lanes, the same order of
 * operations), and paged_attention_<type>_scalar, portable C, which the tests also run (on a
 * CPU with neither both are the portable one). attention.h declares them.
 *
 * An fp8 cache (e4m3 or e5m2 bytes, kv_fp8.h) is read in place the same way, per activation
 * type: paged_attention_<type>_<fp8>[_scalar]. A block of values is widened once into the
 * float32 scratch bf16 values go to; keys are widened to float32 in registers as the scores
 * read them (AVX-512, portable), or, on AVX2, once a block into scratch of their own (WIDEN);
 * the key scale is folded into the score scale and the value scale into each output row's 1 / sum.
 * The SIMD e4m3 widening (AVX-512, or AVX2 with F16C) leaves out a constant 2^8, which UNIT puts
 * back in both scales.
 * write_kv_fp8 stores a step's K/V divided by the scales, as the core's quantize_kv does.
 * A float16 cache (paged_attention_<type>_f16[_scalar], write_kv_f16) goes the fp8 caches' way:
 * two bytes a value like bf16, widened by F16C (AVX2, AVX-512) as e5m2 bytes are.
 */
#include "attention.h"
#include "engine_bf16.h"
#include "engine_exp.h"
#include "engine_lanes.h"
#include "engine_split.h"
#include "kv_fp8.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256
/* below this many multiply-adds (query vectors x context tokens x head_dim, summed over
 * items) a call stays on one thread: waking the pool costs more than it saves. Between a step's
 * kernels the pool spins (engine.openmp), so a region costs ~0.4 us: one decode row over 8-100
 * keys (the default model's three KV heads) took 0.75-0.87x the time on two threads */
#define MIN_PARALLEL_WORK (1 << 12)
/* query rows of a request per work item: a long prompt splits over the threads, and a
 * thread's scratch stays ROW_TILE x group vectors whatever the chunk's length */
#define ROW_TILE 16
/* keys a softmax step covers (whole blocks): its max, correction and rescaling of the
 * accumulators once for all of them rather than once a block */
#define CHUNK_TOKENS 128
/* blocks between the one used and the one prefetched (block_ahead): 4 read a batch-64 step's
 * pages 1.1x faster than 1 */
#define PREFETCH_AHEAD 4
/* tokens between the one write_kv copies and the one whose slots it prefetches for writing: a
 * step's slots lie anywhere in the pool, each a cache miss a plain copy would take in turn */
#define WRITE_AHEAD 8
/* tokens from which write_kv splits them over the threads: a fresh process's first write of
 * each page is a page fault, and the threads take theirs side by side (a 256-row step's
 * write_kv 3.4 -> 2.2 ms while the pool's pages are new) */
#define WRITE_PARALLEL_TOKENS 64

int64_t max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t max_block_size(void) { return MAX_BLOCK_SIZE; }

/* write_kv's arguments as write_token reads them: `row` is one head's slot in bytes, `plane`
 * one head's whole pool */
typedef struct {
    const char *key, *value;
    int64_t row_stride, head_stride, elem_bytes;
    const int64_t *slot_mapping;
    int64_t tokens, kv_heads, row, plane;
    char *cache;
} kv_write;

/* token t's heads into its slot; the slots of the token WRITE_AHEAD on asked for */
static void write_token(const kv_write *w, int64_t t) {
    int64_t row = w->row, plane = w->plane, kv_heads = w->kv_heads;
    char *k_dst = w->cache + w->slot_mapping[t] * row, *v_dst = k_dst + kv_heads * plane;
    if (t + WRITE_AHEAD < w->tokens) {
        char *ahead = w->cache + w->slot_mapping[t + WRITE_AHEAD] * row;
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t b = 0; b < row; b += 64) {
                __builtin_prefetch(ahead + h * plane + b, 1, 3);
                __builtin_prefetch(ahead + (kv_heads + h) * plane + b, 1, 3);
            }
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        int64_t at = (t * w->row_stride + h * w->head_stride) * w->elem_bytes;
        memcpy(k_dst + h * plane, w->key + at, row);
        memcpy(v_dst + h * plane, w->value + at, row);
    }
}

/* This step's keys and values into the cache [2, kv_heads, slots, head_dim]: token t's heads
 * go to slot slot_mapping[t] (block · block_size + offset). key and value are [tokens, kv_heads,
 * head_dim] views of one tensor (row stride `row_stride`, head stride `head_stride`, in
 * elements of `elem_bytes`). Returns 1, writing nothing, if a slot lies outside the cache. */
engine_status write_kv(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                       const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                       int64_t slots, int64_t elem_bytes, char *cache) {
    for (int64_t t = 0; t < tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= slots) return 1;
    int64_t row = head_dim * elem_bytes;
    kv_write w = {key, value, row_stride, head_stride, elem_bytes, slot_mapping, tokens, kv_heads, row, slots * row,
                  cache};
    FOR_ROWS(tokens >= WRITE_PARALLEL_TOKENS, t, tokens, write_token(&w, t));
    return 0;
}

/* write_kv's counterpart for an fp8 cache [2, kv_heads, slots, head_dim] of bytes: each value
 * of key (value) divided by k_scale (v_scale), then saturated and rounded to e4m3 or e5m2. */
engine_status write_kv_fp8(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                           const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                           int64_t slots, int64_t source_bf16, int64_t e5m2, float k_scale, float v_scale,
                           uint8_t *cache) {
    for (int64_t t = 0; t < tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= slots) return 1;
    int64_t plane = slots * head_dim, elem = source_bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        uint8_t *k_dst = cache + slot_mapping[t] * head_dim, *v_dst = k_dst + kv_heads * plane;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = (t * row_stride + h * head_stride) * elem;
            for (int64_t d = 0; d < head_dim; d++) {
                float k, v;
                if (source_bf16) {
                    k = bf16_load(((const uint16_t *)(key + at))[d]);
                    v = bf16_load(((const uint16_t *)(value + at))[d]);
                } else {
                    k = ((const float *)(key + at))[d];
                    v = ((const float *)(value + at))[d];
                }
                k_dst[h * plane + d] = e5m2 ? e5m2_store(k / k_scale) : e4m3_store(k / k_scale);
                v_dst[h * plane + d] = e5m2 ? e5m2_store(v / v_scale) : e4m3_store(v / v_scale);
            }
        }
    }
    return 0;
}

/* write_kv_fp8's counterpart for a float16 cache: each value divided by its scale (1 unless
 * the checkpoint gives one), saturated and rounded to float16 as quantize_kv does. */
engine_status write_kv_f16(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                           const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                           int64_t slots, int64_t source_bf16, float k_scale, float v_scale, uint16_t *cache) {
    for (int64_t t = 0; t < tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= slots) return 1;
    int64_t plane = slots * head_dim, elem = source_bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        uint16_t *k_dst = cache + slot_mapping[t] * head_dim, *v_dst = k_dst + kv_heads * plane;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = (t * row_stride + h * head_stride) * elem;
            for (int64_t d = 0; d < head_dim; d++) {
                float k = source_bf16 ? bf16_load(((const uint16_t *)(key + at))[d]) : ((const float *)(key + at))[d];
                float v = source_bf16 ? bf16_load(((const uint16_t *)(value + at))[d]) : ((const float *)(value + at))[d];
                k_dst[h * plane + d] = f16_store(k / k_scale);
                v_dst[h * plane + d] = f16_store(v / v_scale);
            }
        }
    }
    return 0;
}

/* A block as float32 rows: bf16 converted into `scratch`, f32 read where it lies. */
static inline const float *block_bf16(const uint16_t *src, int64_t count, float *scratch) {
    for (int64_t i = 0; i < count; i++) scratch[i] = bf16_load(src[i]);
    return scratch;
}

static inline const float *block_f32(const float *src, int64_t count, float *scratch) {
    (void)count, (void)scratch;
    return src;
}

/* an fp8 (or f16) block widened into `scratch`: value by value (portable), 16 lanes at a time (AVX-512) */
#define DEFINE_BLOCK_FP8(FP8, C)                                                                     \
static inline const float *block_##FP8(const C *src, int64_t count, float *scratch) {                \
    for (int64_t i = 0; i < count; i++) scratch[i] = FP8##_load(src[i]);                            \
    return scratch;                                                                                  \
}
DEFINE_BLOCK_FP8(e4m3, uint8_t)
DEFINE_BLOCK_FP8(e5m2, uint8_t)
DEFINE_BLOCK_FP8(f16, uint16_t)

/* a query vector as float32, for the math that reads widened keys (WIDEN) */
static inline void load_row_bf16(float *dst, const uint16_t *src, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) dst[d] = bf16_load(src[d]);
}

static inline void load_row_f32(float *dst, const float *src, int64_t dim) { memcpy(dst, src, sizeof(float) * dim); }

static inline void store_row_bf16(uint16_t *dst, const float *src, float inv, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) dst[d] = bf16_store(src[d] * inv);
}

static inline void store_row_f32(float *dst, const float *src, float inv, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) dst[d] = src[d] * inv;
}

/* ---- the per-block math, portable ---------------------------------------------------- */

/* scores[t] = scale · q · keys[t], t < count; q in the activation type, keys in the cache's */
#define DEFINE_SCORES_SCALAR(SUFFIX, T, LOAD, C, LOAD_C)                                          \
static void scores_##SUFFIX##_scalar(const T *q, const C *keys, int64_t count, int64_t dim,       \
                                    float scale, float *scores) {                                 \
    for (int64_t t = 0; t < count; t++) {                                                         \
        float sum = 0.f;                                                                          \
        for (int64_t d = 0; d < dim; d++) sum += LOAD(q[d]) * LOAD_C(keys[t * dim + d]);          \
        scores[t] = sum * scale;                                                                  \
    }                                                                                             \
}
DEFINE_SCORES_SCALAR(bf16, uint16_t, bf16_load, uint16_t, bf16_load)
DEFINE_SCORES_SCALAR(f32, float, f32_load, float, f32_load)
DEFINE_SCORES_SCALAR(bf16_e4m3, uint16_t, bf16_load, uint8_t, e4m3_load)
DEFINE_SCORES_SCALAR(bf16_e5m2, uint16_t, bf16_load, uint8_t, e5m2_load)
DEFINE_SCORES_SCALAR(f32_e4m3, float, f32_load, uint8_t, e4m3_load)
DEFINE_SCORES_SCALAR(f32_e5m2, float, f32_load, uint8_t, e5m2_load)
DEFINE_SCORES_SCALAR(bf16_f16, uint16_t, bf16_load, uint16_t, f16_load)
DEFINE_SCORES_SCALAR(f32_f16, float, f32_load, uint16_t, f16_load)

/* Online softmax step: scores -> exp(score - new max) in place; updates *max and *sum;
 * returns the factor the accumulator must be scaled by (exp(old max - new max)). */
static float softmax_step_scalar(float *scores, int64_t count, float *max, float *sum) {
    float block_max = scores[0];
    for (int64_t t = 1; t < count; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    float new_max = block_max > *max ? block_max : *max;
    float correction = expf(*max - new_max), total = 0.f;
    for (int64_t t = 0; t < count; t++) {
        scores[t] = expf(scores[t] - new_max);
        total += scores[t];
    }
    *sum = *sum * correction + total;
    *max = new_max;
    return correction;
}

/* acc = acc · correction + sum_t probs[t] · values[t] */
static void accumulate_scalar(float *acc, float correction, const float *probs, const float *values,
                              int64_t count, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) {
        float a = acc[d] * correction;
        for (int64_t t = 0; t < count; t++) a += probs[t] * values[t * dim + d];
        acc[d] = a;
    }
}

/* ---- the same with AVX-512 (head_dim a multiple of 16) -------------------------------- */

#ifdef __AVX512F__
/* One vector of 16 sums from 16 vectors: lane t = the sum of acc[t]'s lanes. A tree of
 * unpacks and 128-bit shuffles, ~3 instructions a score where a reduction per score takes ~8. */
static inline __m512 sum16(const __m512 acc[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                 _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

/* A softmax step's new running max: the larger of `max` and the count scores' largest */
static inline float running_max_simd(const float *scores, int64_t count, float max) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < count; t += 16) {
        __mmask16 live = first_lanes(count - t);
        top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, scores + t));
    }
    float block_max = _mm512_reduce_max_ps(top);
    return block_max > max ? block_max : max;
}

#ifdef __AVX512BF16__
#include "attention_bf16_pairs.h"
#define BF16_PAIRS
#else
/* bf16 keys read where they lie, each 16 keys widened to float32 (AVX-512 without
 * AVX512_BF16; with it, attention_bf16_pairs.h). Inlined with dim a constant for the common
 * head sizes, so that the loop over a key's pieces unrolls. */
static inline __attribute__((always_inline)) void scores_bf16_body(const uint16_t *q, const uint16_t *keys,
                                                                   int64_t count, int64_t dim, float scale,
                                                                   float *scores) {
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        __m512 acc[16];
        int64_t n = count - t0 < 16 ? count - t0 : 16;
        for (int64_t t = 0; t < 16; t++) {
            acc[t] = _mm512_setzero_ps();
            if (t >= n) continue;
            const uint16_t *k = keys + (t0 + t) * dim;
            for (int64_t d = 0; d < dim; d += 16)
                acc[t] = _mm512_fmadd_ps(bf16x16_load(q + d), bf16x16_load(k + d), acc[t]);
        }
        _mm512_mask_storeu_ps(scores + t0, first_lanes(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
}

static void scores_bf16_simd(const uint16_t *q, const uint16_t *keys, int64_t count, int64_t dim, float scale,
                             float *scores) {
    if (dim == 64) scores_bf16_body(q, keys, count, 64, scale, scores);
    else if (dim == 128) scores_bf16_body(q, keys, count, 128, scale, scores);
    else scores_bf16_body(q, keys, count, dim, scale, scores);
}
#endif

static void scores_f32_simd(const float *q, const float *keys, int64_t count, int64_t dim, float scale,
                            float *scores) {
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        __m512 acc[16];
        int64_t n = count - t0 < 16 ? count - t0 : 16;
        for (int64_t t = 0; t < 16; t++) {
            acc[t] = _mm512_setzero_ps();
            if (t >= n) continue;
            const float *k = keys + (t0 + t) * dim;
            for (int64_t d = 0; d < dim; d += 16)
                acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc[t]);
        }
        _mm512_mask_storeu_ps(scores + t0, first_lanes(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
}

/* fp8 (or f16) keys widened in registers, 16 at a time, against a query row widened the same way */
#define DEFINE_SCORES_FP8_SIMD(SUFFIX, T, LOAD16, FP8, C, OVER)                                            \
static void scores_##SUFFIX##_simd(const T *q, const C *keys, int64_t count, int64_t dim,            \
                                   float scale, float *scores) {                                     \
    for (int64_t t0 = 0; t0 < count; t0 += 16) {                                                     \
        __m512 acc[16];                                                                              \
        int64_t n = count - t0 < 16 ? count - t0 : 16;                                               \
        for (int64_t t = 0; t < 16; t++) {                                                           \
            acc[t] = _mm512_setzero_ps();                                                            \
            if (t >= n) continue;                                                                    \
            const C *k = keys + (t0 + t) * dim;                                                      \
            for (int64_t d = 0; d < dim; d += 16)                                                    \
                acc[t] = _mm512_fmadd_ps(LOAD16(q + d), FP8##x16_load_##OVER(k + d), acc[t]);      \
        }                                                                                            \
        _mm512_mask_storeu_ps(scores + t0, first_lanes(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale))); \
    }                                                                                                \
}
DEFINE_SCORES_FP8_SIMD(bf16_e4m3, uint16_t, bf16x16_load, e4m3, uint8_t, over256)
DEFINE_SCORES_FP8_SIMD(bf16_e5m2, uint16_t, bf16x16_load, e5m2, uint8_t, over1)
DEFINE_SCORES_FP8_SIMD(f32_e4m3, float, _mm512_loadu_ps, e4m3, uint8_t, over256)
DEFINE_SCORES_FP8_SIMD(f32_e5m2, float, _mm512_loadu_ps, e5m2, uint8_t, over1)
DEFINE_SCORES_FP8_SIMD(bf16_f16, uint16_t, bf16x16_load, f16, uint16_t, over1)
DEFINE_SCORES_FP8_SIMD(f32_f16, float, _mm512_loadu_ps, f16, uint16_t, over1)

#define DEFINE_BLOCK_FP8_SIMD(FP8, C, OVER)                                                          \
static inline const float *block_##FP8##_simd(const C *src, int64_t count, float *scratch) {         \
    for (int64_t i = 0; i < count; i += 16)                                                          \
        _mm512_storeu_ps(scratch + i, FP8##x16_load_##OVER(src + i));                                \
    return scratch;                                                                                  \
}
DEFINE_BLOCK_FP8_SIMD(e4m3, uint8_t, over256)
DEFINE_BLOCK_FP8_SIMD(e5m2, uint8_t, over1)
DEFINE_BLOCK_FP8_SIMD(f16, uint16_t, over1)

static float softmax_step_simd(float *scores, int64_t count, float *max, float *sum) {
    float new_max = running_max_simd(scores, count, *max);
    float correction = expf(*max - new_max);
    __m512 shift = _mm512_set1_ps(new_max), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
        __mmask16 live = first_lanes(count - t);
        __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), shift));
        p = _mm512_maskz_mov_ps(live, p);
        _mm512_mask_storeu_ps(scores + t, live, p);
        total = _mm512_add_ps(total, p);
    }
    *sum = *sum * correction + _mm512_reduce_add_ps(total);
    *max = new_max;
    return correction;
}

/* head_dim in chunks of 64 (4 registers) with the tokens inner, so the accumulator stays
 * in registers across the block */
static void accumulate_simd(float *acc, float correction, const float *probs, const float *values,
                            int64_t count, int64_t dim) {
    __m512 c = _mm512_set1_ps(correction);
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), c);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), c);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 32), c);
        __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 48), c);
        for (int64_t t = 0; t < count; t++) {
            const float *v = values + t * dim + d;
            __m512 p = _mm512_set1_ps(probs[t]);
            a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), a3);
        }
        _mm512_storeu_ps(acc + d, a0);
        _mm512_storeu_ps(acc + d + 16, a1);
        _mm512_storeu_ps(acc + d + 32, a2);
        _mm512_storeu_ps(acc + d + 48, a3);
    }
    for (; d < dim; d += 16) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), c);
        for (int64_t t = 0; t < count; t++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(probs[t]), _mm512_loadu_ps(values + t * dim + d), a);
        _mm512_storeu_ps(acc + d, a);
    }
}
#ifndef BF16_PAIRS
/* Vectors [0, NV) of one query row against REGS · 16 dims at d (NV, REGS compile-time
 * constants once inlined, so every sum stays in a register): see accumulate_row_bf16_simd. */
static inline __attribute__((always_inline)) void accumulate_tile_bf16(
    float *acc, const float *correction, const float *probs, int64_t stride, const uint16_t *values, int64_t count,
    int64_t dim, int64_t d, const int nv, const int regs) {
    __m512 a[4][4];
    for (int j = 0; j < nv; j++)
        for (int r = 0; r < regs; r++)
            a[j][r] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * dim + d + 16 * r), _mm512_set1_ps(correction[j]));
    for (int64_t t = 0; t < count; t++) {
        __m512 v[4];
        for (int r = 0; r < regs; r++) v[r] = bf16x16_load(values + t * dim + d + 16 * r);
        for (int j = 0; j < nv; j++) {
            __m512 p = _mm512_set1_ps(probs[j * stride + t]);
            for (int r = 0; r < regs; r++) a[j][r] = _mm512_fmadd_ps(p, v[r], a[j][r]);
        }
    }
    for (int j = 0; j < nv; j++)
        for (int r = 0; r < regs; r++) _mm512_storeu_ps(acc + j * dim + d + 16 * r, a[j][r]);
}

/* accumulate_tile_bf16 for nv (1-4) vectors, nv made a constant */
static inline __attribute__((always_inline)) void accumulate_piece_bf16(
    float *acc, const float *correction, const float *probs, int64_t stride, const uint16_t *values, int64_t count,
    int64_t dim, int64_t d, int64_t nv, const int regs) {
    switch (nv) {
    case 4: accumulate_tile_bf16(acc, correction, probs, stride, values, count, dim, d, 4, regs); break;
    case 3: accumulate_tile_bf16(acc, correction, probs, stride, values, count, dim, d, 3, regs); break;
    case 2: accumulate_tile_bf16(acc, correction, probs, stride, values, count, dim, d, 2, regs); break;
    default: accumulate_tile_bf16(acc, correction, probs, stride, values, count, dim, d, 1, regs);
    }
}

/* The vectors of one query row (they see the same keys) against a block's bf16 values where
 * they lie: acc[j] = acc[j] · correction[j] + Σ_t probs[j · stride + t] · values[t], j < vectors
 * (acc rows dim apart). Each value is widened in registers once for up to four vectors rather
 * than into scratch once a block and reread by each; every lane's sum is accumulate_simd's. */
static void accumulate_row_bf16_simd(float *acc, const float *correction, const float *probs, int64_t stride,
                                     const uint16_t *values, int64_t count, int64_t dim, int64_t vectors) {
    for (int64_t j = 0; j < vectors; j += 4) {
        int64_t nv = vectors - j < 4 ? vectors - j : 4, d = 0;
        float *a = acc + j * dim;
        const float *c = correction + j, *p = probs + j * stride;
        for (; d + 64 <= dim; d += 64) accumulate_piece_bf16(a, c, p, stride, values, count, dim, d, nv, 4);
        for (; d < dim; d += 16) accumulate_piece_bf16(a, c, p, stride, values, count, dim, d, nv, 1);
    }
}
#endif
#define SIMD_VALUES_IN_PLACE 1
#define SIMD_WIDENS 0
#else
#if defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"
/* Keys widened once a block and query vectors once an item (the driver's WIDEN): with GQA every
 * query vector of a group reads the same keys, and on 8 lanes widening them in registers for
 * each (a bf16 query too) cost more than the fp8 cache saved in bytes. */
#define SIMD_WIDENS 1
#define SIMD_VALUES_IN_PLACE 0
#define scores_f32_simd scores_f32_avx2
#define softmax_step_simd softmax_step_avx2
#define accumulate_simd accumulate_avx2
#else
#define SIMD_WIDENS 0
#define SIMD_VALUES_IN_PLACE 0
#define scores_bf16_simd scores_bf16_scalar
#define scores_f32_simd scores_f32_scalar
#define softmax_step_simd softmax_step_scalar
#define accumulate_simd accumulate_scalar
#define scores_bf16_e4m3_simd scores_bf16_e4m3_scalar
#define scores_bf16_e5m2_simd scores_bf16_e5m2_scalar
#define scores_f32_e4m3_simd scores_f32_e4m3_scalar
#define scores_f32_e5m2_simd scores_f32_e5m2_scalar
#define scores_bf16_f16_simd scores_bf16_f16_scalar
#define scores_f32_f16_simd scores_f32_f16_scalar
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define block_e4m3_simd block_e4m3_avx2
#define block_e5m2_simd block_e5m2_avx2
#define block_f16_simd block_f16_avx2
#else
/* fp8 caches without AVX-512 or F16C: the portable conversion */
#define block_e4m3_simd block_e4m3
#define block_e5m2_simd block_e5m2
#define block_f16_simd block_f16
#undef E4M3_SIMD_UNIT
#define E4M3_SIMD_UNIT 1.f
#endif
#endif
/* the SIMD variants' scores: over float32 where the driver widens (SIMD_WIDENS), else over the
 * query and cache types in place */
#if SIMD_WIDENS
#define SIMD_SCORES(in_place) scores_f32_simd
#else
#define SIMD_SCORES(in_place) in_place
#endif

/* ---- the driver, once per (storage type, math variant) -------------------------------- */

/* Per-thread scratch: M accumulators, their running max and sum, M rows of a chunk's scores and
 * their softmax corrections, one block of values as float32; for the math that widens (WIDEN)
 * the M query vectors and one block of keys as float32 too (else keys and queries are read where
 * they lie); for the math that adds bf16 products (PROBS_BF16) M rows of a chunk's probabilities
 * as bf16. */
typedef struct {
    float *acc, *max, *sum, *correction, *values, *scores, *query, *keys;
    uint16_t *probs16;
    int64_t chunk; /* tokens of a chunk: whole blocks, CHUNK_TOKENS or one block where that is more */
} Workspace;

static int workspace_alloc(Workspace *w, int64_t vectors, int64_t dim, int64_t block_size) {
    int64_t chunk = CHUNK_TOKENS / block_size * block_size;
    w->chunk = chunk > block_size ? chunk : block_size;
    size_t floats = (size_t)vectors * (2 * dim + 3 + w->chunk) + (size_t)block_size * 2 * dim;
    size_t halves = (size_t)vectors * w->chunk;
    float *base = malloc(floats * sizeof(float) + halves * sizeof(uint16_t));
    if (!base) return 0;
    w->acc = base;
    w->max = w->acc + vectors * dim;
    w->sum = w->max + vectors;
    w->correction = w->sum + vectors;
    w->values = w->correction + vectors;
    w->scores = w->values + block_size * dim;
    w->query = w->scores + vectors * w->chunk;
    w->keys = w->query + vectors * dim;
    w->probs16 = (uint16_t *)(w->keys + block_size * dim);
    return 1;
}

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot see the next one coming.
 * Into L2 (locality 2, prefetcht1): measured level with prefetcht0 on the AMX Xeon. */
static inline void prefetch_lines(const void *start, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)start + b, 0, 2);
}

/* A query row at `position` sees keys [lo, hi) of [c0, c1): its own position and earlier,
 * within its window (window > 0). Returns 0 where it sees none there. */
static inline int row_range(int64_t position, int64_t window, int64_t c0, int64_t c1, int64_t *lo, int64_t *hi) {
    int64_t first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
    *lo = first > c0 ? first : c0;
    *hi = position + 1 < c1 ? position + 1 : c1;
    return *lo < *hi;
}

/* Gemma 2's logit soft-cap: scores become cap · tanh(scores / cap). */
static void soft_cap(float *scores, int64_t count, float cap) {
    for (int64_t t = 0; t < count; t++) scores[t] = cap * tanhf(scores[t] / cap);
}

/* paged_attention_<type> on the AVX-512 math where the compiler targets it, and
 * paged_attention_<type>_scalar on the portable math (attention_generic.h) */
#define SUFFIX bf16
#define T uint16_t
#define C uint16_t
#define BLOCK block_bf16
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#ifdef BF16_PAIRS
#define SCORES_ROW scores_row_bf16_pairs
#define WIDEN 0
#define PROBS_BF16 1
#define SOFTMAX_STEP softmax_step_bf16_pairs
#define VALUES_IN_PLACE 1
#define ACCUMULATE_ROW accumulate_row_bf16_pairs
#define STORE_ROW store_row_bf16_pairs
#else
#define SCORES SIMD_SCORES(scores_bf16_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_bf16
#define SOFTMAX_STEP softmax_step_simd
#define VALUES_IN_PLACE SIMD_VALUES_IN_PLACE
#define ACCUMULATE_ROW accumulate_row_bf16_simd
#define STORE_ROW store_row_bf16
#endif
#include "attention_generic.h"

#define SUFFIX bf16_scalar
#define T uint16_t
#define C uint16_t
#define BLOCK block_bf16
#define STORE_ROW store_row_bf16
#define SCORES scores_bf16_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_e4m3
#define T uint16_t
#define C uint8_t
#define BLOCK block_e4m3_simd
#define STORE_ROW store_row_bf16
#define SCORES SIMD_SCORES(scores_bf16_e4m3_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_bf16
#define SOFTMAX_STEP softmax_step_simd
#define UNIT E4M3_SIMD_UNIT
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_e4m3_scalar
#define T uint16_t
#define C uint8_t
#define BLOCK block_e4m3
#define STORE_ROW store_row_bf16
#define SCORES scores_bf16_e4m3_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_e5m2
#define T uint16_t
#define C uint8_t
#define BLOCK block_e5m2_simd
#define STORE_ROW store_row_bf16
#define SCORES SIMD_SCORES(scores_bf16_e5m2_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_bf16
#define SOFTMAX_STEP softmax_step_simd
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_e5m2_scalar
#define T uint16_t
#define C uint8_t
#define BLOCK block_e5m2
#define STORE_ROW store_row_bf16
#define SCORES scores_bf16_e5m2_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32
#define T float
#define C float
#define BLOCK block_f32
#define STORE_ROW store_row_f32
#define SCORES scores_f32_simd
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_simd
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_scalar
#define T float
#define C float
#define BLOCK block_f32
#define STORE_ROW store_row_f32
#define SCORES scores_f32_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_e4m3
#define T float
#define C uint8_t
#define BLOCK block_e4m3_simd
#define STORE_ROW store_row_f32
#define SCORES SIMD_SCORES(scores_f32_e4m3_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_f32
#define SOFTMAX_STEP softmax_step_simd
#define UNIT E4M3_SIMD_UNIT
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_e4m3_scalar
#define T float
#define C uint8_t
#define BLOCK block_e4m3
#define STORE_ROW store_row_f32
#define SCORES scores_f32_e4m3_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_e5m2
#define T float
#define C uint8_t
#define BLOCK block_e5m2_simd
#define STORE_ROW store_row_f32
#define SCORES SIMD_SCORES(scores_f32_e5m2_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_f32
#define SOFTMAX_STEP softmax_step_simd
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_e5m2_scalar
#define T float
#define C uint8_t
#define BLOCK block_e5m2
#define STORE_ROW store_row_f32
#define SCORES scores_f32_e5m2_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_f16
#define T uint16_t
#define C uint16_t
#define BLOCK block_f16_simd
#define STORE_ROW store_row_bf16
#define SCORES SIMD_SCORES(scores_bf16_f16_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_bf16
#define SOFTMAX_STEP softmax_step_simd
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX bf16_f16_scalar
#define T uint16_t
#define C uint16_t
#define BLOCK block_f16
#define STORE_ROW store_row_bf16
#define SCORES scores_bf16_f16_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_f16
#define T float
#define C uint16_t
#define BLOCK block_f16_simd
#define STORE_ROW store_row_f32
#define SCORES SIMD_SCORES(scores_f32_f16_simd)
#define WIDEN SIMD_WIDENS
#define LOAD_ROW load_row_f32
#define SOFTMAX_STEP softmax_step_simd
#define UNIT 1.f
#define ACCUMULATE accumulate_simd
#define VALUES_IN_PLACE 0
#include "attention_generic.h"

#define SUFFIX f32_f16_scalar
#define T float
#define C uint16_t
#define BLOCK block_f16
#define STORE_ROW store_row_f32
#define SCORES scores_f32_f16_scalar
#define WIDEN 0
#define SOFTMAX_STEP softmax_step_scalar
#define UNIT 1.f
#define ACCUMULATE accumulate_scalar
#define VALUES_IN_PLACE 0
#include "attention_generic.h"
