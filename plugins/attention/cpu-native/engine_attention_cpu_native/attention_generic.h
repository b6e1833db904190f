/* attention.c's driver for one (activation type, cache type, math variant): included once per
 * triple, with SUFFIX (bf16, bf16_scalar, f32_e4m3 ...), T (the query's and output's C type), C
 * (the cache's: T, or uint8_t for an fp8 cache), UNIT (what BLOCK's and SCORES' widened cache
 * values must be multiplied by: 1, or 256 for AVX-512 e4m3), BLOCK (a block as float32 rows),
 * STORE_ROW (an output row from float32), WIDEN (1: SCORES reads the item's query vectors and
 * each block's keys as float32, widened once by LOAD_ROW and BLOCK; 0: where they lie) and the
 * math SCORES, SOFTMAX_STEP and ACCUMULATE defined (VALUES_IN_PLACE 1: ACCUMULATE_ROW reads a
 * block's values where they lie, for all of a row's vectors at once, in place of BLOCK and
 * ACCUMULATE), which it undefines again; TYPED(name) is name_<SUFFIX>. Optional: SCORES_ROW, a
 * row's vectors' scores of a block in one call in place of SCORES per vector; PROBS_BF16, the
 * softmax step also writing the probabilities as bf16 (Workspace.probs16), which ACCUMULATE_ROW
 * reads in place of the float32 ones (attention_bf16_pairs.h). A file rather than a macro, so
 * that compiler messages and debuggers see its own lines. */

/* The block PREFETCH_AHEAD blocks after `start` in an item's walk (a chunk's keys, then its
 * values, then the next chunk's keys ...; `values`: this one is a value block), NULL past the
 * end: far enough ahead that its lines arrive while the blocks between are used. */
static inline const C *TYPED(block_ahead)(const C *keys_base, const C *values_base, const int32_t *table,
                                          int64_t block_len, int64_t block_size, int64_t chunk, int64_t b0,
                                          int64_t start, int values, int64_t seq_len) {
    int64_t c1 = (b0 / chunk + 1) * chunk < seq_len ? (b0 / chunk + 1) * chunk : seq_len;
    for (int step = 0; step < PREFETCH_AHEAD; step++) {
        start += block_size;
        if (start < c1) continue;
        if (!values) {
            values = 1, start = b0;
            continue;
        }
        if (c1 >= seq_len) return NULL;
        values = 0, b0 = start = c1, c1 = c1 + chunk < seq_len ? c1 + chunk : seq_len;
    }
    return (values ? values_base : keys_base) + (int64_t)table[start / block_size] * block_len;
}

static void TYPED(attend_item)(const T *query, int64_t q_stride, const C *key_cache, const C *value_cache,
                               int64_t head_stride, const int32_t *table, int64_t q_begin, int64_t n,
                               int64_t seq_len, int64_t kv_head, int64_t heads, int64_t group,
                               int64_t dim, int64_t block_size, float scale, int64_t window, float softcap,
                               const float *sinks, float v_scale, T *out, Workspace *w) {
    int64_t vectors = n * group, block_len = block_size * dim, chunk = w->chunk;
    memset(w->acc, 0, sizeof(float) * vectors * dim);
    for (int64_t m = 0; m < vectors; m++) w->max[m] = -INFINITY, w->sum[m] = 0.f;
    const C *keys_base = key_cache + kv_head * head_stride;
    const C *values_base = value_cache + kv_head * head_stride;
    const T *first_query = query + q_begin * q_stride + kv_head * group * dim;
    int64_t first_position = seq_len - n, lo, hi;
#if WIDEN
    for (int64_t m = 0; m < vectors; m++)
        LOAD_ROW(w->query + m * dim, first_query + m / group * q_stride + m % group * dim, dim);
#endif
    int64_t first_key = window > 0 && first_position - window + 1 > 0 ? first_position - window + 1 : 0;
    int64_t first_block = first_key / block_size * block_size;
    /* The walk asks for each block PREFETCH_AHEAD blocks before its use; its first ones, asked for
     * here, would otherwise come on demand, one miss after another, and a decode row's item is
     * only a few blocks long (a 64-row step over ~70-key contexts 1.25x faster from memory). */
    int64_t first_chunk_end = (first_block / chunk + 1) * chunk;
    for (int64_t start = first_block; start < seq_len && start < first_chunk_end &&
                                      start < first_block + PREFETCH_AHEAD * block_size; start += block_size)
        prefetch_lines(keys_base + (int64_t)table[start / block_size] * block_len, block_len * (int64_t)sizeof(C));
    /* Chunks of whole blocks on a grid fixed by position (never by the batch or the chunk a
     * prompt came in): every row's scores of a chunk first, one softmax step per row and chunk,
     * then its values. */
    for (int64_t c0 = first_key / chunk * chunk; c0 < seq_len; c0 += chunk) {
        int64_t c1 = c0 + chunk < seq_len ? c0 + chunk : seq_len;
        int64_t b0 = first_block > c0 ? first_block : c0;
        for (int64_t start = b0; start < c1; start += block_size) {
            int64_t count = c1 - start < block_size ? c1 - start : block_size;
            const C *block_keys = keys_base + (int64_t)table[start / block_size] * block_len;
            const C *next = TYPED(block_ahead)(keys_base, values_base, table, block_len, block_size, chunk, b0,
                                               start, 0, seq_len);
            if (next) prefetch_lines(next, block_len * (int64_t)sizeof(C));
#if WIDEN
            const float *keys = BLOCK(block_keys, count * dim, w->keys);
#else
            const C *keys = block_keys;
#endif
            for (int64_t i = 0; i < n; i++) {
                if (!row_range(first_position + i, window, start, start + count, &lo, &hi)) continue;
#ifdef SCORES_ROW
                SCORES_ROW(first_query + i * q_stride, group, keys + (lo - start) * dim, hi - lo, dim, scale * UNIT,
                           w->scores + i * group * chunk + lo - c0, chunk);
#else
                for (int64_t j = 0; j < group; j++) {
                    int64_t m = i * group + j;
#if WIDEN
                    const float *q = w->query + m * dim;
#else
                    const T *q = first_query + i * q_stride + j * dim;
#endif
                    SCORES(q, keys + (lo - start) * dim, hi - lo, dim, scale * UNIT, w->scores + m * chunk + lo - c0);
                }
#endif
            }
        }
        for (int64_t i = 0; i < n; i++) {
            if (!row_range(first_position + i, window, c0, c1, &lo, &hi)) continue;
            for (int64_t j = 0; j < group; j++) {
                int64_t m = i * group + j;
                float *scores = w->scores + m * chunk + lo - c0;
                if (softcap > 0.f) soft_cap(scores, hi - lo, softcap);
#ifdef PROBS_BF16
                w->correction[m] =
                    SOFTMAX_STEP(scores, w->probs16 + m * chunk + lo - c0, hi - lo, w->max + m, w->sum + m);
#else
                w->correction[m] = SOFTMAX_STEP(scores, hi - lo, w->max + m, w->sum + m);
#endif
            }
        }
        for (int64_t start = b0; start < c1; start += block_size) {
            int64_t count = c1 - start < block_size ? c1 - start : block_size;
            const C *next = TYPED(block_ahead)(keys_base, values_base, table, block_len, block_size, chunk, b0,
                                               start, 1, seq_len);
            if (next) prefetch_lines(next, block_len * (int64_t)sizeof(C));
#if VALUES_IN_PLACE
            const C *values = values_base + (int64_t)table[start / block_size] * block_len;
#else
            const float *values = BLOCK(values_base + (int64_t)table[start / block_size] * block_len, count * dim,
                                        w->values);
#endif
            for (int64_t i = 0; i < n; i++) {
                if (!row_range(first_position + i, window, start, start + count, &lo, &hi)) continue;
                /* the chunk's rescaling once, with the row's first values */
                float *correction = w->correction + i * group;
#ifdef PROBS_BF16
                ACCUMULATE_ROW(w->acc + i * group * dim, correction, w->probs16 + i * group * chunk + lo - c0, chunk,
                               values + (lo - start) * dim, hi - lo, dim, group);
#else
                float *probs = w->scores + i * group * chunk + lo - c0;
#if VALUES_IN_PLACE
                ACCUMULATE_ROW(w->acc + i * group * dim, correction, probs, chunk, values + (lo - start) * dim,
                               hi - lo, dim, group);
#else
                for (int64_t j = 0; j < group; j++)
                    ACCUMULATE(w->acc + (i * group + j) * dim, correction[j], probs + j * chunk,
                               values + (lo - start) * dim, hi - lo, dim);
#endif
#endif
                for (int64_t j = 0; j < group; j++) correction[j] = 1.f;
            }
        }
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < group; j++) {
            int64_t m = i * group + j, head = kv_head * group + j;
            float sum = w->sum[m] + (sinks ? expf(sinks[head] - w->max[m]) : 0.f);
            STORE_ROW(out + ((q_begin + i) * heads + head) * dim, w->acc + m * dim, v_scale * UNIT / sum, dim);
        }
}

/* Attends requests[0..num_requests) of the batch; out [tokens, heads, dim] contiguous (rows
 * of other requests untouched). query rows are q_stride apart, heads dim apart. A work item is
 * one (request, kv head, tile of ROW_TILE query rows): a tile is attended as a chunk of its own
 * that ends at its last row, which changes nothing for a row (each row walks its own keys), so
 * however a prompt is chunked every row meets the same code in the same order. Each row's output
 * is multiplied by v_scale (an fp8 cache's value scale; 1 otherwise, which changes no bit): the
 * key scale comes folded into `scale`. Returns 0, or -1 when scratch memory cannot be allocated. */
engine_status TYPED(paged_attention)(const T *query, int64_t q_stride, const C *key_cache, const C *value_cache,
                                     int64_t head_stride, const int32_t *block_table, int64_t table_stride,
                                     const int32_t *query_start, const int32_t *seq_lens, const int32_t *requests,
                                     int64_t num_requests, int64_t heads, int64_t kv_heads, int64_t dim,
                                     int64_t block_size, float scale, int64_t window, float softcap,
                                     const float *sinks, float v_scale, T *out) {
    int64_t group = heads / kv_heads, work = 0, failed = 0;
    int64_t *first_tile = malloc(sizeof(int64_t) * (num_requests + 1));
    if (!first_tile) return -1;
    first_tile[0] = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        int64_t b = requests[r], n = query_start[b + 1] - query_start[b];
        first_tile[r + 1] = first_tile[r] + (n + ROW_TILE - 1) / ROW_TILE;
        work += n * group * kv_heads * seq_lens[b] * dim;
    }
    int64_t items = first_tile[num_requests] * kv_heads;
#pragma omp parallel if(work >= MIN_PARALLEL_WORK && items > 1) reduction(|: failed)
    {
        Workspace w = {0};
        int ok = workspace_alloc(&w, ROW_TILE * group, dim, block_size);
        failed |= !ok;
        int64_t r = 0;  /* the request of this thread's last item: items come in rising order */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ok) continue;
            int64_t tile = item / kv_heads;
            if (first_tile[r] > tile) r = 0;
            while (first_tile[r + 1] <= tile) r++;
            int64_t b = requests[r], n = query_start[b + 1] - query_start[b];
            int64_t row = (tile - first_tile[r]) * ROW_TILE, rows = n - row < ROW_TILE ? n - row : ROW_TILE;
            int64_t context = seq_lens[b] - (n - row - rows);  /* keys up to the tile's last row */
            TYPED(attend_item)(query, q_stride, key_cache, value_cache, head_stride,
                               block_table + b * table_stride, query_start[b] + row, rows, context,
                               item % kv_heads, heads, group, dim, block_size, scale, window, softcap,
                               sinks, v_scale, out, &w);
        }
        if (ok) free(w.acc);
    }
    free(first_tile);
    return failed ? -1 : 0;
}

#undef SUFFIX
#undef T
#undef C
#undef BLOCK
#undef STORE_ROW
#undef SCORES
#undef SCORES_ROW
#undef PROBS_BF16
#undef WIDEN
#undef LOAD_ROW
#undef SOFTMAX_STEP
#undef ACCUMULATE
#undef ACCUMULATE_ROW
#undef VALUES_IN_PLACE
#undef UNIT
