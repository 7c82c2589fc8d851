#ifndef LLMFW_NATIVE_POOL_H
#define LLMFW_NATIVE_POOL_H
typedef struct nat_pool nat_pool;
typedef void (*nat_task)(void *ctx, int ith, int nth);
#include <stdint.h>

/* [start, stop) of thread ith's equal share of n items: whole items, so an item's arithmetic never depends on
 * the split */
static inline void nat_share(int64_t n, int ith, int nth, int64_t *start, int64_t *stop) {
    *start = n * ith / nth;
    *stop = n * (ith + 1) / nth;
}

nat_pool *nat_pool_new(int n_threads);
int nat_pool_threads(const nat_pool *pool);
void nat_pool_run(nat_pool *pool, nat_task fn, void *ctx);
void nat_pool_free(nat_pool *pool);
#endif
