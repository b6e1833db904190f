/* tape.c's entry points, bound from here by engine.native.tape. */
#ifndef ENGINE_TAPE_H
#define ENGINE_TAPE_H

#include "engine_native.h"

/* the layout tape.py checks its op structure against */
int64_t tape_op_bytes(void);
int64_t tape_max_ints(void);
int64_t tape_max_floats(void);

/* runs ops[0..count) (tape_op structures); the 1-based index of the first checked op that
 * failed, or 0 when all ran */
int64_t tape_run(const void *ops, int64_t count);

#endif
