/* mla.c's entry points: engine.native binds each with these types (mla.py calls them).
 * The paged latent cache [blocks, block_size, rank + rope] in the storage type (uint16_t:
 * bfloat16; float: float32), one vector per token: the latent, then the rotated key part. */
#ifndef ENGINE_CPU_NATIVE_MLA_H
#define ENGINE_CPU_NATIVE_MLA_H

#include "engine_native.h"

/* the largest block_size and latent vector (rank + rope) the kernels take */
int64_t mla_max_block_size(void);
int64_t mla_max_entry_dim(void);

/* The absorbed decode of rows one query row each: query [rows, heads, rank + rope] float32 (the
 * query's latent part with W_UK folded in, then its rotary part), row r over the first
 * seq_lens[r] tokens of its blocks block_table[r * table_stride ...]; out [rows, heads, rank]
 * float32, the softmax-weighted sum of the latents (W_UV is the caller's). mla_decode_<cache>:
 * the AVX2 + FMA kernel where the compiler targets it, _scalar the portable one. Fails when its
 * scratch memory cannot be allocated. */
engine_status mla_decode_bf16(const float *query, const uint16_t *cache, const int32_t *block_table,
    int64_t table_stride, const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t rank, int64_t rope,
    int64_t block_size, float scale, float *out);
engine_status mla_decode_bf16_scalar(const float *query, const uint16_t *cache, const int32_t *block_table,
    int64_t table_stride, const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t rank, int64_t rope,
    int64_t block_size, float scale, float *out);
engine_status mla_decode_f32(const float *query, const float *cache, const int32_t *block_table,
    int64_t table_stride, const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t rank, int64_t rope,
    int64_t block_size, float scale, float *out);
engine_status mla_decode_f32_scalar(const float *query, const float *cache, const int32_t *block_table,
    int64_t table_stride, const int32_t *seq_lens, int64_t rows, int64_t heads, int64_t rank, int64_t rope,
    int64_t block_size, float scale, float *out);

#endif
