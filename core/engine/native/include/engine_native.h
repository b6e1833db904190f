/* What a kernel library's prototype header includes (engine.native.prototypes reads those
 * headers): the fixed-width types, engine_status, and TYPED for type-generic bodies. */
#ifndef ENGINE_NATIVE_H
#define ENGINE_NATIVE_H

#include <stdint.h>

/* A kernel's result when it is a status: 0 done, non-zero it did not run (it refused its input,
 * or had no scratch memory). engine.native.tape checks it on replay too; an int64_t result is a
 * value Python acts on instead. */
typedef int64_t engine_status;

/* A type-generic body is a file included once per storage type with SUFFIX (and its own
 * parameters) defined: TYPED(rms_norm) names rms_norm_bf16, rms_norm_f32, ... in it. */
#define ENGINE_PASTE_(name, suffix) name##_##suffix
#define ENGINE_PASTE(name, suffix) ENGINE_PASTE_(name, suffix)
#define TYPED(name) ENGINE_PASTE(name, SUFFIX)

#endif
