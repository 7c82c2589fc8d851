/* A persistent pool of worker threads: nat_pool_run(pool, fn, ctx) calls fn(ctx, ith, nth) on every thread (the
 * caller is thread 0) and returns when all finished. Workers spin a while for the next job, then sleep on a
 * condition variable, so back-to-back ops of one token do not pay a wake-up each. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"

#define SPIN_ROUNDS 4000
#define YIELD_EVERY 64  /* an oversubscribed CPU: let the thread we wait for run */

struct nat_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    pthread_cond_t done;
    atomic_uint generation;   /* bumped per job */
    atomic_int pending;       /* workers still running the current job */
    atomic_int stop;
    nat_task fn;
    void *ctx;
};

typedef struct { nat_pool *pool; int ith; } worker_arg;

static void *worker_main(void *raw) {
    worker_arg arg = *(worker_arg *)raw;
    free(raw);
    nat_pool *pool = arg.pool;
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop)) {
            if (++spins < SPIN_ROUNDS) {
                if (spins % YIELD_EVERY == 0) sched_yield();
                continue;
            }
            pthread_mutex_lock(&pool->mutex);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = atomic_load(&pool->generation);
        pool->fn(pool->ctx, arg.ith, pool->n_threads);
        if (atomic_fetch_sub(&pool->pending, 1) == 1) {  /* the last one: wake the caller if it sleeps */
            pthread_mutex_lock(&pool->mutex);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mutex);
        }
    }
}

nat_pool *nat_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    nat_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) { free(pool); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (!arg || pthread_create(&pool->threads[i], NULL, worker_main, arg ? (arg->pool = pool, arg->ith = i, arg)
                                                                              : NULL) != 0) {
            free(arg);
            pool->n_threads = i;   /* run with the threads that started */
            break;
        }
    }
    return pool;
}

int nat_pool_threads(const nat_pool *pool) { return pool->n_threads; }

void nat_pool_run(nat_pool *pool, nat_task fn, void *ctx) {
    if (pool->n_threads == 1) { fn(ctx, 0, 1); return; }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store(&pool->pending, pool->n_threads - 1);
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add(&pool->generation, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    fn(ctx, 0, pool->n_threads);
    for (int spins = 1; atomic_load(&pool->pending) > 0 && spins < SPIN_ROUNDS; spins++)
        if (spins % YIELD_EVERY == 0) sched_yield();
    pthread_mutex_lock(&pool->mutex);
    while (atomic_load(&pool->pending) > 0) pthread_cond_wait(&pool->done, &pool->mutex);
    pthread_mutex_unlock(&pool->mutex);
}

void nat_pool_free(nat_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool);
}
