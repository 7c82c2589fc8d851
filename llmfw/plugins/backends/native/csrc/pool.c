/* A persistent pool of worker threads for a machine that other processes share.
 *
 * A job is n chunks that threads claim one at a time (a compare-and-swap on one word holding the job's
 * generation and the next chunk). The caller is a worker too: it claims chunks until none are left, so a worker
 * the OS has descheduled never stalls a job — the caller does its share — and it only waits for chunks already
 * being run. Between jobs a worker spins briefly (ops of one token follow each other within microseconds), then
 * sleeps on a futex until the next job is published; the caller, waiting for the last chunks, does the same. With
 * one thread there is no worker at all. */
#define _GNU_SOURCE
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

/* how long a thread spins before it sleeps (ns): a few ops' time, not long enough to starve a neighbour */
#define SPIN_NS 30000
#define CHUNKS_PER_THREAD 8

struct nat_pool {
    int n_threads;
    pthread_t *threads;
    _Atomic uint64_t claim;        /* (generation << 32) | next unclaimed chunk */
    _Atomic uint32_t generation;   /* futex word the idle workers sleep on: bumped per published job */
    _Atomic uint32_t finished;     /* futex word the caller sleeps on: the generation of the last finished job */
    _Atomic int64_t done;          /* chunks of the current job finished */
    _Atomic int sleepers;          /* workers asleep (or about to) on `generation` */
    _Atomic int caller_waiting;
    _Atomic int stop;
    _Atomic(nat_chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n_chunks;
    uint32_t published;            /* the caller's own count of jobs */
};

static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int count) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

/* the next chunk of job `gen`, or -1 when that job has none left (or is no longer the current one) */
static int64_t claim_chunk(nat_pool *pool, uint32_t gen, int64_t n_chunks) {
    uint64_t cur = atomic_load(&pool->claim);
    for (;;) {
        if ((uint32_t)(cur >> 32) != gen || (int64_t)(cur & 0xffffffffu) >= n_chunks) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool->claim, &cur, cur + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int64_t)(cur & 0xffffffffu);
    }
}

/* run chunks of job `gen` until none is left; returns how many this thread ran */
static int64_t run_chunks(nat_pool *pool, uint32_t gen, nat_chunk_fn fn, void *ctx, int64_t n_chunks, int ith) {
    int64_t ran = 0;
    for (int64_t c; (c = claim_chunk(pool, gen, n_chunks)) >= 0; ran++) fn(ctx, c, ith);
    return ran;
}

typedef struct { nat_pool *pool; int ith; } worker_arg;

static void *worker_main(void *raw) {
    worker_arg arg = *(worker_arg *)raw;
    free(raw);
    nat_pool *pool = arg.pool;
    uint32_t seen = 0;
    for (;;) {
        int64_t start = now_ns();
        for (int spins = 1; atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop); spins++) {
            relax();
            if (spins % 64 == 0 && now_ns() - start > SPIN_NS) {
                atomic_fetch_add(&pool->sleepers, 1);
                while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                    futex_wait(&pool->generation, seen);
                atomic_fetch_sub(&pool->sleepers, 1);
            }
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = atomic_load(&pool->generation);
        nat_chunk_fn fn = atomic_load(&pool->fn);
        void *ctx = atomic_load(&pool->ctx);
        int64_t n_chunks = atomic_load(&pool->n_chunks);
        /* A worker the OS held back may read these after the caller finished job `seen` alone and began publishing
         * the next one, some fields of each. The caller closes the claim word to the next job before it writes
         * any field (nat_pool_for), and every access here is sequentially consistent, so once a field read comes
         * from a later job, claim_chunk sees a later generation and refuses: fn runs only with all of its own
         * job's fields, and only for that job's chunks. */
        int64_t ran = run_chunks(pool, seen, fn, ctx, n_chunks, arg.ith);
        if (ran && atomic_fetch_add(&pool->done, ran) + ran == n_chunks) {
            atomic_store(&pool->finished, seen);
            if (atomic_load(&pool->caller_waiting)) futex_wake(&pool->finished, 1);
        }
    }
}

nat_pool *nat_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    nat_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) { free(pool); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (arg) { arg->pool = pool; arg->ith = i; }
        if (!arg || pthread_create(&pool->threads[i], NULL, worker_main, arg) != 0) {
            free(arg);
            pool->n_threads = i;   /* run with the threads that started */
            break;
        }
        /* named by the creator, so the name is there when the pool is (top -H, /proc/<pid>/task/<tid>/comm) */
        pthread_setname_np(pool->threads[i], NAT_WORKER_NAME);
    }
    return pool;
}

int nat_pool_threads(const nat_pool *pool) { return pool->n_threads; }

int64_t nat_pool_chunks(const nat_pool *pool, int64_t n_items) {
    int64_t want = pool->n_threads == 1 ? 1 : (int64_t)pool->n_threads * CHUNKS_PER_THREAD;
    return n_items < want ? (n_items > 0 ? n_items : 1) : want;
}

void nat_pool_for(nat_pool *pool, int64_t n_chunks, nat_chunk_fn fn, void *ctx) {
    if (n_chunks <= 0) return;
    if (pool->n_threads == 1 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; c++) fn(ctx, c, 0);
        return;
    }
    uint32_t gen = ++pool->published;
    if (gen == 0) gen = ++pool->published;   /* 0 is the workers' initial "seen" */
    /* closed first (no chunk claimable, a later generation): a late worker of the last job refuses from here on */
    atomic_store(&pool->claim, ((uint64_t)gen << 32) | 0xffffffffu);
    atomic_store(&pool->fn, fn);
    atomic_store(&pool->ctx, ctx);
    atomic_store(&pool->n_chunks, n_chunks);
    atomic_store(&pool->done, 0);
    atomic_store(&pool->claim, (uint64_t)gen << 32);
    atomic_store(&pool->generation, gen);
    if (atomic_load(&pool->sleepers) > 0) futex_wake(&pool->generation, INT_MAX);
    int64_t ran = run_chunks(pool, gen, fn, ctx, n_chunks, 0);
    if (atomic_fetch_add(&pool->done, ran) + ran == n_chunks) return;
    /* workers still run chunks they claimed: spin briefly, then sleep until the last one says it finished */
    int64_t start = now_ns();
    for (int spins = 1; atomic_load(&pool->done) < n_chunks; spins++) {
        relax();
        if (spins % 64 == 0 && now_ns() - start > SPIN_NS) {
            atomic_store(&pool->caller_waiting, 1);
            for (uint32_t seen; (seen = atomic_load(&pool->finished)) != gen;) futex_wait(&pool->finished, seen);
            atomic_store(&pool->caller_waiting, 0);
            break;
        }
    }
}

void nat_pool_free(nat_pool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->generation, 1);
    futex_wake(&pool->generation, INT_MAX);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    free(pool->threads);
    free(pool);
}
