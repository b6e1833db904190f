/* What every AMX tile kernel of this platform needs (quant_gemm_amx.h, dense_bf16_amx.h): the
 * tile configuration's layout and the one request Linux wants before a process may use tiles.
 * Included only where the build targets AMX (AMX_TILE, AMX_BF16, AVX512_BF16). */
#ifndef ENGINE_CPU_NATIVE_AMX_TILES_H
#define ENGINE_CPU_NATIVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a state component */
#define XFEATURE_XTILEDATA 18      /* the tile data, which Linux grants per process */
long syscall(long number, ...);    /* unistd.h's, which -std=c11 does not declare */

/* The tile registers both kernels use (literals: the intrinsics paste them into the
 * instruction): four of float sums, C<i><j> = A<i> · B<j>, and two operands of each kind (what
 * A and B hold is each kernel's own). */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7

/* ldtilecfg's operand (palette 1): each tile register's rows and bytes a row */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands a process the tile state on request only (once: later calls return at once). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(158 /* SYS_arch_prctl */, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Activation rows a pass over a weight's panels takes: their bf16 (rows · k · 2 bytes, ~1 MiB)
 * stay in L2 while every panel runs against them, rather than a long chunk's streaming from L3
 * once a panel; at least 256, a multiple of 32 (a pair of 16-row tiles). */
static inline int64_t pass_rows(int64_t k) {
    int64_t rows = (1 << 20) / (2 * k) / 32 * 32;
    return rows < 256 ? 256 : rows;
}

#endif
