/* decode.c's entry points, bound from here by engine.native.decode. */
#ifndef ENGINE_DECODE_H
#define ENGINE_DECODE_H

#include "engine_native.h"

/* rows [0, rows) of a decode step's inputs moved on by the tokens it chose, in place: input_ids[r]
 * = tokens[r], positions[r] and seq_lens[r] one more, slot_mapping[r] the slot block_table row r
 * (table_stride entries apart) gives the new position */
void decode_advance(const int64_t *tokens, int64_t *input_ids, int64_t *positions, int32_t *seq_lens,
                    int64_t *slot_mapping, const int32_t *block_table, int64_t table_stride, int64_t block_size,
                    int64_t rows);

#endif
