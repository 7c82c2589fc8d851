/* Portable C kernels: the canonical arithmetic of native.h, written out one operation at a time. Every other ISA
 * path must give exactly these bits (tests compare them). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "native.h"

float nat_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);          /* inf / NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);  /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign;                                        /* zero */
    } else {                                                /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f to the nearest f16, ties to even (IEEE, as F16C's vcvtps2ph with rounding 0): overflow to inf, small values to
 * subnormals or zero, a NaN to a quiet NaN keeping its payload's top bits */
uint16_t nat_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* 65520 and up (a tie with 2^16: even) and inf */
    if (mag < 0x33000000u) return (uint16_t)sign;                /* below 2^-25 (2^-25 itself: the tie goes to 0) */
    uint32_t kept, dropped, tie;
    if (mag < 0x38800000u) {  /* below 2^-14: a subnormal, in units of 2^-24 (may round up to the least normal) */
        uint32_t shift = 126 - (mag >> 23), m = (mag & 0x7fffffu) | 0x800000u;
        kept = m >> shift;
        dropped = m & ((1u << shift) - 1);
        tie = 1u << (shift - 1);
    } else {                  /* normal: rebias 127 -> 15 (a carry out of the mantissa raises the exponent) */
        kept = (mag - 0x38000000u) >> 13;
        dropped = mag & 0x1fffu;
        tie = 0x1000u;
    }
    kept += dropped > tie || (dropped == tie && (kept & 1u));
    return (uint16_t)(sign | kept);
}

void nat_f32_to_f16_row(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = nat_f32_to_f16(x[i]);
}

void nat_f16_to_f32_row(const uint16_t *h, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = nat_f16_to_f32(h[i]);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* nearbyint(r) in the default rounding mode (half to even) for |r| < 2^51, without a call into libm: adding and
 * subtracting 1.5 * 2^52 leaves no fraction bits. Exact only where doubles are evaluated as doubles (no x87
 * excess precision) and without -ffast-math (the build never enables it). */
static inline double round_half_even(double r) {
#if FLT_EVAL_METHOD == 0
    const double magic = 6755399441055744.0;
    return (r + magic) - magic;
#else
    return nearbyint(r);
#endif
}

void nat_quantize_nonfinite(int8_t *q, float *d, int32_t *sums, float *asum) {
    memset(q, 0, NAT_BLOCK);
    *d = NAN;
    sums[0] = sums[1] = 0;
    *asum = 0.0f;
}

void nat_act_tile_rows(const nat_qact *a, int64_t n_cols, int64_t t0, int64_t t1) {
    int64_t nb = n_cols / NAT_BLOCK, first = a->tiled_from / NAT_TILE_ROWS;
    uint8_t *tiles = a->tiles;
    if (!tiles) return;
    for (int64_t k = t0 > first ? t0 : first; k < t1; k++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *block = tiles + (k * nb + b) * NAT_TILE_BYTES;
            for (int t = 0; t < NAT_TILE_ROWS; t++) {
                int64_t at = (k * NAT_TILE_ROWS + t) * nb + b;
                memcpy(block + NAT_TILE_Q + NAT_BLOCK * t, a->q + at * NAT_BLOCK, NAT_BLOCK);
                memcpy(block + NAT_TILE_D + 4 * t, a->d + at, 4);
                memcpy(block + NAT_TILE_ASUM + 4 * t, a->asum + at, 4);
                memcpy(block + NAT_TILE_SUMS + 8 * t, a->sums + 2 * at, 8);
            }
        }
    }
}

/* Activation rows [m0, m1) to 8-bit blocks: d = amax/127, q = round-half-even(x * 127/amax). A block with a NaN
 * or inf gets d = NaN (its products are NaN, as in float arithmetic), codes 0. This is where the bits of the
 * activations are decided: kernels_x86.c's vector version does the same IEEE operations, so every ISA path gets
 * these bits. */
void nat_quantize_rows(const float *x, int64_t k, nat_qact *a, int64_t m0, int64_t m1) {
    int64_t nb = k / NAT_BLOCK;
    for (int64_t i = m0; i < m1; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + i * k + b * NAT_BLOCK;
            int8_t *q = a->q + i * k + b * NAT_BLOCK;
            int32_t *sums = a->sums + (i * nb + b) * 2;
            float amax = 0.0f;
            int finite = 1;
            for (int j = 0; j < NAT_BLOCK; j++) {  /* branch-free, so that the compiler vectorises it */
                float v = fabsf(xb[j]);
                finite &= v <= 3.0e38f;            /* NaN or inf (or beyond: nothing finite is that large) */
                amax = v > amax ? v : amax;        /* used only when every value is finite */
            }
            if (!finite) {
                nat_quantize_nonfinite(q, &a->d[i * nb + b], sums, &a->asum[i * nb + b]);
                continue;
            }
            /* the reciprocal in double: it cannot overflow for a subnormal amax */
            double inv = amax > 0.0f ? 127.0 / (double)amax : 0.0;
            for (int half = 0; half < 2; half++) {
                int32_t sum = 0;
                for (int j = 16 * half; j < 16 * half + 16; j++) {
                    double r = round_half_even((double)xb[j] * inv);  /* |r| <= 127 */
                    r = r > 127.0 ? 127.0 : r;
                    r = r < -127.0 ? -127.0 : r;
                    q[j] = (int8_t)(int32_t)r;
                    sum += (int32_t)r;
                }
                sums[half] = sum;
            }
            a->asum[i * nb + b] = (float)(sums[0] + sums[1]);
            a->d[i * nb + b] = amax / 127.0f;
        }
    }
}

/* one row of 8 block parameters as float32 (mult: the row's multipliers of a factored weight) */
static void widen_param_row(const nat_weight *w, const uint8_t *row, const float *mult, float *out) {
    if (w->factored) {
        for (int r = 0; r < NAT_ROWS; r++) out[r] = mult[r] * (float)(int8_t)row[r];
        return;
    }
    if (!w->half_params) {
        memcpy(out, row, NAT_ROWS * sizeof(float));
        return;
    }
    for (int r = 0; r < NAT_ROWS; r++) {
        uint16_t h;
        memcpy(&h, row + 2 * r, 2);
        out[r] = nat_f16_to_f32(h);
    }
}

nat_params nat_block_params(const nat_weight *w, int64_t g, int64_t b, float *store) {
    nat_param_rows rows = nat_block_param_rows(w, nat_block_at(w, g, b));
    const uint8_t *stored[4] = {rows.s0, rows.s1, rows.o0, rows.o1};
    const float *mults = w->factored ? nat_block_mults(w, g, b) : NULL;
    const float *widened[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < 4; k++) {
        if (!stored[k]) continue;
        widen_param_row(w, stored[k], mults ? mults + (k >= 2) * NAT_ROWS : NULL, store + k * NAT_ROWS);
        widened[k] = store + k * NAT_ROWS;
    }
    nat_params p = {widened[0], widened[1], widened[2], widened[3]};
    return p;
}

void nat_qgemm_scalar(const nat_weight *w, const nat_qact *a, int64_t m, float *y, int64_t g0, int64_t g1) {
    int64_t nb = w->n_cols / NAT_BLOCK, n = w->n_rows;
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t i = 0; i < m; i++) {
            float acc[NAT_ROWS] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = nat_block_at(w, g, b);
                float store[4 * NAT_ROWS];
                nat_params p = nat_block_params(w, g, b, store);
                const int8_t *aq = a->q + i * w->n_cols + b * NAT_BLOCK;
                float da = a->d[i * nb + b];
                const int32_t *sums = a->sums + (i * nb + b) * 2;
                float a0 = (float)sums[0], a1 = (float)sums[1], a01 = (float)(sums[0] + sums[1]);
                for (int r = 0; r < NAT_ROWS; r++) {
                    int32_t i0 = 0, i1 = 0;
                    for (int j = 0; j < 16; j++) i0 += nat_code_at(w, blk, r, j) * aq[j];
                    for (int j = 16; j < 32; j++) i1 += nat_code_at(w, blk, r, j) * aq[j];
                    float v;
                    if (w->n_scales == 1) {  /* exact integer sums first: one conversion, one product */
                        v = p.s0[r] * (float)(i0 + i1);
                        if (p.o0) v = fmaf(p.o0[r], a01, v);
                    } else {
                        v = fmaf(p.s1[r], (float)i1, p.s0[r] * (float)i0);
                        if (p.o0) v = fmaf(p.o1[r], a1, fmaf(p.o0[r], a0, v));
                    }
                    acc[r] = fmaf(da, v, acc[r]);
                }
            }
            for (int r = 0; r < NAT_ROWS; r++) {
                int64_t row = g * NAT_ROWS + r;
                if (row < n) y[i * n + row] = acc[r];
            }
        }
    }
}

static inline float weight_value(const nat_weight *w, const uint8_t *row, int64_t j) {
    switch (w->kind) {
    case NAT_F16: { uint16_t h; memcpy(&h, row + 2 * j, 2); return nat_f16_to_f32(h); }
    case NAT_BF16: { uint16_t h; memcpy(&h, row + 2 * j, 2); return bf16_to_f32(h); }
    default: { float f; memcpy(&f, row + 4 * j, 4); return f; }
    }
}

/* the canonical 16-lane reduction (native.h) */
float nat_reduce16(float *lanes) {
    for (int step = 8; step >= 1; step >>= 1)
        for (int l = 0; l < step; l++) lanes[l] = lanes[l] + lanes[l + step];
    return lanes[0];
}

void nat_fgemm_scalar(const nat_weight *w, const float *x, int64_t m, float *y, int64_t r0, int64_t r1) {
    int64_t k = w->n_cols, n = w->n_rows, padded = (k + 15) / 16 * 16;
    size_t esize = w->kind == NAT_F32 ? 4 : 2;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w->data + (size_t)r * k * esize;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float lanes[16] = {0};
            for (int64_t j = 0; j < padded; j++) {
                float p = j < k ? xi[j] * weight_value(w, row, j) : 0.0f * 0.0f;
                lanes[j & 15] = lanes[j & 15] + p;
            }
            y[i * n + r] = nat_reduce16(lanes);
        }
    }
}
