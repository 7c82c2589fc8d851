#ifndef LLMFW_NATIVE_POOL_H
#define LLMFW_NATIVE_POOL_H
#include <stdint.h>

/* the name every worker thread carries (tests count the pool's threads by it) */
#define NAT_WORKER_NAME "llmfw-native"

typedef struct nat_pool nat_pool;
/* one chunk of a job: chunk index, and the index of the thread running it (0 = the caller) for per-thread scratch */
typedef void (*nat_chunk_fn)(void *ctx, int64_t chunk, int ith);

/* [start, stop) of part i of n items split into parts equal parts: whole items, so an item's arithmetic never
 * depends on the split */
static inline void nat_share(int64_t n, int64_t i, int64_t parts, int64_t *start, int64_t *stop) {
    *start = n * i / parts;
    *stop = n * (i + 1) / parts;
}

nat_pool *nat_pool_new(int n_threads);
int nat_pool_threads(const nat_pool *pool);
/* fn(ctx, c, ith) for every chunk c in [0, n_chunks), on the caller and whichever workers are awake; returns when
 * all ran. Chunks are claimed one at a time, so a worker the OS has not scheduled delays nothing: the caller
 * takes its chunks. */
void nat_pool_for(nat_pool *pool, int64_t n_chunks, nat_chunk_fn fn, void *ctx);
/* how many chunks to cut n items into on this pool: enough for balance when threads run at uneven speeds */
int64_t nat_pool_chunks(const nat_pool *pool, int64_t n_items);
void nat_pool_free(nat_pool *pool);
#endif
