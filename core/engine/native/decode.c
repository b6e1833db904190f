/* A decode step's inputs moved on by the token each row chose, for the next step of a burst
 * (several greedy decode steps replayed in a row: engine.runner.step_graphs). Recorded on the
 * greedy step's native tape after its argmax, so that a replay is a whole step and the next one
 * needs nothing from Python; a few rows of integers, on one thread. */
#include "decode.h"
#include <stdint.h>

void decode_advance(const int64_t *tokens, int64_t *input_ids, int64_t *positions, int32_t *seq_lens,
                    int64_t *slot_mapping, const int32_t *block_table, int64_t table_stride, int64_t block_size,
                    int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t position = positions[r] + 1;
        input_ids[r] = tokens[r];
        positions[r] = position;
        seq_lens[r] += 1;
        slot_mapping[r] = (int64_t)block_table[r * table_stride + position / block_size] * block_size
                          + position % block_size;
    }
}
