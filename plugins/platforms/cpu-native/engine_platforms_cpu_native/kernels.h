/* kernels.c's entry points: engine.native binds each with these types (ops.py calls them).
 * x, residual, out...: row-major [rows, hidden] in the storage type (uint16_t: bfloat16). */
#ifndef ENGINE_CPU_NATIVE_KERNELS_H
#define ENGINE_CPU_NATIVE_KERNELS_H

#include "engine_native.h"

/* the largest head_dim the rotary kernels take */
int64_t max_rotary_dim(void);

/* residual += x; x = residual / rms(residual) * weight */
void add_rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t rows, int64_t hidden,
                       float eps);
void add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t rows, int64_t hidden, float eps);

/* out = x / rms(x) * weight, x left as it is (a model's first norm: no residual yet) */
void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, int64_t rows, int64_t hidden, float eps,
                   uint16_t *out);
void rms_norm_f32(const float *x, const float *weight, int64_t rows, int64_t hidden, float eps, float *out);

/* rotate-half RoPE in place on the first `heads` heads of each row of qkv (row stride `stride`);
 * cos, sin: [tokens, dim] */
void rotary_bf16(uint16_t *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim, const uint16_t *cos,
                 const uint16_t *sin);
void rotary_f32(float *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim, const float *cos,
                const float *sin);

/* Qwen3's per-head RMSNorm of q (q_weight, q_eps) and k (k_weight, k_eps), then the rotary */
void qk_norm_rotary_bf16(uint16_t *qkv, int64_t tokens, int64_t stride, int64_t q_heads, int64_t k_heads,
                         int64_t dim, const uint16_t *q_weight, const uint16_t *k_weight, float q_eps, float k_eps,
                         const uint16_t *cos, const uint16_t *sin);
void qk_norm_rotary_f32(float *qkv, int64_t tokens, int64_t stride, int64_t q_heads, int64_t k_heads, int64_t dim,
                        const float *q_weight, const float *k_weight, float q_eps, float k_eps, const float *cos,
                        const float *sin);

/* out[i] = table[ids[i]], rows of row_bytes; refused when an id is outside [0, rows) */
engine_status gather_rows(const char *table, int64_t rows, int64_t row_bytes, const int64_t *ids, int64_t count,
                          char *out);

/* W8A8's per-row int8 activations, outlier columns (|x| > threshold) flagged and left out;
 * returns how many columns it flagged */
int64_t quantize_rows_int8_bf16(const uint16_t *x, int64_t rows, int64_t cols, float threshold, int8_t *xq,
                                float *scale, uint8_t *outlier);
int64_t quantize_rows_int8_f32(const float *x, int64_t rows, int64_t cols, float threshold, int8_t *xq,
                               float *scale, uint8_t *outlier);

/* out[m, n] = acc[m, n] · row_scale[m] · col_scale[n] in the storage type */
void rescale_int32_bf16(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scale,
                        const float *col_scale, uint16_t *out);
void rescale_int32_f32(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scale,
                       const float *col_scale, float *out);

/* out[r, i] = silu(x[r, i]) · x[r, width + i] (x's row stride `stride`), out [rows, width] */
void silu_and_mul_bf16(const uint16_t *x, int64_t rows, int64_t stride, int64_t width, uint16_t *out);
void silu_and_mul_f32(const float *x, int64_t rows, int64_t stride, int64_t width, float *out);

/* LoRA over a batch of mixed adapters; indices [rows]: each row's slot in [0, slots) or -1 (none),
 * another index refused (1). Shrink: h [rows, shards, rank] = scale[s, i] · a[s, i] · x[r]
 * (a [slots, shards, rank, cols], scale [slots, shards]), zero for rows of none; ranks
 * [slots, shards]: the rows of a[s, i] an adapter fills (those past it are zero and not read),
 * a value outside [0, rank] refused (1). Expand:
 * y[r, bounds[i]:bounds[i+1]] += h[r, i] · b[s, :, bounds[i]:bounds[i+1]] (b [slots, rank, width]),
 * rank at most lora_max_rank(). */
int64_t lora_max_rank(void);
engine_status lora_shrink_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t cols, const uint16_t *a,
                               int64_t slots, int64_t shards, int64_t rank, const float *scale,
                               const int64_t *ranks, const int64_t *indices, uint16_t *h);
engine_status lora_shrink_f32(const float *x, int64_t rows, int64_t x_stride, int64_t cols, const float *a,
                              int64_t slots, int64_t shards, int64_t rank, const float *scale, const int64_t *ranks,
                              const int64_t *indices, float *h);
engine_status lora_expand_bf16(uint16_t *y, int64_t rows, int64_t y_stride, const uint16_t *h, const uint16_t *b,
                               int64_t slots, int64_t shards, int64_t rank, int64_t width, const int64_t *bounds,
                               const int64_t *indices);
engine_status lora_expand_f32(float *y, int64_t rows, int64_t y_stride, const float *h, const float *b, int64_t slots,
                              int64_t shards, int64_t rank, int64_t width, const int64_t *bounds,
                              const int64_t *indices);

#endif
