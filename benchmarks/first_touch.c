/* How fast fresh anonymous memory becomes resident, in 4 KiB pages and in transparent huge pages:
 * what the KV pool's first write of each block costs (docs/decisions.md, "The KV pool back on
 * 4 KiB pages"). Maps MiB of fresh memory (advised MADV_HUGEPAGE or not), writes a byte every
 * 4 KiB and prints the rate, then writes every line again (the pages resident) for comparison.
 * In a virtual machine the rate depends on whether the guest used those pages before: run it
 * twice, and once after a run of the other kind.
 *
 *   gcc -O2 -o first_touch benchmarks/first_touch.c
 *   ./first_touch 2048 1; ./first_touch 2048 0 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 3) return fprintf(stderr, "usage: %s MIB HUGE(0|1)\n", argv[0]), 2;
    size_t bytes = (size_t)atoi(argv[1]) << 20;
    int huge = atoi(argv[2]);
    volatile char *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return perror("mmap"), 1;
    if (huge && madvise((void *)p, bytes, MADV_HUGEPAGE)) return perror("madvise"), 1;
    double start = now();
    for (size_t i = 0; i < bytes; i += 4096) p[i] = 1;
    double first = now() - start;
    start = now();
    for (size_t i = 0; i < bytes; i += 64) p[i] = 2;
    double again = now() - start;
    printf("%zu MiB, %s: first write %.3f s (%.2f GB/s), every line again %.2f GB/s\n", bytes >> 20,
           huge ? "huge pages advised" : "default pages", first, bytes / first / 1e9, bytes / again / 1e9);
    return 0;
}
