/* quant_gemm.c's entry points: engine.native binds each with these types (affine.py calls them).
 * qw, sz: a weight packed by pack_affine; form: sz's form (quant_gemm.c: 0 float32 scales and
 * offsets, 1 both float16, 2 float16 scales alone, every offset -2^(bits-1) · scale); bits: 4 or 8,
 * the packed width of q; k, n: the weight's inputs and outputs (k a multiple of 32). */
#ifndef ENGINE_CPU_NATIVE_QUANT_GEMM_H
#define ENGINE_CPU_NATIVE_QUANT_GEMM_H

#include "engine_native.h"

/* the vector width this build multiplies with: 512 (AVX512_VNNI), 256 (AVX2), 0 (plain C) */
int64_t affine_simd_width(void);

/* q uint8 [n, k] (< 2**bits), scale and offset float32 [n, k / 32] into the packed qw and sz */
void pack_affine(const uint8_t *q, const float *scale, const float *offset, int64_t n, int64_t k, int64_t bits,
                 uint8_t *qw, float *sz);

/* raw ggml blocks, [n, k / 32] blocks of type 0 (q4_0, 18 bytes), 1 (q4_1, 20) or 2 (q8_0, 34), into
 * the packed qw and sz (float32) exactly as pack_affine packs the weight they hold */
void pack_ggml_blocks(const uint8_t *raw, int64_t type, int64_t n, int64_t k, uint8_t *qw, float *sz);

/* out [m, n] = x [m, k] (row stride ldx) · wᵀ */
void affine_matmul_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                        int64_t form, int64_t bits, int64_t n, uint16_t *out);
void affine_matmul_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, float *out);

/* 1 when this build and process multiply on AMX tiles (affine_matmul_amx), else 0 */
int64_t affine_amx(void);

/* out [m, n] (bf16, or float32 when out_f32) = x [m, k] (bf16, row stride ldx) · wᵀ with w the
 * dense bf16 weight affine_dequantize_bf16 makes, the sums in float: on AMX tiles, the weight
 * dequantized on the fly (quant_gemm_amx.h); elsewhere in plain C */
void affine_matmul_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, int64_t out_f32, void *out);

/* a vocabulary's logits, float32 out [m, n]: affine_matmul's product with each row's `top`
 * largest recomputed from the float activations times the exact weight */
void affine_logits_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                        int64_t form, int64_t bits, int64_t n, int64_t top, float *out);
void affine_logits_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, int64_t top, float *out);

/* the `top` (1 ≤ top ≤ min(n, 64)) largest of each row's logits as affine_logits's product makes
 * them before its refinement: best [m, top] their columns, approx [m, top] their values, in no
 * order; the entries (by value, then the lower column first on a tie: top_heap.h) a pass over
 * those logits keeps. On VNNI no logit is written, and a row whose top the candidates cannot tell
 * (NaN, more equal values than they hold) gets NaN values. */
void affine_logits_top_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                            int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *best, float *approx);
void affine_logits_top_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                           int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *best, float *approx);
/* affine_logits's refinement of logits out [m, n] that another product made */
void affine_refine_logits_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw,
                               const void *sz, int64_t form, int64_t bits, int64_t n, int64_t top, float *out);
void affine_refine_logits_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw,
                              const void *sz, int64_t form, int64_t bits, int64_t n, int64_t top, float *out);

/* each row's greedy token (tokens [m]): the first maximum of the logits affine_refine_logits leaves
 * of a product whose each row's `top` (at most n) largest are best [m, top] (columns), approx
 * [m, top] (that product's values: affine_logits_top's or logits_int8_top's), found without the
 * rest; -1 for a row
 * whose maximum the candidates cannot tell (the caller then makes the row's logits) */
void affine_greedy_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                        int64_t form, int64_t bits, int64_t n, int64_t top, const int64_t *best,
                        const float *approx, int64_t *tokens);
void affine_greedy_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, int64_t top, const int64_t *best, const float *approx,
                       int64_t *tokens);

/* each row whose token is -1 (tokens [m], as affine_greedy leaves them): its `top` largest logits
 * of logits [m, n] (another product's, logits_int8_unsettled's) refined as affine_refine_logits
 * does, then the token their first maximum; the other rows (and their logits) untouched */
void affine_settle_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                        int64_t form, int64_t bits, int64_t n, int64_t top, float *logits, int64_t *tokens);
void affine_settle_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                       int64_t form, int64_t bits, int64_t n, int64_t top, float *logits, int64_t *tokens);

/* each row's greedy token (tokens [m]): the first maximum of affine_logits's logits (top: the
 * candidates it refines, at most n), found without them where the candidates tell it */
void affine_greedy_rows_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw,
                             const void *sz, int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *tokens);
void affine_greedy_rows_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *qw, const void *sz,
                            int64_t form, int64_t bits, int64_t n, int64_t top, int64_t *tokens);

/* out [count, k] = the weight's rows ids; refused when an id is outside [0, n) */
engine_status affine_rows_bf16(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k, int64_t n,
                               const int64_t *ids, int64_t count, uint16_t *out);
engine_status affine_rows_f32(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k, int64_t n,
                              const int64_t *ids, int64_t count, float *out);

/* out [n, k] = the whole weight */
void affine_dequantize_bf16(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k, int64_t n,
                            uint16_t *out);
void affine_dequantize_f32(const uint8_t *qw, const void *sz, int64_t form, int64_t bits, int64_t k, int64_t n,
                           float *out);

#endif
