/* The recurrent-layer ops (issue 34): the short causal convolution over a carried window and the window it
 * leaves, Mamba-2's selective scan and the gated delta rule (Gated DeltaNet). The carried states arrive as rows of
 * the ubatch's sequences (the recurrent memory gathers them before the program runs and scatters the rows the
 * program returns), so no instruction here indexes memory by data.
 *
 * Batch invariance: work items are whole (sequence, token) rows of the convolution and whole (sequence, head)
 * pairs of the scans, each computed alone in a fixed order whatever chunk or thread runs it, so a sequence's bits
 * never depend on the other sequences of the ubatch or on the threads. The sums over the state's last axis take
 * native.h's canonical 16-lane order (nat_dot16). */
#include <math.h>
#include <string.h>

#include "native.h"
#include "pool.h"

#define WORDS(bufs, in, i) ((char *)(bufs)[(in)->buf[i]] + 4 * (in)->off[i])
#define F32_AT(bufs, in, i) ((float *)WORDS(bufs, in, i))

typedef struct {
    const nat_instr *in;
    void *const *bufs;
    int64_t n_items, n_chunks;
} rec_job;

static void run_items(nat_pool *pool, const nat_instr *in, void *const *bufs, int64_t n_items, nat_chunk_fn fn) {
    rec_job job = {in, bufs, n_items, nat_pool_chunks(pool, n_items)};
    nat_pool_for(pool, job.n_chunks, fn, &job);
}

/* ---- the short convolution --------------------------------------------------------------------------------- */

/* row j of concat(window, x) along the time axis of sequence s: [C] */
static const float *conv_row(const float *window, const float *x, int64_t s, int64_t j, int64_t n_tokens,
                             int64_t n_ch, int64_t keep) {
    return j < keep ? window + (s * keep + j) * n_ch : x + (s * n_tokens + j - keep) * n_ch;
}

/* n: S, T, C, K-1. out[s, t, c] = sum over k = 0.. of xx[s, t + k, c] * w[c, k], the products summed in order */
static void ssm_conv_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    rec_job *job = raw;
    const nat_instr *in = job->in;
    const float *window = F32_AT(job->bufs, in, 1), *x = F32_AT(job->bufs, in, 2), *w = F32_AT(job->bufs, in, 3);
    float *out = F32_AT(job->bufs, in, 0);
    int64_t n_tokens = in->n[1], n_ch = in->n[2], keep = in->n[3], width = keep + 1, r0, r1;
    nat_share(job->n_items, chunk, job->n_chunks, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {  /* r = s * T + t */
        int64_t s = r / n_tokens, t = r % n_tokens;
        float *o = out + r * n_ch;
        const float *first = conv_row(window, x, s, t, n_tokens, n_ch, keep);
        for (int64_t c = 0; c < n_ch; c++) o[c] = first[c] * w[c * width];
        for (int64_t k = 1; k < width; k++) {
            const float *row = conv_row(window, x, s, t + k, n_tokens, n_ch, keep);
            for (int64_t c = 0; c < n_ch; c++) o[c] = o[c] + row[c] * w[c * width + k];
        }
    }
}

/* n: S, T, C, K-1. out[s] = the last K-1 rows of concat(window[s], x[s]) */
static void conv_window(const nat_instr *in, void *const *bufs) {
    const float *window = F32_AT(bufs, in, 1), *x = F32_AT(bufs, in, 2);
    float *out = F32_AT(bufs, in, 0);
    int64_t n_seqs = in->n[0], n_tokens = in->n[1], n_ch = in->n[2], keep = in->n[3];
    for (int64_t s = 0; s < n_seqs; s++)
        for (int64_t j = 0; j < keep; j++)
            memcpy(out + (s * keep + j) * n_ch, conv_row(window, x, s, n_tokens + j, n_tokens, n_ch, keep),
                   (size_t)n_ch * 4);
}

/* ---- Mamba-2's selective scan ------------------------------------------------------------------------------- */

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* n: S, T, H, G, P, N; operands out [S, T*H*P + H*P*N], state [S, H, P, N], x [S, T, H, P], dt [S, T, H], A [H],
 * B then C [S, T, G, N] each. One (sequence, head) pair: its state copied into the output row, then per token
 * d = softplus(dt), state = state * exp(d * A) + (x * d) B (each product rounded, then the sum), y = state . C */
static void ssm_scan_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    rec_job *job = raw;
    const nat_instr *in = job->in;
    int64_t n_tokens = in->n[1], n_head = in->n[2], n_group = in->n[3], dim = in->n[4], d_state = in->n[5];
    int64_t row = n_tokens * n_head * dim + n_head * dim * d_state, bc = in->n[0] * n_tokens * n_group * d_state;
    const float *state = F32_AT(job->bufs, in, 1), *x = F32_AT(job->bufs, in, 2), *dt = F32_AT(job->bufs, in, 3);
    const float *a = F32_AT(job->bufs, in, 4), *b = F32_AT(job->bufs, in, 5), *c = b + bc;
    float *out = F32_AT(job->bufs, in, 0);
    int64_t i0, i1;
    nat_share(job->n_items, chunk, job->n_chunks, &i0, &i1);
    for (int64_t item = i0; item < i1; item++) {  /* item = s * H + h */
        int64_t s = item / n_head, h = item % n_head, grp = h / (n_head / n_group);
        float *st = out + s * row + n_tokens * n_head * dim + h * dim * d_state;
        memcpy(st, state + item * dim * d_state, (size_t)(dim * d_state) * 4);
        for (int64_t t = 0; t < n_tokens; t++) {
            int64_t token = s * n_tokens + t;
            float d = softplus(dt[token * n_head + h]), decay = expf(d * a[h]);
            const float *xt = x + (token * n_head + h) * dim, *bt = b + (token * n_group + grp) * d_state;
            const float *ct = c + (token * n_group + grp) * d_state;
            float *y = out + s * row + (t * n_head + h) * dim;
            for (int64_t p = 0; p < dim; p++) {
                float xdt = xt[p] * d, *sp = st + p * d_state;
                for (int64_t j = 0; j < d_state; j++) sp[j] = sp[j] * decay + xdt * bt[j];
                y[p] = nat_dot16(sp, ct, d_state);
            }
        }
    }
}

/* ---- the gated delta rule ----------------------------------------------------------------------------------- */

/* n: S, T, H, Hk, Dv, Dk; operands out [S, T*H*Dv + H*Dv*Dk], state [S, H, Dv, Dk], q and k [S, T, Hk, Dk],
 * v [S, T, H, Dv], g then beta [S, T, H] each. One (sequence, head) pair (q/k head h % Hk): per token and state row
 * i, M_i = M_i * exp(g); delta = (v_i - M_i . k) * beta; M_i = M_i + delta * k; o_i = (M_i . q) / sqrt(Dv). A row's
 * update reads only that row, so the rows go one after another. */
static void gated_delta_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    rec_job *job = raw;
    const nat_instr *in = job->in;
    int64_t n_seqs = in->n[0], n_tokens = in->n[1], n_head = in->n[2], n_head_k = in->n[3], dv = in->n[4];
    int64_t dk = in->n[5], row = n_tokens * n_head * dv + n_head * dv * dk;
    const float *state = F32_AT(job->bufs, in, 1), *q = F32_AT(job->bufs, in, 2), *k = F32_AT(job->bufs, in, 3);
    const float *v = F32_AT(job->bufs, in, 4), *g = F32_AT(job->bufs, in, 5), *beta = g + n_seqs * n_tokens * n_head;
    float *out = F32_AT(job->bufs, in, 0);
    float scale = (float)(1.0 / sqrt((double)dv));
    int64_t i0, i1;
    nat_share(job->n_items, chunk, job->n_chunks, &i0, &i1);
    for (int64_t item = i0; item < i1; item++) {  /* item = s * H + h */
        int64_t s = item / n_head, h = item % n_head;
        float *m = out + s * row + n_tokens * n_head * dv + h * dv * dk;
        memcpy(m, state + item * dv * dk, (size_t)(dv * dk) * 4);
        for (int64_t t = 0; t < n_tokens; t++) {
            int64_t token = s * n_tokens + t;
            float decay = expf(g[token * n_head + h]), b = beta[token * n_head + h];
            const float *kt = k + (token * n_head_k + h % n_head_k) * dk;
            const float *qt = q + (token * n_head_k + h % n_head_k) * dk, *vt = v + (token * n_head + h) * dv;
            float *o = out + s * row + (t * n_head + h) * dv;
            for (int64_t i = 0; i < dv; i++) {
                float *mi = m + i * dk;
                for (int64_t j = 0; j < dk; j++) mi[j] = mi[j] * decay;
                float delta = (vt[i] - nat_dot16(mi, kt, dk)) * b;
                for (int64_t j = 0; j < dk; j++) mi[j] = mi[j] + delta * kt[j];
                o[i] = nat_dot16(mi, qt, dk) * scale;
            }
        }
    }
}

/* ---- one instruction ---------------------------------------------------------------------------------------- */

int nat_run_recurrent(nat_pool *pool, const nat_instr *in, void *const *bufs) {
    switch (in->op) {
    case NAT_OP_SSM_CONV:
        run_items(pool, in, bufs, in->n[0] * in->n[1], ssm_conv_chunk);
        return 0;
    case NAT_OP_CONV_WINDOW:
        conv_window(in, bufs);
        return 0;
    case NAT_OP_SSM_SCAN:
        run_items(pool, in, bufs, in->n[0] * in->n[2], ssm_scan_chunk);
        return 0;
    case NAT_OP_GATED_DELTA:
        run_items(pool, in, bufs, in->n[0] * in->n[2], gated_delta_chunk);
        return 0;
    default:
        return NAT_BAD_INSTRUCTION;
    }
}
