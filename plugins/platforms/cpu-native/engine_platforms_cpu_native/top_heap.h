/* A row's `top` largest logits and their columns: the heap both the refinement of a row's logits
 * (quant_gemm.c's refine_top) and the greedy product that writes none (logits_int8.c's
 * logits_int8_top) keep, so that the two pick the same candidates.
 *
 * The order is by value, then by column, the lower first on a tie: a strict total order, in which
 * the entries kept are the same whatever order they are offered in (two threads' heaps merge into
 * the one a single pass makes). The root is the worst entry kept. A caller that offers a row's
 * columns in rising order may skip any value not above the root's (an equal one comes later, so
 * ranks below it). NaN is never better than anything: it enters only a heap not yet full. */
#ifndef ENGINE_CPU_NATIVE_TOP_HEAP_H
#define ENGINE_CPU_NATIVE_TOP_HEAP_H

#include <stdint.h>

typedef struct {
    int64_t *column;
    float *value;
    int64_t size, top;
} top_heap;

/* whether (va, ca) ranks above (vb, cb) */
static inline int top_better(float va, int64_t ca, float vb, int64_t cb) {
    return va > vb || (va == vb && ca < cb);
}

/* Keep (v, c) if the heap has room or it ranks above the root, which it then replaces. */
static inline void top_offer(top_heap *h, float v, int64_t c) {
    int64_t at;
    if (h->size < h->top) { /* sift up past the parents it ranks below */
        at = h->size++;
        while (at > 0 && top_better(h->value[(at - 1) / 2], h->column[(at - 1) / 2], v, c)) {
            h->value[at] = h->value[(at - 1) / 2], h->column[at] = h->column[(at - 1) / 2];
            at = (at - 1) / 2;
        }
    } else { /* replace the root, sift down past the children it ranks above */
        if (!top_better(v, c, h->value[0], h->column[0])) return;
        at = 0;
        for (;;) {
            int64_t child = 2 * at + 1;
            if (child >= h->size) break;
            if (child + 1 < h->size &&
                top_better(h->value[child], h->column[child], h->value[child + 1], h->column[child + 1]))
                child++;
            if (!top_better(v, c, h->value[child], h->column[child])) break;
            h->value[at] = h->value[child], h->column[at] = h->column[child];
            at = child;
        }
    }
    h->value[at] = v, h->column[at] = c;
}

#endif
