/* Two builds of the cpu-native group-affine matmul (quant_gemm.c, e.g. two trees') side by side
 * in one process: each shape's calls alternate between the builds round by round, in wall time,
 * with the threads OpenMP is given, the weights streamed from memory (~400 MB of copies walked in
 * turn), so that a shared machine's bandwidth, which moves within minutes, moves both alike.
 * Shapes: the default model's and the 1B-class model's projections and LM heads (Q4_1-like 4-bit
 * values with float16 scales and offsets, the default model's head 8-bit).
 *
 *   DIR=plugins/platforms/cpu-native/engine_platforms_cpu_native   # in each tree
 *   gcc -O3 -march=native -fopenmp -shared -fPIC -Icore/engine/native/include -I$DIR \
 *       -o a.so $DIR/quant_gemm.c -lm                                  # and b.so from the other tree
 *   gcc -O2 -mf16c -fopenmp -o affine_ab benchmarks/affine_ab.c -ldl
 *   OMP_NUM_THREADS=2 OMP_PROC_BIND=true ./affine_ab ./a.so ./b.so [M]
 *
 * Both builds must read the same packed layout's buffer sizes (pairs of 16-column tiles); the
 * values are random bytes, so the figures time the stream, not a product worth checking
 * (affine_stream.c's checksum does that). Add -mno-avx512f to both builds for the AVX2 kernel. */
#include <dlfcn.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*matmul_fn)(const uint16_t *, int64_t, int64_t, int64_t, const uint8_t *, const void *, int64_t,
                          int64_t, int64_t, void *);

static const int64_t SHAPES[][3] = {  /* n, k, bits */
    {960, 576, 4},   {576, 576, 4},   {3072, 576, 4},   {576, 1536, 4}, {49152, 576, 8},
    {3072, 2048, 4}, {2048, 2048, 4}, {16384, 2048, 4}, {2048, 8192, 4}, {49152, 2048, 4},
};
#define ROUNDS 12

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static matmul_fn load(const char *path) {
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        exit(1);
    }
    return (matmul_fn)dlsym(library, "affine_matmul_bf16");
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s A.so B.so [M]\n", argv[0]);
        return 2;
    }
    matmul_fn build[2] = {load(argv[1]), load(argv[2])};
    int64_t m = argc > 3 ? atoi(argv[3]) : 1;
    printf("M = %ld, wall time, best of %d rounds each\n", (long)m, ROUNDS / 2);
    for (size_t i = 0; i < sizeof SHAPES / sizeof *SHAPES; i++) {
        int64_t n = SHAPES[i][0], k = SHAPES[i][1], bits = SHAPES[i][2], tiles = (n + 31) / 32 * 2;
        size_t qbytes = (size_t)(tiles * 16 * k * bits / 8), szcount = (size_t)(tiles * (k / 32) * 2 * 16);
        size_t bytes = qbytes + 2 * szcount;
        int copies = (int)(400e6 / (double)bytes) < 2 ? 2 : (int)(400e6 / (double)bytes);
        uint8_t **qw = malloc(sizeof *qw * (size_t)copies);
        uint16_t **sz = malloc(sizeof *sz * (size_t)copies);
        for (int c = 0; c < copies; c++) {
            qw[c] = malloc(qbytes);
            sz[c] = malloc(2 * szcount);
            for (size_t j = 0; j < qbytes; j++) qw[c][j] = (uint8_t)rand();
            for (size_t j = 0; j < szcount; j++) sz[c][j] = _cvtss_sh((float)(rand() % 1000) * 1e-5f, 0);
        }
        uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(m * k)), *out = malloc(sizeof(uint16_t) * (size_t)(m * n));
        for (int64_t j = 0; j < m * k; j++) x[j] = (uint16_t)(0x3f80 + rand() % 64);  /* bf16 1 … 1.5 */
        double best[2] = {1e9, 1e9};
        for (int round = 0; round < ROUNDS; round++) {
            int b = round % 2;
            double start = seconds();
            for (int c = 0; c < copies; c++) build[b](x, k, m, k, qw[c], sz[c], 1, bits, n, out);
            double took = (seconds() - start) / copies;
            best[b] = took < best[b] ? took : best[b];
        }
        printf("%6ld x %-5ld %ld-bit %7.2f MB   A %8.1f us %5.1f GB/s   B %8.1f us %5.1f GB/s   A/B %.2f\n", (long)n,
               (long)k, (long)bits, (double)bytes / 1e6, best[0] * 1e6, (double)bytes / best[0] / 1e9, best[1] * 1e6,
               (double)bytes / best[1] / 1e9, best[0] / best[1]);
        for (int c = 0; c < copies; c++) free(qw[c]), free(sz[c]);
        free(qw), free(sz), free(x), free(out);
    }
    return 0;
}
