/* The timing loop of benchmarks/native_tile.py: one ISA path's quantized matmul kernel (nat_qgemm_<isa>) on one
 * thread or several, with no Python, pool or activation quantization around it (several threads split each call's
 * group pairs into equal shares and meet after each call, as the engine's pool does). Reads the weight the driver repacked (a
 * header of its nat_weight fields, then its bytes), lays out `copies` of it one after another (1: it stays in L2; a
 * few MB: L3; far more: each call streams from memory) and prints the best time a call and cycles per 16x32 tile.
 * "huge" pages lay the copies out at a 2 MiB boundary and advise them to take huge pages (MADV_HUGEPAGE), as the
 * engine's repacked-weight cache maps its blob; "small" leaves them in whatever pages the allocator gives. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE  /* syscall: the AMX path asks for the tile state */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "native.h"
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* the core's clock, from a chain of dependent 64-bit multiplies (3 cycles each on every x86-64 core of the last
 * fifteen years: Intel's since Nehalem, AMD's since Zen). A chain of adds of a constant does not time it: newer
 * Intel cores fold such adds as they rename them (on the Xeon kind the add chain read 16 GHz). */
static double clock_ghz(void) {
    long n = 150000000, x = 3;
    double start = seconds();
    for (long i = 0; i < n; i += 4)
        __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
    return 3.0 * (double)n / (seconds() - start) / 1e9;
}

static int read_weight(const char *path, nat_weight *w, uint8_t **data, size_t *nbytes) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    int32_t head[6];
    int64_t shape[2];
    int ok = fread(head, 4, 4, f) == 4 && fread(shape, 8, 2, f) == 2 && fread(w->table, 1, 16, f) == 16 &&
             fread(&head[4], 4, 2, f) == 2 && fread(nbytes, 8, 1, f) == 1;
    *data = ok ? malloc(*nbytes) : NULL;
    ok = ok && *data && fread(*data, 1, *nbytes, f) == *nbytes;
    fclose(f);
    w->kind = head[0], w->n_scales = head[1], w->has_offsets = head[2], w->half_params = head[3];
    w->n_rows = shape[0], w->n_cols = shape[1], w->factored = head[4], w->paired = head[5];
    return ok ? 0 : -1;
}

/* what each thread of a timed loop runs: once `go` turns 1 (-1: stop before starting), `calls` calls over its
 * share of the group pairs, cycling through the copies, each followed by the barrier (all threads arrive) */
typedef struct {
    nat_qgemm_fn qgemm;
    const nat_weight *w;
    const uint8_t *data;
    size_t stride;
    int copies, calls, threads, id;
    const nat_qact *act;
    int64_t m;
    float *y;
    atomic_long *arrived;
    atomic_int *go;
} timed_loop;

static void *run_calls(void *raw) {
    const timed_loop *t = raw;
    int go;
    while ((go = atomic_load(t->go)) == 0) continue;
    if (go < 0) return NULL;
    int64_t groups = (t->w->n_rows + NAT_ROWS - 1) / NAT_ROWS, pairs = (groups + 1) / 2;
    int64_t g0 = 2 * (pairs * t->id / t->threads), g1 = 2 * (pairs * (t->id + 1) / t->threads);
    g1 = g1 < groups ? g1 : groups;
    for (int call = 0; call < t->calls; call++) {
        nat_weight copy = *t->w;
        copy.data = t->data + (size_t)(call % t->copies) * t->stride;
        t->qgemm(&copy, t->act, t->m, t->y, g0, g1);
        atomic_fetch_add(t->arrived, 1);
        while (atomic_load(t->arrived) < (long)(call + 1) * t->threads) continue;
    }
    return NULL;
}

/* seconds a call of the loop takes on `threads` threads (the caller is the first), or -1 when a thread could not
 * be started (those that were stop without running) */
static double time_calls(const timed_loop *base, int threads) {
    atomic_long arrived = 0;
    atomic_int go = 0;
    timed_loop loops[64];
    pthread_t ids[64];
    int started = 1;
    for (int i = 0; i < threads; i++) {
        loops[i] = *base;
        loops[i].id = i, loops[i].threads = threads, loops[i].arrived = &arrived, loops[i].go = &go;
    }
    while (started < threads && pthread_create(&ids[started], NULL, run_calls, &loops[started]) == 0) started++;
    atomic_store(&go, started == threads ? 1 : -1);
    double start = seconds();
    if (started == threads) run_calls(&loops[0]);
    for (int i = 1; i < started; i++) pthread_join(ids[i], NULL);
    return started == threads ? (seconds() - start) / base->calls : -1.0;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s WEIGHT_FILE COPIES CALLS amx|avx512|avx2 THREADS huge|small M...\n", argv[0]);
        return 2;
    }
    nat_weight w;
    uint8_t *one;
    size_t nbytes;
    if (read_weight(argv[1], &w, &one, &nbytes)) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 1;
    }
    int copies = atoi(argv[2]), calls = atoi(argv[3]), avx2 = strcmp(argv[4], "avx2") == 0, threads = atoi(argv[5]);
    nat_qgemm_fn qgemm = avx2 ? nat_qgemm_avx2 : nat_qgemm_avx512;
    int64_t (*tiled_from)(int64_t) = avx2 ? NULL : nat_tiled_from_avx512;  /* the rows whose tiles it reads */
#ifdef NAT_HAVE_AMX
    if (strcmp(argv[4], "amx") == 0) {  /* the tile state, as module.c's check asks for it (native_tile.py checked it runs) */
        if (syscall(SYS_arch_prctl, NAT_ARCH_REQ_XCOMP_PERM, NAT_XFEATURE_XTILEDATA) != 0) {
            fprintf(stderr, "the kernel does not grant the AMX tile state\n");
            return 1;
        }
        qgemm = nat_qgemm_amx;
        tiled_from = nat_tiled_from_amx;
    }
#endif
    nat_quantize_fn quantize = avx2 ? nat_quantize_rows_avx2 : nat_quantize_rows_avx512;
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "threads %d: from 1 to 64\n", threads);
        return 1;
    }
    double ghz = clock_ghz();
    printf("clock %.2f GHz\n", ghz);
    if (copies < 1 || calls < 1) {
        fprintf(stderr, "bad counts: %d copies, %d calls\n", copies, calls);
        return 1;
    }
    int huge_pages = strcmp(argv[6], "huge") == 0;
    size_t stride = (nbytes + 63) / 64 * 64, align = huge_pages ? (size_t)2 << 20 : 64;
    size_t total = (stride * (size_t)copies + align - 1) / align * align;  /* aligned_alloc: a multiple of align */
    uint8_t *data = aligned_alloc(align, total);
    if (!data) {
        fprintf(stderr, "no memory for %d copies\n", copies);
        return 1;
    }
    if (huge_pages && madvise(data, total, MADV_HUGEPAGE) != 0) {  /* before the first touch: the pages come huge */
        fprintf(stderr, "the kernel refused huge pages for the copies\n");
        return 1;
    }
    for (int c = 0; c < copies; c++) memcpy(data + (size_t)c * stride, one, nbytes);
    int64_t groups = (w.n_rows + NAT_ROWS - 1) / NAT_ROWS;
    double tiles = (double)groups / 2 * (double)(w.n_cols / NAT_BLOCK);
    for (int arg = 7; arg < argc; arg++) {
        int64_t m = atoi(argv[arg]);
        float *x = malloc(sizeof(float) * (size_t)(m * w.n_cols)), *y = malloc(sizeof(float) * (size_t)(m * w.n_rows));
        void *scratch = malloc(nat_act_layout(m, w.n_cols, NULL, NULL) * 4 + 4);
        if (m < 1 || !x || !y || !scratch) {
            fprintf(stderr, "bad row count, or no memory for %lld rows\n", (long long)m);
            return 1;
        }
        for (int64_t i = 0; i < m * w.n_cols; i++) x[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
        nat_qact act;
        nat_act_layout(m, w.n_cols, scratch, &act);
        quantize(x, w.n_cols, &act, 0, m);
        if (tiled_from) nat_act_place_tiles(&act, m, w.n_cols, scratch, tiled_from(m));  /* as module.c's matmul */
        nat_act_tile_rows(&act, w.n_cols, 0, m / NAT_TILE_ROWS);
        double best = 1e30;
        timed_loop loop = {qgemm, &w, data, stride, copies, calls, threads, 0, &act, m, y, NULL, NULL};
        for (int round = 0; round < 5; round++) {
            double each = time_calls(&loop, threads);
            if (each < 0) {
                fprintf(stderr, "cannot start %d threads\n", threads);
                return 1;
            }
            best = each < best ? each : best;
        }
        printf("%lld %.3f %.2f\n", (long long)m, best * 1e6, best * ghz * 1e9 / tiles);
        free(x), free(y), free(scratch);
    }
    return 0;
}
