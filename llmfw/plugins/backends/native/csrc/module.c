/* The extension module llmfw.plugins.backends.native._native: a C library that Python drives through ctypes
 * (ctypes releases the GIL for every call). The module object itself exports nothing; importing it only proves
 * the build is there, and ctypes opens the same file for the functions below. */
#define PY_SSIZE_T_CLEAN
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE  /* syscall (the AMX probe) */
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "native.h"
#include "pool.h"

#ifdef NAT_HAVE_AMX
#include <cpuid.h>
#include <errno.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* one tile instruction of each kind the AMX path uses, checked: 0 when they ran and gave the right dot product */
__attribute__((target("amx-tile,amx-int8"))) static int amx_self_test(void) {
    uint8_t cfg[64] = {1};  /* palette 1; tiles 0-2: one row of 4 bytes */
    for (int t = 0; t < 3; t++) {
        cfg[16 + 2 * t] = 4;
        cfg[48 + t] = 1;
    }
    int8_t a[4] = {-3, 1, 2, -1};
    uint8_t b[4] = {200, 1, 7, 255};
    int32_t c = 0;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"(a), "r"((int64_t)4) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(b), "r"((int64_t)4) : "memory");
    __asm__ volatile("tilezero %%tmm0" ::: "memory");
    __asm__ volatile("tdpbsud %%tmm2, %%tmm1, %%tmm0" ::: "memory");
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(&c), "r"((int64_t)4) : "memory");
    __asm__ volatile("tilerelease" ::: "memory");
    return c == -3 * 200 + 1 + 14 - 255 ? 0 : 1;
}

/* Whether this process can run the AMX path: the CPU reports AMX-TILE and AMX-INT8, the kernel grants the tile
 * state, and a child process runs the instructions (a hypervisor can report the feature and still fault on its
 * first tile instruction; the child takes that fault, not this process). */
static int amx_runs(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return 0;
    if (syscall(SYS_arch_prctl, NAT_ARCH_REQ_XCOMP_PERM, NAT_XFEATURE_XTILEDATA) != 0) return 0;
    pid_t child = fork();
    if (child < 0) return 0;
    if (child == 0) _exit(amx_self_test());
    int status = 0;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
#endif

/* bit i set: ISA path i (enum nat_isa) is compiled in AND this CPU (and its OS) can run it */
int nat_cpu_isas(void) {
    int isas = 1 << NAT_ISA_SCALAR;
#ifdef NAT_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        isas |= 1 << NAT_ISA_AVX2;
    if ((isas & (1 << NAT_ISA_AVX2)) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        isas |= 1 << NAT_ISA_AVX512;
#ifdef NAT_HAVE_AMX
    if ((isas & (1 << NAT_ISA_AVX512)) && amx_runs()) isas |= 1 << NAT_ISA_AMX;
#endif
#endif
    return isas;
}

int nat_abi_version(void) { return 16; }

/* sizeof(nat_instr): runtime.py checks its record type against it */
int64_t nat_instr_bytes(void) { return (int64_t)sizeof(nat_instr); }

/* the kernels of each ISA path, by enum nat_isa (a path not compiled in falls back to the scalar one) */
nat_kernels nat_kernels_for(int isa) {
#ifdef NAT_HAVE_X86
#ifdef NAT_HAVE_AMX
    if (isa == NAT_ISA_AMX)
        return (nat_kernels){nat_qgemm_amx, nat_fgemm_avx512, nat_quantize_rows_avx512, nat_f32_to_f16_row_f16c,
                             nat_f16_to_f32_row_f16c, nat_tiled_from_amx};
#endif
    if (isa == NAT_ISA_AVX512)
        return (nat_kernels){nat_qgemm_avx512, nat_fgemm_avx512, nat_quantize_rows_avx512, nat_f32_to_f16_row_f16c,
                             nat_f16_to_f32_row_f16c, nat_tiled_from_avx512};
    if (isa == NAT_ISA_AVX2)
        return (nat_kernels){nat_qgemm_avx2, nat_fgemm_avx2, nat_quantize_rows_avx2, nat_f32_to_f16_row_f16c,
                             nat_f16_to_f32_row_f16c, NULL};
#endif
    (void)isa;
    return (nat_kernels){nat_qgemm_scalar, nat_fgemm_scalar, nat_quantize_rows, nat_f32_to_f16_row, nat_f16_to_f32_row,
                         NULL};
}

typedef struct {
    const nat_weight *w;
    const float *x;
    int64_t m;
    float *y;
    const float *residual;  /* added to y's rows (or NULL): y = x @ w^T + residual */
    nat_qact act;
    nat_kernels paths;
    int64_t n_chunks;
} mul_mat_job;

/* a chunk's rows quantized, whole tiles of them, and the tiles the kernel reads written from them */
static void quantize_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    mul_mat_job *job = raw;
    int64_t t0, t1, n_cols = job->w->n_cols;
    nat_share((job->m + NAT_TILE_ROWS - 1) / NAT_TILE_ROWS, chunk, job->n_chunks, &t0, &t1);
    int64_t m1 = t1 * NAT_TILE_ROWS < job->m ? t1 * NAT_TILE_ROWS : job->m;
    job->paths.quantize(job->x, n_cols, &job->act, t0 * NAT_TILE_ROWS, m1);
    nat_act_tile_rows(&job->act, n_cols, t0, m1 / NAT_TILE_ROWS);
}

/* the residual's columns [r0, r1) of every row added to y's, by the thread that just wrote them (an add of its own
 * would read them again, after the next weights pushed them out of the cache); the add of the graph's own op, so
 * its bits */
static void add_residual(const mul_mat_job *job, int64_t r0, int64_t r1) {
    if (!job->residual) return;
    int64_t n = job->w->n_rows;
    for (int64_t i = 0; i < job->m; i++) {  /* row pointers of their own: the stores then cannot touch the job */
        float *restrict y = job->y + i * n;
        const float *restrict residual = job->residual + i * n;
        for (int64_t r = r0; r < r1; r++) y[r] = y[r] + residual[r];
    }
}

static void qgemm_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    mul_mat_job *job = raw;
    int64_t n_groups = (job->w->n_rows + NAT_ROWS - 1) / NAT_ROWS, p0, p1;
    nat_share((n_groups + 1) / 2, chunk, job->n_chunks, &p0, &p1);  /* whole pairs: the AVX-512 path takes two */
    int64_t g1 = 2 * p1 < n_groups ? 2 * p1 : n_groups;
    job->paths.qgemm(job->w, &job->act, job->m, job->y, 2 * p0, g1);
    add_residual(job, 2 * p0 * NAT_ROWS, g1 * NAT_ROWS < job->w->n_rows ? g1 * NAT_ROWS : job->w->n_rows);
}

static void fgemm_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    mul_mat_job *job = raw;
    int64_t r0, r1;
    nat_share(job->w->n_rows, chunk, job->n_chunks, &r0, &r1);
    job->paths.fgemm(job->w, job->x, job->m, job->y, r0, r1);
    add_residual(job, r0, r1);
}

size_t nat_act_words(int64_t m, int64_t n_cols, void *scratch, nat_qact *act) {
    return nat_act_layout(m, n_cols, scratch, act);
}

/* y[m, n_rows] = x[m, n_cols] @ w^T [+ residual[m, n_rows]] with the activation buffers in scratch (nat_act_words
 * words; unused for float weights). Returns 0, or NAT_BAD_INSTRUCTION for a weight the kernels do not know. */
int nat_mul_mat_into(nat_pool *pool, int isa, const nat_weight *w, const float *x, int64_t m, float *y,
                     const float *residual, void *scratch) {
    mul_mat_job job = {w, x, m, y, residual, {NULL, NULL, NULL, NULL, NULL, 0}, nat_kernels_for(isa), 1};
    if (w->kind == NAT_F32 || w->kind == NAT_F16 || w->kind == NAT_BF16) {
        job.n_chunks = nat_pool_chunks(pool, w->n_rows);
        nat_pool_for(pool, job.n_chunks, fgemm_chunk, &job);
        return 0;
    }
    if (!nat_is_quantized(w)) return NAT_BAD_INSTRUCTION;
    nat_act_words(m, w->n_cols, scratch, &job.act);
    nat_act_place_tiles(&job.act, m, w->n_cols, scratch, job.paths.tiled_from ? job.paths.tiled_from(m) : m);
    job.n_chunks = m * w->n_cols < 65536 ? 1 : nat_pool_chunks(pool, m);
    nat_pool_for(pool, job.n_chunks, quantize_chunk, &job);
    job.n_chunks = nat_pool_chunks(pool, ((w->n_rows + NAT_ROWS - 1) / NAT_ROWS + 1) / 2);
    nat_pool_for(pool, job.n_chunks, qgemm_chunk, &job);
    return 0;
}

/* y[m, n_rows] = x[m, n_cols] @ w^T (the kernel tests' entry point). Returns 0, or -1 when the activation buffers
 * cannot be allocated, -2 for a weight the kernels do not know (the Python side validated shapes and sizes). */
int nat_mul_mat(nat_pool *pool, int isa, const nat_weight *w, const float *x, int64_t m, float *y) {
    void *scratch = malloc(nat_act_words(m, w->n_cols, NULL, NULL) * 4 + 4);
    if (!scratch) return NAT_OUT_OF_MEMORY;
    int status = nat_mul_mat_into(pool, isa, w, x, m, y, NULL, scratch);
    free(scratch);
    return status;
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Run a program checked by runtime.py: its n instructions in order, on the pool. Called through ctypes, which
 * releases the GIL for the whole run. times (or NULL): per instruction, the seconds it took are added (profile).
 * Returns 0, or an enum nat_status with the failing instruction's index in *failed_at. */
int nat_program_run(nat_pool *pool, int isa, const nat_instr *prog, int64_t n, void *const *bufs,
                    const nat_weight *weights, double *times, int64_t *failed_at) {
    for (int64_t i = 0; i < n; i++) {
        const nat_instr *in = &prog[i];
        double start = times ? seconds_now() : 0.0;
        int status;
        if (in->op == NAT_OP_MUL_MAT)
            status = nat_mul_mat_into(pool, isa, &weights[in->n[0]], (const float *)((char *)bufs[in->buf[1]] + 4 * in->off[1]),
                                      in->n[1], (float *)((char *)bufs[in->buf[0]] + 4 * in->off[0]),
                                      in->buf[3] >= 0 ? (const float *)((char *)bufs[in->buf[3]] + 4 * in->off[3]) : NULL,
                                      in->buf[2] >= 0 ? (char *)bufs[in->buf[2]] + 4 * in->off[2] : NULL);
        else if (in->op >= NAT_OP_SSM_CONV && in->op <= NAT_OP_GATED_DELTA)
            status = nat_run_recurrent(pool, in, bufs);
        else if (in->op >= NAT_OP_MUL_MAT_ID && in->op <= NAT_OP_CONCAT) {
            nat_kernels paths = nat_kernels_for(isa);
            status = nat_run_moe_op(pool, &paths, in, bufs, weights);
        }
        else
            status = nat_run_op(pool, isa, in, bufs, weights);
        if (times) times[i] += seconds_now() - start;
        if (status != 0) {
            *failed_at = i;
            return status;
        }
    }
    return 0;
}

static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, .m_name = "_native",
                                           .m_doc = "llmfw native kernels (called through ctypes)", .m_size = -1};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
