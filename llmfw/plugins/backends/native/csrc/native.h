/* llmfw native kernels: shared declarations.
 *
 * Canonical arithmetic (every ISA path computes exactly these float operations, in this order, so all paths give
 * the same bits and a row's result never depends on the batch size M or on the thread split):
 *
 *  quantized weights (kind NAT_QNIB / NAT_QBYTE), per output row r, per 32-element block b:
 *      i0, i1 = integer dot products of the block's weight codes with the activation codes, elements 0-15 / 16-31
 *      two scales per block (one per half):  v = fma(s1, i1, s0*i0);   [v = fma(o0, A0, v);  v = fma(o1, A1, v);]
 *      one scale per block (s, o):           v = s*(i0 + i1);           [v = fma(o, A0 + A1, v);]
 *      acc = fma(da, v, acc)
 *    (fma(a, b, c): a*b + c rounded once, C's fmaf; A0/A1: sums of the activation codes of each half, da: the
 *    activation block's scale; the bracket only for a weight with offsets; with one scale the integers are added
 *    exactly before the one conversion); blocks in order. Fused: a batched step's tiles are bound by this float
 *    work per (row, block), and each fused pair is one instruction where a product and a sum were two.
 *  float weights (NAT_F32 / NAT_F16 / NAT_BF16): 16 lanes, element i into lane i % 16 (acc = acc + x*w; the row
 *    padded with zeros to a multiple of 16), then lanes l + l+8, l + l+4, l + l+2, l + l+1.
 * Every other product and sum is its own rounding: the build compiles with -ffp-contract=off, so the compiler never
 * fuses on its own and the only fused multiply-adds are the explicit ones above, alike on every path.
 */
#ifndef LLMFW_NATIVE_H
#define LLMFW_NATIVE_H

#include <stdint.h>
#include <stddef.h>

/* the layout helpers below run inside the kernels' inner loops: always inlined (GCC otherwise stops inlining them
 * into a kernel whose many specialised copies have grown large, and each block then pays calls) */
#if defined(__GNUC__)
#define NAT_LAYOUT static inline __attribute__((always_inline))
#else
#define NAT_LAYOUT static inline
#endif

#define NAT_ROWS 8        /* output rows per interleaved row group */
#define NAT_BLOCK 32      /* elements per quantized block */

enum nat_kind { NAT_QNIB = 0, NAT_QBYTE = 1, NAT_F32 = 2, NAT_F16 = 3, NAT_BF16 = 4, NAT_QNIB5 = 5 };
/* NAT_ISA_AMX: the AVX-512 path with the tile unit's integer dot products in batched tiles (the same bits) */
enum nat_isa { NAT_ISA_SCALAR = 0, NAT_ISA_AVX2 = 1, NAT_ISA_AVX512 = 2, NAT_ISA_AMX = 3 };

/* A repacked weight [n_rows, n_cols].
 * Quantized kinds: n_groups = ceil(n_rows / 8) groups, each n_cols/32 blocks of
 *   codes  [chunk][8 rows][4 bytes], 4 (QNIB) or 8 (QBYTE) chunks of 32 bytes: each chunk holds 4 consecutive
 *          codes of every row of the group, so one 32-byte vector times a broadcast 4-byte activation gives the
 *          8 rows' partial dot products in 8 lanes. QBYTE: chunk c byte 4r+i is int8 element 4c+i of row r;
 *          QNIB: chunk c byte 4r+i holds element 4c+i of row r in its low nibble, element 16+4c+i in its high one;
 *          QNIB5 (5-bit codes): the QNIB nibbles of the codes' low 4 bits, then the fifth bits, 4 bytes a row
 *          [8 rows][4]: bit c of byte i is element 4c+i's (so chunk c's bits are bit c of the bytes at the chunk's
 *          own places, one shift away); a 5-bit weight streams 5 bits a code
 *   scales [n_scales][8 rows], then (has_offsets) offsets [n_scales][8 rows], each a float32, or an f16 where
 *          half_params is set: the block types whose scales and offsets are f16 in the file keep them so, as a
 *          decode step streams every byte of a weight (f16 widens to float32 exactly: the same values), or an
 *          int8 factor where factored is set (its multipliers follow the group's blocks: see `factored`)
 * (n_scales 2: one scale per 16 elements, 1: per 32)
 * a weight value is scale * table[code] + offset (QNIB), scale * (table[0] + code) + offset (QNIB5: the table
 * is table[0] + index, linear) or scale * code + offset (QBYTE).
 * paired: the groups lie side by side in pairs (groups 2p and 2p+1 take turns block by block: block b of 2p, block
 * b of 2p+1, then block b+1 of each; a factored weight's multipliers of 2p, then of 2p+1, after the pair's
 * blocks), so a kernel that multiplies two groups at a time reads one stream of bytes; a last group without a
 * partner lies alone, as every group does unpaired. Each pair takes the bytes of its two groups unpaired.
 * Float kinds: plain row-major rows of n_cols elements. */
typedef struct {
    int32_t kind;
    int32_t n_scales;
    int32_t has_offsets;
    int32_t half_params;
    int64_t n_rows;
    int64_t n_cols;
    const uint8_t *data;
    int8_t table[16];
    /* factored parameters (the K-quants and IQ4_XS): a block's scales and offsets are int8 factors (one byte a
     * row), each times its row's multiplier of the block's 256-element super-block, which follow the group's
     * blocks: [super-block][scale, then (has_offsets) offset][8 rows] float32. The product is exact in float32
     * (an f16 times an integer of at most 8 bits): the value the file's own scale and minimum give. */
    int32_t factored;
    int32_t paired;  /* the groups side by side in pairs (above) */
} nat_weight;

/* activations quantized to 8 bits: per row, n_cols/32 blocks */
typedef struct {
    int8_t *q;        /* [M][n_cols] codes */
    float *d;         /* [M][n_blocks] scales */
    int32_t *sums;    /* [M][n_blocks][2] code sums of each half */
    float *asum;      /* [M][n_blocks] (float)(sum of both halves): a one-scale weight's offset term (exact) */
    /* Or NULL: the same values again, NAT_TILE_ROWS rows at a time (rows 4k..4k+3 the k-th tile), each tile's
     * blocks one after another with the four rows' values of a block together (NAT_TILE_*). A kernel's tile of
     * four rows then finds everything through one pointer at constant offsets, where the rows' own arrays take a
     * pointer a row and array: too many for the general registers beside the dot products' own. Valid for the
     * tiles from row tiled_from on (a multiple of NAT_TILE_ROWS). */
    uint8_t *tiles;
    int64_t tiled_from;
} nat_qact;

#define NAT_TILE_ROWS 4
#define NAT_TILE_Q 0       /* the rows' 32 codes each */
#define NAT_TILE_D 128     /* their scales */
#define NAT_TILE_ASUM 144  /* their float sums */
#define NAT_TILE_SUMS 160  /* their halves' code sums, two each */
#define NAT_TILE_BYTES 192 /* a block of a tile */

static inline int nat_is_quantized(const nat_weight *w) {
    return w->kind == NAT_QNIB || w->kind == NAT_QBYTE || w->kind == NAT_QNIB5;
}

/* where a QNIB5 block's fifth bits start: after the nibbles of its 8 rows */
#define NAT_FIFTH_BITS_AT (16 * NAT_ROWS)

/* the code bytes of one row of a block */
NAT_LAYOUT size_t nat_code_bytes(const nat_weight *w) {
    return w->kind == NAT_QNIB ? 16 : w->kind == NAT_QNIB5 ? 20 : 32;
}

/* the bytes of one block parameter (a scale or an offset) */
NAT_LAYOUT size_t nat_param_bytes(const nat_weight *w) { return w->factored ? 1 : w->half_params ? 2 : 4; }

/* blocks per super-block of a factored weight (256 elements) */
#define NAT_SUPER 8

/* the bytes of a factored weight's multipliers of one row group (none for other weights) */
NAT_LAYOUT size_t nat_group_mult_bytes(const nat_weight *w) {
    if (!w->factored) return 0;
    return (size_t)(w->n_cols / (NAT_BLOCK * NAT_SUPER)) * (size_t)(1 + w->has_offsets) * NAT_ROWS * sizeof(float);
}

NAT_LAYOUT size_t nat_block_bytes(const nat_weight *w) {
    return (size_t)NAT_ROWS * nat_code_bytes(w) + (size_t)w->n_scales * (1 + w->has_offsets) * NAT_ROWS * nat_param_bytes(w);
}

/* the bytes of one row group's blocks (a factored weight's multipliers follow them) */
NAT_LAYOUT size_t nat_group_block_bytes(const nat_weight *w) {
    return (size_t)(w->n_cols / NAT_BLOCK) * nat_block_bytes(w);
}

/* the bytes of one row group: its blocks, then (factored) its multipliers */
NAT_LAYOUT size_t nat_group_bytes(const nat_weight *w) { return nat_group_block_bytes(w) + nat_group_mult_bytes(w); }

/* where row group g's bytes start as they lie unpaired (paired: where its pair's start, for the pair's first) */
NAT_LAYOUT const uint8_t *nat_group_at(const nat_weight *w, int64_t g) {
    return w->data + (size_t)g * nat_group_bytes(w);
}

/* whether row group g takes turns with its partner (paired weights: every group but a last one without one) */
NAT_LAYOUT int nat_in_pair(const nat_weight *w, int64_t g) {
    return w->paired && (g | 1) < (w->n_rows + NAT_ROWS - 1) / NAT_ROWS;
}

/* the bytes from a block of row group g to its next block */
NAT_LAYOUT size_t nat_block_stride(const nat_weight *w, int64_t g) {
    return (size_t)(nat_in_pair(w, g) ? 2 : 1) * nat_block_bytes(w);
}

/* block b of row group g */
NAT_LAYOUT const uint8_t *nat_block_at(const nat_weight *w, int64_t g, int64_t b) {
    if (!nat_in_pair(w, g)) return nat_group_at(w, g) + (size_t)b * nat_block_bytes(w);
    return nat_group_at(w, g & ~(int64_t)1) + (size_t)(2 * b + (g & 1)) * nat_block_bytes(w);
}

/* the multipliers of block b of row group g of a factored weight: 8 rows' scale multipliers, then (has_offsets)
 * their offset multipliers */
NAT_LAYOUT const float *nat_block_mults(const nat_weight *w, int64_t g, int64_t b) {
    const uint8_t *mults = !nat_in_pair(w, g) ? nat_group_at(w, g) + nat_group_block_bytes(w)
                           : nat_group_at(w, g & ~(int64_t)1) + 2 * nat_group_block_bytes(w) +
                                 (size_t)(g & 1) * nat_group_mult_bytes(w);
    return (const float *)mults + (size_t)(b / NAT_SUPER) * (size_t)(1 + w->has_offsets) * NAT_ROWS;
}

/* where a block's parameter rows start (after its codes), as stored: scale of each half, then offset of each half
 * (NULL without offsets), each row 8 values of nat_param_bytes */
typedef struct { const uint8_t *s0, *s1, *o0, *o1; } nat_param_rows;

NAT_LAYOUT nat_param_rows nat_block_param_rows(const nat_weight *w, const uint8_t *blk) {
    size_t row = NAT_ROWS * nat_param_bytes(w);
    const uint8_t *par = blk + NAT_ROWS * nat_code_bytes(w);
    nat_param_rows p;
    p.s0 = par;
    p.s1 = par + (size_t)(w->n_scales - 1) * row;
    p.o0 = w->has_offsets ? par + (size_t)w->n_scales * row : NULL;
    p.o1 = w->has_offsets ? p.o0 + (size_t)(w->n_scales - 1) * row : NULL;
    return p;
}

/* the code of element j (0..31) of row r (0..7) of a block whose codes start at `codes` (table applied) */
NAT_LAYOUT int nat_code_at(const nat_weight *w, const uint8_t *codes, int r, int j) {
    if (w->kind == NAT_QBYTE) return (int8_t)codes[32 * (j >> 2) + 4 * r + (j & 3)];
    uint8_t byte = codes[32 * ((j & 15) >> 2) + 4 * r + (j & 3)];
    int nibble = j < 16 ? (byte & 15) : (byte >> 4);
    if (w->kind == NAT_QNIB) return w->table[nibble];
    const uint8_t *fifth = codes + NAT_FIFTH_BITS_AT + 4 * r;  /* the row's 4 bytes of fifth bits */
    return w->table[0] + (nibble | (((fifth[j & 3] >> (j >> 2)) & 1) << 4));
}

/* a block's parameters as float32 (the portable paths): scale of each half, offset of each half (NULL without
 * offsets), 8 rows each, widened into `store` (4 * NAT_ROWS floats) */
typedef struct { const float *s0, *s1, *o0, *o1; } nat_params;
/* block b of row group g's parameters as float32 rows (in store: 4 rows of 8 floats) */
nat_params nat_block_params(const nat_weight *w, int64_t g, int64_t b, float *store);

/* one ISA's kernels: rows [g0, g1) of groups (quantized) or of rows (float), for all M activation rows */
typedef void (*nat_qgemm_fn)(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1);
typedef void (*nat_fgemm_fn)(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1);

/* activation rows [m0, m1) of x [m][k] to 8-bit blocks in a (kernels_scalar.c says how; every ISA's the same bits) */
typedef void (*nat_quantize_fn)(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1);
/* n values to f16 (round to nearest, ties to even) and back (exact): an f16 KV cache's rows */
typedef void (*nat_to_f16_fn)(const float *x, uint16_t *out, int64_t n);
typedef void (*nat_from_f16_fn)(const uint16_t *h, float *out, int64_t n);

void nat_qgemm_scalar(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1);
void nat_fgemm_scalar(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1);
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(LLMFW_NATIVE_SCALAR_ONLY)
#define NAT_HAVE_X86 1
void nat_qgemm_avx2(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1);
void nat_fgemm_avx2(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1);
void nat_qgemm_avx512(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1);
int64_t nat_tiled_from_avx512(int64_t m);
void nat_fgemm_avx512(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1);
void nat_quantize_rows_avx2(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1);
void nat_quantize_rows_avx512(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1);
void nat_f32_to_f16_row_f16c(const float *x, uint16_t *out, int64_t n);
void nat_f16_to_f32_row_f16c(const uint16_t *h, float *out, int64_t n);
/* the AMX path: Linux (a process asks the kernel for the tile state) and a compiler that knows the tile
 * instructions' target (GCC 11, clang 12) */
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define NAT_HAVE_AMX 1
#define NAT_ARCH_REQ_XCOMP_PERM 0x1023  /* arch_prctl: ask the kernel for an extended state component */
#define NAT_XFEATURE_XTILEDATA 18       /* that component: the tile registers' data */
void nat_qgemm_amx(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1);
int64_t nat_tiled_from_amx(int64_t m);
#endif
#endif

/* the matmul kernels of one ISA path (module.c's nat_kernels_for: a path not compiled in gives the scalar ones) */
typedef struct {
    nat_qgemm_fn qgemm;
    nat_fgemm_fn fgemm;
    nat_quantize_fn quantize;
    nat_to_f16_fn to_f16;
    nat_from_f16_fn from_f16;
    /* the first of m rows whose four-row tiles (nat_qact's tiles) the qgemm reads, or NULL where it reads none */
    int64_t (*tiled_from)(int64_t m);
} nat_kernels;
nat_kernels nat_kernels_for(int isa);

float nat_f16_to_f32(uint16_t h);
uint16_t nat_f32_to_f16(float f);
void nat_f32_to_f16_row(const float *x, uint16_t *out, int64_t n);
void nat_f16_to_f32_row(const uint16_t *h, float *out, int64_t n);
float nat_reduce16(float *lanes);
void nat_quantize_rows(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1);
/* the word at which an activation buffer of m rows of n_cols puts its tiles (after the codes, scales, code sums and
 * float sums) */
static inline size_t nat_act_tiles_word(int64_t m, int64_t n_cols) {
    return (size_t)((m * n_cols + 3) / 4) + (size_t)(m * (n_cols / NAT_BLOCK) * 4);
}
/* the 4-byte words of the activation buffers of m rows of n_cols (whole blocks) at scratch: codes, then scales,
 * code sums and float sums, each part on a word, then room for the whole tiles (program.py's activation_words: the
 * same size); with act, points its buffers there, no tiles yet (nat_act_tile_rows writes them); inline for
 * benchmarks/native_tile.c, which does not link module.c (nat_act_words: the exported function, for ctypes) */
static inline size_t nat_act_layout(int64_t m, int64_t n_cols, void *scratch, nat_qact *act) {
    int64_t nb = n_cols / NAT_BLOCK;
    size_t d_at = (size_t)((m * n_cols + 3) / 4), sums_at = d_at + (size_t)(m * nb);
    size_t asum_at = sums_at + (size_t)(m * nb * 2), tiles_at = nat_act_tiles_word(m, n_cols);
    if (act) {
        act->q = scratch;
        act->d = (float *)scratch + d_at;
        act->sums = (int32_t *)scratch + sums_at;
        act->asum = (float *)scratch + asum_at;
        act->tiles = NULL;
        act->tiled_from = m;
    }
    return tiles_at + (size_t)(m / NAT_TILE_ROWS * nb * (NAT_TILE_BYTES / 4));
}
/* act (laid out at scratch by nat_act_layout) given the place of its whole tiles from row tiled_from on, where
 * there is at least one (nat_act_tile_rows then writes them) */
static inline void nat_act_place_tiles(nat_qact *act, int64_t m, int64_t n_cols, void *scratch, int64_t tiled_from) {
    if (tiled_from + NAT_TILE_ROWS > m) return;
    act->tiles = (uint8_t *)scratch + 4 * nat_act_tiles_word(m, n_cols);
    act->tiled_from = tiled_from;
}
/* the tiles k in [t0, t1) that a keeps (those from row tiled_from on; none where a->tiles is NULL), rows 4k..4k+3
 * quantized, copied from a's rows into a->tiles (kernels_scalar.c) */
void nat_act_tile_rows(const nat_qact *a, int64_t n_cols, int64_t t0, int64_t t1);
size_t nat_act_words(int64_t m, int64_t n_cols, void *scratch, nat_qact *act);

/* the activation rows of a from row `row` on (n_cols columns, whole blocks): a view, nothing copied */
static inline nat_qact nat_qact_from(const nat_qact *a, int64_t row, int64_t n_cols) {
    int64_t nb = n_cols / NAT_BLOCK;
    nat_qact v = {a->q + row * n_cols, a->d + row * nb, a->sums + row * nb * 2, a->asum + row * nb, NULL, 0};
    if (a->tiles && row % NAT_TILE_ROWS == 0) {  /* the tiles stay whole in the view */
        v.tiles = a->tiles + row / NAT_TILE_ROWS * nb * NAT_TILE_BYTES;
        v.tiled_from = a->tiled_from > row ? a->tiled_from - row : 0;
    }
    return v;
}
/* the tile of rows i0..i0+3 of a (i0 a multiple of NAT_TILE_ROWS) where it was written, else NULL */
static inline const uint8_t *nat_act_tile(const nat_qact *a, int64_t i0, int64_t n_cols) {
    if (!a->tiles || i0 < a->tiled_from) return NULL;
    return a->tiles + i0 / NAT_TILE_ROWS * (n_cols / NAT_BLOCK) * NAT_TILE_BYTES;
}
/* a quantized block with a NaN or inf: scale NaN (its products are NaN), codes and sums 0 (every ISA's quantizer) */
void nat_quantize_nonfinite(int8_t *q, float *d, int32_t *sums, float *asum);


/* ---- the kernels of the row-wise ops (ops.c) ---- */
typedef struct nat_pool nat_pool;
void nat_unpack_row(const nat_weight *w, int64_t row, float *out);

/* ---- programs (module.c runs them, runtime.py compiles and checks them) ----
 * A split compiled once into instructions over buffers: buffer 0 is the program's arena (every activation of the
 * split at an offset decided at compile time), the others memory the program reads or writes in place (KV caches,
 * norm weights, constants). An operand is (buffer, offset in 4-byte words); operand 0 is the output. The Python
 * compiler checks every operand's extent against its buffer before a program may run: C trusts the shapes and
 * offsets, and checks only what the data decides (token ids, KV cells) as it runs. */
#define NAT_ARGS 7
#define NAT_INTS 16
#define NAT_FLOATS 8

typedef struct {
    int64_t op;
    int64_t buf[NAT_ARGS];   /* buffer index of operand i (-1: none) */
    int64_t off[NAT_ARGS];   /* its offset in 4-byte words */
    int64_t n[NAT_INTS];     /* shapes and integer attributes (per op, see enum nat_op) */
    float f[NAT_FLOATS];     /* float attributes */
} nat_instr;

/* operands (0 = the output) and n[] of each op */
enum nat_op {
    NAT_OP_BINARY = 1,       /* out, a, b; n: kind (0 add, 1 sub, 2 mul, 3 div), dims[4], a strides[4], b strides[4] */
    NAT_OP_UNARY = 2,        /* out, x; n: kind (enum nat_unary), count, width, x row stride (out: contiguous rows of
                              * width); f: parameters */
    NAT_OP_SWIGLU = 3,       /* out, gate, up; n: rows, width, gate row stride, up row stride (out: contiguous) */
    /* the row ops: rows of n, x's in groups of `group` contiguous rows, `group stride` words apart (the heads of a
     * token, columns of a fused row); out contiguous */
    NAT_OP_RMS_NORM = 4,     /* out, x, w (or none); n: rows, n, group, group stride; f: eps */
    NAT_OP_NORM = 5,         /* out, x, w (or none); n: rows, n, group, group stride; f: eps */
    NAT_OP_SOFTMAX = 6,      /* out, x; n: rows, n, group, group stride */
    NAT_OP_GET_ROWS = 7,     /* out, table, ids; n: n_ids, row words, table rows, id bytes (4|8) */
    NAT_OP_GET_ROWS_W = 8,   /* out, ids; n: n_ids, weight index, -, id bytes */
    NAT_OP_MUL_MAT = 9,      /* out, x, scratch (quantized kinds), residual (added to out, or none); n: weight index,
                              * m */
    NAT_OP_SLICE = 10,       /* out, x; n: outer, row words, start, length */
    NAT_OP_ROPE = 11,        /* out, x, pos (i32), freq factors, YaRN mix (or none), angles (NAT_OP_ROPE_ANGLES's
                              * table for these positions and parameters, or none: computed here); n: T, H, D,
                              * n_dims, neox, x stride t, x stride h, out stride t, out stride h, f16 (0/1: out is
                              * x, f16 keys: a K shift of an f16 cache, strides in values); f: theta scale, freq
                              * scale, magnitude, ext (0/1) */
    NAT_OP_KV_WRITE = 12,    /* K cache, V cache, k, v, cells (i64); n: T, Hkv, dk, dv, n_cells, k token stride,
                              * v token stride, f16 (0/1: the caches hold f16, the rows are rounded to it) */
    NAT_OP_ATTEND = 13,      /* out, q, K cache, V cache, mask, sinks (or none), order (i32 [n_kv], the cells in the
                              * order to sum them; or none: cell order); n: T, H, Hkv, dk, dv, n_kv, n_cells,
                              * f16 (0/1: the caches hold f16); f: scale, softcap */
    /* the recurrent ops (recurrent.c); S sequences of T tokens each */
    NAT_OP_SSM_CONV = 14,    /* out, window, x, kernel [C, K]; n: S, T, C, K-1 */
    NAT_OP_CONV_WINDOW = 15, /* out, window, x; n: S, T, C, K-1 */
    NAT_OP_SSM_SCAN = 16,    /* out, state, x, dt, A, B then C (one operand); n: S, T, H, G, P, N */
    NAT_OP_GATED_DELTA = 17, /* out, state, q, k, v, g then beta (one operand); n: S, T, H, Hk, Dv, Dk */
    /* the mixture-of-experts ops (moe.c) */
    NAT_OP_MUL_MAT_ID = 18,  /* out [T, K, N], x [T or T*K, n_in], ids [T, K], scratch; n: first of the E expert
                              * weights, E, T, K, x per slot (0/1), id bytes (4|8) */
    NAT_OP_ADD_ID = 19,      /* out, a [S, n], b [E, n], ids [S]; n: S, n, E, id bytes */
    NAT_OP_TOP_K = 20,       /* out i32 [rows, k], x [rows, n]; n: rows, n, k */
    NAT_OP_TAKE = 21,        /* out [rows, k], x [rows, n], ids [rows, k]; n: rows, n, k, id bytes */
    NAT_OP_SUM_ROWS = 22,    /* out [rows], x [rows, n]; n: rows, n */
    NAT_OP_ID_MASK = 23,     /* out [rows, n], x, ids [rows, k]; n: rows, n, k, id bytes */
    NAT_OP_SWIGLU_OAI = 24,  /* out, gate, up; n: count; f: alpha, limit */
    NAT_OP_CONCAT = 25,      /* out [rows, na + nb], a [rows, na], b [rows, nb]; n: rows, na, nb */
    NAT_OP_ROPE_ANGLES = 26, /* out [T, n_dims] (each token's cos of its n_dims / 2 pairs, then their sin), -, pos
                              * (i32), freq factors, YaRN mix (or none); n: T, -, -, n_dims; f: as NAT_OP_ROPE's */
};
enum nat_unary { NAT_SILU = 0, NAT_GELU, NAT_RELU, NAT_SIGMOID, NAT_SOFTPLUS, NAT_SCALE, NAT_SOFTCAP, NAT_CLAMP };

/* the status of a program run: 0, or one of these (the instruction's index goes to *failed_at) */
enum nat_status { NAT_OUT_OF_MEMORY = -1, NAT_BAD_INSTRUCTION = -2, NAT_ID_OUT_OF_RANGE = -3 };

int nat_run_op(nat_pool *pool, int isa, const nat_instr *in, void *const *bufs, const nat_weight *weights);
/* attention over the KV cache (attention.c); n: NAT_OP_ATTEND's n[0..7]; k, v: float32 or f16 (n[7]) */
int nat_attend(nat_pool *pool, int isa, const float *q, const void *k, const void *v, const float *mask,
               const float *sinks, const int32_t *order, float *out, const int64_t *n, float scale, float softcap);
int nat_mul_mat_into(nat_pool *pool, int isa, const nat_weight *w, const float *x, int64_t m, float *y,
                     const float *residual, void *scratch);
int nat_run_moe_op(nat_pool *pool, const nat_kernels *paths, const nat_instr *in, void *const *bufs,
                   const nat_weight *weights);

/* q . k in the canonical 16-lane order (attention.c), and the recurrent ops' instructions (recurrent.c) */
float nat_dot16(const float *q, const float *k, int64_t n);
int nat_run_recurrent(nat_pool *pool, const nat_instr *in, void *const *bufs);

#endif
