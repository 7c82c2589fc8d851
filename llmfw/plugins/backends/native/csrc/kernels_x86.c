/* x86-64 kernels: the canonical arithmetic of native.h with 256-bit vectors, for AVX2 + FMA + F16C and for
 * AVX-512 (F/BW/VL + VNNI). The quantized matmul takes the integer dot products of native.h's row-interleaved codes
 * with broadcast activation words, so each lane accumulates one of the group's 8 rows (no horizontal adds); the
 * float part runs across the 8 rows, one lane per row, in the scalar path's order. */
#include "native.h"

#ifdef NAT_HAVE_X86
#include <immintrin.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define TARGET512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

/* How a weight's codes enter the byte dot products, a constant of each specialised kernel.
 * NIB_INDEX, NIB_LINEAR: 4-bit codes whose table is table[0] + index, table[0] zero (Q4_1, Q2_K, Q4_K) or not
 *   (Q4_0, Q3_K): the unsigned index itself, table[0] * A added back (A: the activation codes' half sum);
 * NIB_TABLE: 4-bit codes through a non-linear table (IQ4_NL, IQ4_XS, MXFP4), looked up with vpshufb;
 * BYTE: 8-bit codes;
 * NIB5_INDEX, NIB5_LINEAR: 5-bit indices (QNIB5: Q5_0, Q5_1, Q5_K), table[0] zero or not, as NIB_INDEX / NIB_LINEAR
 *   with the fifth bit put back into each nibble. */
enum code_form { NIB_INDEX, NIB_LINEAR, NIB_TABLE, BYTE, NIB5_INDEX, NIB5_LINEAR };

/* the forms whose codes are indices into a linear table (table[0] + index): the index itself enters the products */
#define INDEXED(form) ((form) <= NIB_LINEAR || (form) >= NIB5_INDEX)
#define FIVE_BIT(form) ((form) >= NIB5_INDEX)
#define ZERO_BASE(form) ((form) == NIB_INDEX || (form) == NIB5_INDEX)

/* What an ISA path needs of a weight: its code form, the lookup table it uses (both 128-bit lanes), and base:
 * a half's integer dot product i = (dot product of the path's operand bytes with the activation codes) + base*A. */
typedef struct {
    int form;
    int32_t base;
    __m256i table;
    int stream_once;  /* fetch the weight with non-temporal prefetches (streams_once below) */
} code_plan;

static int code_form_of(const nat_weight *w) {
    if (w->kind == NAT_QBYTE) return BYTE;
    if (w->kind == NAT_QNIB5) return w->table[0] ? NIB5_LINEAR : NIB5_INDEX;  /* linear by construction */
    for (int c = 1; c < 16; c++)
        if (w->table[c] != w->table[0] + c) return NIB_TABLE;
    return w->table[0] ? NIB_LINEAR : NIB_INDEX;
}

TARGET INLINE __m256i broadcast_word(const int8_t *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

/* chunk c's fifth bits (QNIB5, native.h: bit c of the 32 bytes of the group's rows, each at the chunk's own byte)
 * as 16 or 0 in its bytes: bit c moved to bit 4 (a 16-bit shift: each byte's bit c lands on its own bit 4) */
TARGET INLINE __m256i fifth_bits(__m256i bits, int c) {
    __m256i moved = c <= 4 ? _mm256_slli_epi16(bits, 4 - c) : _mm256_srli_epi16(bits, c - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

/* a block's 8 code chunks (native.h), chunk c against activation bytes 4c..4c+3: nibble indices (the table not
 * yet applied; with high16, those of chunks 4-7 stay in the high nibble: 16 * index; 5-bit forms: the fifth bits
 * added back) or int8 codes */
TARGET INLINE void load_chunks(const uint8_t *codes, int form, int high16, __m256i chunk[8]) {
    if (form == BYTE) {
        for (int c = 0; c < 8; c++) chunk[c] = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        return;
    }
    __m256i low4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        chunk[c] = _mm256_and_si256(packed, low4);
        chunk[c + 4] = high16 ? _mm256_andnot_si256(low4, packed)
                              : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    }
    if (!FIVE_BIT(form)) return;
    __m256i bits = _mm256_loadu_si256((const __m256i *)(codes + NAT_FIFTH_BITS_AT));
    for (int c = 0; c < 8; c++) chunk[c] = _mm256_or_si256(chunk[c], fifth_bits(bits, c));
}

/* How a weight's float parameters enter (flags, a constant of each specialised kernel): PAR_OFFSETS, it has
 * offsets; PAR_ONE_SCALE, one scale (and offset) per block, so the halves' integer sums are added first (native.h);
 * PAR_HALF, they are stored as f16 and widened as they are loaded. */
#define PAR_OFFSETS 1
#define PAR_ONE_SCALE 2
#define PAR_HALF 4
#define PAR_FACTOR 8  /* int8 factors times the super-block's multipliers (native.h: factored) */

/* a row of 8 block parameters as float32 (mult: their multipliers, with PAR_FACTOR) */
TARGET INLINE __m256 load_params(const uint8_t *row, int pars, const float *mult) {
    if (pars & PAR_FACTOR)
        return _mm256_mul_ps(_mm256_loadu_ps(mult),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)row))));
    if (pars & PAR_HALF) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row));
    return _mm256_loadu_ps((const float *)row);
}

/* where block b of group g finds its multipliers (PAR_FACTOR), else NULL; offsets' are NAT_ROWS further */
INLINE const float *block_mults(const nat_weight *w, int pars, int64_t g, int64_t b) {
    return (pars & PAR_FACTOR) ? nat_block_mults(w, g, b) : NULL;
}

/* block b's float parameters, at blk in group g: s0, s1, and o0, o1 (zero without offsets) */
TARGET INLINE void block_params(const nat_weight *w, const uint8_t *blk, int pars, int64_t g, int64_t b,
                                __m256 par[4]) {
    nat_param_rows p = nat_block_param_rows(w, blk);
    const float *mu = block_mults(w, pars, g, b);
    par[0] = load_params(p.s0, pars, mu);
    par[1] = load_params(p.s1, pars, mu);
    par[2] = par[3] = _mm256_setzero_ps();
    if (pars & PAR_OFFSETS) {
        par[2] = load_params(p.o0, pars, mu ? mu + NAT_ROWS : NULL);
        par[3] = load_params(p.o1, pars, mu ? mu + NAT_ROWS : NULL);
    }
}

/* The float part of native.h for the rows of one vector (W: 256, 8 rows; 512, 16 rows), par: s0, s1, o0, o1, with
 * fma(a, b, c) = a*b + c rounded once: two scales: v = fma(s1, i1, s0*i0) [v = fma(o1, A1, fma(o0, A0, v))]; one:
 * v = s0*(i0+i1) [v = fma(o0, A0+A1, v)]; then acc = fma(da, v, acc) (the bracketed offset terms only with
 * PAR_OFFSETS). A0, A1 are broadcast as integers and converted in the vector unit; A0+A1 (asum) comes converted by
 * the quantizer, so a tile row spends no conversion on it: the same exact floats. NAME_one is the one-scale part
 * from i0+i1 already converted (whole). */
#define DEFINE_COMBINE(ATTR, NAME, W)                                                                              \
    ATTR INLINE __m##W NAME##_one(__m##W acc, const __m##W par[4], int pars, __m##W whole, float da, float asum) { \
        __m##W v = _mm##W##_mul_ps(par[0], whole);                                                                 \
        if (pars & PAR_OFFSETS) v = _mm##W##_fmadd_ps(par[2], _mm##W##_set1_ps(asum), v);                         \
        return _mm##W##_fmadd_ps(_mm##W##_set1_ps(da), v, acc);                                                    \
    }                                                                                                              \
    ATTR INLINE __m##W NAME(__m##W acc, const __m##W par[4], int pars, __m##W##i i0, __m##W##i i1, float da,       \
                            const int32_t *sums, float asum) {                                                     \
        if (pars & PAR_ONE_SCALE)                                                                                  \
            return NAME##_one(acc, par, pars, _mm##W##_cvtepi32_ps(_mm##W##_add_epi32(i0, i1)), da, asum);         \
        __m##W v = _mm##W##_mul_ps(par[0], _mm##W##_cvtepi32_ps(i0));                                             \
        v = _mm##W##_fmadd_ps(par[1], _mm##W##_cvtepi32_ps(i1), v);                                                \
        if (pars & PAR_OFFSETS) {                                                                                  \
            v = _mm##W##_fmadd_ps(par[2], _mm##W##_set1_ps((float)sums[0]), v);                                    \
            v = _mm##W##_fmadd_ps(par[3], _mm##W##_set1_ps((float)sums[1]), v);                                    \
        }                                                                                                          \
        return _mm##W##_fmadd_ps(_mm##W##_set1_ps(da), v, acc);                                                    \
    }

DEFINE_COMBINE(TARGET, combine, 256)

/* combine for one scale and a base (table[0] * A, the codes' indices in the integer sum i): i + base*A added as a
 * float, fma(base, A, float(i)), is that integer exactly (each term and the sum below 2^24), the value combine would
 * convert, so the same bits for one fused multiply-add a row and block where the integer route took two integer
 * products, a move to the vector unit and a broadcast (docs/benchmarks.md: what it saves in the four-row tiles) */
TARGET INLINE __m256 combine_with_base(__m256 acc, const __m256 par[4], int pars, __m256i i, int32_t base, float da,
                                       float asum) {
    __m256 whole = _mm256_fmadd_ps(_mm256_set1_ps((float)base), _mm256_set1_ps(asum), _mm256_cvtepi32_ps(i));
    return combine_one(acc, par, pars, whole, da, asum);
}

/* the base terms (base * A) of a row's two half dot products; with one scale all of it goes into the first half
 * (whose sum is never shifted), as the halves' sums are added anyway */
INLINE void base_terms(const code_plan *plan, int form, int pars, const int32_t *sums, int32_t extra[2]) {
    extra[0] = ZERO_BASE(form) ? 0 : plan->base * sums[0];
    extra[1] = ZERO_BASE(form) ? 0 : plan->base * sums[1];
    if (pars & PAR_ONE_SCALE) {
        extra[0] += extra[1];
        extra[1] = 0;
    }
}

TARGET static inline void store_rows(float *y, int64_t n, int64_t i, int64_t g, __m256 acc) {
    if ((g + 1) * NAT_ROWS <= n) {
        _mm256_storeu_ps(y + i * n + g * NAT_ROWS, acc);
        return;
    }
    float lanes[NAT_ROWS];
    _mm256_storeu_ps(lanes, acc);
    for (int r = 0; g * NAT_ROWS + r < n; r++) y[i * n + g * NAT_ROWS + r] = lanes[r];
}

/* How far ahead of the block being multiplied its successors are fetched into L1. The weights stream through once
 * per matmul; the hardware prefetchers alone leave a decode step waiting on memory, most of all when other
 * processes share the memory bus. */
#define PREFETCH_BYTES 1024
/* the AVX-512 two-group path's distance (per stream): measured on a Sapphire Rapids decode step, 8 KiB ran one
 * sequence and four together faster than 1-4 KiB (a batched step takes longer per block, so 1 KiB ahead arrives
 * late); the AVX2 path keeps 1 KiB, as nothing measured it elsewhere */
#define PAIR_PREFETCH_BYTES 8192

/* activation rows per tile: a block's operands are prepared once for them all */
#define M_TILE NAT_TILE_ROWS

/* once: the non-temporal hint (streams_once), else into every level */
TARGET INLINE void prefetch_ahead(const uint8_t *blk, size_t block_bytes, size_t distance, int once) {
    for (size_t line = 0; line < block_bytes; line += 64) {
        if (once)
            _mm_prefetch((const char *)blk + distance + line, _MM_HINT_NTA);
        else
            _mm_prefetch((const char *)blk + distance + line, _MM_HINT_T0);
    }
}

/* Whether a call of m activation rows fetches its weight with non-temporal prefetches. At most M_TILE rows, each
 * group's blocks are read once in the call (one row tile), and a decode step reads every weight once: on AMD
 * CPUs, whose L3 takes every line L2 evicts, the temporal hint made the step's weights (more than the L3 holds)
 * push the KV cache, the activations and the interpreter's own memory out of L2 and L3 at every step. More rows
 * read each block once per row tile, and keep the temporal hint. Intel CPUs keep it too: their prefetch distance
 * was measured with it, and nothing measured the other there. */
static int streams_once(int64_t m) {
    return m <= M_TILE && __builtin_cpu_is("amd");  /* a compare with what libgcc read at startup */
}

/* TILE(w, a, plan, form, pars, rows, i0, g, y) over all m activation rows: tiles of M_TILE rows, then 2, then 1
 * (each tile size a constant, so each gets its own specialised copy) */
#define RUN_TILES(TILE, w, a, plan, form, pars, m, g, y)                             \
    do {                                                                             \
        int64_t i_ = 0;                                                              \
        for (; i_ + M_TILE <= (m); i_ += M_TILE) TILE(w, a, plan, form, pars, M_TILE, i_, g, y); \
        if (i_ + 2 <= (m)) {                                                         \
            TILE(w, a, plan, form, pars, 2, i_, g, y);                            \
            i_ += 2;                                                                 \
        }                                                                            \
        if (i_ < (m)) TILE(w, a, plan, form, pars, 1, i_, g, y);                  \
    } while (0)

/* w with the layout fields its specialised kernel was chosen by (code form, parameter flags) as constants, so the
 * block size and the parameter rows' places fold into the loops instead of being worked out from memory per block
 * (the same values: FOR_PARS chose the kernel from them) */
INLINE nat_weight with_constant_layout(const nat_weight *w, int form, int pars) {
    nat_weight fixed = *w;
    fixed.kind = form == BYTE ? NAT_QBYTE : FIVE_BIT(form) ? NAT_QNIB5 : NAT_QNIB;
    fixed.n_scales = (pars & PAR_ONE_SCALE) ? 1 : 2;
    fixed.has_offsets = (pars & PAR_OFFSETS) != 0;
    fixed.half_params = (pars & PAR_HALF) != 0;
    fixed.factored = (pars & PAR_FACTOR) != 0;
    return fixed;
}

/* The one-group tile of an ISA path (NAME_tile) whose rows share a block's prepared operands: per block the 8 code
 * chunks are loaded (HIGH16(form): keep the high nibbles in place) and OPERANDS(form, table, chunk, signs) turns them
 * into the path's operands once; DOTS(form, pars, chunk, signs, aq, extra, h) gives a row's integer dot products of
 * each half's 4 chunks with its 16 activation codes, plus extra (base * A), in h[0], h[1] (with one scale only their
 * sum counts: a path may put all of it in h[0] and zeros in h[1]). A row's arithmetic is the same in every tile, so
 * nothing depends on M. */
#define DEFINE_ROW_TILE(ATTR, NAME, HIGH16, OPERANDS, DOTS)                                                   \
    ATTR INLINE void NAME##_tile(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form,           \
                                 int pars, int rows, int64_t i0, int64_t g, float *y) {                             \
        int64_t nb = w->n_cols / NAT_BLOCK;                                                                        \
        size_t bb = nat_block_bytes(w), stride = nat_block_stride(w, g);                                           \
        const uint8_t *group = nat_block_at(w, g, 0);                                                              \
        __m256 acc[M_TILE];                                                                                        \
        for (int t = 0; t < rows; t++) acc[t] = _mm256_setzero_ps();                                               \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            const uint8_t *blk = group + b * stride;                                                               \
            prefetch_ahead(blk, bb, PREFETCH_BYTES, plan->stream_once);                                            \
            __m256i chunk[8], signs[8];                                                                            \
            load_chunks(blk, form, HIGH16(form), chunk);                                                           \
            OPERANDS(form, plan->table, chunk, signs);                                                             \
            __m256 par[4];                                                                                         \
            block_params(w, blk, pars, g, b, par);                                                                 \
            for (int t = 0; t < rows; t++) {                                                                       \
                int64_t i = i0 + t;                                                                                \
                const int8_t *aq = a->q + i * w->n_cols + b * NAT_BLOCK;                                           \
                const int32_t *sums = a->sums + (i * nb + b) * 2;                                                  \
                int32_t extra[2];                                                                                  \
                base_terms(plan, form, pars, sums, extra);                                                         \
                __m256i h[2];                                                                                      \
                DOTS(form, pars, chunk, signs, aq, extra, h);                                                      \
                acc[t] = combine(acc[t], par, pars, h[0], h[1], a->d[i * nb + b], sums, a->asum[i * nb + b]);     \
            }                                                                                                      \
        }                                                                                                          \
        for (int t = 0; t < rows; t++) store_rows(y, w->n_rows, i0 + t, g, acc[t]);                                \
    }

/* the parameter flags (PAR_*) of w's layout, which choose its specialised kernel */
static inline int param_flags(const nat_weight *w) {
    return (w->has_offsets ? PAR_OFFSETS : 0) | (w->n_scales == 1 ? PAR_ONE_SCALE : 0) | (w->half_params ? PAR_HALF : 0) |
           (w->factored ? PAR_FACTOR : 0);
}

/* The quantized matmul of one ISA path (NAME): per row group, tiles of up to M_TILE activation rows (NAME_tile).
 * Each (code form, parameter flags, tile size) gets its own copy of the loops, the branches on them compiled away;
 * exact integers: only the instructions differ between paths. PAIRS(w, a, plan, form, pars, m, y, g) may take
 * groups g and g+1 together (all m rows) and return 1, or return 0. */
#define QGEMM_PATH(ATTR, NAME, PAIRS)                                                                              \
    ATTR INLINE void NAME##_groups(const nat_weight *given, const nat_qact *a, const code_plan *plan, int form,     \
                                   int pars, int64_t m, float *y, int64_t g0, int64_t g1) {                         \
        nat_weight fixed = with_constant_layout(given, form, pars);                                                \
        const nat_weight *w = &fixed;                                                                              \
        for (int64_t g = g0; g < g1; g++) {                                                                        \
            if (g + 1 < g1 && PAIRS(w, a, plan, form, pars, m, y, g)) {                                           \
                g++;                                                                                               \
                continue;                                                                                          \
            }                                                                                                      \
            RUN_TILES(NAME##_tile, w, a, plan, form, pars, m, g, y);                                               \
        }                                                                                                          \
    }                                                                                                              \
    ATTR void nat_qgemm_##NAME(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0,             \
                               int64_t g1) {                                                                       \
        code_plan plan = NAME##_plan(w);                                                                           \
        plan.stream_once = streams_once(m);                                                                        \
        int pars = param_flags(w);                                                                                 \
        FOR_FORM(NAME, NIB_INDEX) FOR_FORM(NAME, NIB_LINEAR) FOR_FORM(NAME, NIB_TABLE) FOR_FORM(NAME, BYTE)        \
        FOR_FORM(NAME, NIB5_INDEX) FOR_FORM(NAME, NIB5_LINEAR)                                                    \
        nat_qgemm_scalar(w, a, m, y, g0, g1);                                                                      \
    }

/* the kernel specialised for code form FORM and parameter flags pars (inside nat_qgemm_NAME), for the layouts the
 * repacker makes: f16 parameters (Q4_0 ... Q8_0, IQ4_NL: one scale per block, Q4_1 / Q5_1 with offsets), factored
 * ones (Q2_K ... Q6_K, IQ4_XS), float32 ones (MXFP4); a layout with none of these kernels falls through to the
 * portable one */
#define FOR_PARS(NAME, FORM, PARS)                                         \
    if (pars == (PARS)) {                                                  \
        NAME##_groups(w, a, &plan, FORM, PARS, m, y, g0, g1);              \
        return;                                                            \
    }
#define FOR_FORM(NAME, FORM)                                                                                       \
    if (plan.form == FORM) {                                                                                       \
        FOR_PARS(NAME, FORM, PAR_ONE_SCALE) FOR_PARS(NAME, FORM, PAR_ONE_SCALE | PAR_HALF)                        \
        FOR_PARS(NAME, FORM, PAR_OFFSETS | PAR_ONE_SCALE | PAR_HALF) FOR_PARS(NAME, FORM, PAR_FACTOR)             \
        FOR_PARS(NAME, FORM, PAR_FACTOR | PAR_OFFSETS) FOR_PARS(NAME, FORM, PAR_FACTOR | PAR_ONE_SCALE)           \
        FOR_PARS(NAME, FORM, PAR_FACTOR | PAR_OFFSETS | PAR_ONE_SCALE)                                            \
    }

/* AVX2: vpmaddubsw multiplies unsigned by signed bytes into saturating 16-bit pair sums. Nibble indices (<= 15)
 * go in as they are (base table[0]); signed codes as |w|, their signs moved onto the activations (|w| <= 128,
 * |a| <= 127: a pair never saturates; base 0). The nibble indices' pair sums of a half's 4 chunks add up in 16 bits
 * (at most 4 * 2 * 15 * 127) before one vpmaddwd. */
TARGET static code_plan avx2_plan(const nat_weight *w) {
    code_plan plan = {code_form_of(w), 0, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->table)), 0};
    if (INDEXED(plan.form)) plan.base = w->table[0];
    return plan;
}

/* chunks c and c + 4 of a block (native.h; chunk c against activation bytes 4c..4c+3) as vpmaddubsw's unsigned
 * operands: nibble indices (5-bit forms: the fifth bits put back) or |code|, the codes themselves in *lo_signs,
 * *hi_signs (signed forms). Called for c = 0, 1, 2, 3 in turn; *bits (5-bit forms) holds the block's fifth bits
 * shifted right by c in each 16-bit lane, so each byte's bit c is at its bit 0 and bit c + 4 at its bit 4: constant
 * shifts, in a loop over c that is not unrolled (fifth_bits needs c constant). */
TARGET INLINE void avx2_chunk_pair(const uint8_t *blk, int form, __m256i table, int c, __m256i *bits, __m256i *lo,
                                   __m256i *hi, __m256i *lo_signs, __m256i *hi_signs) {
    if (form == BYTE) {
        *lo_signs = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
        *hi_signs = _mm256_loadu_si256((const __m256i *)(blk + 32 * (c + 4)));
    } else {
        __m256i low4 = _mm256_set1_epi8(15), packed = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
        *lo = _mm256_and_si256(packed, low4);
        *hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        if (FIVE_BIT(form)) {
            __m256i sixteen = _mm256_set1_epi8(16);
            *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(*bits, 4), sixteen));
            *hi = _mm256_or_si256(*hi, _mm256_and_si256(*bits, sixteen));
            *bits = _mm256_srli_epi16(*bits, 1);
        }
        if (INDEXED(form)) return;
        *lo_signs = _mm256_shuffle_epi8(table, *lo);
        *hi_signs = _mm256_shuffle_epi8(table, *hi);
    }
    *lo = _mm256_abs_epi8(*lo_signs);
    *hi = _mm256_abs_epi8(*hi_signs);
}

/* The AVX2 tile: the block's chunks a step at a time (chunks c and c + 4; 5-bit indices under one scale: c, c + 1,
 * c + 4 and c + 5), made from its codes when they are needed and multiplied into every row of the tile. AVX2 has
 * 16 vector registers; a tile that held a block's 8 chunks while it went through its rows spilled chunks and
 * accumulators to the stack at every block. Each row's sums, per half (sum[t][0], sum[t][1]):
 *   nibble indices: 16-bit pair sums, one vpmaddwd at the end (at most 4 * 2 * 31 * 127 = 31496 a half; 4-bit
 *     ones under one scale in one sum: 8 * 2 * 15 * 127 = 30480); 5-bit ones under one scale: a step's four
 *     chunks in 16 bits (31496), then one vpmaddwd into a 32-bit sum of the whole block (two 16-bit sums a row
 *     for the block's halves would not leave the tile's four rows enough registers);
 *   signed codes: |w| against the activations with w's signs (|w| <= 128, |a| <= 127: a pair never saturates),
 *     32-bit sums of each chunk's vpmaddwd; under one scale in one sum.
 * Exact integers, added in another order than the other paths (16-bit sums wrap, and their totals fit), then the
 * same float part: the same bits. The loop over the steps is not unrolled: unrolled, GCC computed every chunk and
 * product of the block first and spilled them. */
TARGET INLINE void avx2_tile(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                             int rows, int64_t i0, int64_t g, float *y) {
    int64_t nb = w->n_cols / NAT_BLOCK;
    size_t bb = nat_block_bytes(w), stride = nat_block_stride(w, g);
    const uint8_t *group = nat_block_at(w, g, 0);
    int one_scale = (pars & PAR_ONE_SCALE) != 0;
    int five_one = FIVE_BIT(form) && one_scale;  /* 5-bit indices under one scale: two chunk pairs a step */
    int sum16 = INDEXED(form) && !five_one;       /* sums kept in 16 bits until the block's end */
    int float_base = one_scale && INDEXED(form) && !ZERO_BASE(form);  /* a base combine_with_base adds */
    __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[M_TILE];
    for (int t = 0; t < rows; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * stride;
        prefetch_ahead(blk, bb, PREFETCH_BYTES, plan->stream_once);
        const int8_t *aq = a->q + i0 * w->n_cols + b * NAT_BLOCK;
        __m256i sum[M_TILE][2];
        for (int t = 0; t < rows; t++) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
        __m256i bits = FIVE_BIT(form) ? _mm256_loadu_si256((const __m256i *)(blk + NAT_FIFTH_BITS_AT))
                                      : _mm256_setzero_si256();
        int step = five_one ? 2 : 1;
#pragma GCC unroll 1
        for (int c = 0; c < 4; c += step) {
            __m256i lo[2], hi[2], lo_signs[2] = {0}, hi_signs[2] = {0};
            for (int k = 0; k < step; k++)
                avx2_chunk_pair(blk, form, plan->table, c + k, &bits, &lo[k], &hi[k], &lo_signs[k], &hi_signs[k]);
            for (int t = 0; t < rows; t++) {
                const int8_t *at = aq + t * w->n_cols + 4 * c;
                __m256i half[2];
                if (INDEXED(form)) {
                    half[0] = _mm256_maddubs_epi16(lo[0], broadcast_word(at));
                    half[1] = _mm256_maddubs_epi16(hi[0], broadcast_word(at + 16));
                    if (five_one) {  /* this step's four chunks into the block's sum */
                        half[0] = _mm256_add_epi16(half[0], _mm256_maddubs_epi16(lo[1], broadcast_word(at + 4)));
                        half[1] = _mm256_add_epi16(half[1], _mm256_maddubs_epi16(hi[1], broadcast_word(at + 20)));
                        __m256i both = _mm256_madd_epi16(_mm256_add_epi16(half[0], half[1]), ones);
                        sum[t][0] = _mm256_add_epi32(sum[t][0], both);
                    } else if (one_scale) {
                        sum[t][0] = _mm256_add_epi16(sum[t][0], _mm256_add_epi16(half[0], half[1]));
                    } else {
                        sum[t][0] = _mm256_add_epi16(sum[t][0], half[0]);
                        sum[t][1] = _mm256_add_epi16(sum[t][1], half[1]);
                    }
                    continue;
                }
                for (int h = 0; h < 2; h++) {
                    const int8_t *ah = at + 16 * h;
                    __m256i d = _mm256_maddubs_epi16(h ? hi[0] : lo[0],
                                                     _mm256_sign_epi8(broadcast_word(ah), h ? hi_signs[0] : lo_signs[0]));
                    half[h] = _mm256_madd_epi16(d, ones);
                }
                if (one_scale) {
                    sum[t][0] = _mm256_add_epi32(sum[t][0], _mm256_add_epi32(half[0], half[1]));
                } else {
                    sum[t][0] = _mm256_add_epi32(sum[t][0], half[0]);
                    sum[t][1] = _mm256_add_epi32(sum[t][1], half[1]);
                }
            }
        }
        __m256 par[4];
        block_params(w, blk, pars, g, b, par);
        for (int t = 0; t < rows; t++) {
            int64_t i = i0 + t;
            const int32_t *sums = a->sums + (i * nb + b) * 2;
            int32_t extra[2] = {0, 0};  /* signed codes enter as they are: no base */
            if (INDEXED(form) && !float_base) base_terms(plan, form, pars, sums, extra);
            __m256i h0 = sum[t][0], h1 = one_scale ? _mm256_setzero_si256() : sum[t][1];
            if (sum16) {
                h0 = _mm256_madd_epi16(h0, ones);
                if (!one_scale) h1 = _mm256_madd_epi16(h1, ones);
            }
            h0 = _mm256_add_epi32(h0, _mm256_set1_epi32(extra[0]));
            if (!one_scale) h1 = _mm256_add_epi32(h1, _mm256_set1_epi32(extra[1]));
            float da = a->d[i * nb + b], asum = a->asum[i * nb + b];
            acc[t] = float_base ? combine_with_base(acc[t], par, pars, h0, plan->base, da, asum)
                                : combine(acc[t], par, pars, h0, h1, da, sums, asum);
        }
    }
    for (int t = 0; t < rows; t++) store_rows(y, w->n_rows, i0 + t, g, acc[t]);
}

/* The AVX2 tile over two row groups (16 rows), for 4-bit indices under one scale (Q4_0, Q4_1, Q4_K), whose sums
 * stay in 16 bits: each activation word is broadcast once for both groups. On Zen 3 a broadcast from memory takes
 * one of the two vector loads a cycle, and the one-group tile of several activation rows issued a broadcast for
 * every vpmaddubsw: its loads bound it as much as its vector instructions did. The float sums wait in memory between
 * blocks (eight of them in registers as well would spill the 16-bit sums); a step's codes are loaded again for the
 * block's second half instead of held. A row's lanes do exactly what the one-group tile's do: the same bits.
 * Paired weights (native.h) give the two groups' blocks one after the other: one stream, fetched ahead as it lies
 * (on into the next pair); otherwise each group's blocks are fetched ahead in their own group. */
TARGET INLINE void avx2_pair_tile(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                                  int rows, int64_t i0, int64_t g, float *y) {
    int64_t nb = w->n_cols / NAT_BLOCK;
    size_t bb = nat_block_bytes(w), stride[2] = {nat_block_stride(w, g), nat_block_stride(w, g + 1)};
    const uint8_t *groups[2] = {nat_block_at(w, g, 0), nat_block_at(w, g + 1, 0)};
    int one_stream = nat_in_pair(w, g) && !(g & 1);  /* the two groups take turns */
    __m256i low4 = _mm256_set1_epi8(15);
    float acc[M_TILE][2][NAT_ROWS] __attribute__((aligned(32)));
    for (int t = 0; t < rows; t++)
        for (int k = 0; k < 2; k++) _mm256_store_ps(acc[t][k], _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[2] = {groups[0] + b * stride[0], groups[1] + b * stride[1]};
        if (one_stream)
            prefetch_ahead(blk[0], 2 * bb, PREFETCH_BYTES, plan->stream_once);
        else
            for (int k = 0; k < 2; k++) prefetch_ahead(blk[k], bb, PREFETCH_BYTES, plan->stream_once);
        const int8_t *aq = a->q + i0 * w->n_cols + b * NAT_BLOCK;
        __m256i sum[M_TILE][2];
        for (int t = 0; t < rows; t++) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {
            for (int h = 0; h < 2; h++) {  /* chunk c, then chunk c + 4 (the high nibbles) */
                __m256i code[2];
                for (int k = 0; k < 2; k++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(blk[k] + 32 * c));
                    code[k] = _mm256_and_si256(h ? _mm256_srli_epi16(packed, 4) : packed, low4);
                }
                for (int t = 0; t < rows; t++) {
                    __m256i x = broadcast_word(aq + t * w->n_cols + 4 * c + 16 * h);
                    sum[t][0] = _mm256_add_epi16(sum[t][0], _mm256_maddubs_epi16(code[0], x));
                    sum[t][1] = _mm256_add_epi16(sum[t][1], _mm256_maddubs_epi16(code[1], x));
                    /* a row at a time: GCC otherwise loaded every row's activations first and spilled a sum */
                    __asm__("" : "+x"(sum[t][0]), "+x"(sum[t][1]));
                }
            }
        }
        for (int k = 0; k < 2; k++) {
            __m256 par[4];
            block_params(w, blk[k], pars, g + k, b, par);
            for (int t = 0; t < rows; t++) {
                int64_t i = i0 + t;
                const int32_t *sums = a->sums + (i * nb + b) * 2;
                float da = a->d[i * nb + b], asum = a->asum[i * nb + b];
                __m256i h0 = _mm256_madd_epi16(sum[t][k], _mm256_set1_epi16(1));
                __m256 sofar = _mm256_load_ps(acc[t][k]);
                _mm256_store_ps(acc[t][k], ZERO_BASE(form)
                                               ? combine(sofar, par, pars, h0, _mm256_setzero_si256(), da, sums, asum)
                                               : combine_with_base(sofar, par, pars, h0, plan->base, da, asum));
            }
        }
    }
    for (int t = 0; t < rows; t++)
        for (int k = 0; k < 2; k++) store_rows(y, w->n_rows, i0 + t, g + k, _mm256_load_ps(acc[t][k]));
}

/* groups g and g + 1 together (all m rows) where avx2_pair_tile serves: 4-bit indices under one scale. Paired
 * weights (one stream; repack.pairable: those with f16 parameters) take it for every call. Unpaired ones only for
 * more activation rows than one tile (a prompt, a large batch), whose tiles run over each group's blocks from L1
 * and L2: streaming from memory (Zen 3, a decode step), two groups' separate streams were slower than one group's. */
TARGET INLINE int avx2_pairs(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                             int64_t m, float *y, int64_t g) {
    if (!INDEXED(form) || FIVE_BIT(form) || !(pars & PAR_ONE_SCALE)) return 0;
    if (m <= M_TILE && !nat_in_pair(w, g)) return 0;
    RUN_TILES(avx2_pair_tile, w, a, plan, form, pars, m, g, y);
    return 1;
}

QGEMM_PATH(TARGET, avx2, avx2_pairs)

/* AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes into 32-bit lanes, exactly. Nibble indices go in as
 * they are (base table[0]; the second half's as 16 * index, saving a shift per chunk, its sum shifted back once),
 * other codes as w + 128 (a table of entries + 128, or one xor; base -128). */
TARGET512 static code_plan avx512_plan(const nat_weight *w) {
    __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->table));
    code_plan plan = {code_form_of(w), -128, _mm256_xor_si256(table, _mm256_set1_epi8((char)0x80)), 0};
    if (INDEXED(plan.form)) plan.base = w->table[0];
    return plan;
}

#define VNNI_HIGH16(form) ((form) <= NIB_LINEAR)

TARGET512 INLINE void vnni_operands(int form, __m256i table, __m256i chunk[8], __m256i signs[8]) {
    (void)signs;
    for (int c = 0; c < 8 && !INDEXED(form); c++)
        chunk[c] = form == NIB_TABLE ? _mm256_shuffle_epi8(table, chunk[c])
                                     : _mm256_xor_si256(chunk[c], _mm256_set1_epi8((char)0x80));
}

TARGET512 INLINE __m256i vnni_half_dot(int form, int half, const __m256i *chunk, const __m256i *signs,
                                       const int8_t *aq, int32_t extra) {
    (void)signs;
    int high16 = half && VNNI_HIGH16(form);  /* the sum is 16 times the dot product: extra too, until the shift */
    __m256i sum = _mm256_set1_epi32(high16 ? extra * 16 : extra);
    for (int c = 0; c < 4; c++) sum = _mm256_dpbusd_epi32(sum, chunk[c], broadcast_word(aq + 4 * c));
    return high16 ? _mm256_srai_epi32(sum, 4) : sum;
}

TARGET512 INLINE void vnni_dots(int form, int pars, const __m256i *chunk, const __m256i *signs, const int8_t *aq,
                                const int32_t extra[2], __m256i h[2]) {
    (void)pars;
    h[0] = vnni_half_dot(form, 0, chunk, signs, aq, extra[0]);
    h[1] = vnni_half_dot(form, 1, chunk + 4, signs + 4, aq + 16, extra[1]);
}

/* AVX-512 over two row groups at once: groups g and g+1 in the two 256-bit halves of each 512-bit vector, so one
 * vpdpbusd with a broadcast activation word gives 16 rows' partial dot products and the float part runs over 16
 * lanes. Each lane does exactly its row's operations of the one-group kernel above: the same bits. */
TARGET512 INLINE __m512i load_pair(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* the two groups' rows of 8 block parameters as float32 */
TARGET512 INLINE __m512 load_pair_params(const uint8_t *lo, const uint8_t *hi, int pars) {
    if (!(pars & PAR_HALF)) return _mm512_castsi512_ps(load_pair(lo, hi));
    __m128i lo_half = _mm_loadu_si128((const __m128i *)lo), hi_half = _mm_loadu_si128((const __m128i *)hi);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo_half), hi_half, 1));
}

/* the two groups' 8 code chunks as vnni_operands makes them (table: the plan's, in all four 128-bit lanes); high16:
 * the second half's nibbles stay in the high nibble (16 * index), or are shifted down like the first half's */
TARGET512 INLINE void pair_operands(const uint8_t *lo, const uint8_t *hi, int form, int high16, __m512i table,
                                    __m512i chunk[8]) {
    if (form == BYTE) {
        for (int c = 0; c < 8; c++)
            chunk[c] = _mm512_xor_si512(load_pair(lo + 32 * c, hi + 32 * c), _mm512_set1_epi8((char)0x80));
        return;
    }
    __m512i low4 = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        __m512i packed = load_pair(lo + 32 * c, hi + 32 * c);
        chunk[c] = _mm512_and_si512(packed, low4);
        chunk[c + 4] = high16 ? _mm512_andnot_si512(low4, packed)
                              : _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
    for (int c = 0; c < 8 && form == NIB_TABLE; c++) chunk[c] = _mm512_shuffle_epi8(table, chunk[c]);
    if (!FIVE_BIT(form)) return;
    /* the fifth bits (native.h): bit c of each byte of the two groups' bits, 16 added where it is set */
    __m512i bits = load_pair(lo + NAT_FIFTH_BITS_AT, hi + NAT_FIFTH_BITS_AT);
    for (int c = 0; c < 8; c++) {
        __mmask64 set = _mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(1 << c)));
        chunk[c] = _mm512_mask_add_epi8(chunk[c], set, chunk[c], _mm512_set1_epi8(16));
    }
}

/* sum + the 16 lanes' byte dot products of chunk with the activation word at aq, broadcast by vpdpbusd itself
 * (EVEX's {1to16}): GCC loads a _mm512_set1_epi32 of it with a vpbroadcastd of its own, an instruction more per
 * dot product, which a batched step's tiles measurably pay for */
TARGET512 INLINE __m512i pair_dot_word(__m512i sum, __m512i chunk, const int8_t *aq) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(chunk), "m"(*(const int32_t *)aq));
    return sum;
}

/* vnni_half_dot over 16 rows, in two chains of two (exact integers: the order is free), so a block's dot products
 * are ready sooner: a batched step's tiles wait on these chains, not on the vector units */
TARGET512 INLINE __m512i pair_half_dot(int form, int half, const __m512i *chunk, const int8_t *aq, int32_t extra) {
    int high16 = half && VNNI_HIGH16(form);
    __m512i first = pair_dot_word(_mm512_set1_epi32(high16 ? extra * 16 : extra), chunk[0], aq);
    __m512i second = pair_dot_word(_mm512_setzero_si512(), chunk[2], aq + 8);
    first = pair_dot_word(first, chunk[1], aq + 4);
    second = pair_dot_word(second, chunk[3], aq + 12);
    __m512i sum = _mm512_add_epi32(first, second);
    return high16 ? _mm512_srai_epi32(sum, 4) : sum;
}

/* one scale per block: only the halves' sum i0 + i1 (+ extra) enters the float part, so the whole block is one
 * integer dot product of its 8 chunks (the second half's nibbles shifted down, pair_operands), in two chains */
TARGET512 INLINE __m512i pair_block_dot(const __m512i *chunk, const int8_t *aq, int32_t extra) {
    __m512i first = pair_dot_word(_mm512_set1_epi32(extra), chunk[0], aq);
    __m512i second = pair_dot_word(_mm512_setzero_si512(), chunk[4], aq + 16);
    for (int c = 1; c < 4; c++) {
        first = pair_dot_word(first, chunk[c], aq + 4 * c);
        second = pair_dot_word(second, chunk[c + 4], aq + 16 + 4 * c);
    }
    return _mm512_add_epi32(first, second);
}

DEFINE_COMBINE(TARGET512, pair_combine, 512)

/* the two groups' 8 multipliers at mult_lo and mult_hi as one vector (a factored weight's, per super-block) */
TARGET512 INLINE __m512 pair_mults(const float *mult_lo, const float *mult_hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)mult_lo)),
                                               _mm256_loadu_pd((const double *)mult_hi), 1));
}

/* two consecutive rows of 8 int8 factors of each group (at lo and hi: 16 bytes each) as float32: the first rows of
 * both groups in *first, the second rows in *second */
TARGET512 INLINE void pair_factor_rows(const uint8_t *lo, const uint8_t *hi, __m512 *first, __m512 *second) {
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)lo)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)hi)));
    *first = _mm512_shuffle_f32x4(a, b, 0x44);   /* a's rows 0-7, then b's */
    *second = _mm512_shuffle_f32x4(a, b, 0xEE);  /* a's rows 8-15, then b's */
}

/* a factored block's parameters of both groups: factor times multiplier (exact). The rows come in pairs as
 * stored: (s0, o0) with one scale and offsets, (s0, s1) with two scales, then (o0, o1) with offsets too; one scale
 * without offsets reads 8 bytes past its row, still inside the group (its multipliers follow its blocks). */
TARGET512 INLINE void pair_factored_params(nat_param_rows p0, nat_param_rows p1, int pars, __m512 mult_s,
                                           __m512 mult_o, __m512 par[4]) {
    __m512 first, second;
    pair_factor_rows(p0.s0, p1.s0, &first, &second);
    par[0] = _mm512_mul_ps(mult_s, first);
    if (pars & PAR_ONE_SCALE) {
        par[1] = par[0];
        par[2] = par[3] = (pars & PAR_OFFSETS) ? _mm512_mul_ps(mult_o, second) : _mm512_setzero_ps();
        return;
    }
    par[1] = _mm512_mul_ps(mult_s, second);
    par[2] = par[3] = _mm512_setzero_ps();
    if (pars & PAR_OFFSETS) {
        pair_factor_rows(p0.o0, p1.o0, &first, &second);
        par[2] = _mm512_mul_ps(mult_o, first);
        par[3] = _mm512_mul_ps(mult_o, second);
    }
}

/* The pair path reads groups g and g+1 side by side, block after block, then the next pair. A fixed distance in
 * bytes ahead of either stream stays in its own group only while the group's row is longer than the distance:
 * past it, the first stream's address lands in the second group just ahead of where that one reads (ffn_down's
 * long rows, a group a little shorter than the distance), and the second stream's blocks arrive late. So each
 * stream fetches the block a number of blocks on in the pairs' own order: further along its group, or at that
 * place in the corresponding group of a following pair. The cursor steps over groups as they lie apart: the backend
 * keeps them so where this path runs (a paired weight's prefetches land elsewhere in it, and never fault). */
typedef struct {
    const uint8_t *group;  /* the first group of the pair the cursor is in */
    int64_t block;         /* its block in that pair */
    int64_t blocks;        /* blocks a group row holds */
    size_t group_bytes, mult_bytes;  /* a group's bytes; those of a factored weight's multipliers after its blocks */
    int once;              /* the plan's stream_once */
} pair_cursor;

/* the cursor `ahead` blocks past the start of the pair at group g (whole pairs: groups are contiguous, as laid out) */
TARGET512 INLINE pair_cursor pair_cursor_at(const nat_weight *w, int64_t g, int64_t ahead, int once) {
    int64_t nb = w->n_cols / NAT_BLOCK;
    pair_cursor c = {nat_group_at(w, g + 2 * (ahead / nb)), ahead % nb, nb, nat_group_bytes(w), nat_group_mult_bytes(w),
                     once};
    return c;
}

/* the cursor's block of both groups towards L1, then the cursor one block on; entering a pair, a factored weight's
 * multipliers of both groups too (they follow each group's blocks). A prefetch past the weight's end fetches
 * nothing it needs and never faults. */
TARGET512 INLINE void prefetch_pair_ahead(pair_cursor *c, size_t bb) {
    const uint8_t *lo = c->group + c->block * bb;
    prefetch_ahead(lo, bb, 0, c->once);
    prefetch_ahead(lo + c->group_bytes, bb, 0, c->once);
    if (++c->block < c->blocks) return;
    c->block = 0;
    c->group += 2 * c->group_bytes;
    size_t mults_at = c->group_bytes - c->mult_bytes;
    prefetch_ahead(c->group + mults_at, c->mult_bytes, 0, c->once);
    prefetch_ahead(c->group + c->group_bytes + mults_at, c->mult_bytes, 0, c->once);
}

/* block b's float parameters of groups g and g+1 (at lo and hi) in par (s0, s1, o0, o1); a factored weight's
 * multipliers of the block's super-block in *mult_s, *mult_o, loaded at its first block and kept for the next 7 */
TARGET512 INLINE void pair_block_params(const nat_weight *w, const uint8_t *lo, const uint8_t *hi, int pars, int64_t g,
                                        int64_t b, __m512 *mult_s, __m512 *mult_o, __m512 par[4]) {
    nat_param_rows p0 = nat_block_param_rows(w, lo), p1 = nat_block_param_rows(w, hi);
    if (pars & PAR_FACTOR) {
        if (b % NAT_SUPER == 0) {
            const float *m0 = nat_block_mults(w, g, b), *m1 = nat_block_mults(w, g + 1, b);
            *mult_s = pair_mults(m0, m1);
            if (pars & PAR_OFFSETS) *mult_o = pair_mults(m0 + NAT_ROWS, m1 + NAT_ROWS);
        }
        pair_factored_params(p0, p1, pars, *mult_s, *mult_o, par);
        return;
    }
    par[0] = load_pair_params(p0.s0, p1.s0, pars);
    par[1] = load_pair_params(p0.s1, p1.s1, pars);
    par[2] = par[3] = _mm512_setzero_ps();
    if (pars & PAR_OFFSETS) {
        par[2] = load_pair_params(p0.o0, p1.o0, pars);
        par[3] = load_pair_params(p0.o1, p1.o1, pars);
    }
}

/* a tile row's 16 results: group g's 8 rows from the low half of acc, group g+1's from the high half */
TARGET512 INLINE void store_pair_rows(float *y, int64_t n, int64_t i, int64_t g, __m512 acc) {
    store_rows(y, n, i, g, _mm512_castps512_ps256(acc));
    store_rows(y, n, i, g + 1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

/* Where a tile row finds block b's activation values: its own arrays (row i0 + t of a), or the block's place in the
 * rows' tile (tile: native.h's nat_qact tiles), where every row's values lie at a constant offset from one pointer */
typedef struct {
    const int8_t *q;
    const int32_t *sums;
    float d, asum;
} act_block;

INLINE act_block act_block_at(const nat_qact *a, const uint8_t *tile, int64_t i0, int t, int64_t b, int64_t n_cols) {
    if (tile) {
        const uint8_t *at = tile + b * NAT_TILE_BYTES;
        act_block v = {(const int8_t *)(at + NAT_TILE_Q + NAT_BLOCK * t), (const int32_t *)(at + NAT_TILE_SUMS) + 2 * t,
                       ((const float *)(at + NAT_TILE_D))[t], ((const float *)(at + NAT_TILE_ASUM))[t]};
        return v;
    }
    int64_t at = (i0 + t) * (n_cols / NAT_BLOCK) + b;
    act_block v = {a->q + at * NAT_BLOCK, a->sums + 2 * at, a->d[at], a->asum[at]};
    return v;
}

/* acc plus one tile row's block: its dot products with the block's prepared chunks and their float part */
TARGET512 INLINE __m512 pair_row(const code_plan *plan, int form, int pars, const __m512i *chunk, const __m512 par[4],
                                 act_block v, __m512 acc) {
    int32_t extra[2];
    base_terms(plan, form, pars, v.sums, extra);
    __m512i h0, h1 = _mm512_setzero_si512();  /* one scale: the combine adds h1 = 0 to the block's sum */
    if (pars & PAR_ONE_SCALE) {
        h0 = pair_block_dot(chunk, v.q, extra[0]);
    } else {
        h0 = pair_half_dot(form, 0, chunk, v.q, extra[0]);
        h1 = pair_half_dot(form, 1, chunk + 4, v.q + 16, extra[1]);
    }
    return pair_combine(acc, par, pars, h0, h1, v.d, v.sums, v.asum);
}

/* The rows' sums are four named variables, not an array: GCC kept an array's in memory (a load and a store a row
 * and block) */
_Static_assert(M_TILE == 4, "pair_tile_from names one sum a tile row");
TARGET512 INLINE void pair_tile_from(const nat_weight *w, const nat_qact *a, const uint8_t *tile, const code_plan *plan,
                                     int form, int pars, int rows, int64_t i0, int64_t g, float *y) {
    int64_t nb = w->n_cols / NAT_BLOCK;
    size_t bb = nat_block_bytes(w);
    size_t stride[2] = {nat_block_stride(w, g), nat_block_stride(w, g + 1)};
    const uint8_t *group = nat_block_at(w, g, 0), *next = nat_block_at(w, g + 1, 0);
    __m512i table = _mm512_broadcast_i64x4(plan->table);
    __m512 mult_s = _mm512_setzero_ps(), mult_o = _mm512_setzero_ps();
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    pair_cursor ahead = pair_cursor_at(w, g, (int64_t)(PAIR_PREFETCH_BYTES / bb) + 1, plan->stream_once);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *lo = group + b * stride[0], *hi = next + b * stride[1];
        prefetch_pair_ahead(&ahead, bb);
        __m512i chunk[8];
        pair_operands(lo, hi, form, VNNI_HIGH16(form) && !(pars & PAR_ONE_SCALE), table, chunk);
        __m512 par[4];
        pair_block_params(w, lo, hi, pars, g, b, &mult_s, &mult_o, par);
        acc0 = pair_row(plan, form, pars, chunk, par, act_block_at(a, tile, i0, 0, b, w->n_cols), acc0);
        if (rows > 1) acc1 = pair_row(plan, form, pars, chunk, par, act_block_at(a, tile, i0, 1, b, w->n_cols), acc1);
        if (rows > 2) acc2 = pair_row(plan, form, pars, chunk, par, act_block_at(a, tile, i0, 2, b, w->n_cols), acc2);
        if (rows > 3) acc3 = pair_row(plan, form, pars, chunk, par, act_block_at(a, tile, i0, 3, b, w->n_cols), acc3);
    }
    __m512 acc[M_TILE] = {acc0, acc1, acc2, acc3};
    for (int t = 0; t < rows; t++) store_pair_rows(y, w->n_rows, i0 + t, g, acc[t]);
}

/* a tile of rows from i0: four rows from their tile where the quantizer wrote one (the same values, so the same
 * bits), else from their own arrays; two calls, so the one without a tile is its own copy with the tile a constant
 * NULL */
TARGET512 INLINE void pair_tile(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                                int rows, int64_t i0, int64_t g, float *y) {
    const uint8_t *tile = rows == NAT_TILE_ROWS ? nat_act_tile(a, i0, w->n_cols) : NULL;
    if (tile)
        pair_tile_from(w, a, tile, plan, form, pars, rows, i0, g, y);
    else
        pair_tile_from(w, a, NULL, plan, form, pars, rows, i0, g, y);
}

/* groups g and g+1 for all m activation rows */
TARGET512 INLINE int pair_groups(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                                 int64_t m, float *y, int64_t g) {
    RUN_TILES(pair_tile, w, a, plan, form, pars, m, g, y);
    return 1;
}

DEFINE_ROW_TILE(TARGET512, avx512, VNNI_HIGH16, vnni_operands, vnni_dots)
QGEMM_PATH(TARGET512, avx512, pair_groups)

/* the AVX-512 path reads every whole tile of four rows (pair_tile) */
int64_t nat_tiled_from_avx512(int64_t m) {
    (void)m;
    return 0;
}

#ifdef NAT_HAVE_AMX
/* AMX (AMX-TILE + AMX-INT8): the AVX-512 path with a prompt's integer dot products taken by the tile unit, whose
 * one instruction multiplies 16 activation rows by 16 weight rows over a block's codes. A block of the two groups
 * is made into pair_operands' 8 chunks as before (the second half's nibbles shifted down): chunk c's 64 bytes, 4
 * codes of each of the pair's 16 rows, are row c of the tile unit's second operand as it wants it (4 consecutive
 * bytes per column); the activation rows' codes are its first operand as they lie. The exact integer dot products
 * (plus the base terms) then take the AVX-512 pair path's float part: the same bits.
 * The tile unit pays for its operands' trip through memory: a block's operands are stored, then loaded as a tile,
 * and its dot products stored, then loaded into vectors. So a pair's blocks are made into operands (and their float
 * parameters widened) once, for all of the call's tiles of 16 rows, a run of AMX_BLOCKS blocks at a time, and each
 * tile's float part takes the dot products of the block two before the one the tile unit works on. With fewer
 * than 16 rows there is too little to share them with (four rows ran slower than the AVX-512 tile's dot products):
 * those rows take the AVX-512 pair tile. The instructions are written in assembly with a memory clobber each, so
 * the compiler orders the tiles' loads and stores with the vector stores and loads around them. */
#define TARGET_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define AMX_ROWS 16    /* activation rows of a tile */
#define AMX_BLOCKS 32  /* blocks made into operands at a time (a multiple of NAT_SUPER) */
#define AMX_LAG 2      /* blocks between a block's dot products and its float part */

/* the tile registers: the dot products of even and odd blocks (two scales: a pair for the halves each), the
 * activation codes [16 rows][the block's 32 bytes, or a half's 16] and the weight operands [chunks][64 bytes] */
#define AMX_C_EVEN 0
#define AMX_C_EVEN_HIGH 1
#define AMX_C_ODD 2
#define AMX_C_ODD_HIGH 3
#define AMX_A 4
#define AMX_A_HIGH 5
#define AMX_B 6
#define AMX_B_HIGH 7
#define AMX_STR(x) #x
#define AMX_TMM(t) "%%tmm" AMX_STR(t)
#define AMX_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), " AMX_TMM(t) ::"r"(base), "r"((int64_t)(stride)) : "memory")
#define AMX_STORE(t, base) \
    __asm__ volatile("tilestored " AMX_TMM(t) ", (%0,%1,1)" ::"r"(base), "r"((int64_t)64) : "memory")
#define AMX_ZERO(t) __asm__ volatile("tilezero " AMX_TMM(t) ::: "memory")
/* c += a (signed bytes) . b (unsigned bytes), 4 at a time into each int32 */
#define AMX_DOT(c, a, b) __asm__ volatile("tdpbsud " AMX_TMM(b) ", " AMX_TMM(a) ", " AMX_TMM(c) ::: "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_config;

/* the tile registers' shapes: one scale, a whole block a dot product; two, a half each */
static void amx_configure(int one_scale) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = AMX_C_EVEN; t <= AMX_C_ODD_HIGH; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.bytes_per_row[t] = 64;
    }
    cfg.rows[AMX_A] = cfg.rows[AMX_A_HIGH] = AMX_ROWS;
    cfg.bytes_per_row[AMX_A] = cfg.bytes_per_row[AMX_A_HIGH] = one_scale ? 32 : 16;
    cfg.rows[AMX_B] = cfg.rows[AMX_B_HIGH] = one_scale ? 8 : 4;
    cfg.bytes_per_row[AMX_B] = cfg.bytes_per_row[AMX_B_HIGH] = 64;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

static void amx_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* A run of a pair's blocks made ready for the tile unit: each block's 8 operand chunks and its 4 rows of float
 * parameters (s0, s1, o0, o1 over the pair's 16 rows) */
typedef struct {
    _Alignas(64) uint8_t operands[AMX_BLOCKS][8 * 64];
    _Alignas(64) float params[AMX_BLOCKS][4][16];
} amx_run;

/* blocks [b0, b0 + n) of groups g and g+1 into run */
TARGET_AMX INLINE void amx_prepare(const nat_weight *w, const code_plan *plan, int form, int pars, int64_t g,
                                   int64_t b0, int n, amx_run *run) {
    size_t stride[2] = {nat_block_stride(w, g), nat_block_stride(w, g + 1)};
    const uint8_t *group = nat_block_at(w, g, 0), *next = nat_block_at(w, g + 1, 0);
    __m512i table = _mm512_broadcast_i64x4(plan->table);
    /* a run starts on a super-block (AMX_BLOCKS is a multiple of NAT_SUPER), whose multipliers its first block loads */
    __m512 mult_s = _mm512_setzero_ps(), mult_o = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        int64_t b = b0 + j;
        const uint8_t *lo = group + b * stride[0], *hi = next + b * stride[1];
        __m512i chunk[8];
        pair_operands(lo, hi, form, 0, table, chunk);
        for (int c = 0; c < 8; c++) _mm512_store_si512((__m512i *)(run->operands[j] + 64 * c), chunk[c]);
        __m512 par[4];
        pair_block_params(w, lo, hi, pars, g, b, &mult_s, &mult_o, par);
        for (int r = 0; r < 4; r++) _mm512_store_ps(run->params[j][r], par[r]);
    }
}

/* the loaded block's dot products into tile C (two scales: the halves in C and C_HIGH), stored in dots[0] (and
 * dots[1]); tile numbers are the instructions' own operands, so each pair of tiles is its own copy */
#define AMX_DOTS_INTO(C, C_HIGH, one_scale, dots)        \
    do {                                                 \
        AMX_ZERO(C);                                     \
        AMX_DOT(C, AMX_A, AMX_B);                        \
        AMX_STORE(C, (dots)[0]);                         \
        if (!(one_scale)) {                              \
            AMX_ZERO(C_HIGH);                            \
            AMX_DOT(C_HIGH, AMX_A_HIGH, AMX_B_HIGH);     \
            AMX_STORE(C_HIGH, (dots)[1]);                \
        }                                                \
    } while (0)

/* the tile unit's dot products of run block j for the 16 activation rows at aq (row stride n_cols), into the even
 * or odd tiles (so a block's tiles are not those whose results the last block is still storing), stored in dots
 * (one scale: the whole block in dots[0]; two: the halves in dots[0], dots[1]) */
TARGET_AMX INLINE void amx_block_dots(const amx_run *run, int j, const int8_t *aq, int64_t n_cols, int one_scale,
                                      int odd, int32_t dots[2][AMX_ROWS * 16]) {
    const uint8_t *operands = run->operands[j];
    AMX_LOAD(AMX_B, operands, 64);
    AMX_LOAD(AMX_A, aq, n_cols);
    if (!one_scale) {
        AMX_LOAD(AMX_B_HIGH, operands + 4 * 64, 64);
        AMX_LOAD(AMX_A_HIGH, aq + 16, n_cols);
    }
    if (odd)
        AMX_DOTS_INTO(AMX_C_ODD, AMX_C_ODD_HIGH, one_scale, dots);
    else
        AMX_DOTS_INTO(AMX_C_EVEN, AMX_C_EVEN_HIGH, one_scale, dots);
}

/* block b's float part for the tile's 16 rows from i0 (pair_tile's, from the stored dot products) */
TARGET_AMX INLINE void amx_combine(const nat_qact *a, const code_plan *plan, int form, int pars, const float par_at[4][16],
                                   int64_t i0, int64_t nb, int64_t b, int32_t dots[2][AMX_ROWS * 16],
                                   __m512 acc[AMX_ROWS]) {
    __m512 par[4];
    for (int r = 0; r < 4; r++) par[r] = _mm512_load_ps(par_at[r]);
    int one_scale = (pars & PAR_ONE_SCALE) != 0;
    for (int t = 0; t < AMX_ROWS; t++) {
        int64_t i = i0 + t;
        const int32_t *sums = a->sums + (i * nb + b) * 2;
        int32_t extra[2];
        base_terms(plan, form, pars, sums, extra);
        __m512i h0 = _mm512_add_epi32(_mm512_load_si512((const __m512i *)(dots[0] + 16 * t)), _mm512_set1_epi32(extra[0]));
        __m512i h1 = _mm512_setzero_si512();
        if (!one_scale)
            h1 = _mm512_add_epi32(_mm512_load_si512((const __m512i *)(dots[1] + 16 * t)), _mm512_set1_epi32(extra[1]));
        acc[t] = pair_combine(acc[t], par, pars, h0, h1, a->d[i * nb + b], sums, a->asum[i * nb + b]);
    }
}

/* the run's blocks [b0, b0 + n) for the 16 activation rows from i0: acc carried in (from zeros, or from the last
 * run's sums as stored in y: a float stored and loaded back is the same float) and stored out to y */
TARGET_AMX INLINE void amx_pair_rows(const nat_weight *w, const nat_qact *a, const code_plan *plan, int form, int pars,
                                     const amx_run *run, int64_t b0, int n, int64_t i0, int64_t g, float *y) {
    int64_t nb = w->n_cols / NAT_BLOCK, n_out = w->n_rows;
    int one_scale = (pars & PAR_ONE_SCALE) != 0;
    _Alignas(64) int32_t dots[AMX_LAG + 2][2][AMX_ROWS * 16];
    __m512 acc[AMX_ROWS];
    for (int t = 0; t < AMX_ROWS; t++)
        acc[t] = b0 ? _mm512_loadu_ps(y + (i0 + t) * n_out + g * NAT_ROWS) : _mm512_setzero_ps();
    const int8_t *aq = a->q + i0 * w->n_cols + b0 * NAT_BLOCK;
    for (int j = 0; j < n + AMX_LAG; j++) {
        if (j < n) amx_block_dots(run, j, aq + j * NAT_BLOCK, w->n_cols, one_scale, j & 1, dots[j % (AMX_LAG + 2)]);
        int k = j - AMX_LAG;
        if (k >= 0)
            amx_combine(a, plan, form, pars, run->params[k], i0, nb, b0 + k, dots[k % (AMX_LAG + 2)], acc);
    }
    for (int t = 0; t < AMX_ROWS; t++) _mm512_storeu_ps(y + (i0 + t) * n_out + g * NAT_ROWS, acc[t]);
}

/* the whole pairs of groups [g0, g1) (their 16 results of a row lie side by side in y) for the m activation rows, m
 * a multiple of AMX_ROWS (the FOR_FORM kernel NAME_groups of amx_pairs below) */
TARGET_AMX INLINE void amx_groups(const nat_weight *given, const nat_qact *a, const code_plan *plan, int form, int pars,
                                  int64_t m, float *y, int64_t g0, int64_t g1) {
    nat_weight fixed = with_constant_layout(given, form, pars);
    const nat_weight *w = &fixed;
    int64_t nb = w->n_cols / NAT_BLOCK;
    amx_run run;
    amx_configure((pars & PAR_ONE_SCALE) != 0);
    for (int64_t g = g0; g < g1; g += 2) {
        for (int64_t b0 = 0; b0 < nb; b0 += AMX_BLOCKS) {
            int n = nb - b0 < AMX_BLOCKS ? (int)(nb - b0) : AMX_BLOCKS;
            amx_prepare(w, plan, form, pars, g, b0, n, &run);
            for (int64_t i = 0; i < m; i += AMX_ROWS) amx_pair_rows(w, a, plan, form, pars, &run, b0, n, i, g, y);
        }
    }
}

/* amx_groups specialised for w's code form and parameter flags; a layout without such a kernel takes the AVX-512
 * call */
TARGET_AMX static void amx_pairs(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1) {
    code_plan plan = avx512_plan(w);
    plan.stream_once = streams_once(m);
    int pars = param_flags(w);
    FOR_FORM(amx, NIB_INDEX) FOR_FORM(amx, NIB_LINEAR) FOR_FORM(amx, NIB_TABLE) FOR_FORM(amx, BYTE)
    FOR_FORM(amx, NIB5_INDEX) FOR_FORM(amx, NIB5_LINEAR)
    nat_qgemm_avx512(w, a, m, y, g0, g1);
}

/* the AMX path's AVX-512 call reads the four-row tiles past its whole 16-row ones */
int64_t nat_tiled_from_amx(int64_t m) { return m / AMX_ROWS * AMX_ROWS; }

/* The AMX path's matmul: the tile unit for the whole tiles of 16 rows over the whole pairs of groups, the AVX-512
 * call for the rest (a decode step's fewer rows all of it; the groups past the last whole pair; the rows past the
 * last whole tile). The tile registers are given back after a call that used them, so a thread that leaves the
 * kernels carries no tile state (the kernel then saves none at a switch). */
TARGET_AMX void nat_qgemm_amx(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1) {
    /* whole groups end at `whole`; g0 is even (the pool shares whole pairs), so the whole pairs end at `paired` */
    int64_t tiled = m / AMX_ROWS * AMX_ROWS, whole = w->n_rows / NAT_ROWS < g1 ? w->n_rows / NAT_ROWS : g1;
    int64_t paired = whole > g0 ? g0 + (whole - g0) / 2 * 2 : g0;
    if (tiled == 0 || paired == g0) {
        nat_qgemm_avx512(w, a, m, y, g0, g1);
        return;
    }
    amx_pairs(w, a, tiled, y, g0, paired);
    amx_release();
    if (paired < g1) nat_qgemm_avx512(w, a, tiled, y, paired, g1);
    if (tiled < m) {
        nat_qact rest = nat_qact_from(a, tiled, w->n_cols);
        nat_qgemm_avx512(w, &rest, m - tiled, y + tiled * w->n_rows, g0, g1);
    }
}
#endif /* NAT_HAVE_AMX */

/* nat_quantize_rows (kernels_scalar.c) in 256-bit vectors, for the AVX2 path: the same operations in IEEE
 * float and double — |x| and its maximum, the double reciprocal, x * inv in double rounded half to even
 * (vroundpd), clamped to +-127 — so the same codes, scales and sums. */
TARGET static void quantize_half(const float *x, __m256d inv, int8_t *q, int32_t *sum) {
    __m128i codes[4];
    __m256d top = _mm256_set1_pd(127.0), bottom = _mm256_set1_pd(-127.0);
    for (int c = 0; c < 4; c++) {
        __m256d r = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + 4 * c)), inv);
        r = _mm256_round_pd(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        codes[c] = _mm256_cvtpd_epi32(_mm256_max_pd(_mm256_min_pd(r, top), bottom));
    }
    __m128i total = _mm_add_epi32(_mm_add_epi32(codes[0], codes[1]), _mm_add_epi32(codes[2], codes[3]));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, _MM_SHUFFLE(1, 0, 3, 2)));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, _MM_SHUFFLE(2, 3, 0, 1)));
    *sum = _mm_cvtsi128_si32(total);
    __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(codes[0], codes[1]), _mm_packs_epi32(codes[2], codes[3]));
    _mm_storeu_si128((__m128i *)q, bytes);
}

/* blocks a vector quantizer takes at a time: their maxima first, then the divisions for all of them in a few vector
 * instructions (127 / top in double, top / 127 in float), then their codes, so no division's latency stands
 * between one block's maximum and its codes */
#define QUANTIZE_BATCH 16

/* The row and block loop of a vector quantizer (NAME), QUANTIZE_BATCH blocks at a time: TOP(xb) gives a block's
 * largest magnitude, or -1 for a block with a NaN or inf (its codes, scale and sums then come from
 * nat_quantize_nonfinite); DIVIDE(top, d, inv) fills d[j] = top[j] / 127 and inv[j] = 127 / top[j] (0 where
 * top[j] <= 0) for all QUANTIZE_BATCH entries; CODES(xb, inv, q, sums) writes a block's codes and its halves' sums.
 * The operations of nat_quantize_rows, so the same bits. */
#define QUANTIZE_ROWS(ATTR, NAME, TOP, DIVIDE, CODES)                                                              \
    ATTR void NAME(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1) {                               \
        int64_t nb = k / NAT_BLOCK;                                                                                \
        for (int64_t i = m0; i < m1; i++) {                                                                        \
            for (int64_t b0 = 0; b0 < nb; b0 += QUANTIZE_BATCH) {                                                  \
                int n = nb - b0 < QUANTIZE_BATCH ? (int)(nb - b0) : QUANTIZE_BATCH;                                \
                float top[QUANTIZE_BATCH] = {0}, d[QUANTIZE_BATCH];                                                \
                double inv[QUANTIZE_BATCH];                                                                        \
                for (int j = 0; j < n; j++) top[j] = TOP(x + i * k + (b0 + j) * NAT_BLOCK);                        \
                DIVIDE(top, d, inv);                                                                               \
                for (int j = 0; j < n; j++) {                                                                      \
                    int64_t at = i * nb + b0 + j;                                                                  \
                    int8_t *q = a->q + i * k + (b0 + j) * NAT_BLOCK;                                               \
                    int32_t *sums = a->sums + at * 2;                                                              \
                    if (top[j] < 0.0f) {                                                                           \
                        nat_quantize_nonfinite(q, &a->d[at], sums, &a->asum[at]);                                  \
                        continue;                                                                                  \
                    }                                                                                              \
                    CODES(x + i * k + (b0 + j) * NAT_BLOCK, inv[j], q, sums);                                      \
                    a->asum[at] = (float)(sums[0] + sums[1]);                                                      \
                    a->d[at] = d[j];                                                                               \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }

TARGET INLINE float block_top_avx2(const float *xb) {
    __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), largest = _mm256_set1_ps(3.0e38f);
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int c = 0; c < 4; c++) {
        __m256 v = _mm256_and_ps(_mm256_loadu_ps(xb + 8 * c), magnitude);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(v, largest, _CMP_LE_OQ));  /* false for NaN */
        amax = _mm256_max_ps(amax, v);
    }
    if (_mm256_movemask_ps(finite) != 0xff) return -1.0f;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

TARGET INLINE void divide_avx2(const float *top, float *d, double *inv) {
    for (int j = 0; j < QUANTIZE_BATCH; j += 8)
        _mm256_storeu_ps(d + j, _mm256_div_ps(_mm256_loadu_ps(top + j), _mm256_set1_ps(127.0f)));
    for (int j = 0; j < QUANTIZE_BATCH; j += 4) {
        __m256d t = _mm256_cvtps_pd(_mm_loadu_ps(top + j));
        __m256d positive = _mm256_cmp_pd(t, _mm256_setzero_pd(), _CMP_GT_OQ);
        _mm256_storeu_pd(inv + j, _mm256_and_pd(positive, _mm256_div_pd(_mm256_set1_pd(127.0), t)));
    }
}

TARGET INLINE void codes_avx2(const float *xb, double inv, int8_t *q, int32_t sums[2]) {
    __m256d scale = _mm256_set1_pd(inv);
    quantize_half(xb, scale, q, &sums[0]);
    quantize_half(xb + 16, scale, q + 16, &sums[1]);
}

QUANTIZE_ROWS(TARGET, nat_quantize_rows_avx2, block_top_avx2, divide_avx2, codes_avx2)

/* nat_quantize_rows with 512-bit vectors: the same IEEE operations as quantize_half, 8 doubles at a time, rounded
 * half to even as they are converted (an exact integer either way) and clamped as integers (the same codes: a
 * rounded value beyond +-127 clamps to +-127 whether it is clamped before or after the conversion); the codes of
 * 16 elements as bytes */
TARGET512 static __m128i quantize_16_avx512(const float *x, __m512d inv) {
    __m256i lo = _mm512_cvt_roundpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x)), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i hi = _mm512_cvt_roundpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + 8)), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    codes = _mm512_min_epi32(_mm512_max_epi32(codes, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    return _mm512_cvtepi32_epi8(codes);
}

/* the two halves' code sums of a block's 32 codes: vpsadbw sums 8 bytes at a time, unsigned, so the codes go in
 * offset by 128 (xor of the sign bit) and 16 * 128 comes off each half */
TARGET512 static void half_sums_avx512(__m256i codes, int32_t sums[2]) {
    __m256i parts = _mm256_sad_epu8(_mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    __m256i pairs = _mm256_add_epi64(parts, _mm256_shuffle_epi32(parts, _MM_SHUFFLE(1, 0, 3, 2)));
    sums[0] = _mm256_cvtsi256_si32(pairs) - 16 * 128;
    sums[1] = _mm256_extract_epi32(pairs, 4) - 16 * 128;
}

/* a block's largest magnitude, or -1 for a block with a NaN (the compare is false) or an inf */
TARGET512 INLINE float block_top_avx512(const float *xb) {
    __m512 largest = _mm512_set1_ps(3.0e38f);
    __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), v1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    __mmask16 finite = _mm512_cmp_ps_mask(v0, largest, _CMP_LE_OQ) & _mm512_cmp_ps_mask(v1, largest, _CMP_LE_OQ);
    return finite == 0xFFFF ? _mm512_reduce_max_ps(_mm512_max_ps(v0, v1)) : -1.0f;  /* an exact maximum: any order */
}

TARGET512 INLINE void divide_avx512(const float *top, float *d, double *inv) {
    __m512 tops = _mm512_loadu_ps(top);
    _mm512_storeu_ps(d, _mm512_div_ps(tops, _mm512_set1_ps(127.0f)));
    for (int h = 0; h < 2; h++) {
        __m256 part = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(tops), 1))
                        : _mm512_castps512_ps256(tops);
        __m512d t = _mm512_cvtps_pd(part);
        __mmask8 positive = _mm512_cmp_pd_mask(t, _mm512_setzero_pd(), _CMP_GT_OQ);
        _mm512_storeu_pd(inv + 8 * h, _mm512_maskz_div_pd(positive, _mm512_set1_pd(127.0), t));
    }
}

TARGET512 INLINE void codes_avx512(const float *xb, double inv, int8_t *q, int32_t sums[2]) {
    __m512d scale = _mm512_set1_pd(inv);
    __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(quantize_16_avx512(xb, scale)),
                                            quantize_16_avx512(xb + 16, scale), 1);
    _mm256_storeu_si256((__m256i *)q, codes);
    half_sums_avx512(codes, sums);
}

QUANTIZE_ROWS(TARGET512, nat_quantize_rows_avx512, block_top_avx512, divide_avx512, codes_avx512)

/* 8 weights from element j of a row as float (zero past n_cols) */
TARGET static inline __m256 load_weights8(const nat_weight *w, const uint8_t *row, int64_t j, int64_t k) {
    if (j + 8 > k) {
        float tmp[8] = {0};
        for (int l = 0; j + l < k; l++) {
            if (w->kind == NAT_F32) memcpy(&tmp[l], row + 4 * (j + l), 4);
            else {
                uint16_t h;
                memcpy(&h, row + 2 * (j + l), 2);
                if (w->kind == NAT_F16) tmp[l] = nat_f16_to_f32(h);
                else { uint32_t bits = (uint32_t)h << 16; memcpy(&tmp[l], &bits, 4); }
            }
        }
        return _mm256_loadu_ps(tmp);
    }
    if (w->kind == NAT_F32) return _mm256_loadu_ps((const float *)(row + 4 * j));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * j));
    if (w->kind == NAT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TARGET static inline __m256 load_x8(const float *x, int64_t j, int64_t k) {
    if (j + 8 <= k) return _mm256_loadu_ps(x + j);
    float tmp[8] = {0};
    for (int l = 0; j + l < k; l++) tmp[l] = x[j + l];
    return _mm256_loadu_ps(tmp);
}

/* The float-weight matmul of both x86 paths: LANES(w, x_row, w_row, k, lanes) leaves the 16 canonical partial sums
 * (native.h) of one row pair in lanes. */
#define FGEMM_ROWS(LANES)                                                   \
    int64_t k = w->n_cols, n = w->n_rows;                                   \
    size_t esize = w->kind == NAT_F32 ? 4 : 2;                              \
    for (int64_t r = r0; r < r1; r++) {                                     \
        const uint8_t *row = w->data + (size_t)r * k * esize;               \
        for (int64_t i = 0; i < m; i++) {                                   \
            float lanes[16];                                                \
            LANES(w, x + i * k, row, k, lanes);                             \
            y[i * n + r] = nat_reduce16(lanes);                             \
        }                                                                   \
    }

TARGET static inline void avx2_lanes(const nat_weight *w, const float *xi, const uint8_t *row, int64_t k,
                                     float *lanes) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(load_x8(xi, j, k), load_weights8(w, row, j, k)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(load_x8(xi, j + 8, k), load_weights8(w, row, j + 8, k)));
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
}

TARGET void nat_fgemm_avx2(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1) {
    FGEMM_ROWS(avx2_lanes)
}

/* ---- AVX-512 float lanes ---- */
TARGET512 static inline void avx512_lanes(const nat_weight *w, const float *xi, const uint8_t *row, int64_t k,
                                         float *lanes) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __mmask16 keep = j + 16 <= k ? (__mmask16)0xffff : (__mmask16)((1u << (k - j)) - 1);
        __m512 xv = _mm512_maskz_loadu_ps(keep, xi + j), wv;
        if (w->kind == NAT_F32) {
            wv = _mm512_maskz_loadu_ps(keep, row + 4 * j);
        } else {
            __m256i h = _mm256_maskz_loadu_epi16(keep, row + 2 * j);
            wv = w->kind == NAT_F16 ? _mm512_cvtph_ps(h)
                                    : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(xv, wv));
    }
    _mm512_storeu_ps(lanes, acc);
}

TARGET512 void nat_fgemm_avx512(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1) {
    FGEMM_ROWS(avx512_lanes)
}

/* ---- f16 rows (an f16 KV cache): F16C's conversions, round to nearest even, the scalar functions' bits ---- */

TARGET void nat_f32_to_f16_row_f16c(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = nat_f32_to_f16(x[i]);
}

TARGET void nat_f16_to_f32_row_f16c(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = nat_f16_to_f32(h[i]);
}
#endif
