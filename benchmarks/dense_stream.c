/* The cpu-native bfloat16 widening matmul (dense_bf16.c) at M rows on the default model's bf16
 * shapes (SmolLM2-135M: qkv, o, gate|up, down, the tied LM head), from cache (the same weight
 * each call) and streamed from memory (~200 MB of copies walked in turn, past any L3), in GB/s of
 * bf16 weight bytes, beside a STREAM triad on as many threads, in the same run. Each figure is
 * given in wall time and in the process's CPU time (all threads together, so at T threads
 * T × the CPU figure is what the threads would stream if nothing else ran): on a shared machine
 * other processes holding the cores inflate the wall figure, while the memory they stream still
 * counts in both.
 *
 *   DIR=plugins/platforms/cpu-native/engine_platforms_cpu_native
 *   gcc -O3 -march=native -fopenmp -Icore/engine/native/include -I$DIR -o dense_stream \
 *       benchmarks/dense_stream.c -lm
 *   OMP_NUM_THREADS=1 ./dense_stream [M] [huge]
 *
 * "huge" puts each weight on transparent huge pages (2 MiB aligned, madvise(MADV_HUGEPAGE)), to
 * see what the TLB misses of 4 KiB pages cost the stream.
 *
 * The checksum line hashes every output: two builds that print the same one computed the same
 * bits. Build two trees' kernels (-I each tree's DIR) and run them alternated to compare. */
#include "dense_bf16.c"
#include <omp.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE ((size_t)2 << 20)
static int huge_pages;

typedef struct {
    const char *name;
    int64_t n, k;
} Shape;

static const Shape SHAPES[] = {
    {"qkv", 960, 576}, {"o", 576, 576}, {"gate_up", 3072, 576}, {"down", 576, 1536}, {"lm_head", 49152, 576},
};

typedef struct {
    double wall, cpu;
} Seconds;

static double clock_seconds(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static Seconds now(void) {
    return (Seconds){clock_seconds(CLOCK_MONOTONIC), clock_seconds(CLOCK_PROCESS_CPUTIME_ID)};
}

/* Seconds per call over `copies` weights (all the same one when `same`), the best of 7 rounds
 * (each clock's best on its own) */
static Seconds per_call(int64_t m, const Shape *s, const uint16_t *x, uint16_t **w, int copies, int same,
                        uint16_t *out) {
    Seconds best = {1e9, 1e9};
    for (int round = 0; round < 7; round++) {
        Seconds start = now();
        for (int c = 0; c < copies; c++) dense_matmul_bf16(x, s->k, m, s->k, w[same ? 0 : c], NULL, s->n, out);
        Seconds end = now();
        double wall = (end.wall - start.wall) / copies, cpu = (end.cpu - start.cpu) / copies;
        best.wall = wall < best.wall ? wall : best.wall;
        best.cpu = cpu < best.cpu ? cpu : best.cpu;
    }
    return best;
}

/* `bytes` for a weight, on huge pages when asked for (advised before the first touch) */
static uint16_t *weight_memory(size_t bytes) {
    if (!huge_pages) return malloc(bytes);
    size_t rounded = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    uint16_t *p = aligned_alloc(HUGE_PAGE, rounded);
    madvise(p, rounded, MADV_HUGEPAGE);
    return p;
}

static uint64_t run_shape(int64_t m, const Shape *s) {
    int64_t n = s->n, k = s->k;
    size_t bytes = sizeof(uint16_t) * (size_t)(n * k);
    int copies = (int)(200e6 / (double)bytes) < 2 ? 2 : (int)(200e6 / (double)bytes);
    uint16_t **w = malloc(sizeof *w * (size_t)copies);
    w[0] = weight_memory(bytes);
    for (int64_t i = 0; i < n * k; i++) w[0][i] = bf16_store((float)(rand() % 2001 - 1000) * 1e-4f);
    for (int c = 1; c < copies; c++) memcpy(w[c] = weight_memory(bytes), w[0], bytes);
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(m * k)), *out = malloc(sizeof(uint16_t) * (size_t)(m * n));
    for (int64_t i = 0; i < m * k; i++) x[i] = bf16_store((float)(rand() % 2001 - 1000) * 1e-3f);
    Seconds cached = per_call(m, s, x, w, copies, 1, out), streamed = per_call(m, s, x, w, copies, 0, out);
    printf("%-8s %5ld x %-5ld %6.2f MB  cache %8.1f us %5.1f GB/s  memory %8.1f us %5.1f GB/s wall, "
           "%8.1f us %5.1f GB/s cpu\n",
           s->name, (long)n, (long)k, (double)bytes / 1e6, cached.wall * 1e6, (double)bytes / cached.wall / 1e9,
           streamed.wall * 1e6, (double)bytes / streamed.wall / 1e9, streamed.cpu * 1e6,
           (double)bytes / streamed.cpu / 1e9);
    uint64_t hash = 0;
    for (int64_t i = 0; i < m * n; i++) hash = hash * 31 + out[i];
    for (int c = 0; c < copies; c++) free(w[c]);
    free(w), free(x), free(out);
    return hash;
}

/* STREAM's a = b + s·c over 3 × 128 MiB on the OpenMP threads, counted as STREAM does (12 bytes
 * an element), the best of 5 */
static Seconds triad_gbs(void) {
    size_t count = (size_t)32 << 20;
    float *a = malloc(4 * count), *b = malloc(4 * count), *c = malloc(4 * count);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < count; i++) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
    Seconds best = {1e9, 1e9};
    for (int round = 0; round < 5; round++) {
        Seconds start = now();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < count; i++) a[i] = b[i] + 1.5f * c[i];
        Seconds end = now();
        best.wall = end.wall - start.wall < best.wall ? end.wall - start.wall : best.wall;
        best.cpu = end.cpu - start.cpu < best.cpu ? end.cpu - start.cpu : best.cpu;
    }
    free(a), free(b), free(c);
    return (Seconds){12.0 * (double)count / best.wall / 1e9, 12.0 * (double)count / best.cpu / 1e9};
}

int main(int argc, char **argv) {
    int64_t m = argc > 1 ? atoi(argv[1]) : 1;
    huge_pages = argc > 2 && strcmp(argv[2], "huge") == 0;
    srand(1);
    uint64_t hash = 0;
    printf("M = %ld, %d threads%s\n", (long)m, omp_get_max_threads(), huge_pages ? ", huge pages" : "");
    for (size_t i = 0; i < sizeof SHAPES / sizeof *SHAPES; i++) hash = hash * 1000003 + run_shape(m, &SHAPES[i]);
    Seconds triad = triad_gbs();
    printf("checksum %016llx\ntriad %.1f GB/s wall, %.1f GB/s cpu\n", (unsigned long long)hash, triad.wall, triad.cpu);
    return 0;
}
