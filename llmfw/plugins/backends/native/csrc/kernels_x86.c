/* AVX2 + FMA + F16C kernels (x86-64 only): the canonical arithmetic of native.h with 256-bit vectors. The integer
 * dot products use vpmaddubsw/vpmaddwd (exact: |w| <= 128, |a| <= 127, so a pair never saturates 16 bits); the
 * float part runs across the 8 interleaved rows of a group, one lane per row, in the scalar path's order. */
#include "native.h"

#ifdef NAT_HAVE_X86
#include <immintrin.h>
#include <string.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))

/* the 32 weight codes of one row of a block as int8 */
TARGET static inline __m256i load_codes(const nat_weight *w, const uint8_t *codes, __m256i table) {
    if (w->kind == NAT_QBYTE) return _mm256_loadu_si256((const __m256i *)codes);
    __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    return _mm256_shuffle_epi8(table, _mm256_set_m128i(high, low));
}

/* per-row half sums of 8 rows' lane vectors: (i0 of rows 0-7, i1 of rows 0-7) */
TARGET static inline void half_sums(const __m256i p[8], __m256i *i0, __m256i *i1) {
    __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    *i0 = _mm256_permute2x128_si256(q0, q1, 0x20);
    *i1 = _mm256_permute2x128_si256(q0, q1, 0x31);
}

/* acc + da * (((s0*i0 + s1*i1) + o0*A0) + o1*A1) for the 8 rows of a group: shared by the AVX2 and AVX-512 paths */
TARGET static inline __m256 combine(__m256 acc, nat_params p, __m256i i0, __m256i i1, float da, float a0, float a1) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p.s0), _mm256_cvtepi32_ps(i0));
    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(p.s1), _mm256_cvtepi32_ps(i1)));
    if (p.o0) {
        v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(p.o0), _mm256_set1_ps(a0)));
        v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(p.o1), _mm256_set1_ps(a1)));
    }
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(da), v));
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

/* activation rows per tile: their accumulators stay in L1 while a block's unpacked codes are reused by each */
#define M_TILE 16

TARGET static inline void store_tile(float *y, int64_t n, int64_t i0, int64_t rows, int64_t g, const __m256 *acc) {
    for (int64_t t = 0; t < rows; t++) store_rows(y, n, i0 + t, g, acc[t]);
}

/* The tiled quantized matmul of both x86 paths: per row group, per tile of M_TILE activation rows, per block, the
 * 8 rows' codes are unpacked once (with AUX, what the ISA's dot product needs per row, and FIX0/FIX1, a per-block
 * correction of the half sums) and reused by every activation row of the tile. ACT prepares an activation block,
 * DOT(act, r) gives row r's int32 lane vector. Exact integers throughout: only the instructions differ. */
#define QGEMM_TILED(ROW_PREP, BLOCK_PREP, ACT, DOT)                                                                \
    int64_t nb = w->n_cols / NAT_BLOCK, n = w->n_rows;                                                             \
    size_t cb = nat_code_bytes(w), bb = nat_block_bytes(w);                                                        \
    __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->table));                       \
    for (int64_t g = g0; g < g1; g++) {                                                                            \
        const uint8_t *group = w->data + (size_t)g * nb * bb;                                                      \
        for (int64_t i0 = 0; i0 < m; i0 += M_TILE) {                                                               \
            int64_t rows = m - i0 < M_TILE ? m - i0 : M_TILE;                                                      \
            __m256 acc[M_TILE];                                                                                    \
            for (int t = 0; t < M_TILE; t++) acc[t] = _mm256_setzero_ps();                                         \
            for (int64_t b = 0; b < nb; b++) {                                                                     \
                const uint8_t *blk = group + b * bb;                                                               \
                __m256i codes[NAT_ROWS], aux[NAT_ROWS], fix0 = _mm256_setzero_si256(), fix1 = fix0;                \
                for (int r = 0; r < NAT_ROWS; r++) {                                                               \
                    codes[r] = load_codes(w, blk + r * cb, table);                                                 \
                    ROW_PREP;                                                                                      \
                }                                                                                                  \
                BLOCK_PREP;                                                                                        \
                nat_params par = nat_block_params(w, (const float *)(blk + NAT_ROWS * cb));                        \
                for (int64_t t = 0; t < rows; t++) {                                                               \
                    int64_t i = i0 + t;                                                                            \
                    __m256i act = ACT(_mm256_loadu_si256((const __m256i *)(a->q + i * w->n_cols + b * NAT_BLOCK))); \
                    __m256i p[NAT_ROWS], h0, h1;                                                                   \
                    for (int r = 0; r < NAT_ROWS; r++) p[r] = DOT(act, r);                                         \
                    half_sums(p, &h0, &h1);                                                                        \
                    const int32_t *sums = a->sums + (i * nb + b) * 2;                                              \
                    acc[t] = combine(acc[t], par, _mm256_sub_epi32(h0, fix0), _mm256_sub_epi32(h1, fix1),          \
                                     a->d[i * nb + b], (float)sums[0], (float)sums[1]);                            \
                }                                                                                                  \
            }                                                                                                      \
            store_tile(y, n, i0, rows, g, acc);                                                                    \
        }                                                                                                          \
    }

/* AVX2: vpmaddubsw takes |w| (unsigned) and a with w's sign; aux = |w| */
#define AVX2_ACT(v) (v)
#define AVX2_DOT(act, r) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(aux[r], _mm256_sign_epi8(act, codes[r])), _mm256_set1_epi16(1))

TARGET void nat_qgemm_avx2(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1) {
    QGEMM_TILED(aux[r] = _mm256_sign_epi8(codes[r], codes[r]), (void)0, AVX2_ACT, AVX2_DOT)
}

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

/* ---- AVX-512 (F/BW/VL + VNNI): vpdpbusd for the integer products, 512-bit float lanes ---- */
#define TARGET512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* The activation codes enter vpdpbusd as unsigned bytes a + 128 (one xor); the weight codes stay signed, and
 * 128 * (sum of the weight codes) comes off again (aux: the code sums, fix: their half sums times 128). */
#define VNNI_ACT(v) _mm256_xor_si256((v), _mm256_set1_epi8((char)0x80))
#define VNNI_DOT(act, r) _mm256_dpbusd_epi32(_mm256_setzero_si256(), act, codes[r])
#define VNNI_FIX                                       \
    do {                                               \
        half_sums(aux, &fix0, &fix1);                  \
        fix0 = _mm256_slli_epi32(fix0, 7);             \
        fix1 = _mm256_slli_epi32(fix1, 7);             \
    } while (0)

TARGET512 void nat_qgemm_avx512(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0,
                                int64_t g1) {
    QGEMM_TILED(aux[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), codes[r]), VNNI_FIX,
                VNNI_ACT, VNNI_DOT)
}

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
#endif
