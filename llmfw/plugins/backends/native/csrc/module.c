/* The extension module llmfw.plugins.backends.native._native: a C library that Python drives through ctypes
 * (ctypes releases the GIL for every call). The module object itself exports nothing; importing it only proves
 * the build is there, and ctypes opens the same file for the functions below. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "pool.h"

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
#endif
    return isas;
}

int nat_abi_version(void) { return 1; }

/* the kernels of each ISA path, by enum nat_isa (a path not compiled in falls back to the scalar one) */
typedef struct { nat_qgemm_fn qgemm; nat_fgemm_fn fgemm; } isa_kernels;

static isa_kernels kernels_for(int isa) {
#ifdef NAT_HAVE_X86
    if (isa == NAT_ISA_AVX512) return (isa_kernels){nat_qgemm_avx512, nat_fgemm_avx512};
    if (isa == NAT_ISA_AVX2) return (isa_kernels){nat_qgemm_avx2, nat_fgemm_avx2};
#endif
    (void)isa;
    return (isa_kernels){nat_qgemm_scalar, nat_fgemm_scalar};
}

typedef struct {
    const nat_weight *w;
    const float *x;
    int64_t m;
    float *y;
    nat_qact act;
    nat_qgemm_fn qgemm;
    nat_fgemm_fn fgemm;
} mul_mat_job;

static void quantize_task(void *raw, int ith, int nth) {
    mul_mat_job *job = raw;
    int64_t m0, m1;
    nat_share(job->m, ith, nth, &m0, &m1);
    nat_quantize_rows(job->x, job->m, job->w->n_cols, &job->act, m0, m1);
}

static void qgemm_task(void *raw, int ith, int nth) {
    mul_mat_job *job = raw;
    int64_t g0, g1;
    nat_share((job->w->n_rows + NAT_ROWS - 1) / NAT_ROWS, ith, nth, &g0, &g1);
    job->qgemm(job->w, &job->act, job->m, job->y, g0, g1);
}

static void fgemm_task(void *raw, int ith, int nth) {
    mul_mat_job *job = raw;
    int64_t r0, r1;
    nat_share(job->w->n_rows, ith, nth, &r0, &r1);
    job->fgemm(job->w, job->x, job->m, job->y, r0, r1);
}

/* y[m, n_rows] = x[m, n_cols] @ w^T. Returns 0, or -1 when the activation buffers cannot be allocated, -2 for a
 * weight the kernels do not know (the Python side validated shapes and sizes before). */
int nat_mul_mat(nat_pool *pool, int isa, const nat_weight *w, const float *x, int64_t m, float *y) {
    isa_kernels paths = kernels_for(isa);
    mul_mat_job job = {w, x, m, y, {NULL, NULL, NULL}, paths.qgemm, paths.fgemm};
    if (w->kind == NAT_F32 || w->kind == NAT_F16 || w->kind == NAT_BF16) {
        nat_pool_run(pool, fgemm_task, &job);
        return 0;
    }
    if (w->kind != NAT_QNIB && w->kind != NAT_QBYTE) return -2;
    int64_t nb = w->n_cols / NAT_BLOCK;
    job.act.q = malloc((size_t)(m * w->n_cols));
    job.act.d = malloc((size_t)(m * nb) * sizeof(float));
    job.act.sums = malloc((size_t)(m * nb) * 2 * sizeof(int32_t));
    int status = -1;
    if (job.act.q && job.act.d && job.act.sums) {
        nat_pool_run(pool, quantize_task, &job);
        nat_pool_run(pool, qgemm_task, &job);
        status = 0;
    }
    free(job.act.q);
    free(job.act.d);
    free(job.act.sums);
    return status;
}

static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, .m_name = "_native",
                                           .m_doc = "llmfw native kernels (called through ctypes)", .m_size = -1};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
