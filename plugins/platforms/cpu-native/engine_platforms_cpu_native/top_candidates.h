/* A row's candidates for its `top` largest logits, kept while a product makes them, so that no
 * logit need be written: what a greedy step reads of a vocabulary's logits is each row's
 * largest. Both products that find them so share this (logits_int8.c's on AMX int8 tiles,
 * quant_gemm.c's on VNNI), and both then merge a row's candidates with top_heap.h's order, the
 * one refine_top's pass over written logits keeps.
 *
 * One thread's candidates for a row over its own columns: every value not below the row's floor
 * (kept apart, the one thing each vector reads), a bound that stays at most the row's top-th
 * largest, so no entry of the row's top is ever left out. When a vector more would not fit, the
 * floor rises (raise_floor) and the values below it go; `full` marks a row whose ties leave no
 * room (its top cannot be told: nothing enters after). NaN never enters. Why not a heap: a row's
 * scan lets ~500 values in (its threshold starts low and rises slowly), and a sift-down for each
 * took 9 ms at 256 rows where storing every logit took 7 (AMX); an exact top-th largest
 * (quickselect) at each rise took as long. */
#ifndef ENGINE_CPU_NATIVE_TOP_CANDIDATES_H
#define ENGINE_CPU_NATIVE_TOP_CANDIDATES_H

#include "top_heap.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CANDIDATES 256
typedef struct {
    float value[CANDIDATES + 16];
    int32_t column[CANDIDATES + 16];
    int64_t size;
    int full;
} candidates;

/* Every thread's candidates for each of m rows (rows[t · m + r], floor[t · m + r]), empty. */
typedef struct {
    candidates *rows;
    float *floor;
    int64_t top, m, threads;
} top_candidates;

/* One thread's candidates for each row (rows[r], floor[r]); rows NULL where none are kept. */
typedef struct {
    candidates *rows;
    float *floor;
    int64_t top;
} candidate_rows;

/* thread t's share of `all` (all NULL: none) */
static inline candidate_rows thread_rows(const top_candidates *all, int64_t t) {
    if (!all) return (candidate_rows){NULL, NULL, 0};
    return (candidate_rows){all->rows + t * all->m, all->floor + t * all->m, all->top};
}

static inline top_candidates top_candidates_new(int64_t m, int64_t top) {
    int64_t threads = omp_get_max_threads();
    top_candidates all = {malloc(sizeof(candidates) * (size_t)(threads * m)),
                          malloc(sizeof(float) * (size_t)(threads * m)), top, m, threads};
    for (int64_t i = 0; i < threads * m; i++) all.rows[i].size = 0, all.rows[i].full = 0, all.floor[i] = -INFINITY;
    return all;
}

/* The least of the maxima of `top` groups of c's values (value i in group i mod top): `top`
 * values lie at or above it, so it is at most their top-th largest (size ≥ top). On AVX-512, for
 * a `top` of whole vectors, group g's maximum builds in lane g mod 16 of accumulator g / 16. */
static inline float group_floor(const candidates *c, int64_t top) {
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
static inline void raise_floor(candidates *c, int64_t top, float *floor) {
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

/* the logit v of column col, offered to a row's candidates c (floor: the row's) */
static inline void offer_one(candidates *c, float *floor, int64_t top, float v, int64_t col) {
    if (v >= *floor && make_room(c, 1, top, floor)) c->value[c->size] = v, c->column[c->size++] = (int32_t)col;
}

#if defined(__AVX512F__)
/* the 16 logits v of columns [col, col + 16) where mask says, offered to a row's candidates */
static inline void offer16(candidates *c, float *floor, int64_t top, int64_t col, __mmask16 mask, __m512 v) {
    mask &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(*floor), _CMP_GE_OQ);
    if (!mask || !make_room(c, 16, top, floor)) return;
    mask &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(*floor), _CMP_GE_OQ);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_mask_compressstoreu_ps(c->value + c->size, mask, v);
    _mm512_mask_compressstoreu_epi32(c->column + c->size, mask, _mm512_add_epi32(lane, _mm512_set1_epi32((int)col)));
    c->size += __builtin_popcount(mask);
}
#endif

/* Each row's threads' candidates merged into one heap (top_heap.h), whose total order keeps the
 * entries a single pass keeps: best [m, top] their columns, approx [m, top] their values. A row
 * whose candidates are too few (NaN) or too many (ties) to tell its top gets NaN values. Frees
 * the candidates. */
static inline void top_candidates_merge(top_candidates all, int64_t *best, float *approx, int parallel) {
    int64_t m = all.m, top = all.top;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < m; r++) {
        top_heap merged = {best + r * top, approx + r * top, 0, top};
        int full = 0;
        for (int64_t t = 0; t < all.threads; t++) {
            candidates *c = all.rows + t * m + r;
            full |= c->full;
            for (int64_t i = 0; i < c->size; i++) top_offer(&merged, c->value[i], c->column[i]);
        }
        if (full || merged.size < top)
            for (int64_t i = 0; i < top; i++) best[r * top + i] = 0, approx[r * top + i] = NAN;
    }
    free(all.rows);
    free(all.floor);
}

#endif
