/* The cpu-native group-affine matmul (quant_gemm.c) at M rows on the default model's shapes, in
 * thread CPU time: from cache (the same weight each call) and streamed from memory (~200 MB of
 * copies walked in turn), in GB/s of packed weight bytes, beside a one-thread STREAM triad.
 * CPU time, not wall time, so that other processes holding the cores of a shared machine do not
 * count; the memory they stream still does. Random Q4_1-like weights (float16 scales) for the
 * projections, 8-bit for the LM head, as SmolLM2-135M's GGUF file holds them.
 *
 *   DIR=plugins/platforms/cpu-native/engine_platforms_cpu_native
 *   gcc -O3 -march=native -fopenmp -Icore/engine/native/include -I$DIR -o affine_stream \
 *       benchmarks/affine_stream.c -lm
 *   OMP_NUM_THREADS=1 ./affine_stream [M]
 *
 * The checksum line hashes every output: two builds that print the same one computed the same
 * bits. Build two trees' kernels (-I each tree's DIR) and run them alternated to compare. */
#include "quant_gemm.c"
#include <stdio.h>
#include <time.h>

typedef struct {
    const char *name;
    int64_t n, k, bits;
} Shape;

static const Shape SHAPES[] = {
    {"qkv", 960, 576, 4}, {"o", 576, 576, 4}, {"gate_up", 3072, 576, 4}, {"down", 576, 1536, 4}, {"lm_head", 49152, 576, 8},
};

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Seconds per call over `copies` weights (all the same one when `same`), the best of 7 */
static double per_call(int64_t m, const Shape *s, const uint16_t *x, uint8_t **qw, uint16_t **sz, int copies, int same,
                       uint16_t *out) {
    double best = 1e9;
    for (int round = 0; round < 7; round++) {
        double start = cpu_seconds();
        for (int c = 0; c < copies; c++)
            affine_matmul_bf16(x, s->k, m, s->k, qw[same ? 0 : c], sz[same ? 0 : c], 1, s->bits, s->n, out);
        double took = (cpu_seconds() - start) / copies;
        best = took < best ? took : best;
    }
    return best;
}

static uint64_t run_shape(int64_t m, const Shape *s) {
    int64_t n = s->n, k = s->k, tiles = (n + 31) / 32 * 2, groups = n * k / 32; /* tiles in pairs */
    size_t qbytes = (size_t)(tiles * 16 * k * s->bits / 8), szcount = (size_t)(tiles * (k / 32) * 2 * 16);
    size_t bytes = qbytes + 2 * szcount;
    int copies = (int)(200e6 / (double)bytes) < 2 ? 2 : (int)(200e6 / (double)bytes);
    uint8_t *q = malloc((size_t)(n * k));
    float *scale = malloc(sizeof(float) * (size_t)groups), *offset = malloc(sizeof(float) * (size_t)groups);
    float *packed_sz = malloc(sizeof(float) * szcount);
    for (int64_t i = 0; i < n * k; i++) q[i] = (uint8_t)(rand() % (1 << s->bits));
    for (int64_t i = 0; i < groups; i++) { /* values a float16 holds exactly, as GGUF's */
        scale[i] = _cvtsh_ss(_cvtss_sh((float)(rand() % 1000) * 1e-5f, 0));
        offset[i] = _cvtsh_ss(_cvtss_sh(-(float)(rand() % 1000) * 1e-4f, 0));
    }
    uint8_t **qw = malloc(sizeof *qw * (size_t)copies);
    uint16_t **sz = malloc(sizeof *sz * (size_t)copies);
    pack_affine(q, scale, offset, n, k, s->bits, qw[0] = malloc(qbytes), packed_sz);
    sz[0] = malloc(2 * szcount);
    for (size_t i = 0; i < szcount; i++) sz[0][i] = _cvtss_sh(packed_sz[i], 0);
    for (int c = 1; c < copies; c++) {
        memcpy(qw[c] = malloc(qbytes), qw[0], qbytes);
        memcpy(sz[c] = malloc(2 * szcount), sz[0], 2 * szcount);
    }
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(m * k)), *out = malloc(sizeof(uint16_t) * (size_t)(m * n));
    for (int64_t i = 0; i < m * k; i++) x[i] = bf16_store((float)(rand() % 2001 - 1000) * 1e-3f);
    double cached = per_call(m, s, x, qw, sz, copies, 1, out), streamed = per_call(m, s, x, qw, sz, copies, 0, out);
    printf("%-8s %5ld x %-5ld %ld-bit %6.2f MB  cache %8.1f us %5.1f GB/s  memory %8.1f us %5.1f GB/s\n", s->name,
           (long)n, (long)k, (long)s->bits, (double)bytes / 1e6, cached * 1e6, (double)bytes / cached / 1e9,
           streamed * 1e6, (double)bytes / streamed / 1e9);
    uint64_t hash = 0;
    for (int64_t i = 0; i < m * n; i++) hash = hash * 31 + out[i];
    for (int c = 0; c < copies; c++) {
        free(qw[c]);
        free(sz[c]);
    }
    free(qw), free(sz), free(q), free(scale), free(offset), free(packed_sz), free(x), free(out);
    return hash;
}

/* STREAM's a = b + s·c over 3 × 128 MiB, counted as STREAM does (12 bytes an element) */
static double triad_gbs(void) {
    size_t count = (size_t)32 << 20;
    float *a = malloc(4 * count), *b = malloc(4 * count), *c = malloc(4 * count);
    for (size_t i = 0; i < count; i++) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
    double best = 1e9;
    for (int round = 0; round < 5; round++) {
        double start = cpu_seconds();
        for (size_t i = 0; i < count; i++) a[i] = b[i] + 1.5f * c[i];
        double took = cpu_seconds() - start;
        best = took < best ? took : best;
    }
    free(a), free(b), free(c);
    return 12.0 * (double)count / best / 1e9;
}

int main(int argc, char **argv) {
    int64_t m = argc > 1 ? atoi(argv[1]) : 1;
    srand(1);
    uint64_t hash = 0;
    printf("M = %ld\n", (long)m);
    for (size_t i = 0; i < sizeof SHAPES / sizeof *SHAPES; i++) hash = hash * 1000003 + run_shape(m, &SHAPES[i]);
    printf("checksum %016llx\ntriad %.1f GB/s\n", (unsigned long long)hash, triad_gbs());
    return 0;
}
