/* Every op of the core IR but the matmul (module.c) and attention (attention.c): elementwise ops, norms, softmax,
 * row lookups (also from a repacked weight), slices, RoPE, the KV cache write. Portable C (one path for every
 * CPU; the exp loops and the contiguous elementwise rows also in an AVX2 copy of the same operations); each
 * output row is computed alone in a fixed order and the work is split by whole rows (or (row, head) pairs), so a
 * row's bits never depend on the batch around it or on the threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "nat_exp.h"
#include "pool.h"

/* elements per chunk of an elementwise op: below two chunks the op runs on the calling thread alone */
#define ELEMENTS_PER_CHUNK 16384
/* what an element of an op through nat_exp costs, in elements of an add (for the chunks: such an op splits over the
 * threads from a few thousand elements on, a batched decode step's SwiGLU among them) */
#define EXP_ELEMENT_COST 8
#define ROPE_ANGLE_COST 16

/* The elementwise loops (those that call nat_exp, binary_row, and the norms' sums), compiled three times where the
 * compiler and loader can choose a copy at load time (GCC/Clang ifuncs on x86-64 Linux): for AVX-512's 16 lanes,
 * AVX2's 8 and the baseline. The same IEEE operations in the same order either way (no fused multiply-add:
 * -ffp-contract=off), so the same bits on every CPU. */
#if defined(NAT_HAVE_X86) && defined(__linux__) && defined(__GNUC__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#define WORDS(bufs, in, i) ((char *)(bufs)[(in)->buf[i]] + 4 * (in)->off[i])
#define F32_AT(bufs, in, i) ((float *)WORDS(bufs, in, i))
#define HAS(in, i) ((in)->buf[i] >= 0)

/* ---- elementwise ------------------------------------------------------------------------------------------ */

/* x * sigmoid(x) */
static inline float silu(float x) { return x / (1.0f + nat_exp(-x)); }

/* ggml's tanh form 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same
 * function: no cancellation where tanh(u) is near -1, and no libm call, so the loop vectorises) */
static inline float gelu(float x) {
    const float c = 0.7978845608028654f;
    float inner = c * (x + 0.044715f * x * x * x);
    return x / (1.0f + nat_exp(-2.0f * inner));
}

static inline float unary(int kind, float x, const float *f) {
    switch (kind) {
    case NAT_SILU: return silu(x);
    case NAT_GELU: return gelu(x);
    case NAT_RELU: return x > 0.0f ? x : 0.0f;
    case NAT_SIGMOID: return 1.0f / (1.0f + nat_exp(-x));
    case NAT_SOFTPLUS: return x > 20.0f ? x : log1pf(expf(x));
    case NAT_SCALE: return x * f[0];
    case NAT_SOFTCAP: return tanhf(x / f[0]) * f[0];
    default: return x < f[0] ? f[0] : (x > f[1] ? f[1] : x);  /* NAT_CLAMP */
    }
}

typedef struct {
    const nat_instr *in;
    void *const *bufs;
    int64_t count, n_chunks;
} flat_job;

VECTOR_CLONES static void unary_span(int kind, const float *x, float *out, int64_t n, const float *f) {
    if (kind == NAT_GELU)  /* the activations of the models' feed-forward layers: loops of their own, vectorised */
        for (int64_t j = 0; j < n; j++) out[j] = gelu(x[j]);
    else if (kind == NAT_SILU)
        for (int64_t j = 0; j < n; j++) out[j] = silu(x[j]);
    else
        for (int64_t j = 0; j < n; j++) out[j] = unary(kind, x[j], f);
}

VECTOR_CLONES static void swiglu_span(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t j = 0; j < n; j++) out[j] = silu(g[j]) * u[j];
}

/* The next piece of elements [i, i1) of a contiguous output of rows of `width` that lies in one row: its row and
 * column (the inputs' rows may be strided: columns of a fused matmul's rows, so a piece is one contiguous loop);
 * returns its length. */
static inline int64_t row_piece(int64_t i, int64_t i1, int64_t width, int64_t *row, int64_t *col) {
    *row = i / width;
    *col = i % width;
    return width - *col < i1 - i ? width - *col : i1 - i;
}

static void unary_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    const nat_instr *in = job->in;
    const float *x = F32_AT(job->bufs, in, 1);
    float *out = F32_AT(job->bufs, in, 0);
    int64_t i0, i1, row, col;
    nat_share(job->count, chunk, job->n_chunks, &i0, &i1);
    for (int64_t i = i0, n; i < i1; i += n) {
        n = row_piece(i, i1, in->n[2], &row, &col);
        unary_span((int)in->n[0], x + row * in->n[3] + col, out + i, n, in->f);
    }
}

static void swiglu_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    const nat_instr *in = job->in;
    const float *g = F32_AT(job->bufs, in, 1), *u = F32_AT(job->bufs, in, 2);
    float *out = F32_AT(job->bufs, in, 0);
    int64_t i0, i1, row, col;
    nat_share(job->count, chunk, job->n_chunks, &i0, &i1);
    for (int64_t i = i0, n; i < i1; i += n) {
        n = row_piece(i, i1, in->n[1], &row, &col);
        swiglu_span(g + row * in->n[2] + col, u + row * in->n[3] + col, out + i, n);
    }
}

static inline float binary(int kind, float a, float b) {
    switch (kind) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    default: return a / b;
    }
}

/* o = a op b over n contiguous elements: a loop per op, so each vectorises (a residual add of a batched step) */
VECTOR_CLONES static void binary_row(int kind, const float *a, const float *b, float *o, int64_t n) {
    switch (kind) {
    case 0: for (int64_t j = 0; j < n; j++) o[j] = a[j] + b[j]; break;
    case 1: for (int64_t j = 0; j < n; j++) o[j] = a[j] - b[j]; break;
    case 2: for (int64_t j = 0; j < n; j++) o[j] = a[j] * b[j]; break;
    default: for (int64_t j = 0; j < n; j++) o[j] = a[j] / b[j]; break;
    }
}

/* out[i0, i1, i2, i3] = a[...] op b[...] over 4-D dims with per-operand strides (0 on a broadcast axis); chunks
 * are ranges of the (i0, i1, i2) rows */
static void binary_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    const nat_instr *in = job->in;
    const float *a = F32_AT(job->bufs, in, 1), *b = F32_AT(job->bufs, in, 2);
    float *out = F32_AT(job->bufs, in, 0);
    const int64_t *d = in->n + 1, *sa = in->n + 5, *sb = in->n + 9;
    int kind = (int)in->n[0];
    int64_t r0, r1;
    nat_share(job->count, chunk, job->n_chunks, &r0, &r1);  /* count = d0 * d1 * d2 rows */
    for (int64_t r = r0; r < r1; r++) {
        int64_t i2 = r % d[2], i1 = (r / d[2]) % d[1], i0 = r / (d[2] * d[1]);
        const float *ar = a + i0 * sa[0] + i1 * sa[1] + i2 * sa[2];
        const float *br = b + i0 * sb[0] + i1 * sb[1] + i2 * sb[2];
        float *o = out + r * d[3];
        if (sa[3] == 1 && sb[3] == 1) {
            binary_row(kind, ar, br, o, d[3]);
        } else {
            for (int64_t j = 0; j < d[3]; j++) o[j] = binary(kind, ar[j * sa[3]], br[j * sb[3]]);
        }
    }
}

static void run_flat(nat_pool *pool, const nat_instr *in, void *const *bufs, int64_t count, int64_t per_item,
                     nat_chunk_fn fn) {
    int64_t big = count * per_item / ELEMENTS_PER_CHUNK, threads = nat_pool_threads(pool);
    int64_t rounds = (big + threads - 1) / threads * threads;  /* 3 chunks on 2 threads take as long as 4 */
    flat_job job = {in, bufs, count, big < 2 ? 1 : nat_pool_chunks(pool, rounds < count ? rounds : count)};
    nat_pool_for(pool, job.n_chunks, fn, &job);
}

/* ---- norms and softmax --------------------------------------------------------------------------------------- */

/* A sum in double over NORM_LANES lanes, element j into lane j % NORM_LANES, then the lanes in a fixed tree: an order
 * the compiler vectorises (a single running sum is one long chain of dependent adds), the same on every CPU. */
#define NORM_LANES 8

static inline double lanes_total(const double *lanes) {
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

/* the body of a lane sum of TERM(j) over j < n */
#define LANE_SUM(TERM)                                                            \
    double lanes[NORM_LANES] = {0};                                               \
    int64_t j = 0;                                                                \
    for (; j + NORM_LANES <= n; j += NORM_LANES)                                  \
        for (int l = 0; l < NORM_LANES; l++) lanes[l] += TERM(j + l);             \
    for (; j < n; j++) lanes[j % NORM_LANES] += TERM(j);                          \
    return lanes_total(lanes);

#define SQUARE_IN_DOUBLE(j) ((double)x[j] * (double)x[j])
#define VALUE(j) ((double)x[j])
#define CENTERED_SQUARE(j) ((double)((x[j] - center) * (x[j] - center)))

VECTOR_CLONES static double sum_squares(const float *x, int64_t n) { LANE_SUM(SQUARE_IN_DOUBLE) }
VECTOR_CLONES static double sum_values(const float *x, int64_t n) { LANE_SUM(VALUE) }
/* the float (x - center)^2 summed in double */
VECTOR_CLONES static double centered_squares(const float *x, int64_t n, float center) { LANE_SUM(CENTERED_SQUARE) }

/* out = (x - center) * inv [* w] */
VECTOR_CLONES static void scale_row(const float *x, const float *w, float *out, int64_t n, float center, float inv) {
    for (int64_t j = 0; j < n; j++) {
        float v = (x[j] - center) * inv;
        out[j] = w ? v * w[j] : v;
    }
}

/* the sum of squares in double, like ggml */
static void rms_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float scale = (float)(1.0 / sqrt(sum_squares(x, n) / (double)n + (double)eps));
    scale_row(x, w, out, n, 0.0f, scale);
}

/* (x - mean) / sqrt(var + eps): mean and variance in double, like the oracle */
static void layer_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float mean = (float)(sum_values(x, n) / (double)n);
    float inv = (float)(1.0 / sqrt(centered_squares(x, n, mean) / (double)n + (double)eps));
    scale_row(x, w, out, n, mean, inv);
}

static void softmax_row(const float *x, float *out, int64_t n) {
    float peak = -INFINITY;
    for (int64_t j = 0; j < n; j++) peak = x[j] > peak ? x[j] : peak;
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        out[j] = expf(x[j] - peak);
        total = total + out[j];
    }
    for (int64_t j = 0; j < n; j++) out[j] = out[j] / total;
}

static void row_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    const nat_instr *in = job->in;
    const float *x = F32_AT(job->bufs, in, 1);
    const float *w = in->op != NAT_OP_SOFTMAX && HAS(in, 2) ? F32_AT(job->bufs, in, 2) : NULL;
    float *out = F32_AT(job->bufs, in, 0);
    int64_t n = in->n[1], group = in->n[2], r0, r1;
    nat_share(job->count, chunk, job->n_chunks, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r / group * in->n[3] + r % group * n;  /* groups of rows may be strided (heads of a token) */
        if (in->op == NAT_OP_RMS_NORM) rms_row(xr, w, out + r * n, n, in->f[0]);
        else if (in->op == NAT_OP_NORM) layer_norm_row(xr, w, out + r * n, n, in->f[0]);
        else softmax_row(xr, out + r * n, n);
    }
}

/* ---- row lookups and slices ---------------------------------------------------------------------------------- */

static int64_t id_at(const void *ids, int64_t i, int64_t id_bytes) {
    if (id_bytes == 8) return ((const int64_t *)ids)[i];
    return ((const int32_t *)ids)[i];
}

/* whether every id is a row of a table of n rows */
static int ids_in_range(const void *ids, int64_t count, int64_t id_bytes, int64_t n) {
    for (int64_t i = 0; i < count; i++) {
        int64_t id = id_at(ids, i, id_bytes);
        if (id < 0 || id >= n) return 0;
    }
    return 1;
}

/* row `row` of a repacked weight as float32: scale * code + offset per element, the dequantizer's own values */
void nat_unpack_row(const nat_weight *w, int64_t row, float *out) {
    int64_t k = w->n_cols;
    if (w->kind == NAT_F32 || w->kind == NAT_F16 || w->kind == NAT_BF16) {
        size_t esize = w->kind == NAT_F32 ? 4 : 2;
        const uint8_t *src = w->data + (size_t)row * (size_t)k * esize;
        for (int64_t j = 0; j < k; j++) {
            uint16_t h;
            if (w->kind == NAT_F32) { memcpy(&out[j], src + 4 * j, 4); continue; }
            memcpy(&h, src + 2 * j, 2);
            if (w->kind == NAT_F16) out[j] = nat_f16_to_f32(h);
            else { uint32_t bits = (uint32_t)h << 16; memcpy(&out[j], &bits, 4); }
        }
        return;
    }
    int64_t nb = k / NAT_BLOCK, lane = row % NAT_ROWS;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = nat_block_at(w, row / NAT_ROWS, b);
        float store[4 * NAT_ROWS];
        nat_params p = nat_block_params(w, row / NAT_ROWS, b, store);
        for (int j = 0; j < NAT_BLOCK; j++) {
            int code = nat_code_at(w, blk, (int)lane, j);
            float s = j < 16 ? p.s0[lane] : p.s1[lane];
            float v = s * (float)code;
            if (p.o0) v = v + (j < 16 ? p.o0[lane] : p.o1[lane]);
            out[b * NAT_BLOCK + j] = v;
        }
    }
}

typedef struct {
    const nat_instr *in;
    void *const *bufs;
    const nat_weight *w;
    int64_t n_chunks;
} rows_job;

static void get_rows_w_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    rows_job *job = raw;
    const nat_instr *in = job->in;
    const void *ids = WORDS(job->bufs, in, 1);
    float *out = F32_AT(job->bufs, in, 0);
    int64_t i0, i1;
    nat_share(in->n[0], chunk, job->n_chunks, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) nat_unpack_row(job->w, id_at(ids, i, in->n[3]), out + i * job->w->n_cols);
}

static int get_rows(nat_pool *pool, const nat_instr *in, void *const *bufs, const nat_weight *weights) {
    const void *ids = WORDS(bufs, in, in->op == NAT_OP_GET_ROWS ? 2 : 1);
    if (in->op == NAT_OP_GET_ROWS) {
        int64_t words = in->n[1];
        if (!ids_in_range(ids, in->n[0], in->n[3], in->n[2])) return NAT_ID_OUT_OF_RANGE;
        const char *table = WORDS(bufs, in, 1);
        char *out = WORDS(bufs, in, 0);
        for (int64_t i = 0; i < in->n[0]; i++)
            memmove(out + 4 * i * words, table + 4 * id_at(ids, i, in->n[3]) * words, (size_t)(4 * words));
        return 0;
    }
    const nat_weight *w = &weights[in->n[1]];
    if (!ids_in_range(ids, in->n[0], in->n[3], w->n_rows)) return NAT_ID_OUT_OF_RANGE;
    rows_job job = {in, bufs, w, in->n[0] * w->n_cols < 2 * ELEMENTS_PER_CHUNK ? 1 : nat_pool_chunks(pool, in->n[0])};
    nat_pool_for(pool, job.n_chunks, get_rows_w_chunk, &job);
    return 0;
}

static void slice_rows(const nat_instr *in, void *const *bufs) {
    const char *x = WORDS(bufs, in, 1);
    char *out = WORDS(bufs, in, 0);
    int64_t outer = in->n[0], row = in->n[1], start = in->n[2], len = in->n[3];
    for (int64_t r = 0; r < outer; r++) memmove(out + 4 * r * len, x + 4 * (r * row + start), (size_t)(4 * len));
}

/* ---- RoPE ---------------------------------------------------------------------------------------------------- */

/* cos / sin of each rotated pair at position pos, as ggml_rope_cache_init (the angle advanced by float products);
 * ff, mix: freq factors and YaRN mix (or NULL); f: theta scale, freq scale, magnitude */
static void rope_angles(const float *ff, const float *mix, const float *f, int64_t half, float pos, float *cs,
                        float *sn) {
    float theta_scale = f[0], freq_scale = f[1], magnitude = f[2], cur = pos;
    for (int64_t i = 0; i < half; i++) {
        float extrap = ff ? cur / ff[i] : cur;
        float theta = freq_scale * extrap;
        if (mix) theta = theta * (1.0f - mix[i]) + extrap * mix[i];
        cs[i] = cosf(theta) * magnitude;
        sn[i] = sinf(theta) * magnitude;
        cur = cur * theta_scale;
    }
}

/* the angles of an instruction whose operands 2, 3, 4 are positions, freq factors and YaRN mix (ROPE and
 * ROPE_ANGLES alike), n_dims in n[3], the parameters in f[0..2], for token t */
static void token_angles(const nat_instr *in, void *const *bufs, int64_t t, float *cs, float *sn) {
    const int32_t *pos = (const int32_t *)WORDS(bufs, in, 2);
    const float *ff = HAS(in, 3) ? F32_AT(bufs, in, 3) : NULL, *mix = HAS(in, 4) ? F32_AT(bufs, in, 4) : NULL;
    rope_angles(ff, mix, in->f, in->n[3] / 2, (float)pos[t], cs, sn);
}

/* the n_dims rotated dimensions of one head's row x into o (o may be x: each pair is read before it is written) */
static void rotate_pairs(const float *x, float *o, int64_t half, int neox, const float *cs, const float *sn) {
    for (int64_t i = 0; i < half; i++) {
        int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1];
        o[i0] = x0 * cs[i] - x1 * sn[i];
        o[i1] = x0 * sn[i] + x1 * cs[i];
    }
}

static void rope_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    const nat_instr *in = job->in;
    const float *x = F32_AT(job->bufs, in, 1);
    const float *table = HAS(in, 5) ? F32_AT(job->bufs, in, 5) : NULL;  /* the step's angles (ROPE_ANGLES) */
    float *out = F32_AT(job->bufs, in, 0);
    int64_t n_head = in->n[1], dim = in->n[2], n_dims = in->n[3], half = n_dims / 2, t0, t1;
    int neox = (int)in->n[4], f16 = (int)in->n[9];  /* f16: an f16 KV cache's keys, rotated in place (a K shift) */
    float angles[1024], row[1024];  /* n_dims <= 1024: the compiler checks */
    nat_share(job->count, chunk, job->n_chunks, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = angles, *sn = angles + half;
        if (table)
            cs = table + t * n_dims, sn = cs + half;
        else
            token_angles(in, job->bufs, t, angles, angles + half);
        for (int64_t h = 0; h < n_head; h++) {
            if (f16) {
                uint16_t *keys = (uint16_t *)out + t * in->n[7] + h * in->n[8];
                nat_f16_to_f32_row(keys, row, n_dims);
                rotate_pairs(row, row, half, neox, cs, sn);
                nat_f32_to_f16_row(row, keys, n_dims);
                continue;
            }
            const float *xr = x + t * in->n[5] + h * in->n[6];
            float *o = out + t * in->n[7] + h * in->n[8];
            rotate_pairs(xr, o, half, neox, cs, sn);
            if (o != xr)
                for (int64_t d = n_dims; d < dim; d++) o[d] = xr[d];
        }
    }
}

/* ROPE_ANGLES: each token's cos, then sin, of its n_dims / 2 pairs, once for every rope of a step that shares them */
static void rope_angles_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    flat_job *job = raw;
    int64_t n_dims = job->in->n[3], t0, t1;
    float *out = F32_AT(job->bufs, job->in, 0);
    nat_share(job->count, chunk, job->n_chunks, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) token_angles(job->in, job->bufs, t, out + t * n_dims, out + t * n_dims + n_dims / 2);
}

/* ---- the KV cache and attention ------------------------------------------------------------------------------ */

/* a token's k and v rows into its cell of each KV head: copied, or rounded to f16 for an f16 cache (n[7]) */
static int kv_write(int isa, const nat_instr *in, void *const *bufs) {
    char *kc = WORDS(bufs, in, 0), *vc = WORDS(bufs, in, 1);
    const float *k = F32_AT(bufs, in, 2), *v = F32_AT(bufs, in, 3);
    const int64_t *cells = (const int64_t *)WORDS(bufs, in, 4);
    int64_t n_tokens = in->n[0], n_head_kv = in->n[1], dk = in->n[2], dv = in->n[3], n_cells = in->n[4];
    int64_t k_stride = in->n[5], v_stride = in->n[6];  /* a token's k and v rows: maybe columns of a fused row */
    int f16 = (int)in->n[7];
    size_t esize = f16 ? 2 : 4;
    nat_to_f16_fn to_f16 = nat_kernels_for(isa).to_f16;
    if (!ids_in_range(cells, n_tokens, 8, n_cells)) return NAT_ID_OUT_OF_RANGE;
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t h = 0; h < n_head_kv; h++) {
            char *kd = kc + (size_t)((h * n_cells + cells[t]) * dk) * esize;
            char *vd = vc + (size_t)((h * n_cells + cells[t]) * dv) * esize;
            const float *ks = k + t * k_stride + h * dk, *vs = v + t * v_stride + h * dv;
            if (f16) {
                to_f16(ks, (uint16_t *)kd, dk);
                to_f16(vs, (uint16_t *)vd, dv);
            } else {
                memcpy(kd, ks, (size_t)dk * 4);
                memcpy(vd, vs, (size_t)dv * 4);
            }
        }
    return 0;
}

/* ---- one instruction ----------------------------------------------------------------------------------------- */

int nat_run_op(nat_pool *pool, int isa, const nat_instr *in, void *const *bufs, const nat_weight *weights) {
    switch (in->op) {
    case NAT_OP_BINARY:
        run_flat(pool, in, bufs, in->n[1] * in->n[2] * in->n[3], in->n[4], binary_chunk);
        return 0;
    case NAT_OP_UNARY:
        run_flat(pool, in, bufs, in->n[1], in->n[0] == NAT_SILU || in->n[0] == NAT_GELU ? EXP_ELEMENT_COST : 1,
                 unary_chunk);
        return 0;
    case NAT_OP_SWIGLU:
        run_flat(pool, in, bufs, in->n[0] * in->n[1], EXP_ELEMENT_COST, swiglu_chunk);
        return 0;
    case NAT_OP_RMS_NORM: case NAT_OP_NORM: case NAT_OP_SOFTMAX:
        run_flat(pool, in, bufs, in->n[0], in->n[1], row_chunk);
        return 0;
    case NAT_OP_GET_ROWS: case NAT_OP_GET_ROWS_W:
        return get_rows(pool, in, bufs, weights);
    case NAT_OP_SLICE:
        slice_rows(in, bufs);
        return 0;
    case NAT_OP_ROPE:
        run_flat(pool, in, bufs, in->n[0], in->n[1] * in->n[2], rope_chunk);
        return 0;
    case NAT_OP_ROPE_ANGLES:  /* a sine and a cosine cost about as much as ROPE_ANGLE_COST elements of an add */
        run_flat(pool, in, bufs, in->n[0], in->n[3] * ROPE_ANGLE_COST, rope_angles_chunk);
        return 0;
    case NAT_OP_KV_WRITE:
        return kv_write(isa, in, bufs);
    case NAT_OP_ATTEND:
        return nat_attend(pool, isa, F32_AT(bufs, in, 1), WORDS(bufs, in, 2), WORDS(bufs, in, 3),
                          F32_AT(bufs, in, 4), HAS(in, 5) ? F32_AT(bufs, in, 5) : NULL,
                          HAS(in, 6) ? (const int32_t *)WORDS(bufs, in, 6) : NULL, F32_AT(bufs, in, 0), in->n,
                          in->f[0], in->f[1]);
    default:
        return NAT_BAD_INSTRUCTION;
    }
}

/* ---- the per-op entry points of the kernel tests ------------------------------------------------------------- */

/* out[rows, n] = x / sqrt(mean(x^2) + eps) (* w[n] when w is not NULL) */
void nat_rms_norm(nat_pool *pool, const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    void *bufs[3] = {out, (void *)x, (void *)w};
    nat_instr in = {.op = NAT_OP_RMS_NORM, .buf = {0, 1, w ? 2 : -1, -1, -1, -1, -1}, .n = {rows, n, rows, rows * n},
                    .f = {eps}};
    nat_run_op(pool, NAT_ISA_SCALAR, &in, bufs, NULL);
}

/* q [T, H, Dk], k cache [Hkv, n_cells, Dk], v cache [Hkv, n_cells, Dv] (float32, or f16 with kv_f16), mask
 * [T, n_kv], sinks [H] (or NULL), order [n_kv] (or NULL: cell order) -> out [T, H * Dv] on ISA path isa. Returns
 * nat_attend's status. */
int nat_attention(nat_pool *pool, int isa, const float *q, const void *k, const void *v, const float *mask,
                  const float *sinks, const int32_t *order, float *out, int64_t n_tokens, int64_t n_head,
                  int64_t n_head_kv, int64_t dk, int64_t dv, int64_t n_kv, int64_t n_cells, float scale,
                  float softcap, int64_t kv_f16) {
    int64_t n[8] = {n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells, kv_f16};
    return nat_attend(pool, isa, q, k, v, mask, sinks, order, out, n, scale, softcap);
}
