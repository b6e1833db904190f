/* logits_int8.c's entry points: engine.native binds each with these types (logits.py calls them).
 * w8, scale: a vocabulary table packed by logits_int8_pack; k, n: its inputs and outputs. */
#ifndef ENGINE_CPU_NATIVE_LOGITS_INT8_H
#define ENGINE_CPU_NATIVE_LOGITS_INT8_H

#include "engine_native.h"

/* 1 when this build and process multiply on AMX int8 tiles, else 0 (plain C then) */
int64_t logits_int8_amx(void);

/* bytes of w8 for a table of n rows and k inputs (n rounded up to 32, k to 64) */
int64_t logits_int8_bytes(int64_t n, int64_t k);

/* rows [row0, row0 + rows) of the table, w float32 [rows, k], into w8 (logits_int8_bytes, zeroed
 * first) and scale [n]: each row rounded to int8 with its own scale, absmax / 127 */
void logits_int8_pack(const float *w, int64_t row0, int64_t rows, int64_t k, int8_t *w8, float *scale);

/* out float32 [m, n] = x [m, k] (bf16, row stride ldx) · wᵀ: each row of x split into two int8
 * halves (hi + lo / 254, one scale a row), both multiplied by the int8 table in int32 */
void logits_int8(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                 int64_t n, float *out);

/* the logits_int8 product's `top` (1 ≤ top ≤ min(n, 64)) largest logits of each row, found without
 * writing the rest: best [m, top] their columns, approx [m, top] their values, in no order; the
 * same entries (by value, then the lower column first on a tie: top_heap.h) a pass over the row
 * logits_int8 writes would keep */
void logits_int8_top(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8, const float *scale,
                     int64_t n, int64_t top, int64_t *best, float *approx);

/* the logits_int8 product of each row whose token is -1 (tokens [m], as quant_gemm.c's affine_greedy
 * leaves a row logits_int8_top's candidates cannot settle) into out [m, n]; the other rows of out
 * are not written */
void logits_int8_unsettled(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int8_t *w8,
                           const float *scale, int64_t n, const int64_t *tokens, float *out);

#endif
