/* A kernel's loop over independent rows, split over the OpenMP threads only where the call is
 * big enough, for C kernels built with engine.native.load_source (#include "engine_split.h").
 *
 * Why not `#pragma omp parallel for if (big)`: where the condition is false libgomp still makes
 * and frees a one-thread team, 0.25-0.5 us a call, as long as a decode row's norm takes. A
 * single-stream token calls the small kernels ~9 times a layer, so they run their loop plainly
 * instead (benchmarks/RESULTS.md, the section titled with "OpenMP's if clause"). */
#ifndef ENGINE_SPLIT_H
#define ENGINE_SPLIT_H

/* for (int64_t r = 0; r < count; r++) call; — in static shares over the OpenMP threads where
 * `split`, else on this thread alone. `call` is one statement (a row function's call), so that
 * compiler messages and debuggers see the row's own lines. */
#define FOR_ROWS(split, r, count, call)                                                           \
    do {                                                                                          \
        if (split) {                                                                              \
            _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < (count); r++) call; \
        } else {                                                                                  \
            for (int64_t r = 0; r < (count); r++) call;                                           \
        }                                                                                         \
    } while (0)

#endif
