/* A persistent pool of worker threads for a machine that other processes share.
 *
 * A job is n chunks. Each thread owns a slot: one word holding the job's generation and the thread's range of chunks
 * still unclaimed, on a cache line of its own. A thread claims its own chunks first, one at a time (a
 * compare-and-swap on its own line, which no other core touches meanwhile), then takes what is left in the other
 * threads' slots. So a job costs each thread a few cache-line transfers, not one per chunk (a shared counter's line
 * moved between the cores on every claim: over a microsecond of a 16-chunk job), and a worker the OS has descheduled
 * still never stalls a job: the caller is a worker too, and once its own range is done it takes the stalled
 * worker's chunks; it only waits for chunks already being run. Which thread runs a chunk changes nothing in it.
 * Between jobs a worker spins briefly (ops of one token follow each other within microseconds), then sleeps on a
 * futex until the next job is published; the caller, waiting for the last chunks, does the same. With one thread
 * there is no worker at all. */
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
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

/* how long a thread spins before it sleeps (ns): a few ops' time, not long enough to starve a neighbour */
#define SPIN_NS 30000
#define CHUNKS_PER_THREAD 8
#define LINE 64
/* chunks of one pass of a job: a slot word holds a range's next and end chunk in 16 bits each */
#define PASS_CHUNKS 65535

/* a thread's slot: (generation << 32) | (next unclaimed chunk << 16) | end of its range */
typedef struct {
    _Alignas(LINE) _Atomic uint64_t word;
} slot;

struct nat_pool {
    int n_threads;
    pthread_t *threads;
    slot *slots;                   /* one per thread, the caller's first */
    /* what a waiting worker reads: written by the caller per job, generation last */
    _Alignas(LINE) _Atomic uint32_t generation;   /* futex word the idle workers sleep on: bumped per published job */
    _Atomic(nat_chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n_chunks;      /* of this pass */
    _Atomic int64_t first;         /* the job's chunk that this pass's chunk 0 is */
    _Atomic int stop;
    /* what finishing a job writes */
    _Alignas(LINE) _Atomic int64_t done;          /* chunks of the current pass finished */
    _Atomic uint32_t finished;     /* futex word the caller sleeps on: the generation of the last finished pass */
    _Atomic int caller_waiting;
    _Alignas(LINE) _Atomic int sleepers;          /* workers asleep (or about to) on `generation` */
    uint32_t published;            /* the caller's own count of passes */
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

static inline uint64_t slot_word(uint32_t gen, int64_t next, int64_t end) {
    return ((uint64_t)gen << 32) | ((uint64_t)next << 16) | (uint64_t)end;
}

/* the next chunk of pass `gen` in slot s, or -1 when it has none left (or holds another pass) */
static int64_t claim_from(slot *s, uint32_t gen) {
    uint64_t cur = atomic_load(&s->word);
    for (;;) {
        int64_t next = (int64_t)((cur >> 16) & 0xffffu), end = (int64_t)(cur & 0xffffu);
        if ((uint32_t)(cur >> 32) != gen || next >= end) return -1;
        if (atomic_compare_exchange_weak(&s->word, &cur, slot_word(gen, next + 1, end))) return next;
    }
}

/* run chunks of pass `gen`, this thread's own range first, then what the others left; returns how many it ran */
static int64_t run_chunks(nat_pool *pool, uint32_t gen, nat_chunk_fn fn, void *ctx, int64_t first, int ith) {
    int64_t ran = 0;
    for (int k = 0; k < pool->n_threads; k++) {
        slot *s = &pool->slots[(ith + k) % pool->n_threads];
        for (int64_t c; (c = claim_from(s, gen)) >= 0; ran++) fn(ctx, first + c, ith);
    }
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
        int64_t n_chunks = atomic_load(&pool->n_chunks), first = atomic_load(&pool->first);
        /* A worker the OS held back may read these after the caller finished pass `seen` alone and began publishing
         * the next one, some fields of each. The caller closes every slot to the next pass before it writes any
         * field (publish), and every access here is sequentially consistent, so once a field read comes from a
         * later pass, claim_from sees a later generation and refuses: fn runs only with all of its own pass's
         * fields, and only for that pass's chunks. */
        int64_t ran = run_chunks(pool, seen, fn, ctx, first, arg.ith);
        if (ran && atomic_fetch_add(&pool->done, ran) + ran == n_chunks) {
            atomic_store(&pool->finished, seen);
            if (atomic_load(&pool->caller_waiting)) futex_wake(&pool->finished, 1);
        }
    }
}

nat_pool *nat_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    /* aligned like its members' cache lines (calloc promises only 16 bytes); sizeof is a multiple of LINE */
    nat_pool *pool = aligned_alloc(LINE, sizeof *pool);
    if (!pool) return NULL;
    memset(pool, 0, sizeof *pool);
    pool->n_threads = n_threads;
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    pool->slots = aligned_alloc(LINE, (size_t)n_threads * sizeof(slot));
    if (!pool->threads || !pool->slots) {
        free(pool->threads);
        free(pool->slots);
        free(pool);
        return NULL;
    }
    memset(pool->slots, 0, (size_t)n_threads * sizeof(slot));
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

/* Publish pass `gen`: chunks [first, first + n) of the job, split into equal ranges over the threads' slots. */
static void publish(nat_pool *pool, uint32_t gen, nat_chunk_fn fn, void *ctx, int64_t first, int64_t n) {
    int threads = pool->n_threads;
    /* closed first (nothing claimable, a later generation): a late worker of the last pass refuses from here on */
    for (int i = 0; i < threads; i++) atomic_store(&pool->slots[i].word, slot_word(gen, 0, 0));
    atomic_store(&pool->fn, fn);
    atomic_store(&pool->ctx, ctx);
    atomic_store(&pool->n_chunks, n);
    atomic_store(&pool->first, first);
    atomic_store(&pool->done, 0);
    for (int i = 0; i < threads; i++) {
        int64_t start, stop;
        nat_share(n, i, threads, &start, &stop);
        atomic_store(&pool->slots[i].word, slot_word(gen, start, stop));
    }
    atomic_store(&pool->generation, gen);
    if (atomic_load(&pool->sleepers) > 0) futex_wake(&pool->generation, INT_MAX);
}

/* one pass of at most PASS_CHUNKS chunks on the caller and the workers; returns when all ran */
static void run_pass(nat_pool *pool, nat_chunk_fn fn, void *ctx, int64_t first, int64_t n) {
    uint32_t gen = ++pool->published;
    if (gen == 0) gen = ++pool->published;   /* 0 is the workers' initial "seen" */
    publish(pool, gen, fn, ctx, first, n);
    int64_t ran = run_chunks(pool, gen, fn, ctx, first, 0);
    if (atomic_fetch_add(&pool->done, ran) + ran == n) return;
    /* workers still run chunks they claimed: spin briefly, then sleep until the last one says it finished */
    int64_t start = now_ns();
    for (int spins = 1; atomic_load(&pool->done) < n; spins++) {
        relax();
        if (spins % 64 == 0 && now_ns() - start > SPIN_NS) {
            atomic_store(&pool->caller_waiting, 1);
            for (uint32_t seen; (seen = atomic_load(&pool->finished)) != gen;) futex_wait(&pool->finished, seen);
            atomic_store(&pool->caller_waiting, 0);
            break;
        }
    }
}

void nat_pool_for(nat_pool *pool, int64_t n_chunks, nat_chunk_fn fn, void *ctx) {
    if (n_chunks <= 0) return;
    if (pool->n_threads == 1 || n_chunks == 1) {
        for (int64_t c = 0; c < n_chunks; c++) fn(ctx, c, 0);
        return;
    }
    for (int64_t first = 0; first < n_chunks; first += PASS_CHUNKS)
        run_pass(pool, fn, ctx, first, n_chunks - first < PASS_CHUNKS ? n_chunks - first : PASS_CHUNKS);
}

void nat_pool_free(nat_pool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->generation, 1);
    futex_wake(&pool->generation, INT_MAX);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    free(pool->threads);
    free(pool->slots);
    free(pool);
}
