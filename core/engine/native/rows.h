/* rows.c's entry points, bound from here by engine.native.rows. */
#ifndef ENGINE_ROWS_H
#define ENGINE_ROWS_H

#include "engine_native.h"

/* out[r] = the index of row r's first maximum (a NaN counting as the maximum: its first NaN)
 * over x[r * stride .. r * stride + n), float32; n >= 1 */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out);
/* the same over bfloat16 values: the first maximum of their float32 widening */
void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out);

#endif
