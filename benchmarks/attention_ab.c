/* Two builds of the cpu-native paged attention kernel (attention.c, e.g. two trees') side by
 * side in one process: one decode call (every request one query row over `context` keys, bf16,
 * block size 16, blocks shuffled over the pool) alternates between the builds call by call, in
 * wall time, with the threads OpenMP is given. `layers` pools are walked in turn (default 11; an
 * odd count of at least 3 gives each build every pool), so that the K/V come from memory as in
 * a model's step, not from the caches (nor from the other build's call just before).
 *
 *   DIR=plugins/attention/cpu-native/engine_attention_cpu_native   # in each tree
 *   gcc -O3 -march=native -fopenmp -shared -fPIC -Icore/engine/native/include -I$DIR \
 *       -o a.so $DIR/attention.c -lm                                  # and b.so from the other tree
 *   gcc -O2 -fopenmp -o attention_ab benchmarks/attention_ab.c -ldl -lm
 *   OMP_NUM_THREADS=2 ./attention_ab ./a.so ./b.so BATCH CONTEXT [HEADS KV_HEADS DIM [LAYERS [SECONDS]]]
 *
 * Prints each build's median µs a call, ns per key and KV head, the K/V read rate, the ratio
 * b ÷ a of the medians, and the largest difference of each build's output from a's portable
 * kernel (paged_attention_bf16_scalar) on the first pool. Defaults: the default model's shape
 * (9 query heads, 3 KV heads, head dim 64). */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*attention_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, int64_t, const int32_t *,
                            int64_t, const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float, int64_t, float, const float *, float, uint16_t *);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static attention_fn load(const char *path, const char *symbol) {
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    attention_fn fn = library ? (attention_fn)dlsym(library, symbol) : NULL;
    if (!fn) fprintf(stderr, "%s: %s\n", path, dlerror()), exit(1);
    return fn;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static float largest_difference(const uint16_t *a, const uint16_t *b, int64_t n) {
    float worst = 0.f;
    for (int64_t i = 0; i < n; i++) worst = fmaxf(worst, fabsf(from_bf16(a[i]) - from_bf16(b[i])));
    return worst;
}

int main(int argc, char **argv) {
    if (argc < 5) return fprintf(stderr, "usage: %s A.so B.so BATCH CONTEXT [HEADS KV_HEADS DIM [LAYERS [SECONDS]]]\n", argv[0]), 2;
    attention_fn fn[2] = {load(argv[1], "paged_attention_bf16"), load(argv[2], "paged_attention_bf16")};
    attention_fn reference = load(argv[1], "paged_attention_bf16_scalar");
    int64_t batch = atoi(argv[3]), context = atoi(argv[4]), block = 16;
    int64_t heads = argc > 5 ? atoi(argv[5]) : 9, kv_heads = argc > 6 ? atoi(argv[6]) : 3;
    int64_t dim = argc > 7 ? atoi(argv[7]) : 64, layers = argc > 8 ? atoi(argv[8]) : 11;
    double seconds = argc > 9 ? atof(argv[9]) : 4.0;
    int64_t per_request = (context + block - 1) / block, pool = batch * per_request + 1;
    int64_t head_stride = pool * block * dim, layer = 2 * kv_heads * head_stride;
    uint16_t *caches = malloc(sizeof(uint16_t) * layer * layers);
    int32_t *table = malloc(sizeof(int32_t) * batch * per_request);
    uint16_t *query = malloc(sizeof(uint16_t) * batch * heads * dim), *out[3];
    int32_t *starts = malloc(sizeof(int32_t) * (batch + 1)), *lengths = malloc(sizeof(int32_t) * batch);
    int32_t *requests = malloc(sizeof(int32_t) * batch);
    srand(1);
    for (int64_t i = 0; i < layer * layers; i++) caches[i] = to_bf16(2.f * rand() / RAND_MAX - 1.f);
    for (int64_t i = 0; i < batch * heads * dim; i++) query[i] = to_bf16(2.f * rand() / RAND_MAX - 1.f);
    for (int64_t i = 0; i < batch * per_request; i++) table[i] = (int32_t)(i + 1);
    for (int64_t i = batch * per_request - 1; i > 0; i--) {
        int64_t j = rand() % (i + 1);
        int32_t t = table[i];
        table[i] = table[j], table[j] = t;
    }
    for (int64_t r = 0; r <= batch; r++) starts[r] = (int32_t)r;
    for (int64_t r = 0; r < batch; r++) lengths[r] = (int32_t)context, requests[r] = (int32_t)r;
    for (int i = 0; i < 3; i++) out[i] = malloc(sizeof(uint16_t) * batch * heads * dim);
    float scale = 1.f / sqrtf((float)dim);
#define CALL(f, cache, o)                                                                                       \
    f(query, heads * dim, cache, cache + kv_heads * head_stride, head_stride, table, per_request, starts, lengths, \
      requests, batch, heads, kv_heads, dim, block, scale, 0, 0.f, NULL, 1.f, o)
    CALL(reference, caches, out[2]);
    for (int b = 0; b < 2; b++) CALL(fn[b], caches, out[b]);
    size_t capacity = 1 << 20, n = 0;
    double *times[2] = {malloc(sizeof(double) * capacity), malloc(sizeof(double) * capacity)};
    for (double start = now(); now() - start < seconds && n < capacity; n++)
        for (int b = 0; b < 2; b++) {
            const uint16_t *cache = caches + (int64_t)((2 * n + b) % layers) * layer; /* never the pool just read */
            double t = now();
            CALL(fn[b], cache, out[b]);
            times[b][n] = now() - t;
        }
    double median[2];
    for (int b = 0; b < 2; b++) {
        qsort(times[b], n, sizeof(double), by_value);
        median[b] = times[b][n / 2];
        printf("%s: %.1f µs, %.2f ns a key and KV head, %.1f GB/s of K/V\n", argv[1 + b], median[b] * 1e6,
               median[b] * 1e9 / ((double)batch * context * kv_heads),
               (double)batch * context * kv_heads * dim * 4 / median[b] / 1e9);
    }
    CALL(fn[0], caches, out[0]);
    CALL(fn[1], caches, out[1]);
    printf("%ld × %ld, %ld/%ld heads, dim %ld, %ld pools, %zu calls each: b ÷ a %.3f; largest difference "
           "from the portable kernel: a %.2e, b %.2e\n",
           (long)batch, (long)context, (long)heads, (long)kv_heads, (long)dim, (long)layers, n,
           median[1] / median[0], largest_difference(out[0], out[2], batch * heads * dim),
           largest_difference(out[1], out[2], batch * heads * dim));
    return 0;
}
