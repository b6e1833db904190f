/* dense_bf16.c's entry points: engine.native binds each with these types (dense.py calls them).
 * w: bfloat16 [n, k], row-major (the checkpoint's own layout); bias: [n] in the activations'
 * type, or NULL for none. */
#ifndef ENGINE_CPU_NATIVE_DENSE_BF16_H
#define ENGINE_CPU_NATIVE_DENSE_BF16_H

#include "engine_native.h"

/* the vector width this build multiplies with: 256 (AVX2 + FMA), 0 (plain C) */
int64_t dense_simd_width(void);

/* the rows from which a call runs the register-tiled path (the same sums, the same bits); 0: one
 * path at every row count (plain C) */
int64_t dense_tiled_min_rows(void);

/* out [m, n] = x [m, k] (row stride ldx) · wᵀ (+ bias), summed in float32 */
void dense_matmul_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w,
                       const uint16_t *bias, int64_t n, uint16_t *out);
void dense_matmul_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, const float *bias,
                      int64_t n, float *out);

/* 1 when this build and process multiply on AMX tiles (dense_matmul_amx), else 0 */
int64_t dense_amx(void);

/* out [m, n] = x [m, k] (row stride ldx) · wᵀ (+ bias), summed in float in 32-input steps on AMX
 * tiles (dense_bf16_amx.h); without them, dense_matmul_bf16's sums */
void dense_matmul_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w,
                      const uint16_t *bias, int64_t n, uint16_t *out);

#endif
