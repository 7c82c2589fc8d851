/* The native kernels' exp: one float polynomial (no libm call, no fused multiply-add), so that the vector paths
 * of attention.c reproduce it lane by lane and the compiler can vectorise the elementwise ops that use it. Within
 * 2 ulp of exp over the softmax and activation range; 0 below -87 (where exp is subnormal), exp(88) above 88. */
#ifndef LLMFW_NATIVE_EXP_H
#define LLMFW_NATIVE_EXP_H
#include <stdint.h>
#include <string.h>

/* exp(x) = 2^n * poly(r), x = n ln2 + r, |r| <= ln2 / 2 */
#define EXP_LOW -87.0f      /* below: 0 (the result would be subnormal) */
#define EXP_HIGH 88.0f      /* above: clamped (softmax arguments are <= 0) */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_SHIFT 12582912.0f   /* 1.5 * 2^23: t + SHIFT rounds t to an integer, kept in the low mantissa bits */
#define EXP_LN2_HI 0.693359375f  /* ln 2 split so that n * LN2_HI is exact */
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline uint32_t nat_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float nat_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* when ? a : b without a branch (the compiler keeps branches on floats, which may trap, out of vectorised loops) */
static inline float nat_select(int when, float a, float b) {
    uint32_t keep = 0u - (uint32_t)(when != 0);
    return nat_bits_f32((nat_f32_bits(a) & keep) | (nat_f32_bits(b) & ~keep));
}

/* the vector paths of attention.c perform these operations, in this order, lane by lane */
static inline float nat_exp(float x) {
    float c = nat_select(x > EXP_HIGH, EXP_HIGH, x);
    float shifted = c * EXP_LOG2E + EXP_SHIFT;
    float n = shifted - EXP_SHIFT;
    float scale = nat_bits_f32((nat_f32_bits(shifted) - nat_f32_bits(EXP_SHIFT) + 127u) << 23);
    float r = (c - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    float z = r * r;
    float y = ((((EXP_P0 * r + EXP_P1) * r + EXP_P2) * r + EXP_P3) * r + EXP_P4) * r + EXP_P5;
    y = (y * z + r) + 1.0f;
    return nat_select(c < EXP_LOW, 0.0f, y * scale);
}

#endif
