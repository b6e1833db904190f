/* fp4_gemm.c's entry points: engine.native binds each with these types (fp4.py calls them).
 * codes: uint8 [n, k/2], two e2m1 codes a byte (input 2i in the low nibble, 2i + 1 in the high);
 * scale: float32 [n, k / block], block a multiple of 16 dividing k; w = e2m1(code) · scale. */
#ifndef ENGINE_CPU_NATIVE_FP4_GEMM_H
#define ENGINE_CPU_NATIVE_FP4_GEMM_H

#include "engine_native.h"

/* the vector width this build multiplies with: 256 (AVX2 + FMA), 0 (plain C) */
int64_t fp4_simd_width(void);

/* out [m, n] = x [m, k] (row stride ldx) · wᵀ, summed in float32 */
void fp4_matmul_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *codes, const float *scale,
                     int64_t block, int64_t n, uint16_t *out);
void fp4_matmul_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *codes, const float *scale,
                    int64_t block, int64_t n, float *out);

/* out [n, k] = the whole weight */
void fp4_dequantize_bf16(const uint8_t *codes, const float *scale, int64_t block, int64_t k, int64_t n,
                         uint16_t *out);
void fp4_dequantize_f32(const uint8_t *codes, const float *scale, int64_t block, int64_t k, int64_t n, float *out);

#endif
