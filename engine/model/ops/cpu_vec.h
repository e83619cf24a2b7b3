/* nextn CPU kernels: eight-lane float vectors (GCC vector extensions: AVX when built with -mavx2, two SSE halves
 * otherwise, two NEON halves on aarch64; the same IEEE operations either way) and the lane-wise exp every kernel
 * shares. */
#ifndef NEXTN_CPU_VEC_H
#define NEXTN_CPU_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 ld8_(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8_(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline v8 splat8_(float x) {
    const v8 zero = {0, 0, 0, 0, 0, 0, 0, 0};
    return zero + x;
}

/* n < 8 floats as one vector, the other lanes `fill` */
static inline v8 ldn_(const float *p, int64_t n, float fill) {
    v8 v = splat8_(fill);
    for (int64_t i = 0; i < n; i++) v[i] = p[i];
    return v;
}

static inline void stn_(float *p, v8 v, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = v[i];
}

static inline float hsum8_(v8 a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* e^x per lane: 0 below -87 and +inf above 88 (no denormal, like a flush-to-zero exp; NaN stays NaN); in between
 * x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error < 1e-8 before
 * rounding), times 2^k through the exponent bits. The same operations in every lane and every call: no libm, no
 * data-dependent path. */
static inline v8 exp8_(v8 x) {
    const v8 lo = splat8_(-87.0f), hi = splat8_(88.0f);
    const v8i under = x < lo, over = x > hi;
    x = (v8)(((v8i)x & ~under) | ((v8i)lo & under));
    x = (v8)(((v8i)x & ~over) | ((v8i)hi & over));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer (round to nearest even) */
    const v8 kf = (x * 1.44269504088896341f + magic) - magic;
    const v8 r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;
    v8 p = splat8_(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i scale = (__builtin_convertvector(kf, v8i) + 127) << 23;
    const v8i e = (v8i)(p * (v8)scale) & ~under;                    /* below -87: 0 */
    return (v8)((e & ~over) | ((v8i)splat8_(__builtin_inff()) & over));  /* above 88: +inf */
}

/* x * sigmoid(x) = x / (1 + e^-x), per lane */
static inline v8 silu8_(v8 x) { return x * (1.0f / (1.0f + exp8_(-x))); }

/* silu(x[i]) in place, i < n (the tail as one padded vector: the same per-lane operations) */
static inline void silu_n_(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) st8_(x + i, silu8_(ld8_(x + i)));
    if (i < n) stn_(x + i, silu8_(ldn_(x + i, n - i, 0.0f)), n - i);
}

#endif
