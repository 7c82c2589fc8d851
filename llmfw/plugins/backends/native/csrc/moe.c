/* The mixture-of-experts ops (module.c dispatches them here): the expert matmul mul_mat_id and its per-expert bias
 * add_id, the routing ops (top_k, take, sum_rows, id_mask), gpt-oss's clamped SwiGLU and concat (DeepSeek's MLA).
 *
 * mul_mat_id computes only what the routing chose: the (token, slot) pairs are grouped by expert (a counting sort,
 * stable), each activation row is quantized once (a token's row serves its K slots), and every chosen expert runs
 * the ISA's own matmul kernel over the rows that chose it; the work is split over the pool by (expert, row group).
 * A row's result is the matmul kernel's canonical arithmetic on that row alone (native.h): the same bits whatever
 * else is in the batch, whichever thread ran it, on every ISA path. Expert ids are data: checked here, as they run.
 */
#include <math.h>
#include <string.h>

#include "native.h"
#include "pool.h"

#define OPERAND(bufs, in, i) ((char *)(bufs)[(in)->buf[i]] + 4 * (in)->off[i])
#define FLOATS(bufs, in, i) ((float *)OPERAND(bufs, in, i))

/* an op below this many elements runs on the calling thread alone */
#define SERIAL_ELEMENTS 32768

/* id i of an array of 4- or 8-byte ids */
static int64_t expert_id(const void *ids, int64_t i, int64_t id_bytes) {
    return id_bytes == 8 ? ((const int64_t *)ids)[i] : (int64_t)((const int32_t *)ids)[i];
}

/* whether every one of count ids is in [0, limit) */
static int all_below(const void *ids, int64_t count, int64_t id_bytes, int64_t limit) {
    for (int64_t i = 0; i < count; i++) {
        int64_t id = expert_id(ids, i, id_bytes);
        if (id < 0 || id >= limit) return 0;
    }
    return 1;
}

/* the activation buffers of m rows of k columns at base (native.h's nat_act_words) */
static nat_qact act_at(void *base, int64_t m, int64_t k) {
    nat_qact a;
    nat_act_words(m, k, base, &a);
    return a;
}

static int64_t act_size(int64_t m, int64_t k) { return (int64_t)nat_act_words(m, k, NULL, NULL); }

static int is_float_kind(const nat_weight *w) { return w->kind == NAT_F32 || w->kind == NAT_F16 || w->kind == NAT_BF16; }

/* ---- mul_mat_id ------------------------------------------------------------------------------------------------ */

typedef struct {
    const nat_weight *w;       /* the E experts */
    nat_kernels paths;
    const float *x;            /* [R][k]: a row per token (per_slot 0) or per (token, slot) (per_slot 1) */
    int64_t per_slot, n_used, k, n, n_slots;
    int64_t *starts;           /* [E + 1]: the sorted positions of each expert's slots */
    int64_t *active;           /* the experts some slot chose, ascending */
    int64_t n_active;
    int64_t *order;            /* [S]: slot (token * n_used + j) at each sorted position */
    nat_qact act, gathered;    /* quantized kinds: the R rows once; their copies in sorted order */
    float *xg;                 /* float kinds: the x rows in sorted order */
    float *ys;                 /* [S][n]: results in sorted order */
    float *out;                /* [S][n] */
    int64_t units, n_chunks;   /* row groups (or rows, float kinds) per expert; chunks of the current step */
} moe_job;

static int64_t source_row(const moe_job *job, int64_t slot) { return job->per_slot ? slot : slot / job->n_used; }

static void quantize_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    moe_job *job = raw;
    int64_t rows = job->per_slot ? job->n_slots : job->n_slots / job->n_used, r0, r1;
    nat_share(rows, chunk, job->n_chunks, &r0, &r1);
    job->paths.quantize(job->x, job->k, &job->act, r0, r1);
}

static void gather_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    moe_job *job = raw;
    int64_t k = job->k, nb = k / NAT_BLOCK, p0, p1;
    nat_share(job->n_slots, chunk, job->n_chunks, &p0, &p1);
    for (int64_t p = p0; p < p1; p++) {
        int64_t r = source_row(job, job->order[p]);
        if (job->xg) {
            memcpy(job->xg + p * k, job->x + r * k, (size_t)k * sizeof(float));
            continue;
        }
        nat_qact from = nat_qact_from(&job->act, r, k), to = nat_qact_from(&job->gathered, p, k);
        memcpy(to.q, from.q, (size_t)k);
        memcpy(to.d, from.d, (size_t)nb * sizeof(float));
        memcpy(to.sums, from.sums, (size_t)nb * 2 * sizeof(int32_t));
        memcpy(to.asum, from.asum, (size_t)nb * sizeof(float));
    }
}

/* units [u0, u1) of active expert a: its row groups (quantized) or rows (float) for every slot that chose it */
static void expert_units(const moe_job *job, int64_t a, int64_t u0, int64_t u1) {
    int64_t e = job->active[a], start = job->starts[e], m = job->starts[e + 1] - start;
    float *y = job->ys + start * job->n;
    if (job->xg) {
        job->paths.fgemm(&job->w[e], job->xg + start * job->k, m, y, u0, u1);
        return;
    }
    nat_qact rows = nat_qact_from(&job->gathered, start, job->k);
    job->paths.qgemm(&job->w[e], &rows, m, y, u0, u1);
}

static void gemm_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    moe_job *job = raw;
    int64_t i0, i1;
    nat_share(job->n_active * job->units, chunk, job->n_chunks, &i0, &i1);
    while (i0 < i1) {  /* the chunk's units, one expert's contiguous run at a time */
        int64_t a = i0 / job->units, u0 = i0 % job->units;
        int64_t u1 = u0 + (i1 - i0) < job->units ? u0 + (i1 - i0) : job->units;
        expert_units(job, a, u0, u1);
        i0 += u1 - u0;
    }
}

static void scatter_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    moe_job *job = raw;
    int64_t p0, p1;
    nat_share(job->n_slots, chunk, job->n_chunks, &p0, &p1);
    for (int64_t p = p0; p < p1; p++)
        memcpy(job->out + job->order[p] * job->n, job->ys + p * job->n, (size_t)job->n * sizeof(float));
}

/* order the slots by expert (stable: a slot's rank among its expert's slots is its index order) */
static void sort_by_expert(moe_job *job, const void *ids, int64_t id_bytes, int64_t n_expert) {
    int64_t *starts = job->starts;
    memset(starts, 0, (size_t)(n_expert + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < job->n_slots; s++) starts[expert_id(ids, s, id_bytes) + 1]++;
    job->n_active = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        if (starts[e + 1]) job->active[job->n_active++] = e;
        starts[e + 1] += starts[e];
    }
    for (int64_t s = 0; s < job->n_slots; s++) job->order[starts[expert_id(ids, s, id_bytes)]++] = s;
    for (int64_t e = n_expert; e > 0; e--) starts[e] = starts[e - 1];  /* the cursors ran to each next start */
    starts[0] = 0;
}

static void run_step(nat_pool *pool, moe_job *job, int64_t items, int64_t per_item, nat_chunk_fn fn) {
    job->n_chunks = items * per_item < SERIAL_ELEMENTS ? 1 : nat_pool_chunks(pool, items);
    nat_pool_for(pool, job->n_chunks, fn, job);
}

/* operands: out [T, K, n], x [R, k], ids [T, K], scratch; n: first weight, E, T, K, per_slot, id bytes.
 * Scratch (program.py moe_scratch_words mirrors it): starts [E + 1] and active [E] int64, order [S] int64, then
 * the activations of the R rows and of the S sorted rows (quantized kinds) or the S sorted x rows (float kinds),
 * then the sorted results [S][n]. */
static int mul_mat_id(nat_pool *pool, const nat_kernels *paths, const nat_instr *in, void *const *bufs,
                      const nat_weight *weights) {
    const nat_weight *w = &weights[in->n[0]];
    int64_t n_expert = in->n[1], n_tokens = in->n[2], n_used = in->n[3], id_bytes = in->n[5];
    const void *ids = OPERAND(bufs, in, 2);
    int64_t n_slots = n_tokens * n_used;
    if (!all_below(ids, n_slots, id_bytes, n_expert)) return NAT_ID_OUT_OF_RANGE;
    if (!is_float_kind(w) && !nat_is_quantized(w)) return NAT_BAD_INSTRUCTION;
    int64_t k = w->n_cols, n = w->n_rows, rows = in->n[4] ? n_slots : n_tokens;
    int64_t *scratch = (int64_t *)OPERAND(bufs, in, 3);
    moe_job job = {w, *paths, FLOATS(bufs, in, 1), in->n[4], n_used, k, n, n_slots, scratch,
                   scratch + n_expert + 1, 0, scratch + 2 * n_expert + 1, {0}, {0}, NULL, NULL, FLOATS(bufs, in, 0),
                   0, 1};
    float *after = (float *)(job.order + n_slots);
    sort_by_expert(&job, ids, id_bytes, n_expert);
    if (is_float_kind(w)) {
        job.xg = after;
        job.ys = after + n_slots * k;
        job.units = n;
    } else {
        job.act = act_at(after, rows, k);
        job.gathered = act_at(after + act_size(rows, k), n_slots, k);
        job.ys = after + act_size(rows, k) + act_size(n_slots, k);
        job.units = (n + NAT_ROWS - 1) / NAT_ROWS;
        run_step(pool, &job, rows, k, quantize_part);
    }
    run_step(pool, &job, n_slots, k, gather_part);
    job.n_chunks = nat_pool_chunks(pool, job.n_active * job.units);
    nat_pool_for(pool, job.n_chunks, gemm_part, &job);
    run_step(pool, &job, n_slots, n, scatter_part);
    return 0;
}

/* ---- the elementwise ones: add_id, swiglu_oai ------------------------------------------------------------------ */

/* two inputs (and ids) to one output, elementwise or by rows */
typedef struct {
    const float *a, *b;
    const void *ids;      /* add_id: the expert of each row */
    float *out;
    int64_t width, id_bytes;
    float alpha, limit;   /* swiglu_oai */
    int64_t count, n_chunks;
} pair_job;

/* out[s, :] = a[s, :] + b[ids[s], :] over rows s (ids checked before) */
static void add_id_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    pair_job *job = raw;
    int64_t n = job->width, r0, r1;
    nat_share(job->count, chunk, job->n_chunks, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *bias = job->b + expert_id(job->ids, r, job->id_bytes) * n;
        for (int64_t j = 0; j < n; j++) job->out[r * n + j] = job->a[r * n + j] + bias[j];
    }
}

/* g * sigmoid(alpha * g) * (u + 1) with g = min(gate, limit), u = clip(up, -limit, limit) (NaN stays NaN) */
static void swiglu_oai_part(void *raw, int64_t chunk, int ith) {
    (void)ith;
    pair_job *job = raw;
    float limit = job->limit;
    int64_t i0, i1;
    nat_share(job->count, chunk, job->n_chunks, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        float g = job->a[i] > limit ? limit : job->a[i];
        float u = job->b[i] > limit ? limit : (job->b[i] < -limit ? -limit : job->b[i]);
        float sig = 1.0f / (1.0f + expf(-(job->alpha * g)));
        job->out[i] = (g * sig) * (u + 1.0f);
    }
}

static void run_pair(nat_pool *pool, pair_job *job, int64_t per_item, nat_chunk_fn fn) {
    job->n_chunks = job->count * per_item < SERIAL_ELEMENTS ? 1 : nat_pool_chunks(pool, job->count);
    nat_pool_for(pool, job->n_chunks, fn, job);
}

/* ---- routing: top_k, take, id_mask, sum_rows; concat --------------------------------------------------------- */

/* whether a ranks before b: the larger first, a NaN after every number (numpy's argsort of -x) */
static int ranks_before(float a, float b) { return isnan(b) ? !isnan(a) : a > b; }

/* out i32 [rows, k]: the indices of each row's k best of n, best first, ties by the lower index */
static void top_k(const float *x, int32_t *out, int64_t rows, int64_t n, int64_t k) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        int32_t *best = out + r * k;
        int64_t held = 0;
        for (int64_t j = 0; j < n; j++) {  /* insertion into the sorted best: an equal value stays behind */
            int64_t at = held;
            while (at > 0 && ranks_before(row[j], row[best[at - 1]])) at--;
            if (at >= k) continue;
            int64_t last = held < k ? held : k - 1;
            for (int64_t i = last; i > at; i--) best[i] = best[i - 1];
            best[at] = (int32_t)j;
            if (held < k) held++;
        }
    }
}

static int take_or_mask(const nat_instr *in, void *const *bufs) {
    int64_t rows = in->n[0], n = in->n[1], k = in->n[2], id_bytes = in->n[3];
    const float *x = FLOATS(bufs, in, 1);
    const void *ids = OPERAND(bufs, in, 2);
    float *out = FLOATS(bufs, in, 0);
    if (!all_below(ids, rows * k, id_bytes, n)) return NAT_ID_OUT_OF_RANGE;
    for (int64_t r = 0; r < rows; r++) {
        if (in->op == NAT_OP_ID_MASK)
            for (int64_t j = 0; j < n; j++) out[r * n + j] = -INFINITY;
        for (int64_t j = 0; j < k; j++) {
            int64_t id = expert_id(ids, r * k + j, id_bytes);
            if (in->op == NAT_OP_TAKE) out[r * k + j] = x[r * n + id];
            else out[r * n + id] = 0.0f;
        }
    }
    return 0;
}

/* out[r] = the sum of row r, in double in index order, rounded once */
static void sum_rows(const float *x, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        double total = 0.0;
        for (int64_t j = 0; j < n; j++) total += (double)x[r * n + j];
        out[r] = (float)total;
    }
}

static void concat(const nat_instr *in, void *const *bufs) {
    int64_t rows = in->n[0], na = in->n[1], nb = in->n[2];
    const float *a = FLOATS(bufs, in, 1), *b = FLOATS(bufs, in, 2);
    float *out = FLOATS(bufs, in, 0);
    for (int64_t r = 0; r < rows; r++) {
        memmove(out + r * (na + nb), a + r * na, (size_t)na * sizeof(float));
        memmove(out + r * (na + nb) + na, b + r * nb, (size_t)nb * sizeof(float));
    }
}

int nat_run_moe_op(nat_pool *pool, const nat_kernels *paths, const nat_instr *in, void *const *bufs,
                   const nat_weight *weights) {
    switch (in->op) {
    case NAT_OP_MUL_MAT_ID:
        return mul_mat_id(pool, paths, in, bufs, weights);
    case NAT_OP_ADD_ID: {
        pair_job job = {FLOATS(bufs, in, 1), FLOATS(bufs, in, 2), OPERAND(bufs, in, 3), FLOATS(bufs, in, 0), in->n[1],
                        in->n[3], 0.0f, 0.0f, in->n[0], 1};
        if (!all_below(job.ids, job.count, job.id_bytes, in->n[2])) return NAT_ID_OUT_OF_RANGE;
        run_pair(pool, &job, job.width, add_id_part);
        return 0;
    }
    case NAT_OP_SWIGLU_OAI: {
        pair_job job = {FLOATS(bufs, in, 1), FLOATS(bufs, in, 2), NULL, FLOATS(bufs, in, 0), 1, 4, in->f[0], in->f[1],
                        in->n[0], 1};
        run_pair(pool, &job, 1, swiglu_oai_part);
        return 0;
    }
    case NAT_OP_TOP_K:
        top_k(FLOATS(bufs, in, 1), (int32_t *)OPERAND(bufs, in, 0), in->n[0], in->n[1], in->n[2]);
        return 0;
    case NAT_OP_TAKE: case NAT_OP_ID_MASK:
        return take_or_mask(in, bufs);
    case NAT_OP_SUM_ROWS:
        sum_rows(FLOATS(bufs, in, 1), FLOATS(bufs, in, 0), in->n[0], in->n[1]);
        return 0;
    case NAT_OP_CONCAT:
        concat(in, bufs);
        return 0;
    default:
        return NAT_BAD_INSTRUCTION;
    }
}
