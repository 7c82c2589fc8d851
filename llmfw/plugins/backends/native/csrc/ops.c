/* The row-wise ops next to the matmuls: RMS norm and attention over the KV cache. Portable C (one path for every
 * CPU), each output row computed alone in a fixed order, so a row's bits never depend on the batch around it or
 * on the thread split (the work is split by whole rows / (row, head) pairs). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "pool.h"

typedef struct {
    const float *x, *w;
    float *out;
    int64_t rows, n;
    float eps;
} rms_job;

static void normalise_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    double sum = 0.0;  /* the sum of squares in double, like ggml */
    for (int64_t j = 0; j < n; j++) sum += (double)x[j] * (double)x[j];
    float scale = (float)(1.0 / sqrt(sum / (double)n + (double)eps));
    for (int64_t j = 0; j < n; j++) {
        float v = x[j] * scale;
        out[j] = w ? v * w[j] : v;
    }
}

static void rms_task(void *raw, int ith, int nth) {
    rms_job *job = raw;
    int64_t r0, r1;
    nat_share(job->rows, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) normalise_row(job->x + r * job->n, job->w, job->out + r * job->n, job->n, job->eps);
}

/* out[rows, n] = x / sqrt(mean(x^2) + eps) (* w[n] when w is not NULL) */
void nat_rms_norm(nat_pool *pool, const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    rms_job job = {x, w, out, rows, n, eps};
    nat_pool_run(pool, rms_task, &job);
}

typedef struct {
    const float *q, *k, *v, *mask;
    float *out;
    int64_t n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells;
    float scale, softcap;
} attn_job;

/* four lanes of native.h's canonical sixteen (GCC/clang vector extension: SSE on x86-64, NEON on aarch64) */
typedef float lanes4 __attribute__((vector_size(16)));

static inline lanes4 load4(const float *p) {
    lanes4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* q . k in the canonical 16-lane order: element d into lane d % 16, then the fixed reduction */
static float dot16(const float *q, const float *k, int64_t n) {
    lanes4 acc[4] = {{0}};
    int64_t full = n & ~(int64_t)15;
    for (int64_t d = 0; d < full; d += 16)
        for (int part = 0; part < 4; part++) acc[part] = acc[part] + load4(q + d + 4 * part) * load4(k + d + 4 * part);
    float lanes[16];
    memcpy(lanes, acc, sizeof lanes);
    for (int64_t d = full; d < n; d++) lanes[d - full] = lanes[d - full] + q[d] * k[d];
    return nat_reduce16(lanes);
}

static int hidden(float mask) { return isinf(mask) && mask < 0; }

/* query rows per attention work item: each K and V row read serves TILE_T rows x the heads of its group */
#define TILE_T 4

/* Rows t0.. (up to TILE_T) of every query head h of KV head kvh: for each (t, h) alone,
 * softmax(softcap(scale q . k_j) + mask_j) . v_j over the visible cells j in cell order; hidden cells (mask -inf)
 * are skipped, which is what their zero probability does to the sums. The tile only shares the loads: a row's
 * operations are the same whatever tile (or thread) it is in. scratch: TILE_T * group * (dk + n_kv + 2) floats */
static void attend_tile(const attn_job *job, int64_t t0, int64_t kvh, float *scratch) {
    int64_t group = job->n_head / job->n_head_kv, rows = job->n_tokens - t0 < TILE_T ? job->n_tokens - t0 : TILE_T;
    int64_t n = rows * group, dk = job->dk, dv = job->dv;
    float *qs = scratch, *scores = qs + n * dk, *best = scores + n * job->n_kv, *total = best + n;
    for (int64_t i = 0; i < n; i++) {  /* i = row * group + head in group; the scale on q, as the oracle */
        const float *q = job->q + ((t0 + i / group) * job->n_head + kvh * group + i % group) * dk;
        for (int64_t d = 0; d < dk; d++) qs[i * dk + d] = q[d] * job->scale;
        best[i] = -INFINITY;
        total[i] = 0.0f;
    }
    int seen[TILE_T] = {0};
    for (int64_t j = 0; j < job->n_kv; j++) {
        const float *k = job->k + (kvh * job->n_cells + j) * dk;
        for (int64_t r = 0; r < rows; r++) {
            float mask = job->mask[(t0 + r) * job->n_kv + j];
            if (hidden(mask)) continue;
            for (int64_t g = 0; g < group; g++) {
                int64_t i = r * group + g;
                float s = dot16(qs + i * dk, k, dk);
                if (job->softcap != 0.0f) s = tanhf(s / job->softcap) * job->softcap;
                s = s + mask;
                scores[i * job->n_kv + j] = s;
                if (!seen[r] || s > best[i]) best[i] = s;
            }
            seen[r] = 1;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float *out = job->out + ((t0 + i / group) * job->n_head + kvh * group + i % group) * dv;
        for (int64_t d = 0; d < dv; d++) out[d] = seen[i / group] ? 0.0f : NAN;  /* no visible cell: 0/0 */
    }
    for (int64_t j = 0; j < job->n_kv; j++) {
        const float *v = job->v + (kvh * job->n_cells + j) * dv;
        for (int64_t r = 0; r < rows; r++) {
            if (hidden(job->mask[(t0 + r) * job->n_kv + j])) continue;
            for (int64_t g = 0; g < group; g++) {
                int64_t i = r * group + g;
                float *out = job->out + ((t0 + r) * job->n_head + kvh * group + g) * dv;
                float p = expf(scores[i * job->n_kv + j] - best[i]);
                total[i] = total[i] + p;
                for (int64_t d = 0; d < dv; d++) out[d] = out[d] + p * v[d];
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        if (!seen[i / group]) continue;
        float *out = job->out + ((t0 + i / group) * job->n_head + kvh * group + i % group) * dv;
        for (int64_t d = 0; d < dv; d++) out[d] = out[d] / total[i];
    }
}

typedef struct {
    attn_job *job;
    atomic_int failed;
} attn_ctx;

static void attn_task(void *raw, int ith, int nth) {
    attn_ctx *ctx = raw;
    attn_job *job = ctx->job;
    int64_t tiles = (job->n_tokens + TILE_T - 1) / TILE_T, i0, i1;
    nat_share(tiles * job->n_head_kv, ith, nth, &i0, &i1);
    if (i0 == i1) return;
    int64_t group = job->n_head / job->n_head_kv;
    float *scratch = malloc((size_t)(TILE_T * group * (job->dk + job->n_kv + 2)) * sizeof(float));
    if (!scratch) { atomic_store(&ctx->failed, 1); return; }
    for (int64_t i = i0; i < i1; i++) attend_tile(job, (i / job->n_head_kv) * TILE_T, i % job->n_head_kv, scratch);
    free(scratch);
}

/* q [T, H, Dk], k cache [Hkv, n_cells, Dk], v cache [Hkv, n_cells, Dv], mask [T, n_kv] -> out [T, H * Dv].
 * Returns 0, or -1 when a thread's score buffer cannot be allocated. */
int nat_attention(nat_pool *pool, const float *q, const float *k, const float *v, const float *mask, float *out,
                  int64_t n_tokens, int64_t n_head, int64_t n_head_kv, int64_t dk, int64_t dv, int64_t n_kv,
                  int64_t n_cells, float scale, float softcap) {
    attn_job job = {q, k, v, mask, out, n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells, scale, softcap};
    attn_ctx ctx = {&job, 0};
    nat_pool_run(pool, attn_task, &ctx);
    return atomic_load(&ctx.failed) ? -1 : 0;
}
