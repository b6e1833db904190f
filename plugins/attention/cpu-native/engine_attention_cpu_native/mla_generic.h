/* mla.c's driver for one (cache type, math variant): included once per pair, with SUFFIX
 * (bf16, bf16_scalar, f32, f32_scalar), C (the cache's C type), BLOCK (a block as float32
 * vectors) and the math SCORES, SOFTMAX_STEP and ACCUMULATE defined, which it undefines again;
 * TYPED(name) is name_<SUFFIX>. A file rather than a macro, so that compiler messages and
 * debuggers see its own lines. */

/* heads [0, tile) of one row (query and out at the tile's first head) over its seq_len tokens */
static void TYPED(attend_tile)(const float *query, const C *cache, const int32_t *table, int64_t seq_len,
                               int64_t tile, int64_t rank, int64_t entry, int64_t block_size, float scale,
                               float *out, Workspace *w) {
    int64_t block_len = block_size * entry;
    memset(w->acc, 0, sizeof(float) * tile * rank);
    for (int64_t h = 0; h < tile; h++) w->max[h] = -INFINITY, w->sum[h] = 0.f;
    for (int64_t start = 0; start < seq_len; start += block_size) {
        int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        if (start + block_size < seq_len)  /* the next block's lines, while this one is used */
            prefetch_block(cache + (int64_t)table[start / block_size + 1] * block_len, block_len * (int64_t)sizeof(C));
        const float *vectors = BLOCK(cache + (int64_t)table[start / block_size] * block_len, count * entry, w->block);
        SCORES(query, tile, entry, vectors, count, scale, w->scores, block_size);
        for (int64_t h = 0; h < tile; h++)
            w->correction[h] = SOFTMAX_STEP(w->scores + h * block_size, count, w->max + h, w->sum + h);
        ACCUMULATE(w->acc, tile, rank, w->correction, w->scores, block_size, vectors, count, entry);
    }
    for (int64_t h = 0; h < tile; h++) {
        float inv = w->sum[h] > 0.f ? 1.f / w->sum[h] : 0.f;
        for (int64_t d = 0; d < rank; d++) out[h * rank + d] = w->acc[h * rank + d] * inv;
    }
}

/* Attends every row: a work item is one (row, tile of heads); see mla.h. Returns 0, or -1 when
 * scratch memory cannot be allocated. */
engine_status TYPED(mla_decode)(const float *query, const C *cache, const int32_t *block_table,
                                int64_t table_stride, const int32_t *seq_lens, int64_t rows, int64_t heads,
                                int64_t rank, int64_t rope, int64_t block_size, float scale, float *out) {
    int64_t entry = rank + rope, tile = head_tile(rows, heads), failed = 0, work = 0;
    int64_t tiles = (heads + tile - 1) / tile, items = rows * tiles;
    for (int64_t r = 0; r < rows; r++) work += heads * seq_lens[r] * entry;
#pragma omp parallel if(work >= MIN_PARALLEL_WORK && items > 1) reduction(|: failed)
    {
        Workspace w = {0};
        int ok = workspace_alloc(&w, rank, entry, block_size);
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ok) continue;
            int64_t r = item / tiles, first = item % tiles * tile;
            int64_t count = heads - first < tile ? heads - first : tile;
            TYPED(attend_tile)(query + (r * heads + first) * entry, cache, block_table + r * table_stride,
                               seq_lens[r], count, rank, entry, block_size, scale,
                               out + (r * heads + first) * rank, &w);
        }
        if (ok) free(w.acc);
    }
    return failed ? -1 : 0;
}

#undef SUFFIX
#undef C
#undef BLOCK
#undef SCORES
#undef SOFTMAX_STEP
#undef ACCUMULATE
