/* What a kernel library's prototype header includes (engine.native.prototypes reads those
 * headers): the fixed-width types and engine_status. */
#ifndef ENGINE_NATIVE_H
#define ENGINE_NATIVE_H

#include <stdint.h>

/* A kernel's result when it is a status: 0 done, non-zero it did not run (it refused its input,
 * or had no scratch memory). engine.native.tape checks it on replay too; an int64_t result is a
 * value Python acts on instead. */
typedef int64_t engine_status;

#endif
