/* attention.c's entry points: engine.native binds each with these types (backend.py calls them).
 * Caches [2, kv_heads, blocks, block_size, head_dim] in the storage type (uint16_t: bfloat16;
 * uint8_t: an 8-bit float, e4m3 or e5m2; paged_attention_<type>_f16: uint16_t float16). */
#ifndef ENGINE_CPU_NATIVE_ATTENTION_H
#define ENGINE_CPU_NATIVE_ATTENTION_H

#include "engine_native.h"

/* the largest head_dim and block_size the kernels take */
int64_t max_head_dim(void);
int64_t max_block_size(void);

/* this step's key and value rows [tokens, kv_heads, head_dim] (strides in elements of elem_bytes)
 * into the cache's slots slot_mapping[t]; refused when a slot lies outside [0, slots) */
engine_status write_kv(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                       const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                       int64_t slots, int64_t elem_bytes, char *cache);

/* this step's key and value rows, float32 (source_bf16 0) or bfloat16 (1), divided by k_scale and
 * v_scale and stored as e4m3 (e5m2 0) or e5m2 (1) bytes into the cache's slots slot_mapping[t]
 * (strides in elements); refused, writing nothing, when a slot lies outside [0, slots) */
engine_status write_kv_fp8(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                           const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                           int64_t slots, int64_t source_bf16, int64_t e5m2, float k_scale, float v_scale,
                           uint8_t *cache);

/* write_kv_fp8's counterpart for a float16 cache */
engine_status write_kv_f16(const char *key, const char *value, int64_t row_stride, int64_t head_stride,
                           const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                           int64_t slots, int64_t source_bf16, float k_scale, float v_scale, uint16_t *cache);

/* Attends requests[0..num_requests) of the batch into out [tokens, heads, dim]; fails when its
 * scratch memory cannot be allocated. paged_attention_<activation>[_<fp8 cache>]: the AVX-512
 * kernel, and the portable one (_scalar). An fp8 cache's key scale comes folded into `scale`;
 * every output row is multiplied by `v_scale` (1 for a bf16 or f32 cache). `sinks`: per query
 * head a logit in the softmax's denominator only (gpt-oss's attention sinks), or NULL. */
engine_status paged_attention_bf16(const uint16_t *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_scalar(const uint16_t *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_e4m3(const uint16_t *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_e4m3_scalar(const uint16_t *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_e5m2(const uint16_t *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_e5m2_scalar(const uint16_t *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_f32(const float *query, int64_t q_stride,
    const float *key_cache, const float *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_scalar(const float *query, int64_t q_stride,
    const float *key_cache, const float *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_e4m3(const float *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_e4m3_scalar(const float *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_e5m2(const float *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_e5m2_scalar(const float *query, int64_t q_stride,
    const uint8_t *key_cache, const uint8_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);

engine_status paged_attention_bf16_f16(const uint16_t *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_bf16_f16_scalar(const uint16_t *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, uint16_t *out);
engine_status paged_attention_f32_f16(const float *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);
engine_status paged_attention_f32_f16_scalar(const float *query, int64_t q_stride,
    const uint16_t *key_cache, const uint16_t *value_cache,
    int64_t head_stride, const int32_t *block_table, int64_t table_stride, const int32_t *query_start,
    const int32_t *seq_lens, const int32_t *requests, int64_t num_requests, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks, float v_scale, float *out);

#endif
