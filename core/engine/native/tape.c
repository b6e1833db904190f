/* The tape interpreter: replays a recorded sequence of C kernel calls in one call from Python.
 *
 * An op is a kernel's address and its arguments, split by class: up to TAPE_INTS integer or
 * pointer arguments and up to TAPE_FLOATS float arguments, each class in the order the kernel
 * declares it. On the System V AMD64 and AAPCS64 calling conventions integer and float
 * arguments take separate register sequences and only integers overflow to the stack (eight
 * float registers hold every float here), so calling any kernel through one prototype of
 * TAPE_INTS integers followed by TAPE_FLOATS floats passes exactly what the kernel expects;
 * the arguments it does not declare are ignored, as they are by every callee on these ABIs.
 * engine.native.tape refuses other platforms, and kernels with double or struct arguments.
 *
 * A kernel whose result is a status (non-zero: it refused its input) is marked `checked`; the
 * first failing op stops the replay and its 1-based index is returned (0: all ran).
 */
#include "tape.h"
#include <stdint.h>

#define TAPE_INTS 24
#define TAPE_FLOATS 8

typedef int64_t (*tape_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           float, float, float, float, float, float, float, float);

typedef struct {
    int64_t fn;      /* the kernel's address */
    int64_t checked; /* its int64 result is a status */
    int64_t i[TAPE_INTS];
    float f[TAPE_FLOATS];
} tape_op;

int64_t tape_op_bytes(void) { return (int64_t)sizeof(tape_op); }
int64_t tape_max_ints(void) { return TAPE_INTS; }
int64_t tape_max_floats(void) { return TAPE_FLOATS; }

int64_t tape_run(const void *ops, int64_t count) {
    for (int64_t n = 0; n < count; n++) {
        const tape_op *op = (const tape_op *)ops + n;
        const int64_t *i = op->i;
        const float *f = op->f;
        int64_t status = ((tape_fn)(intptr_t)op->fn)(
            i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10], i[11], i[12], i[13], i[14],
            i[15], i[16], i[17], i[18], i[19], i[20], i[21], i[22], i[23],
            f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
        if (op->checked && status != 0) return n + 1;
    }
    return 0;
}
