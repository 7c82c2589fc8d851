/* The row-wise ops next to the matmuls: RMS norm and attention over the KV cache. Portable C (one path for every
 * CPU), each output row computed alone in a fixed order, so a row's bits never depend on the batch around it or
 * on the thread split (the work is split by whole rows / (row, head) pairs). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

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

/* q . k in native.h's canonical 16-lane order (independent lanes: the compiler may vectorise them) */
static float dot16(const float *q, const float *k, int64_t n) {
    float lanes[16] = {0};
    int64_t full = n & ~(int64_t)15;
    for (int64_t d = 0; d < full; d += 16)
        for (int l = 0; l < 16; l++) lanes[l] = lanes[l] + q[d + l] * k[d + l];
    for (int64_t d = full; d < n; d++) lanes[d - full] = lanes[d - full] + q[d] * k[d];
    return nat_reduce16(lanes);
}

static int hidden(float mask) { return isinf(mask) && mask < 0; }

/* one query row of one head: softmax(softcap(scale q . k_j) + mask_j) . v_j over the visible cells j, in cell
 * order; hidden cells (mask -inf) are skipped, which is what their zero probability does to the sums.
 * scratch: n_kv + dk floats */
static void attend_one(const attn_job *job, int64_t t, int64_t h, float *scratch) {
    int64_t kvh = h / (job->n_head / job->n_head_kv);
    const float *q = job->q + (t * job->n_head + h) * job->dk;
    const float *mask = job->mask + t * job->n_kv;
    float *out = job->out + (t * job->n_head + h) * job->dv, *qs = scratch, *scores = scratch + job->dk;
    for (int64_t d = 0; d < job->dk; d++) qs[d] = q[d] * job->scale;  /* the scale on q, as the oracle */
    float best = -INFINITY;
    int any = 0;
    for (int64_t j = 0; j < job->n_kv; j++) {
        if (hidden(mask[j])) continue;
        float s = dot16(qs, job->k + (kvh * job->n_cells + j) * job->dk, job->dk);
        if (job->softcap != 0.0f) s = tanhf(s / job->softcap) * job->softcap;
        s = s + mask[j];
        scores[j] = s;
        if (!any || s > best) best = s;
        any = 1;
    }
    for (int64_t d = 0; d < job->dv; d++) out[d] = any ? 0.0f : NAN;  /* no visible cell: 0/0 */
    if (!any) return;
    float total = 0.0f;
    for (int64_t j = 0; j < job->n_kv; j++) {
        if (hidden(mask[j])) continue;
        float p = expf(scores[j] - best);
        total = total + p;
        const float *v = job->v + (kvh * job->n_cells + j) * job->dv;
        for (int64_t d = 0; d < job->dv; d++) out[d] = out[d] + p * v[d];
    }
    for (int64_t d = 0; d < job->dv; d++) out[d] = out[d] / total;
}

typedef struct {
    attn_job *job;
    atomic_int failed;
} attn_ctx;

static void attn_task(void *raw, int ith, int nth) {
    attn_ctx *ctx = raw;
    attn_job *job = ctx->job;
    int64_t i0, i1;
    nat_share(job->n_tokens * job->n_head, ith, nth, &i0, &i1);
    if (i0 == i1) return;
    float *scratch = malloc((size_t)(job->n_kv + job->dk + 1) * sizeof(float));
    if (!scratch) { atomic_store(&ctx->failed, 1); return; }
    for (int64_t i = i0; i < i1; i++) attend_one(job, i / job->n_head, i % job->n_head, scratch);
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
