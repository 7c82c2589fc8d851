/* Attention over the KV cache (NAT_OP_ATTEND): a portable C path and AVX2 / AVX-512 paths that compute the same
 * bits. For each query row t and head h alone, over the cells j its mask row shows (mask_j > -inf), in the order
 * `order` lists the cells (the graph's kv_order: the cells by ascending position), numbering them c = 0, 1, ...
 * (the c-th visible cell: never its cell index, so a sequence's result does not move with where its cells sit in
 * the cache, a sliding window's ring that wrapped included):
 *   qs   = q * scale
 *   s_c  = dot(qs, k_j): element d into lane d % 16, lane = fma(qs[d], k[d], lane) (lanes from +0), then the lanes
 *          reduced l + l+8, l + l+4, l + l+2, l + l+1 (native.h's canonical sixteen lanes)
 *          [s_c = tanh(s_c / softcap) * softcap]; s_c = s_c + mask_j
 *   best = the largest s_c (and the sink);  p_c = nat_exp(s_c - best)  (nat_exp.h: one polynomial, the same on every path)
 *   total = the p_c summed with p_c into lane c % 16, then the same reduction [+ nat_exp(sink - best)]
 *   out[d] = fma(p_n, v_n[d], ... fma(p_1, v_1[d], fma(p_0, v_0[d], 0))) / total   (cells in order, one lane per d;
 *            fma(a, b, c) = a*b + c rounded once: the vector paths' fused multiply-adds, fmaf in the portable path)
 * A row that sees no cell gives NaN (0/0, like the oracle). Hidden cells cost nothing: a tile of query rows only
 * visits the key blocks (16 entries of `order`) some row of it sees (causal prefill never looks at future keys); the
 * kernels read each key through its own row pointer, so keys of cells anywhere (a sequence beside others) are read
 * where they lie, never copied. Tiles share the K loads
 * across their rows and the heads of a GQA group; a row's arithmetic is the same whatever tile, thread or ISA
 * path computes it. K and V are float32, or f16 (the default cache) widened exactly where they are read: in the AVX2
 * and AVX-512 kernels' loads, else into a buffer of 16 keys or 64 value rows (the sums run on over the chunks), or,
 * for a prefill whose rows each read most cells, all at once into a float32 copy for the op; so an f16 cache gives
 * the bits of a float32 cache holding its values. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "nat_exp.h"
#include "pool.h"

#define KEYS 16  /* keys per score block: one call of an ISA's scores kernel */

/* ---- one ISA's kernels ------------------------------------------------------------------------------------- */

typedef struct {
    /* out[i] = dot(q, keys[i]) [+ add[i] when add is not NULL] for the KEYS key rows (q padded with zeros to whole
     * 16s) */
    void (*scores)(const float *q, const float *const *keys, int64_t dk, const float *add, float *out);
    /* the largest of s[0..n) (n > 0; NaNs ignored; which zero of +0 and -0 when both are there is unspecified:
     * it changes no result, as nat_exp(x - (+0)) and nat_exp(x - (-0)) are the same) */
    float (*peak)(const float *s, int64_t n);
    /* p[c] = nat_exp(p[c] - best) for c < n; returns their canonical sum */
    float (*exp_sum)(float *p, int64_t n, float best);
    /* for each of the heads h: out[h][d] = out[h][d] + p[h][c] * v[cells[c] * dv + d], c = 0..n-1 in order */
    void (*weigh)(float *const *out, const float *const *p, int64_t heads, const int32_t *cells, int64_t n,
                  const float *v, int64_t dv);
    /* scores and weigh over f16 keys and values, widened as they are loaded (dk a multiple of 16, dv of 8), the
     * same bits; NULL: the driver widens rows into a buffer for scores and weigh */
    void (*scores_f16)(const float *q, const uint16_t *const *keys, int64_t dk, const float *add, float *out);
    void (*weigh_f16)(float *const *out, const float *const *p, int64_t heads, const int32_t *cells, int64_t n,
                      const uint16_t *v, int64_t dv);
    /* the visible cells of a mask row (its entries above -inf) in the order order[0..n) lists them: cells[c] =
     * order[o] and at[c] = o for the c-th of them (o ascending); order NULL: cell order (o is the cell, at not
     * written). Returns their count. */
    int64_t (*visible)(const float *row, const int32_t *order, int64_t n, int32_t *cells, int32_t *at);
    /* scores_f16 for heads (1 to SHARED_HEADS) query rows q[h] against the same KEYS keys, into out[h]: each key
     * widened once for them all, the same bits; NULL: scores_f16 per head */
    void (*scores_f16_heads)(int heads, const float *const *q, const uint16_t *const *keys, int64_t dk,
                             const float *add, float *const *out);
} attn_kernels;

#define SHARED_HEADS 3  /* query heads one scores_f16_heads call takes (its sums stay in registers) */

/* native.h's reduction of sixteen lanes (nat_reduce16), inlined: the scalar path runs it for every score */
static inline float reduce_lanes(float *lanes) {
    for (int step = 8; step >= 1; step >>= 1)
        for (int l = 0; l < step; l++) lanes[l] = lanes[l] + lanes[l + step];
    return lanes[0];
}

/* q . k in native.h's canonical sixteen lanes, element d into lane d % 16: each product added to its lane by a
 * multiply then an add, or (fused) by one fused multiply-add; a constant at each caller, so each loop compiles to
 * its own (the unfused one vectorises) */
static inline float lane_dot(const float *q, const float *k, int64_t n, int fused) {
    float lanes[16] = {0};
    for (int64_t d = 0; d < n; d += 16) {
        int64_t m = n - d < 16 ? n - d : 16;
        for (int64_t l = 0; l < m; l++)
            lanes[l] = fused ? fmaf(q[d + l], k[d + l], lanes[l]) : lanes[l] + q[d + l] * k[d + l];
    }
    return reduce_lanes(lanes);  /* the padding would add +0 to lanes that are never -0: no change */
}

/* the recurrent ops' dot product (recurrent.c): a multiply then an add per product */
float nat_dot16(const float *q, const float *k, int64_t n) { return lane_dot(q, k, n, 0); }

/* q . k as attention's scores sum it: one fused multiply-add per product */
static float attn_dot16(const float *q, const float *k, int64_t n) { return lane_dot(q, k, n, 1); }

static void scores_scalar(const float *q, const float *const *keys, int64_t dk, const float *add, float *out) {
    for (int i = 0; i < KEYS; i++) {
        float dot = attn_dot16(q, keys[i], dk);
        out[i] = add ? dot + add[i] : dot;
    }
}

static float exp_sum_scalar(float *p, int64_t n, float best) {
    float lanes[16] = {0};
    for (int64_t c0 = 0; c0 < n; c0 += 16) {  /* p[c] into lane c % 16, by whole 16s: the loop vectorises */
        int64_t m = n - c0 < 16 ? n - c0 : 16;
        for (int64_t l = 0; l < m; l++) {
            p[c0 + l] = nat_exp(p[c0 + l] - best);
            lanes[l] = lanes[l] + p[c0 + l];
        }
    }
    return reduce_lanes(lanes);
}

static float peak_scalar(const float *s, int64_t n) {
    float best = -INFINITY;
    for (int64_t c = 0; c < n; c++) best = s[c] > best ? s[c] : best;
    return best;
}

/* attn_kernels.visible without branches: a mask row has runs of both kinds */
static int64_t visible_scalar(const float *row, const int32_t *order, int64_t n, int32_t *cells, int32_t *at) {
    int64_t count = 0;
    if (!order) {
        for (int64_t j = 0; j < n; j++) {
            cells[count] = (int32_t)j;
            count += row[j] != -INFINITY;
        }
        return count;
    }
    for (int64_t o = 0; o < n; o++) {
        int32_t j = order[o];
        cells[count] = j;
        at[count] = (int32_t)o;
        count += row[j] != -INFINITY;
    }
    return count;
}

static void weigh_scalar(float *const *out, const float *const *p, int64_t heads, const int32_t *cells, int64_t n,
                         const float *v, int64_t dv) {
    for (int64_t h = 0; h < heads; h++) {
        float *restrict acc = out[h];
        for (int64_t c = 0; c < n; c++) {
            const float *restrict row = v + (int64_t)cells[c] * dv;
            float pc = p[h][c];
            for (int64_t d = 0; d < dv; d++) acc[d] = fmaf(pc, row[d], acc[d]);
        }
    }
}

#ifdef NAT_HAVE_X86
#include <immintrin.h>

#define TARGET2 __attribute__((target("avx2,fma,f16c")))
#define TARGET512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* nat_exp's 2^n * poly(r) for the clamped argument c on W-bit vectors (256: AVX2, 512: AVX-512), into out */
#define EXP_SCALED(W, c, out)                                                                                  \
    do {                                                                                                       \
        __m##W shift = _mm##W##_set1_ps(EXP_SHIFT);                                                            \
        __m##W shifted = _mm##W##_add_ps(_mm##W##_mul_ps(c, _mm##W##_set1_ps(EXP_LOG2E)), shift);              \
        __m##W n = _mm##W##_sub_ps(shifted, shift);                                                            \
        __m##W##i e = _mm##W##_add_epi32(_mm##W##_sub_epi32(_mm##W##_castps_si##W(shifted),                    \
                                                            _mm##W##_castps_si##W(shift)),                     \
                                         _mm##W##_set1_epi32(127));                                            \
        __m##W scale = _mm##W##_castsi##W##_ps(_mm##W##_slli_epi32(e, 23));                                    \
        __m##W r = _mm##W##_sub_ps(_mm##W##_sub_ps(c, _mm##W##_mul_ps(n, _mm##W##_set1_ps(EXP_LN2_HI))),       \
                                   _mm##W##_mul_ps(n, _mm##W##_set1_ps(EXP_LN2_LO)));                          \
        __m##W z = _mm##W##_mul_ps(r, r);                                                                      \
        __m##W y = _mm##W##_add_ps(_mm##W##_mul_ps(_mm##W##_set1_ps(EXP_P0), r), _mm##W##_set1_ps(EXP_P1));    \
        y = _mm##W##_add_ps(_mm##W##_mul_ps(y, r), _mm##W##_set1_ps(EXP_P2));                                  \
        y = _mm##W##_add_ps(_mm##W##_mul_ps(y, r), _mm##W##_set1_ps(EXP_P3));                                  \
        y = _mm##W##_add_ps(_mm##W##_mul_ps(y, r), _mm##W##_set1_ps(EXP_P4));                                  \
        y = _mm##W##_add_ps(_mm##W##_mul_ps(y, r), _mm##W##_set1_ps(EXP_P5));                                  \
        y = _mm##W##_add_ps(_mm##W##_add_ps(_mm##W##_mul_ps(y, z), r), _mm##W##_set1_ps(1.0f));                \
        out = _mm##W##_mul_ps(y, scale);                                                                       \
    } while (0)

/* ---- AVX2: the sixteen lanes as two 8-lane halves (lanes 0-7, 8-15) ---- */

TARGET2 static inline __m256i avx2_keep(int64_t n) {  /* lanes < n of 8 */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TARGET2 static inline __m256 avx2_load(const float *p, int64_t n) {  /* n < 8: the rest zeros, never read */
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, avx2_keep(n));
}

TARGET2 static inline __m256 avx2_load_cut(const float *p, int64_t n) { return _mm256_maskload_ps(p, avx2_keep(n)); }

/* 8 f16 values from p, widened */
TARGET2 static inline __m256 avx2_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* the 16-lane sums of q . k for keys k[0..3] over dims [0, dk): float32 keys (a cut tail masked) or f16 keys (whole
 * 16s), LOAD(key, d) giving 8 of a key's values from d on */
#define AVX2_KEY_SUMS(LOAD, CUT)                                                                               \
    do {                                                                                                       \
        int64_t d = 0;                                                                                         \
        for (; d + 16 <= dk; d += 16) {                                                                        \
            __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);                               \
            for (int i = 0; i < 4; i++) {                                                                      \
                lo[i] = _mm256_fmadd_ps(q0, LOAD(k[i], d), lo[i]);                                             \
                hi[i] = _mm256_fmadd_ps(q1, LOAD(k[i], d + 8), hi[i]);                                         \
            }                                                                                                  \
        }                                                                                                      \
        if (CUT && d < dk) {                                                                                   \
            __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);                               \
            for (int i = 0; i < 4; i++) {                                                                      \
                lo[i] = _mm256_fmadd_ps(q0, avx2_load_cut((const float *)k[i] + d, dk - d), lo[i]);            \
                hi[i] = _mm256_fmadd_ps(q1, avx2_load_cut((const float *)k[i] + d + 8, dk - d - 8), hi[i]);    \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
#define AVX2_LOAD_KEY(key, d) _mm256_loadu_ps((key) + (d))
#define AVX2_LOAD_KEY_F16(key, d) avx2_load_f16((key) + (d))

/* four keys' lanes l + l+8 (s8) reduced to their l + l+2 pairs: [k0 k0 k2 k2 | k1 k1 k3 k3] */
TARGET2 static inline __m256 avx2_pairs_of_s8(const __m256 *s8) {
    __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(s8[0], s8[1], 0x20), _mm256_permute2f128_ps(s8[0], s8[1], 0x31));
    __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(s8[2], s8[3], 0x20), _mm256_permute2f128_ps(s8[2], s8[3], 0x31));
    /* a = [k0 s4 | k1 s4], b = [k2 s4 | k3 s4]; l + l+2: */
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
}

/* lanes l + l+8 of each of four keys, then avx2_pairs_of_s8 */
TARGET2 static inline __m256 avx2_four_pairs(const __m256 *lo, const __m256 *hi) {
    __m256 s8[4];
    for (int i = 0; i < 4; i++) s8[i] = _mm256_add_ps(lo[i], hi[i]);  /* l + l+8 */
    return avx2_pairs_of_s8(s8);
}

TARGET2 static inline __m256 avx2_four_keys(const float *q, const float *const *k, int64_t dk) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    AVX2_KEY_SUMS(AVX2_LOAD_KEY, 1);
    return avx2_four_pairs(lo, hi);
}

TARGET2 static inline __m256 avx2_four_keys_f16(const float *q, const uint16_t *const *k, int64_t dk) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    AVX2_KEY_SUMS(AVX2_LOAD_KEY_F16, 0);
    return avx2_four_pairs(lo, hi);
}

/* l + l+1 of two four-key pair sums: lanes [k0 k2 k4 k6 | k1 k3 k5 k7] of these 8 keys, in key order, [+ add] */
TARGET2 static inline void avx2_store_scores(__m256 e, __m256 f, const float *add, float *out) {
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(e, f, 0x88), _mm256_shuffle_ps(e, f, 0xDD));
    s = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (add) s = _mm256_add_ps(s, _mm256_loadu_ps(add));
    _mm256_storeu_ps(out, s);
}

TARGET2 static void scores_avx2(const float *q, const float *const *k, int64_t dk, const float *add, float *out) {
    for (int half = 0; half < 2; half++)
        avx2_store_scores(avx2_four_keys(q, k + 8 * half, dk), avx2_four_keys(q, k + 8 * half + 4, dk),
                          add ? add + 8 * half : NULL, out + 8 * half);
}

TARGET2 static void scores_f16_avx2(const float *q, const uint16_t *const *k, int64_t dk, const float *add,
                                    float *out) {
    for (int half = 0; half < 2; half++)
        avx2_store_scores(avx2_four_keys_f16(q, k + 8 * half, dk), avx2_four_keys_f16(q, k + 8 * half + 4, dk),
                          add ? add + 8 * half : NULL, out + 8 * half);
}

/* The scores of KEYS keys for HEADS query rows, each key's values widened once for them all: per key and head the
 * sixteen lanes in two halves (2 * HEADS sums in registers), added l + l+8 into s8; then each head's keys through
 * the reduction of avx2_four_keys: the same adds in the same order, so the same bits as scores_f16_avx2. */
#define AVX2_SCORES_HEADS(HEADS)                                                                               \
    TARGET2 static void scores_f16_##HEADS##_avx2(const float *const *q, const uint16_t *const *k, int64_t dk, \
                                                  const float *add, float *const *out) {                       \
        __m256 s8[HEADS][KEYS];                                                                                \
        for (int i = 0; i < KEYS; i++) {                                                                       \
            __m256 lo[HEADS], hi[HEADS];                                                                       \
            for (int h = 0; h < HEADS; h++) lo[h] = hi[h] = _mm256_setzero_ps();                               \
            for (int64_t d = 0; d < dk; d += 16) {                                                             \
                __m256 k0 = avx2_load_f16(k[i] + d), k1 = avx2_load_f16(k[i] + d + 8);                         \
                for (int h = 0; h < HEADS; h++) {                                                              \
                    lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + d), k0, lo[h]);                             \
                    hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + d + 8), k1, hi[h]);                         \
                }                                                                                              \
            }                                                                                                  \
            for (int h = 0; h < HEADS; h++) s8[h][i] = _mm256_add_ps(lo[h], hi[h]);                            \
        }                                                                                                      \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int half = 0; half < 2; half++)                                                               \
                avx2_store_scores(avx2_pairs_of_s8(s8[h] + 8 * half), avx2_pairs_of_s8(s8[h] + 8 * half + 4),  \
                                  add ? add + 8 * half : NULL, out[h] + 8 * half);                             \
    }
AVX2_SCORES_HEADS(1)
AVX2_SCORES_HEADS(2)
AVX2_SCORES_HEADS(3)

TARGET2 static void scores_f16_heads_avx2(int heads, const float *const *q, const uint16_t *const *keys, int64_t dk,
                                          const float *add, float *const *out) {
    if (heads == 3) scores_f16_3_avx2(q, keys, dk, add, out);
    else if (heads == 2) scores_f16_2_avx2(q, keys, dk, add, out);
    else scores_f16_1_avx2(q, keys, dk, add, out);
}

/* nat_exp on 8 lanes */
TARGET2 static inline __m256 avx2_exp(__m256 x) {
    __m256 c = _mm256_blendv_ps(x, _mm256_set1_ps(EXP_HIGH), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HIGH), _CMP_GT_OQ));
    __m256 scaled;
    EXP_SCALED(256, c, scaled);
    __m256 low = _mm256_cmp_ps(c, _mm256_set1_ps(EXP_LOW), _CMP_LT_OQ);
    return _mm256_andnot_ps(low, scaled);
}

TARGET2 static float exp_sum_avx2(float *p, int64_t n, float best) {
    __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, b = _mm256_set1_ps(best);
    for (int64_t c = 0; c < n; c += 8) {
        int64_t left = n - c;
        __m256 e = avx2_exp(_mm256_sub_ps(avx2_load(p + c, left), b));
        if (left >= 8) _mm256_storeu_ps(p + c, e);
        else {
            e = _mm256_and_ps(e, _mm256_castsi256_ps(avx2_keep(left)));  /* padding adds +0 */
            _mm256_maskstore_ps(p + c, avx2_keep(left), e);
        }
        lanes[(c / 8) % 2] = _mm256_add_ps(lanes[(c / 8) % 2], e);
    }
    float all[16];
    _mm256_storeu_ps(all, lanes[0]);
    _mm256_storeu_ps(all + 8, lanes[1]);
    return nat_reduce16(all);
}

/* 64 lanes of out from d0 (the chunk is whole: FULL, or cut at dv) in registers over every cell; LOAD reads out,
 * ROW_LOAD(row, n) 8 values of a value row (n of them left) */
#define AVX2_WEIGH_CHUNK(LOAD, ROW_LOAD, T)                                                                    \
    do {                                                                                                       \
        __m256 acc[8];                                                                                         \
        for (int i = 0; i < 8; i++) acc[i] = LOAD(out + d0 + 8 * i, dv - d0 - 8 * i);                          \
        for (int64_t c = 0; c < n; c++) {                                                                      \
            const T *row = v + (int64_t)cells[c] * dv + d0;                                                    \
            __m256 pc = _mm256_set1_ps(p[c]);                                                                  \
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pc, ROW_LOAD(row + 8 * i, dv - d0 - 8 * i), acc[i]); \
        }                                                                                                      \
        for (int i = 0; i < 8; i++) avx2_store(out + d0 + 8 * i, dv - d0 - 8 * i, acc[i]);                    \
    } while (0)

/* 8 f16 values (dv a multiple of 8: a piece is whole, or past dv: zeros, never stored) */
TARGET2 static inline __m256 avx2_load_f16_piece(const uint16_t *p, int64_t n) {
    return n >= 8 ? avx2_load_f16(p) : _mm256_setzero_ps();
}

TARGET2 static inline __m256 avx2_load_full(const float *p, int64_t n) {
    (void)n;
    return _mm256_loadu_ps(p);
}


TARGET2 static inline void avx2_store(float *p, int64_t n, __m256 x) {
    if (n >= 8) _mm256_storeu_ps(p, x);
    else if (n > 0) _mm256_maskstore_ps(p, avx2_keep(n), x);
}

TARGET2 static void weigh_one_avx2(float *out, const float *p, const int32_t *cells, int64_t n, const float *v,
                                   int64_t dv) {
    int64_t d0 = 0;
    for (; d0 + 64 <= dv; d0 += 64) AVX2_WEIGH_CHUNK(avx2_load_full, avx2_load_full, float);
    if (d0 < dv) AVX2_WEIGH_CHUNK(avx2_load_cut, avx2_load_cut, float);
}

/* 32 lanes of out[h] from d0 for HEADS heads at once (12 sums in registers at most), each value row's 32 values
 * widened once for them all, 16 at a time; PIECE(row, n): 8 values of a value row (n of them left). Each lane's
 * chain over the cells is that of AVX2_WEIGH_CHUNK: the same bits. */
#define AVX2_WEIGH_HEADS_CHUNK(HEADS, PIECE)                                                                   \
    do {                                                                                                       \
        __m256 acc[HEADS][4];                                                                                  \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int i = 0; i < 4; i++) acc[h][i] = avx2_load_cut(out[h] + d0 + 8 * i, dv - d0 - 8 * i);      \
        for (int64_t c = 0; c < n; c++) {                                                                      \
            const uint16_t *row = v + (int64_t)cells[c] * dv + d0;                                             \
            for (int i = 0; i < 4; i += 2) {                                                                   \
                __m256 v0 = PIECE(row + 8 * i, dv - d0 - 8 * i), v1 = PIECE(row + 8 * i + 8, dv - d0 - 8 * i - 8); \
                for (int h = 0; h < HEADS; h++) {                                                              \
                    __m256 pc = _mm256_set1_ps(p[h][c]);                                                       \
                    acc[h][i] = _mm256_fmadd_ps(pc, v0, acc[h][i]);                                            \
                    acc[h][i + 1] = _mm256_fmadd_ps(pc, v1, acc[h][i + 1]);                                    \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int i = 0; i < 4; i++) avx2_store(out[h] + d0 + 8 * i, dv - d0 - 8 * i, acc[h][i]);          \
    } while (0)

TARGET2 static inline __m256 avx2_load_f16_whole(const uint16_t *p, int64_t n) {
    (void)n;
    return avx2_load_f16(p);
}

#define AVX2_WEIGH_HEADS(HEADS)                                                                                \
    TARGET2 static void weigh_f16_##HEADS##_avx2(float *const *out, const float *const *p, const int32_t *cells, \
                                                 int64_t n, const uint16_t *v, int64_t dv) {                   \
        int64_t d0 = 0;                                                                                        \
        for (; d0 + 32 <= dv; d0 += 32) AVX2_WEIGH_HEADS_CHUNK(HEADS, avx2_load_f16_whole);                    \
        if (d0 < dv) AVX2_WEIGH_HEADS_CHUNK(HEADS, avx2_load_f16_piece);                                       \
    }
AVX2_WEIGH_HEADS(1)
AVX2_WEIGH_HEADS(2)
AVX2_WEIGH_HEADS(3)

/* the heads three at a time (two and two for four: fewer sums than three and one), each value row widened once
 * per call of a group */
TARGET2 static void weigh_f16_avx2(float *const *out, const float *const *p, int64_t heads, const int32_t *cells,
                                   int64_t n, const uint16_t *v, int64_t dv) {
    while (heads > 0) {
        int take = heads >= 3 && heads != 4 ? 3 : heads >= 2 ? 2 : 1;
        if (take == 3) weigh_f16_3_avx2(out, p, cells, n, v, dv);
        else if (take == 2) weigh_f16_2_avx2(out, p, cells, n, v, dv);
        else weigh_f16_1_avx2(out, p, cells, n, v, dv);
        out += take;
        p += take;
        heads -= take;
    }
}

TARGET2 static void weigh_avx2(float *const *out, const float *const *p, int64_t heads, const int32_t *cells,
                               int64_t n, const float *v, int64_t dv) {
    for (int64_t h = 0; h < heads; h++) weigh_one_avx2(out[h], p[h], cells, n, v, dv);
}

TARGET2 static float peak_avx2(const float *s, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; c += 8) {
        __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), avx2_load(s + c, n - c),
                                    _mm256_castsi256_ps(avx2_keep(n - c)));
        best = _mm256_max_ps(x, best);  /* x > best ? x : best */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    return peak_scalar(lanes, 8);
}

/* ---- AVX-512: the sixteen lanes as one register ---- */

/* lanes < n of 16 (none for n <= 0) */
TARGET512 static inline __mmask16 avx512_keep(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

#define EACH_KEY(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define ZERO_ACC(i) __m512 acc##i = _mm512_setzero_ps();
#define FULL_LOAD(p) _mm512_loadu_ps(p)
#define CUT_LOAD(p) _mm512_maskz_loadu_ps(keep, p)
/* 16 f16 values widened (CUT: those of the lanes `keep` selects, the others +0 as a float32 cut gives them) */
#define FULL_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define CUT_LOAD_F16(p) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, p))
/* one reduction step of two registers: lanes (l, l + width) summed, per TAKE's two operand selections */
#define PAIR_F32X4(a, b, lo, hi) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, lo), _mm512_shuffle_f32x4(a, b, hi))
#define PAIR_PS(a, b, lo, hi) _mm512_add_ps(_mm512_shuffle_ps(a, b, lo), _mm512_shuffle_ps(a, b, hi))

/* the scores of 16 keys (K: their element type; FULL, CUT: the loads of 16 of a key's values, whole or cut at dk) */
#define AVX512_SCORES(K, FULL, CUT)                                                                            \
    TARGET512 static void K##_scores_avx512(const float *q, const K *const *k, int64_t dk, const float *add,   \
                                            float *out) {                                                      \
        EACH_KEY(ZERO_ACC)                                                                                     \
        int64_t d = 0;                                                                                         \
        for (; d + 16 <= dk; d += 16) {                                                                        \
            __m512 qv = _mm512_loadu_ps(q + d);                                                                \
            EACH_KEY_WITH(ADD_KEY, FULL)                                                                           \
        }                                                                                                      \
        if (d < dk) {                                                                                          \
            __m512 qv = _mm512_loadu_ps(q + d);                                                                \
            __mmask16 keep = avx512_keep(dk - d);                                                              \
            EACH_KEY_WITH(ADD_KEY, CUT)                                                                            \
        }                                                                                                      \
        store_scores_avx512(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9, acc10, acc11, acc12,  \
                            acc13, acc14, acc15, add, out);                                                    \
    }
/* key i's next 16 products with q added to its lanes, its values read by LOAD */
#define ADD_KEY(LOAD, i) acc##i = _mm512_fmadd_ps(qv, LOAD(k[i] + d), acc##i);
#define EACH_KEY_WITH(X, A) X(A, 0) X(A, 1) X(A, 2) X(A, 3) X(A, 4) X(A, 5) X(A, 6) X(A, 7) X(A, 8) X(A, 9) \
    X(A, 10) X(A, 11) X(A, 12) X(A, 13) X(A, 14) X(A, 15)

/* the fixed reduction of the 16 keys' lanes, 16 keys at once: l + l+8 (keys i, i+8 share a register), l + l+4,
 * l + l+2, l + l+1; [+ add] */
TARGET512 static inline void store_scores_avx512(__m512 acc0, __m512 acc1, __m512 acc2, __m512 acc3, __m512 acc4,
                                                 __m512 acc5, __m512 acc6, __m512 acc7, __m512 acc8, __m512 acc9,
                                                 __m512 acc10, __m512 acc11, __m512 acc12, __m512 acc13,
                                                 __m512 acc14, __m512 acc15, const float *add, float *out) {
    __m512 s8_0 = PAIR_F32X4(acc0, acc8, 0x44, 0xEE), s8_1 = PAIR_F32X4(acc1, acc9, 0x44, 0xEE);
    __m512 s8_2 = PAIR_F32X4(acc2, acc10, 0x44, 0xEE), s8_3 = PAIR_F32X4(acc3, acc11, 0x44, 0xEE);
    __m512 s8_4 = PAIR_F32X4(acc4, acc12, 0x44, 0xEE), s8_5 = PAIR_F32X4(acc5, acc13, 0x44, 0xEE);
    __m512 s8_6 = PAIR_F32X4(acc6, acc14, 0x44, 0xEE), s8_7 = PAIR_F32X4(acc7, acc15, 0x44, 0xEE);
    /* 128-bit blocks: keys [i, i+8, i+4, i+12] */
    __m512 s4_0 = PAIR_F32X4(s8_0, s8_4, 0x88, 0xDD), s4_1 = PAIR_F32X4(s8_1, s8_5, 0x88, 0xDD);
    __m512 s4_2 = PAIR_F32X4(s8_2, s8_6, 0x88, 0xDD), s4_3 = PAIR_F32X4(s8_3, s8_7, 0x88, 0xDD);
    __m512 s2_0 = PAIR_PS(s4_0, s4_2, 0x44, 0xEE), s2_1 = PAIR_PS(s4_1, s4_3, 0x44, 0xEE);
    __m512 s1 = PAIR_PS(s2_0, s2_1, 0x88, 0xDD);
    /* s1's lanes hold keys [0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15] */
    s1 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), s1);
    if (add) s1 = _mm512_add_ps(s1, _mm512_loadu_ps(add));
    _mm512_storeu_ps(out, s1);
}

AVX512_SCORES(float, FULL_LOAD, CUT_LOAD)
AVX512_SCORES(uint16_t, FULL_LOAD_F16, CUT_LOAD_F16)

/* store_scores_avx512's reduction for 8 keys (the same sums of the same lanes) [+ add] */
TARGET512 static inline void store_scores8_avx512(const __m512 *acc, const float *add, float *out) {
    __m512 s8_0 = PAIR_F32X4(acc[0], acc[4], 0x44, 0xEE), s8_1 = PAIR_F32X4(acc[1], acc[5], 0x44, 0xEE);
    __m512 s8_2 = PAIR_F32X4(acc[2], acc[6], 0x44, 0xEE), s8_3 = PAIR_F32X4(acc[3], acc[7], 0x44, 0xEE);
    /* 128-bit blocks: s4_0 keys [0, 4, 2, 6], s4_1 keys [1, 5, 3, 7] */
    __m512 s4_0 = PAIR_F32X4(s8_0, s8_2, 0x88, 0xDD), s4_1 = PAIR_F32X4(s8_1, s8_3, 0x88, 0xDD);
    __m512 s2 = PAIR_PS(s4_0, s4_1, 0x44, 0xEE);  /* blocks [0 0 1 1], [4 4 5 5], [2 2 3 3], [6 6 7 7] */
    __m512 s1 = PAIR_PS(s2, s2, 0x88, 0xDD);      /* blocks [0 1 0 1], [4 5 4 5], [2 3 2 3], [6 7 6 7] */
    __m256 r = _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 8, 9, 4, 5, 12, 13, 0, 1, 8, 9, 4, 5, 12, 13), s1));
    if (add) r = _mm256_add_ps(r, _mm256_loadu_ps(add));
    _mm256_storeu_ps(out, r);
}

/* the scores of 8 keys for HEADS query rows, each key's 16 values widened once (HEADS * 8 sums in registers) */
#define SCORES8_HEADS(HEADS)                                                                                   \
    TARGET512 static void scores8_f16_##HEADS(const float *const *q, const uint16_t *const *k, int64_t dk,     \
                                              const float *add, float *const *out) {                           \
        __m512 acc[HEADS][8];                                                                                  \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int i = 0; i < 8; i++) acc[h][i] = _mm512_setzero_ps();                                       \
        for (int64_t d = 0; d < dk; d += 16) {                                                                 \
            __m512 qv[HEADS];                                                                                  \
            for (int h = 0; h < HEADS; h++) qv[h] = _mm512_loadu_ps(q[h] + d);                                 \
            for (int i = 0; i < 8; i++) {                                                                      \
                __m512 key = FULL_LOAD_F16(k[i] + d);                                                          \
                for (int h = 0; h < HEADS; h++) acc[h][i] = _mm512_fmadd_ps(qv[h], key, acc[h][i]);            \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < HEADS; h++) store_scores8_avx512(acc[h], add, out[h]);                            \
    }
SCORES8_HEADS(1)
SCORES8_HEADS(2)
SCORES8_HEADS(3)

TARGET512 static void scores_f16_heads_avx512(int heads, const float *const *q, const uint16_t *const *keys,
                                              int64_t dk, const float *add, float *const *out) {
    for (int half = 0; half < KEYS; half += 8) {
        float *dst[SHARED_HEADS];
        for (int h = 0; h < heads; h++) dst[h] = out[h] + half;
        const float *more = add ? add + half : NULL;
        if (heads == 3) scores8_f16_3(q, keys + half, dk, more, dst);
        else if (heads == 2) scores8_f16_2(q, keys + half, dk, more, dst);
        else scores8_f16_1(q, keys + half, dk, more, dst);
    }
}

TARGET512 static inline __m512 avx512_exp(__m512 x) {
    __m512 c = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HIGH), _CMP_GT_OQ), x, _mm512_set1_ps(EXP_HIGH));
    __m512 scaled;
    EXP_SCALED(512, c, scaled);
    __mmask16 low = _mm512_cmp_ps_mask(c, _mm512_set1_ps(EXP_LOW), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~low, scaled);
}

TARGET512 static float exp_sum_avx512(float *p, int64_t n, float best) {
    __m512 lanes = _mm512_setzero_ps(), b = _mm512_set1_ps(best);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 keep = avx512_keep(n - c);
        __m512 e = _mm512_maskz_mov_ps(keep, avx512_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, p + c), b)));
        _mm512_mask_storeu_ps(p + c, keep, e);
        lanes = _mm512_add_ps(lanes, e);  /* the padding adds +0 */
    }
    float all[16];
    _mm512_storeu_ps(all, lanes);
    return nat_reduce16(all);
}

/* HEADS heads at once over 64-lane chunks: each V load serves every head, 4 * HEADS independent sums per cell;
 * ROW_LOAD(keep, p): 16 values of a value row (those of the lanes keep selects, the others +0) */
#define AVX512_WEIGH(HEADS, V, ROW_LOAD)                                                                        \
    for (int64_t d0 = 0; d0 < dv; d0 += 64) {                                                                  \
        __mmask16 keep[4];                                                                                     \
        __m512 acc[HEADS][4];                                                                                  \
        for (int i = 0; i < 4; i++) keep[i] = avx512_keep(dv - d0 - 16 * i);                                  \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_maskz_loadu_ps(keep[i], out[h] + d0 + 16 * i);      \
        for (int64_t c = 0; c < n; c++) {                                                                      \
            const V *row = v + (int64_t)cells[c] * dv + d0;                                                    \
            __m512 vr[4];                                                                                      \
            for (int i = 0; i < 4; i++) vr[i] = ROW_LOAD(keep[i], row + 16 * i);                                \
            for (int h = 0; h < HEADS; h++) {                                                                  \
                __m512 pc = _mm512_set1_ps(p[h][c]);                                                           \
                for (int i = 0; i < 4; i++) acc[h][i] = _mm512_fmadd_ps(pc, vr[i], acc[h][i]);    \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < HEADS; h++)                                                                        \
            for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(out[h] + d0 + 16 * i, keep[i], acc[h][i]);       \
    }

#define ROW_LOAD_F32(keep, p) _mm512_maskz_loadu_ps(keep, p)
#define ROW_LOAD_F16(keep, p) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, p))

/* weigh and weigh_f16 of the AVX-512 path (V: the value rows' element type) */
#define AVX512_WEIGH_HEADS(V, ROW_LOAD)                                                                        \
    TARGET512 static void V##_weigh_avx512(float *const *out, const float *const *p, int64_t heads,            \
                                           const int32_t *cells, int64_t n, const V *v, int64_t dv) {          \
        for (; heads >= 4; heads -= 4, out += 4, p += 4) { AVX512_WEIGH(4, V, ROW_LOAD) }                         \
        if (heads == 3) { AVX512_WEIGH(3, V, ROW_LOAD) }                                                          \
        if (heads == 2) { AVX512_WEIGH(2, V, ROW_LOAD) }                                                          \
        if (heads == 1) { AVX512_WEIGH(1, V, ROW_LOAD) }                                                          \
    }

AVX512_WEIGH_HEADS(float, ROW_LOAD_F32)
AVX512_WEIGH_HEADS(uint16_t, ROW_LOAD_F16)

TARGET512 static float peak_avx512(const float *s, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; c += 16)
        best = _mm512_max_ps(_mm512_mask_loadu_ps(best, avx512_keep(n - c), s + c), best);  /* x > best ? x : best */
    float lanes[16];
    _mm512_storeu_ps(lanes, best);
    return peak_scalar(lanes, 16);
}

/* visible_scalar sixteen entries at a time: the visible ones' cells (and places) compressed into place */
TARGET512 static int64_t visible_avx512(const float *row, const int32_t *order, int64_t n, int32_t *cells,
                                        int32_t *at) {
    int64_t count = 0;
    __m512 hidden = _mm512_set1_ps(-INFINITY);
    __m512i place = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t o = 0; o < n; o += 16, place = _mm512_add_epi32(place, _mm512_set1_epi32(16))) {
        __mmask16 keep = avx512_keep(n - o);
        if (!order) {
            __mmask16 seen = _mm512_mask_cmp_ps_mask(keep, _mm512_maskz_loadu_ps(keep, row + o), hidden, _CMP_NEQ_UQ);
            _mm512_mask_compressstoreu_epi32(cells + count, seen, place);
            count += __builtin_popcount(seen);
            continue;
        }
        __m512i cell = _mm512_maskz_loadu_epi32(keep, order + o);
        __m512 value = _mm512_mask_i32gather_ps(hidden, keep, cell, row, 4);
        __mmask16 seen = _mm512_mask_cmp_ps_mask(keep, value, hidden, _CMP_NEQ_UQ);
        _mm512_mask_compressstoreu_epi32(cells + count, seen, cell);
        _mm512_mask_compressstoreu_epi32(at + count, seen, place);
        count += __builtin_popcount(seen);
    }
    return count;
}
#endif

static const attn_kernels *kernels_for(int isa) {
    static const attn_kernels scalar = {scores_scalar, peak_scalar, exp_sum_scalar, weigh_scalar, NULL, NULL,
                                        visible_scalar, NULL};
#ifdef NAT_HAVE_X86
    static const attn_kernels avx2 = {scores_avx2, peak_avx2, exp_sum_avx2, weigh_avx2, scores_f16_avx2,
                                      weigh_f16_avx2, visible_scalar, scores_f16_heads_avx2};
    static const attn_kernels avx512 = {float_scores_avx512, peak_avx512, exp_sum_avx512, float_weigh_avx512,
                                        uint16_t_scores_avx512, uint16_t_weigh_avx512, visible_avx512,
                                        scores_f16_heads_avx512};
    if (isa == NAT_ISA_AVX512 || isa == NAT_ISA_AMX) return &avx512;
    if (isa == NAT_ISA_AVX2) return &avx2;
#endif
    (void)isa;
    return &scalar;
}

/* ---- the driver: work items of (query tile, KV head, heads of its group) ---------------------------------- */

/* query rows per tile in a prefill (a decode step gives each row, and each head, its own item for the threads) */
#define TILE_ROWS 4
#define DECODE_ROWS 16  /* fewer rows than this: a decode step */
#define MAX_HEADS 8  /* heads of a GQA group per work item, at most */
#define ITEMS_PER_THREAD 4  /* work items per thread, at least, where the heads can be split that far */
#define VALUES 64  /* value rows of an f16 cache widened at a time (the weighted sum runs on over the chunks) */

typedef struct {
    const float *q, *mask, *sinks;
    const char *k, *v;     /* the caches: float32, or f16 (widen: their rows to float32, as they are used) */
    size_t esize;
    nat_from_f16_fn widen;
    int direct16;          /* f16 caches the ISA's f16 kernels read in place (else widened into a buffer) */
    int32_t local[VALUES]; /* 0, 1, ...: the cells of a chunk of widened value rows */
    const int32_t *order;  /* the n_kv cells in the order their scores are summed, each in [0, n_kv) */
    int in_cell_order;     /* order[o] == o for every o: a cell's place in the order is the cell */
    float *out;
    int64_t n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells;
    float scale, softcap;
    const attn_kernels *isa;
    int64_t tile_rows, heads_per_item, parts, n_items, n_chunks;
    size_t scratch_floats;  /* per thread */
    float *scratch;
} attn_job;

/* per thread: q rows [tile * heads][dk padded], scores [tile * heads][n_kv], a block's scores [KEYS], visible
 * cells [tile][n_kv] and their places in `order` [tile][n_kv]; for an f16 cache, widened keys [KEYS][dk] and values
 * [VALUES][dv] */
static size_t scratch_floats(const attn_job *job) {
    int64_t dk16 = (job->dk + 15) / 16 * 16, rows = job->tile_rows, n_kv = job->n_kv;
    int64_t widened = job->widen ? KEYS * job->dk + VALUES * job->dv : 0;
    return (size_t)(rows * job->heads_per_item * (dk16 + n_kv) + KEYS + 2 * rows * n_kv + widened);
}

/* KV head kvh's rows of a cache (row: floats per cell) */
static inline const char *head_rows(const attn_job *job, const char *cache, int64_t kvh, int64_t row) {
    return cache + (size_t)(kvh * job->n_cells * row) * job->esize;
}

/* the visible cells of mask row `row` in the job's order (cells) and their places in it (at, ascending); returns
 * their count */
static int64_t visible_cells(const attn_job *job, const float *row, int32_t *cells, int32_t *at) {
    return job->isa->visible(row, job->in_cell_order ? NULL : job->order, job->n_kv, cells, at);  /* at is cells */
}

/* x[0] when x[0..n) are consecutive cells x[0], x[0] + 1, ... (rows to read in place), else -1 */
static inline int64_t consecutive(const int32_t *x, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        if (x[i] != x[0] + i) return -1;
    return x[0];
}

/* a block's key rows: float32 (in a float32 cache, or widened into a buffer) or f16 (in an f16 cache) */
typedef struct {
    const float *f32[KEYS];
    const uint16_t *f16[KEYS];
} key_rows;

/* the key rows of cells[0..n) (n >= 1) from a KV head's keys kbase, to KEYS rows (past n: the first again, its
 * score never read): read in place, or widened into buf (KEYS rows of dk) from an f16 cache the ISA's kernels do
 * not read */
static void block_keys(const attn_job *job, const char *kbase, const int32_t *cells, int64_t n, float *buf,
                       key_rows *keys) {
    int64_t dk = job->dk;
    for (int64_t i = 0; i < KEYS; i++) {
        int64_t cell = cells[i < n ? i : 0];
        if (job->direct16) {
            keys->f16[i] = (const uint16_t *)kbase + cell * dk;
        } else if (!job->widen) {
            keys->f32[i] = (const float *)kbase + cell * dk;
        } else if (i < n) {
            job->widen((const uint16_t *)kbase + cell * dk, buf + i * dk, dk);
            keys->f32[i] = buf + i * dk;
        } else {
            keys->f32[i] = buf;
        }
    }
}

static inline void score_keys(const attn_job *job, const float *q, const key_rows *keys, const float *add,
                              float *out) {
    if (job->direct16)
        job->isa->scores_f16(q, keys->f16, job->dk, add, out);
    else
        job->isa->scores(q, keys->f32, job->dk, add, out);
}

/* a raw score, soft-capped when the model caps them */
static inline float capped(const attn_job *job, float s) {
    return job->softcap != 0.0f ? tanhf(s / job->softcap) * job->softcap : s;
}

/* the scores of key block [o0, o0 + KEYS) of the order for the rows of the tile that see a cell of it, compacted
 * by visible index; cursor[r]: the first visible cell of row r not scored yet */
static void score_block(const attn_job *job, int64_t t0, int64_t rows, int64_t h0, int64_t o0,
                        const float *qs, float *scores, const int32_t *cells, const int32_t *at, const int64_t *count,
                        int64_t *cursor, float *block, float *widened) {
    int64_t heads = job->heads_per_item, dk16 = (job->dk + 15) / 16 * 16;
    int64_t n = job->n_kv - o0 < KEYS ? job->n_kv - o0 : KEYS;
    key_rows keys;
    block_keys(job, head_rows(job, job->k, h0 / (job->n_head / job->n_head_kv), job->dk), job->order + o0, n,
               widened, &keys);
    int64_t first = n == KEYS ? consecutive(job->order + o0, n) : -1;  /* its first cell, when they are consecutive */
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *vis = at + r * job->n_kv, *row_cells = cells + r * job->n_kv;
        const float *mask = job->mask + (t0 + r) * job->n_kv;
        int64_t lo = cursor[r], hi = lo;
        if (lo + KEYS <= count[r] && vis[lo] == o0 && vis[lo + KEYS - 1] == o0 + KEYS - 1)
            hi = lo + KEYS;  /* the row sees the whole block (places ascend, each once) */
        else
            while (hi < count[r] && vis[hi] < o0 + KEYS) hi++;
        if (hi == lo) continue;
        for (int64_t g = 0; g < heads; g++) {
            int64_t i = r * heads + g;
            float *dst = scores + i * job->n_kv;
            if (hi - lo == KEYS && first >= 0 && job->softcap == 0.0f) {  /* scores plus the mask's run, in place */
                score_keys(job, qs + i * dk16, &keys, mask + first, dst + lo);
                continue;
            }
            score_keys(job, qs + i * dk16, &keys, NULL, block);
            for (int64_t c = lo; c < hi; c++) dst[c] = capped(job, block[vis[c] - o0]) + mask[row_cells[c]];
        }
        cursor[r] = hi;
    }
}

/* the rows of cells[0..n) from base (rows of `floats` floats) towards the cache: a decode step reads a few keys
 * and values of each cell, from wherever the layer's cache lies (the weights streaming through push it out of L2) */
static void prefetch_rows(const char *base, const int32_t *cells, int64_t n, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + (int64_t)cells[i] * row_bytes + b, 0, 3);
}

/* The scores of one query row (a decode step's tile) for the heads of the item, by chunks of KEYS visible cells:
 * the cells of a sequence beside others in the cache are not contiguous, and a block of cells would score the
 * other sequences' keys for nothing. */
static void score_visible(const attn_job *job, int64_t t, int64_t h0, const float *qs, float *scores,
                          const int32_t *vis, int64_t count, float *block, float *widened) {
    int64_t heads = job->heads_per_item, dk = job->dk, dk16 = (dk + 15) / 16 * 16;
    const float *mask = job->mask + t * job->n_kv;
    int64_t kvh = h0 / (job->n_head / job->n_head_kv), k_bytes = dk * (int64_t)job->esize;
    const char *kbase = head_rows(job, job->k, kvh, dk), *vbase = head_rows(job, job->v, kvh, job->dv);
    float add[KEYS];
    prefetch_rows(kbase, vis, count < KEYS ? count : KEYS, k_bytes);
    for (int64_t c0 = 0; c0 < count; c0 += KEYS) {
        int64_t n = count - c0 < KEYS ? count - c0 : KEYS;
        int64_t next = count - c0 - KEYS < KEYS ? count - c0 - KEYS : KEYS;
        if (next > 0) prefetch_rows(kbase, vis + c0 + KEYS, next, k_bytes);  /* the next chunk's keys */
        prefetch_rows(vbase, vis + c0, n, job->dv * (int64_t)job->esize);
        key_rows keys;
        block_keys(job, kbase, vis + c0, n, widened, &keys);
        for (int64_t i = 0; i < n; i++) add[i] = mask[vis[c0 + i]];
        if (n == KEYS && job->softcap == 0.0f && job->direct16 && job->isa->scores_f16_heads) {
            for (int64_t g0 = 0; g0 < heads; g0 += SHARED_HEADS) {  /* the keys widened once for the heads */
                int shared = heads - g0 < SHARED_HEADS ? (int)(heads - g0) : SHARED_HEADS;
                const float *q[SHARED_HEADS];
                float *dst[SHARED_HEADS];
                for (int h = 0; h < shared; h++) {
                    q[h] = qs + (g0 + h) * dk16;
                    dst[h] = scores + (g0 + h) * job->n_kv + c0;
                }
                job->isa->scores_f16_heads(shared, q, keys.f16, dk, add, dst);
            }
            continue;
        }
        for (int64_t g = 0; g < heads; g++) {
            float *dst = scores + g * job->n_kv + c0;
            if (n == KEYS && job->softcap == 0.0f) {
                score_keys(job, qs + g * dk16, &keys, add, dst);
                continue;
            }
            score_keys(job, qs + g * dk16, &keys, NULL, block);
            for (int64_t i = 0; i < n; i++) dst[i] = capped(job, block[i]) + add[i];
        }
    }
}

/* out[g] = out[g] + the p[g]-weighted value rows of cells[0..count), in order: read in place from a float32
 * cache; from an f16 one, chunks of VALUES rows widened into buf (each chunk's sums stored and reloaded exactly, so
 * the bits are those of one pass) */
static void weigh_values(const attn_job *job, float *const *outs, float *const *ps, int64_t heads,
                         const int32_t *cells, int64_t count, const char *vbase, float *buf) {
    int64_t dv = job->dv;
    if (job->direct16) {
        job->isa->weigh_f16(outs, (const float *const *)ps, heads, cells, count, (const uint16_t *)vbase, dv);
        return;
    }
    if (!job->widen) {
        job->isa->weigh(outs, (const float *const *)ps, heads, cells, count, (const float *)vbase, dv);
        return;
    }
    for (int64_t c0 = 0; c0 < count; c0 += VALUES) {
        int64_t n = count - c0 < VALUES ? count - c0 : VALUES;
        const float *p[MAX_HEADS];
        for (int64_t i = 0; i < n; i++) job->widen((const uint16_t *)vbase + (int64_t)cells[c0 + i] * dv, buf + i * dv, dv);
        for (int64_t g = 0; g < heads; g++) p[g] = ps[g] + c0;
        job->isa->weigh(outs, p, heads, job->local, n, buf, dv);
    }
}

/* x[d] = x[d] / total (a loop of its own: it vectorises) */
static void divide_row(float *x, int64_t n, float total) {
    for (int64_t d = 0; d < n; d++) x[d] = x[d] / total;
}

/* p[c] = nat_exp(p[c] - best) for head h's scores p[0..count) (count > 0), best their peak (and the sink's);
 * returns the softmax's denominator: their canonical sum [+ nat_exp(sink - best)] */
static float exp_total(const attn_job *job, float *p, int64_t count, int64_t h) {
    float best = job->isa->peak(p, count);
    if (job->sinks) best = job->sinks[h] > best ? job->sinks[h] : best;
    float total = job->isa->exp_sum(p, count, best);
    return job->sinks ? total + nat_exp(job->sinks[h] - best) : total;
}

/* softmax(scores) . V of one query row for its heads h0.. of the item: out rows of dv floats */
static void finish_row(const attn_job *job, float *scores, const int32_t *cells, int64_t count, int64_t t,
                       int64_t h0, float *widened) {
    float *outs[MAX_HEADS] = {NULL}, *ps[MAX_HEADS] = {NULL}, totals[MAX_HEADS];
    int64_t heads = job->heads_per_item, dv = job->dv, kvh = h0 / (job->n_head / job->n_head_kv);
    for (int64_t g = 0; g < heads; g++) {
        int64_t h = h0 + g;
        outs[g] = job->out + (t * job->n_head + h) * dv;
        ps[g] = scores + g * job->n_kv;
        if (count == 0) continue;
        totals[g] = exp_total(job, ps[g], count, h);
        memset(outs[g], 0, (size_t)dv * sizeof(float));
    }
    if (count == 0) {  /* no visible cell: 0/0 */
        for (int64_t g = 0; g < heads; g++)
            for (int64_t d = 0; d < dv; d++) outs[g][d] = NAN;
        return;
    }
    weigh_values(job, outs, ps, heads, cells, count, head_rows(job, job->v, kvh, dv), widened);
    for (int64_t g = 0; g < heads; g++) divide_row(outs[g], dv, totals[g]);
}

/* qs[g] = q * scale of row t's heads h0.. (heads of them), each padded with zeros to whole 16s */
static void scaled_queries(const attn_job *job, int64_t t, int64_t h0, int64_t heads, float *qs) {
    int64_t dk = job->dk, dk16 = (dk + 15) / 16 * 16;
    for (int64_t g = 0; g < heads; g++) {
        const float *q = job->q + (t * job->n_head + h0 + g) * dk;
        float *dst = qs + g * dk16;
        for (int64_t d = 0; d < dk16; d++) dst[d] = d < dk ? q[d] * job->scale : 0.0f;
    }
}

static void attend_item(const attn_job *job, int64_t item, float *scratch) {
    int64_t part = item % job->parts, kvh = (item / job->parts) % job->n_head_kv;
    /* the last tiles first: in a causal prefill they see the most keys, and the cheap ones then fill the threads'
     * ends */
    int64_t tiles = (job->n_tokens + job->tile_rows - 1) / job->tile_rows;
    int64_t t0 = (tiles - 1 - item / (job->parts * job->n_head_kv)) * job->tile_rows;
    int64_t rows = job->n_tokens - t0 < job->tile_rows ? job->n_tokens - t0 : job->tile_rows;
    int64_t heads = job->heads_per_item, h0 = kvh * (job->n_head / job->n_head_kv) + part * heads;
    int64_t dk = job->dk, dk16 = (dk + 15) / 16 * 16, n_kv = job->n_kv;
    float *qs = scratch, *scores = qs + rows * heads * dk16, *block = scores + rows * heads * n_kv;
    int32_t *cells = (int32_t *)(block + KEYS), *at = job->in_cell_order ? cells : cells + rows * n_kv;
    float *widened = (float *)(cells + 2 * job->tile_rows * n_kv);  /* f16 caches: keys, then values */
    int64_t count[DECODE_ROWS], cursor[DECODE_ROWS], first = n_kv, end = 0;
    for (int64_t r = 0; r < rows; r++) {
        count[r] = visible_cells(job, job->mask + (t0 + r) * n_kv, cells + r * n_kv, at + r * n_kv);
        cursor[r] = 0;
        if (count[r]) {  /* the places in the order the tile sees: the blocks it visits */
            first = at[r * n_kv] < first ? at[r * n_kv] : first;
            end = at[r * n_kv + count[r] - 1] + 1 > end ? at[r * n_kv + count[r] - 1] + 1 : end;
        }
        scaled_queries(job, t0 + r, h0, heads, qs + r * heads * dk16);
    }
    if (rows == 1)
        score_visible(job, t0, h0, qs, scores, cells, count[0], block, widened);
    else
        for (int64_t o0 = first; o0 < end; o0 += KEYS)
            score_block(job, t0, rows, h0, o0, qs, scores, cells, at, count, cursor, block, widened);
    for (int64_t r = 0; r < rows; r++)
        finish_row(job, scores + r * heads * n_kv, cells + r * n_kv, count[r], t0 + r, h0, widened + KEYS * dk);
}

static void attend_chunk(void *raw, int64_t chunk, int ith) {
    attn_job *job = raw;
    int64_t i0, i1;
    nat_share(job->n_items, chunk, job->n_chunks, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) attend_item(job, i, job->scratch + (size_t)ith * job->scratch_floats);
}

/* whether every cell of order[0..n_kv) is one of the n_kv cells attended (the data decides: checked per run) */
static int order_in_range(const int32_t *order, int64_t n_kv) {
    int bad = 0;
    for (int64_t o = 0; o < n_kv; o++) bad |= (uint32_t)order[o] >= (uint64_t)n_kv;
    return !bad;
}

static int is_cell_order(const int32_t *order, int64_t n_kv) {
    int other = 0;
    for (int64_t o = 0; o < n_kv; o++) other |= order[o] != o;
    return !other;
}

/* An f16 cache's attended cells are widened once for the whole op when its rows see each cell this many times
 * on average (a prefill's rows: hundreds), rather than in every score call and weighted sum that reads them; a
 * decode step's rows (each sequence's row sees its own cells) keep reading them in place. */
#define WIDEN_ALL_VIEWS 2
#define WIDEN_CELLS 256  /* cells of one KV head per chunk of that widening */

/* how many (row, cell) pairs of the mask are visible */
static int64_t visible_pairs(const float *mask, int64_t n) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) count += mask[i] != -INFINITY;
    return count;
}

typedef struct {
    const attn_job *job;
    float *k, *v;       /* [Hkv][n_kv][dk], [Hkv][n_kv][dv] */
    int64_t per_head;   /* chunks per KV head */
} widen_job;

static void widen_chunk(void *raw, int64_t chunk, int ith) {
    (void)ith;
    const widen_job *wj = raw;
    const attn_job *job = wj->job;
    int64_t kvh = chunk / wj->per_head, c0, c1;
    nat_share(job->n_kv, chunk % wj->per_head, wj->per_head, &c0, &c1);
    const uint16_t *k = (const uint16_t *)head_rows(job, job->k, kvh, job->dk) + c0 * job->dk;
    const uint16_t *v = (const uint16_t *)head_rows(job, job->v, kvh, job->dv) + c0 * job->dv;
    job->widen(k, wj->k + (kvh * job->n_kv + c0) * job->dk, (c1 - c0) * job->dk);
    job->widen(v, wj->v + (kvh * job->n_kv + c0) * job->dv, (c1 - c0) * job->dv);
}

/* The job's f16 caches as float32 copies of their first n_kv cells (freed by the caller; NULL when out of memory):
 * the same values, so the same bits, every key and value widened once. */
static float *widen_caches(nat_pool *pool, attn_job *job) {
    size_t k_floats = (size_t)(job->n_head_kv * job->n_kv * job->dk);
    float *copy = malloc((k_floats + (size_t)(job->n_head_kv * job->n_kv * job->dv)) * sizeof(float));
    if (!copy) return NULL;
    widen_job wj = {job, copy, copy + k_floats, (job->n_kv + WIDEN_CELLS - 1) / WIDEN_CELLS};
    nat_pool_for(pool, job->n_head_kv * wj.per_head, widen_chunk, &wj);
    job->k = (const char *)wj.k;
    job->v = (const char *)wj.v;
    job->esize = 4;
    job->widen = NULL;
    job->direct16 = 0;
    job->n_cells = job->n_kv;  /* the copies' rows per KV head */
    return copy;
}

/* the most heads of a GQA group (a divisor of it, at most MAX_HEADS) per item that still makes `wanted` items of
 * `slots` (tiles times KV heads) */
static int64_t heads_per_item(int64_t group, int64_t slots, int64_t wanted) {
    int64_t heads = group < MAX_HEADS ? group : MAX_HEADS;
    while (heads > 1 && (group % heads || slots * (group / heads) < wanted)) heads--;
    return heads;
}

/* ---- a decode step's long rows over all the threads ------------------------------------------------------
 * A decode step has a few items (rows times KV heads, three for one SmolLM2 row), so on a long context one thread
 * takes two while another waits. These rows go in three passes that keep every operation of the items above: the
 * scores of ranges of a row's visible cells (each score is its own), each head's peak, exponentials and total, then
 * the weighted sums split by value dimensions (each dimension's chain over the cells is its own). */
#define SPLIT_CELLS 1024  /* a decode row that sees this many cells takes the split passes */
#define RANGE_CELLS 256   /* visible cells per scoring item (whole KEYS blocks) */

typedef struct {
    attn_job *job;
    int32_t *cells;   /* [T][n_kv]: each row's visible cells */
    int32_t *rows;    /* [T][n_kv]: those cells * parts, the rows of one part's width in a value row */
    int64_t count[DECODE_ROWS];
    float *scores;    /* [T][H][n_kv] */
    float *totals;    /* [T][H] */
    float *scratch;   /* per thread: one item's scaled queries and a block of scores */
    int64_t ranges, parts, group;
} split_job;

/* item of a split pass with `per` items for each row's head part (ranges or value parts): its row t, its first
 * head h0 and its KV head; returns its index among those `per` */
static int64_t split_item(const split_job *sj, int64_t item, int64_t per, int64_t *t, int64_t *h0, int64_t *kvh) {
    const attn_job *job = sj->job;
    int64_t head_part = (item / per) % job->parts;
    *kvh = (item / (per * job->parts)) % job->n_head_kv;
    *t = item / (per * job->parts * job->n_head_kv);
    *h0 = *kvh * sj->group + head_part * job->heads_per_item;
    return item % per;
}

static void split_scores(void *raw, int64_t item, int ith) {
    const split_job *sj = raw;
    const attn_job *job = sj->job;
    int64_t t, h0, kvh, range = split_item(sj, item, sj->ranges, &t, &h0, &kvh);
    int64_t heads = job->heads_per_item, dk16 = (job->dk + 15) / 16 * 16;
    int64_t c0 = range * RANGE_CELLS, n = sj->count[t] - c0 < RANGE_CELLS ? sj->count[t] - c0 : RANGE_CELLS;
    if (n <= 0) return;
    float *qs = sj->scratch + (size_t)ith * (size_t)(MAX_HEADS * dk16 + KEYS);
    scaled_queries(job, t, h0, heads, qs);
    score_visible(job, t, h0, qs, sj->scores + (t * job->n_head + h0) * job->n_kv + c0, sj->cells + t * job->n_kv + c0,
                  n, qs + heads * dk16, NULL);
}

static void split_softmax(void *raw, int64_t item, int ith) {
    (void)ith;
    split_job *sj = raw;
    const attn_job *job = sj->job;
    int64_t t = item / job->n_head, h = item % job->n_head, count = sj->count[t];
    if (count == 0) return;
    sj->totals[item] = exp_total(job, sj->scores + item * job->n_kv, count, h);
}

static void split_weigh(void *raw, int64_t item, int ith) {
    (void)ith;
    const split_job *sj = raw;
    const attn_job *job = sj->job;
    int64_t t, h0, kvh, part = split_item(sj, item, sj->parts, &t, &h0, &kvh);
    int64_t heads = job->heads_per_item, count = sj->count[t];
    int64_t width = job->dv / sj->parts, d0 = part * width;
    float *outs[MAX_HEADS];
    const float *ps[MAX_HEADS];
    for (int64_t g = 0; g < heads; g++) {
        outs[g] = job->out + (t * job->n_head + h0 + g) * job->dv + d0;
        ps[g] = sj->scores + (t * job->n_head + h0 + g) * job->n_kv;
        for (int64_t d = 0; d < width; d++) outs[g][d] = count ? 0.0f : NAN;  /* no visible cell: 0/0 */
    }
    if (count == 0) return;
    const char *vbase = head_rows(job, job->v, kvh, job->dv) + (size_t)d0 * job->esize;
    const int32_t *rows = sj->rows + t * job->n_kv;
    if (job->direct16)
        job->isa->weigh_f16(outs, ps, heads, rows, count, (const uint16_t *)vbase, width);
    else
        job->isa->weigh(outs, ps, heads, rows, count, (const float *)vbase, width);
    for (int64_t g = 0; g < heads; g++) divide_row(outs[g], width, sj->totals[t * job->n_head + h0 + g]);
}

/* each row's visible cells and their count (at: room for their places in the order, [T][n_kv]); returns the most
 * cells a row sees */
static int64_t visible_rows(const attn_job *job, int32_t *cells, int32_t *at, int64_t *count) {
    int64_t most = 0;
    for (int64_t t = 0; t < job->n_tokens; t++) {
        count[t] = visible_cells(job, job->mask + t * job->n_kv, cells + t * job->n_kv,
                                 job->in_cell_order ? cells + t * job->n_kv : at + t * job->n_kv);
        most = count[t] > most ? count[t] : most;
    }
    return most;
}

/* the job's rows in the split passes when they are decode rows of a float32 cache or of an f16 one its kernels read
 * in place, too few items for the threads, and one sees SPLIT_CELLS cells: returns 0; else 1, or NAT_OUT_OF_MEMORY
 * before any pass ran (the caller then runs the items) */
static int attend_split(nat_pool *pool, attn_job *job) {
    int threads = nat_pool_threads(pool);
    if (job->tile_rows != 1 || threads < 2 || (job->widen && !job->direct16)
        || job->n_items >= ITEMS_PER_THREAD * threads || job->n_kv < SPLIT_CELLS)
        return 1;
    size_t cells = (size_t)(job->n_tokens * job->n_kv);
    split_job sj = {job, malloc(2 * cells * sizeof(int32_t)), NULL, {0}, NULL, NULL, NULL, 0, 1,
                    job->n_head / job->n_head_kv};
    if (!sj.cells) return NAT_OUT_OF_MEMORY;
    int64_t most = visible_rows(job, sj.cells, sj.cells + cells, sj.count);  /* places where rows go next */
    if (most < SPLIT_CELLS) {
        free(sj.cells);
        return 1;
    }
    /* the whole group per item where it fits (each key read once: the ranges spread the work), value parts one per
     * thread where their width stays whole 16s (8s for the f16 kernels' loads suffice) */
    job->heads_per_item = heads_per_item(sj.group, 0, 0);
    job->parts = sj.group / job->heads_per_item;
    if (job->dv % (16 * threads) == 0) sj.parts = threads;
    int64_t dk16 = (job->dk + 15) / 16 * 16;
    sj.ranges = (most + RANGE_CELLS - 1) / RANGE_CELLS;
    sj.rows = sj.cells + cells;
    sj.scores = malloc((cells * (size_t)job->n_head + (size_t)(job->n_tokens * job->n_head)) * sizeof(float));
    sj.scratch = malloc((size_t)threads * (size_t)(MAX_HEADS * dk16 + KEYS) * sizeof(float));
    if (!sj.scores || !sj.scratch) {
        free(sj.cells);
        free(sj.scores);
        free(sj.scratch);
        return NAT_OUT_OF_MEMORY;
    }
    sj.totals = sj.scores + cells * (size_t)job->n_head;
    for (int64_t t = 0; t < job->n_tokens; t++)
        for (int64_t c = 0; c < sj.count[t]; c++)
            sj.rows[t * job->n_kv + c] = sj.cells[t * job->n_kv + c] * (int32_t)sj.parts;
    int64_t items = job->n_tokens * job->n_head_kv * job->parts;
    nat_pool_for(pool, items * sj.ranges, split_scores, &sj);
    nat_pool_for(pool, job->n_tokens * job->n_head, split_softmax, &sj);
    nat_pool_for(pool, items * sj.parts, split_weigh, &sj);
    free(sj.cells);
    free(sj.scores);
    free(sj.scratch);
    return 0;
}

/* n: T, H, Hkv, dk, dv, n_kv, n_cells, f16 (native.h's NAT_OP_ATTEND); order: the n_kv cells in the order to sum
 * them (NULL: cell order). Returns 0, NAT_OUT_OF_MEMORY, or NAT_ID_OUT_OF_RANGE for a cell of the order out of
 * range. */
int nat_attend(nat_pool *pool, int isa, const float *q, const void *k, const void *v, const float *mask,
               const float *sinks, const int32_t *order, float *out, const int64_t *n, float scale, float softcap) {
    attn_job job = {q, mask, sinks, k, v, n[7] ? 2 : 4, n[7] ? nat_kernels_for(isa).from_f16 : NULL, 0, {0},
                    order, !order || is_cell_order(order, n[5]), out,
                    n[0], n[1], n[2], n[3], n[4], n[5], n[6], scale, softcap, kernels_for(isa),
                    n[0] < DECODE_ROWS ? 1 : TILE_ROWS, 1, 1, 0, 1, 0, NULL};
    for (int i = 0; i < VALUES; i++) job.local[i] = i;
    job.direct16 = job.widen && job.isa->scores_f16 && job.dk % 16 == 0 && job.dv % 8 == 0;
    if (order && !order_in_range(order, job.n_kv)) return NAT_ID_OUT_OF_RANGE;
    int64_t group = n[1] / n[2], tiles = (job.n_tokens + job.tile_rows - 1) / job.tile_rows;
    /* the most heads of a group per item (sharing their K and V loads) that still leaves every thread items: a
     * prefill's several (they differ in cost), a decode step's one each (its items read the most cells per head,
     * each reading its KV head's keys and values again) */
    int64_t wanted = (job.tile_rows > 1 ? ITEMS_PER_THREAD : 1) * nat_pool_threads(pool);
    job.heads_per_item = heads_per_item(group, tiles * job.n_head_kv, wanted);
    job.parts = group / job.heads_per_item;
    job.n_items = tiles * job.n_head_kv * job.parts;
    if (job.n_items == 0) return 0;
    float *widened = NULL;
    if (job.widen && job.tile_rows > 1 && visible_pairs(mask, job.n_tokens * job.n_kv) >= WIDEN_ALL_VIEWS * job.n_kv
        && !(widened = widen_caches(pool, &job)))
        return NAT_OUT_OF_MEMORY;
    job.scratch_floats = scratch_floats(&job);
    job.scratch = malloc(job.scratch_floats * sizeof(float) * (size_t)nat_pool_threads(pool));
    int32_t *identity = order ? NULL : malloc((size_t)job.n_kv * sizeof(int32_t));
    if (!job.scratch || (!order && !identity)) {
        free(job.scratch);
        free(identity);
        free(widened);
        return NAT_OUT_OF_MEMORY;
    }
    if (identity) {
        for (int64_t o = 0; o < job.n_kv; o++) identity[o] = (int32_t)o;
        job.order = identity;
    }
    int split = attend_split(pool, &job);
    if (split != 0) {  /* not split (1), or no memory for the split passes' buffers: the items */
        job.n_chunks = nat_pool_chunks(pool, job.n_items);
        nat_pool_for(pool, job.n_chunks, attend_chunk, &job);
    }
    free(job.scratch);
    free(identity);
    free(widened);
    return 0;
}
