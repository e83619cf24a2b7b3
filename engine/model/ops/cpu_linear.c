/* nextn CPU kernels: the small-M GEMM of a step forward's projections, y = x W^T, and the SwiGLU MLP built on it
 * (engine/model/ops/cpu.py builds and calls them; their torch twins are F.linear and MLP's torch path in
 * engine/model/moe.py).
 *
 * Every output element y[m, n] is the same computation wherever it sits in the launch: eight lanes, lane l
 * accumulating x[m, k] * W[n, k] for k = l mod 8 in ascending k with fused multiply-adds, then the fixed tree
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). The tiles below (1 x 8, 4 x 3 and their remainders) only
 * choose which elements are computed together, never the order of a sum, so a row's bits do not depend on how many
 * rows the launch has: verify (K+1 rows per session), plain decode (1) and any batch agree bitwise.
 *
 * The tiles are written once over an eight-lane accumulator type (acc8_, below): on x86 an AVX2 register with
 * _mm256_fmadd_ps; in the portable build (any other CPU, or -DNEXTN_PORTABLE: cpu_arch.h) two four-lane vectors
 * with C99 fmaf in each lane, which is the same exactly rounded fused multiply-add, so both give the same bits
 * (tests/test_ops_cpu_portable.py compares them). GCC turns the portable lanes into vector FMAs where the target
 * has them (fmla on aarch64).
 *
 * On a CPU with AVX-512 the tiles of two or more rows run on 16-lane registers (tile16_): rows are packed in pairs
 * so that one register holds row 2p's eight lanes and row 2p+1's side by side, against a W chunk broadcast to both
 * halves. Each half is exactly the eight-lane accumulation above (the same fused multiply-adds, the same chunk
 * order, the same final tree, taken for both halves at once), so the 16-lane tiles give the same bits as the
 * 8-lane ones, at twice the multiply-adds per instruction (tests/test_ops_cpu_linear.py compares the two bitwise).
 * Their main tile is 2 pairs x 8 columns (tile16x8_): a pair's 16 final trees are taken together in one register
 * (hsums8_: the same additions of the same operands, lanes side by side) and stored as two rows of eight; the last
 * columns (fewer than 8) take 4 pairs x 3 columns (tile16_), each tree on its own.
 *
 * The code needs a hardware FMA (nextn_linear_ok() says whether it runs: AVX2 + FMA on x86; in the portable build
 * a target whose fmaf is one instruction, as on aarch64) and K a multiple of 8: otherwise the caller keeps torch's
 * GEMM. A software fmaf (glibc's, on x86 without FMA) made this GEMM cost ~70 ns a multiply-add (measured with
 * glibc's FMA code switched off), hundreds of times torch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_arch.h"
#include "cpu_par.h"
#include "cpu_vec.h"

#if NEXTN_X86
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma")))
#define TGT16 __attribute__((target("avx512f,avx2,fma")))

int nextn_linear_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
#define TGT

int nextn_linear_ok(void) {
#if defined(__FP_FAST_FMAF) || defined(__aarch64__)
    return 1;  /* fmaf is one instruction (AArch64 has FMA in its base ISA, whatever the compiler says) */
#else
    return 0;  /* fmaf would be a software routine */
#endif
}
#endif

/* 1 when this library was built from the portable code (cpu_arch.h), 0 for the x86 build */
int nextn_portable(void) { return !NEXTN_X86; }

static int wide_ = 0;  /* the 16-lane tiles run (nextn_linear_set_wide) */

/* Use the 16-lane tiles when `on` and this CPU has AVX-512F (and AVX2 + FMA); returns whether they are now used.
 * Either way every output has the same bits: only the speed changes. The portable build has none. */
int nextn_linear_set_wide(int on) {
#if NEXTN_AVX512
    __builtin_cpu_init();
    wide_ = on && nextn_linear_ok() && __builtin_cpu_supports("avx512f");
#else
    (void)on;
#endif
    return wide_;
}

#if NEXTN_X86
typedef __m256 acc8_;  /* eight lanes of partial sums */
#define ZERO8_() _mm256_setzero_ps()
#define LOAD8_(p) _mm256_loadu_ps(p)
#define FMA8_(a, b, c) _mm256_fmadd_ps(a, b, c)
#define HSUM8_(a) hsum256_(a)

TGT static inline float hsum256_(__m256 a) {
    const __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
    const __m128 s = _mm_add_ps(lo, hi);                   /* l0+l4, l1+l5, l2+l6, l3+l7 */
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));   /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
/* Eight lanes as two four-lane vectors (lanes 0-3, 4-7): a 16-byte vector is a register on every SIMD target
 * (NEON, SSE), where GCC (12, aarch64) keeps cpu_vec.h's 32-byte v8 in memory; and an accumulator is never read
 * lane by lane inside a loop, so the lanes' fmaf become vector FMAs (fmla) instead of scalar code. */
typedef float v4_ __attribute__((vector_size(16)));
typedef float v4u_ __attribute__((vector_size(16), aligned(4), may_alias));  /* an unaligned load */
typedef struct { v4_ lo, hi; } acc8_;

static inline acc8_ zero8_(void) { return (acc8_){{0, 0, 0, 0}, {0, 0, 0, 0}}; }

static inline acc8_ load8_(const float *p) { return (acc8_){*(const v4u_ *)p, *(const v4u_ *)(p + 4)}; }

/* a * b + c per lane, each rounded once (C99 fmaf: what _mm256_fmadd_ps computes in each lane) */
static inline v4_ fma4_(v4_ a, v4_ b, v4_ c) {
    return (v4_){fmaf(a[0], b[0], c[0]), fmaf(a[1], b[1], c[1]), fmaf(a[2], b[2], c[2]), fmaf(a[3], b[3], c[3])};
}

static inline acc8_ fma8_(acc8_ a, acc8_ b, acc8_ c) {
    return (acc8_){fma4_(a.lo, b.lo, c.lo), fma4_(a.hi, b.hi, c.hi)};
}

/* hsum256_'s tree: s_i = l_i + l_(i+4), then (s0 + s2) + (s1 + s3) */
static inline float hsum_acc8_(acc8_ a) {
    const v4_ s = a.lo + a.hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
}

#define ZERO8_() zero8_()
#define LOAD8_(p) load8_(p)
#define FMA8_(a, b, c) fma8_(a, b, c)
#define HSUM8_(a) hsum_acc8_(a)
#endif

/* y[i, j] (i < MR <= 4, j < NR <= 3) for x rows ldx apart and W rows ldw apart; y rows ldy apart */
TGT static void tile_(int64_t MR, int64_t NR, int64_t K, const float *x, int64_t ldx, const float *W, int64_t ldw,
                      float *y, int64_t ldy) {
    if (MR == 4 && NR == 3) {
        const float *w0 = W, *w1 = W + ldw, *w2 = W + 2 * ldw;
        const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
        acc8_ a00 = ZERO8_(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
        acc8_ a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
        for (int64_t k = 0; k < K; k += 8) {
            const acc8_ b0 = LOAD8_(w0 + k), b1 = LOAD8_(w1 + k), b2 = LOAD8_(w2 + k);
            acc8_ v = LOAD8_(x0 + k);
            a00 = FMA8_(v, b0, a00); a01 = FMA8_(v, b1, a01); a02 = FMA8_(v, b2, a02);
            v = LOAD8_(x1 + k);
            a10 = FMA8_(v, b0, a10); a11 = FMA8_(v, b1, a11); a12 = FMA8_(v, b2, a12);
            v = LOAD8_(x2 + k);
            a20 = FMA8_(v, b0, a20); a21 = FMA8_(v, b1, a21); a22 = FMA8_(v, b2, a22);
            v = LOAD8_(x3 + k);
            a30 = FMA8_(v, b0, a30); a31 = FMA8_(v, b1, a31); a32 = FMA8_(v, b2, a32);
        }
        y[0] = HSUM8_(a00); y[1] = HSUM8_(a01); y[2] = HSUM8_(a02);
        y += ldy; y[0] = HSUM8_(a10); y[1] = HSUM8_(a11); y[2] = HSUM8_(a12);
        y += ldy; y[0] = HSUM8_(a20); y[1] = HSUM8_(a21); y[2] = HSUM8_(a22);
        y += ldy; y[0] = HSUM8_(a30); y[1] = HSUM8_(a31); y[2] = HSUM8_(a32);
        return;
    }
    acc8_ acc[4][3];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = ZERO8_();
    for (int64_t k = 0; k < K; k += 8) {
        acc8_ b[3];
        for (int64_t j = 0; j < NR; j++) b[j] = LOAD8_(W + j * ldw + k);
        for (int64_t i = 0; i < MR; i++) {
            const acc8_ v = LOAD8_(x + i * ldx + k);
            for (int64_t j = 0; j < NR; j++) acc[i][j] = FMA8_(v, b[j], acc[i][j]);
        }
    }
    for (int64_t i = 0; i < MR; i++)
        for (int64_t j = 0; j < NR; j++) y[i * ldy + j] = HSUM8_(acc[i][j]);
}

#if NEXTN_AVX512
/* hsum256_ of both eight-lane halves of a 16-lane accumulator at once (rows 2p and 2p + 1 of a pair), the same
 * tree: xi = li + l(i+4), then (x0 + x2) + (x1 + x3); the low half's sum to *y0, the high half's to *y1 unless
 * y1 is NULL */
TGT16 static inline void hsum2x8_(__m512 a, float *y0, float *y1) {
    const __m512 s = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));  /* x0..x3 per half */
    const __m512 t = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(3, 2, 3, 2)));     /* x0+x2, x1+x3 */
    const __m512 u = _mm512_add_ps(t, _mm512_shuffle_ps(t, t, _MM_SHUFFLE(1, 1, 1, 1)));     /* lane 0 and 8 */
    *y0 = _mm512_cvtss_f32(u);
    if (y1) *y1 = _mm512_cvtss_f32(_mm512_castps256_ps512(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1))));
}

/* W's eight floats at p in both halves */
TGT16 static inline __m512 bcast8_(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

/* x's 16 floats at p in a register: the compiler would otherwise fold the load into each of the three FMAs that use
 * it, and the loads, not the FMAs, would bound the loop (two 64-byte loads a cycle) */
TGT16 static inline __m512 ldx16_(const float *p) {
    __m512 v = _mm512_loadu_ps(p);
    __asm__("" : "+v"(v));
    return v;
}

/* y[i, j] (i < 2P, j < 3) from P <= 4 row pairs of xp (pack_pairs_ layout, pairs 2K floats apart) and three W rows
 * ldw apart; y rows ldy apart; row 2P - 1 is skipped when `odd`. Per output: tile_'s sum, in one half of a 16-lane
 * register. Inlined with P constant, so the accumulators live in registers. */
TGT16 static inline __attribute__((always_inline)) void tile16_p_(const int P, int odd, int64_t K, const float *xp,
                                                                  const float *W, int64_t ldw, float *y,
                                                                  int64_t ldy) {
    __m512 acc[4][3];
    for (int p = 0; p < P; p++)
        for (int j = 0; j < 3; j++) acc[p][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m512 b0 = bcast8_(W + k), b1 = bcast8_(W + ldw + k), b2 = bcast8_(W + 2 * ldw + k);
        for (int p = 0; p < P; p++) {
            const __m512 v = ldx16_(xp + p * 2 * K + 2 * k);
            acc[p][0] = _mm512_fmadd_ps(v, b0, acc[p][0]);
            acc[p][1] = _mm512_fmadd_ps(v, b1, acc[p][1]);
            acc[p][2] = _mm512_fmadd_ps(v, b2, acc[p][2]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int j = 0; j < 3; j++)
            hsum2x8_(acc[p][j], y + 2 * p * ldy + j, p < P - 1 || !odd ? y + (2 * p + 1) * ldy + j : NULL);
}

/* y[i, j] (i < MR <= 8, j < 3) from xp's (MR + 1) / 2 row pairs and three W rows ldw apart, y rows ldy apart */
TGT16 static void tile16_(int64_t MR, int64_t K, const float *xp, const float *W, int64_t ldw, float *y,
                          int64_t ldy) {
    const int odd = (int)(MR & 1);
    switch ((MR + 1) / 2) {
        case 4: tile16_p_(4, odd, K, xp, W, ldw, y, ldy); return;
        case 3: tile16_p_(3, odd, K, xp, W, ldw, y, ldy); return;
        case 2: tile16_p_(2, odd, K, xp, W, ldw, y, ldy); return;
        default: tile16_p_(1, odd, K, xp, W, ldw, y, ldy); return;
    }
}

/* hsum2x8_ of eight accumulators a[0..8) at once, in one register: the same additions of the same operands,
 * with the lanes of several accumulators side by side (14 shuffles and 7 adds for 16 sums instead of 32 and 24).
 * Sum r (0: the low half's row, 1: the high half's) of accumulator i lands in lane 8 (i & 1) + 4 r + i / 2. */
TGT16 static inline __m512 hsums8_(const __m512 *a) {
    __m512 s[4], t[2];
    for (int e = 0; e < 4; e++)  /* x_q = l_q + l_(q+4) of each half: [a(2e) lo, a(2e) hi, a(2e+1) lo, a(2e+1) hi] */
        s[e] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * e], a[2 * e + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * e], a[2 * e + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int f = 0; f < 2; f++)  /* x0 + x2, x1 + x3 of s[2f]'s four halves, then of s[2f + 1]'s */
        t[f] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * f], s[2 * f + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s[2 * f], s[2 * f + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),  /* (x0 + x2) + (x1 + x3) */
                         _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* y[i, j] (i < 2P, j < 8) from P <= 2 row pairs of xp (pack_pairs_ layout) and eight W rows ldw apart; y rows
 * ldy apart; row 2P - 1 is skipped when `odd`. Per output: tile_'s sum, in one half of a 16-lane register; a
 * pair's 16 sums come out of hsums8_ in one register, permuted into its two rows of eight and stored as such. The
 * k loop is tile16_p_'s, written out again: one inline routine filling an accumulator array for both tiles kept the
 * accumulators in memory (12% slower at M = 32, measured). */
TGT16 static inline __attribute__((always_inline)) void tile16x8_p_(const int P, int odd, int64_t K, const float *xp,
                                                                    const float *W, int64_t ldw, float *y,
                                                                    int64_t ldy) {
    __m512 acc[2][8];
    for (int p = 0; p < P; p++)
        for (int j = 0; j < 8; j++) acc[p][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m512 b[8];
        for (int j = 0; j < 8; j++) b[j] = bcast8_(W + j * ldw + k);
        for (int p = 0; p < P; p++) {
            const __m512 v = ldx16_(xp + p * 2 * K + 2 * k);
            for (int j = 0; j < 8; j++) acc[p][j] = _mm512_fmadd_ps(v, b[j], acc[p][j]);
        }
    }
    /* lane 8 r + j <- hsums8_'s lane of (column j, row r) */
    const __m512i to_rows = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    for (int p = 0; p < P; p++) {
        const __m512 u = _mm512_permutexvar_ps(to_rows, hsums8_(acc[p]));
        _mm256_storeu_ps(y + 2 * p * ldy, _mm512_castps512_ps256(u));
        if (p < P - 1 || !odd)
            _mm256_storeu_ps(y + (2 * p + 1) * ldy, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    }
}

/* y[i, j] (i < MR <= 4, j < 8) from xp's (MR + 1) / 2 row pairs */
TGT16 static void tile16x8_(int64_t MR, int64_t K, const float *xp, const float *W, int64_t ldw, float *y,
                            int64_t ldy) {
    if (MR > 2) tile16x8_p_(2, (int)(MR & 1), K, xp, W, ldw, y, ldy);
    else tile16x8_p_(1, (int)(MR & 1), K, xp, W, ldw, y, ldy);
}

/* x [M, K] (rows ldx apart) in row pairs for tile16_: pair p is 2K floats, chunk c of it x[2p][8c .. 8c+8] then
 * x[2p+1][8c .. 8c+8] (zeros for an odd M's missing row). NULL when out of memory. */
static float *pack_pairs_(int64_t M, int64_t K, const float *x, int64_t ldx) {
    const int64_t P = (M + 1) / 2;
    float *xp = aligned_alloc(64, sizeof(float) * (size_t)(P * 2 * K));  /* K % 8 == 0: a multiple of 64 bytes */
    if (!xp) return NULL;
    for (int64_t p = 0; p < P; p++) {
        const float *r0 = x + 2 * p * ldx, *r1 = r0 + ldx;
        float *d = xp + p * 2 * K;
        for (int64_t k = 0; k < K; k += 8, d += 16) {
            memcpy(d, r0 + k, 8 * sizeof(float));
            if (2 * p + 1 < M) memcpy(d + 8, r1 + k, 8 * sizeof(float));
            else memset(d + 8, 0, 8 * sizeof(float));
        }
    }
    return xp;
}
#endif /* NEXTN_AVX512 */

/* one row: eight W rows at a time */
TGT static void row_(int64_t N, int64_t K, const float *x, const float *W, int64_t ldw, float *y) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        const float *w = W + n * ldw;
        acc8_ a0 = ZERO8_(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            const acc8_ v = LOAD8_(x + k);
            a0 = FMA8_(v, LOAD8_(w + k), a0);
            a1 = FMA8_(v, LOAD8_(w + ldw + k), a1);
            a2 = FMA8_(v, LOAD8_(w + 2 * ldw + k), a2);
            a3 = FMA8_(v, LOAD8_(w + 3 * ldw + k), a3);
            a4 = FMA8_(v, LOAD8_(w + 4 * ldw + k), a4);
            a5 = FMA8_(v, LOAD8_(w + 5 * ldw + k), a5);
            a6 = FMA8_(v, LOAD8_(w + 6 * ldw + k), a6);
            a7 = FMA8_(v, LOAD8_(w + 7 * ldw + k), a7);
        }
        y[n] = HSUM8_(a0); y[n + 1] = HSUM8_(a1); y[n + 2] = HSUM8_(a2); y[n + 3] = HSUM8_(a3);
        y[n + 4] = HSUM8_(a4); y[n + 5] = HSUM8_(a5); y[n + 6] = HSUM8_(a6); y[n + 7] = HSUM8_(a7);
    }
    for (; n < N; n += 3) tile_(1, N - n < 3 ? N - n : 3, K, x, 0, W + n * ldw, ldw, y + n, 0);
}

/* columns [n0, n1) of y [M, N] (rows N apart); xp: x packed by pack_pairs_ (16-lane tiles) or NULL (8-lane) */
TGT static void gemm_cols_(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *xp,
                           const float *W, float *y, int64_t n0, int64_t n1) {
    if (M == 1) {
        row_(n1 - n0, K, x, W + n0 * K, K, y + n0);
        return;
    }
#if NEXTN_AVX512
    if (xp) {  /* as below: tiles of 4 rows (2 pairs) x 8 columns, then the last columns (fewer than 8) in tiles
                * of 8 rows x 3 columns, their last one or two in the 8-lane tiles (the same sums) */
        const int64_t mb = (16384 / (4 * K)) & ~(int64_t)7 ? (16384 / (4 * K)) & ~(int64_t)7 : 8;
        const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = m0 + mb < M ? m0 + mb : M;
            for (int64_t n = n0; n < n8; n += 8)
                for (int64_t m = m0; m < m1; m += 4)
                    tile16x8_(m1 - m < 4 ? m1 - m : 4, K, xp + m * K, W + n * K, K, y + m * N + n, N);
            for (int64_t n = n8; n < n1; n += 3)
                for (int64_t m = m0; m < m1; m += n1 - n < 3 ? 4 : 8)
                    if (n1 - n < 3)
                        tile_(m1 - m < 4 ? m1 - m : 4, n1 - n, K, x + m * ldx, ldx, W + n * K, K, y + m * N + n, N);
                    else
                        tile16_(m1 - m < 8 ? m1 - m : 8, K, xp + m * K, W + n * K, K, y + m * N + n, N);
        }
        return;
    }
#else
    (void)xp;  /* never packed */
#endif
    /* blocks of x's rows small enough to stay in L1 (~16 KB) while the columns' W rows pass, 3 at a time, each
     * staying in L1 while the block's rows do */
    const int64_t mb = 16384 / (4 * K) >= 8 ? (16384 / (4 * K)) & ~(int64_t)3 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m1 = m0 + mb < M ? m0 + mb : M;
        for (int64_t n = n0; n < n1; n += 3)
            for (int64_t m = m0; m < m1; m += 4)
                tile_(m1 - m < 4 ? m1 - m : 4, n1 - n < 3 ? n1 - n : 3, K, x + m * ldx, ldx, W + n * K, K,
                      y + m * N + n, N);
    }
}

#define NB 24  /* columns per work item: a multiple of the tiles' 3 and the row's 8 */

/* the end of block b's columns [b * NB, ...) of n */
static inline int64_t block_end_(int64_t b, int64_t n) { return (b + 1) * NB < n ? (b + 1) * NB : n; }

typedef struct {
    int64_t M, N, K, ldx;
    const float *x, *xp, *W;
    float *y;
} gemm_job_;

static void gemm_item_(void *arg, int64_t b) {
    const gemm_job_ *j = arg;
    gemm_cols_(j->M, j->N, j->K, j->x, j->ldx, j->xp, j->W, j->y, b * NB, block_end_(b, j->N));
}

/* x packed for the 16-lane tiles when they run and M > 1 (*xp NULL otherwise); 0, or 2 when out of memory */
static int maybe_pack_(int64_t M, int64_t K, const float *x, int64_t ldx, float **xp) {
    *xp = NULL;
#if NEXTN_AVX512
    if (!wide_ || M < 2) return 0;
    *xp = pack_pairs_(M, K, x, ldx);
    return *xp ? 0 : 2;
#else
    (void)M, (void)K, (void)x, (void)ldx;
    return 0;
#endif
}

/* y = x W^T over both threads (cpu_par.c) when the job is large enough: column blocks, each computed as above */
static int gemm_(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *W, float *y) {
    float *xp;
    if (maybe_pack_(M, K, x, ldx, &xp)) return 2;
    gemm_job_ j = {M, N, K, ldx, x, xp, W, y};
    nextn_par_(gemm_item_, &j, (N + NB - 1) / NB, M * N * K);
    free(xp);
    return 0;
}

/* y [M, N] = x [M, K] (rows ldx apart) @ W [N, K]^T (contiguous); K % 8 == 0 */
int nextn_linear_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *W, float *y) {
    if (K % 8 || !nextn_linear_ok()) return 1;
    return gemm_(M, N, K, x, ldx, W, y);
}

typedef struct {
    int64_t M, H, I, ldx;
    const float *x, *xp, *Wgu;
    float *gu;
} gate_up_job_;

/* gate and up columns [c0, c1) of every row, then silu(g) * u over them (in place over the gate half) */
static void gate_up_item_(void *arg, int64_t b) {
    const gate_up_job_ *j = arg;
    const int64_t c0 = b * NB, c1 = block_end_(b, j->I);
    gemm_cols_(j->M, 2 * j->I, j->H, j->x, j->ldx, j->xp, j->Wgu, j->gu, c0, c1);
    gemm_cols_(j->M, 2 * j->I, j->H, j->x, j->ldx, j->xp, j->Wgu, j->gu, j->I + c0, j->I + c1);
    for (int64_t m = 0; m < j->M; m++) {  /* row m is [2I] at gu + m * 2I; c0, c1 are multiples of 8 (I is) */
        float *g = j->gu + m * 2 * j->I;
        const float *u = g + j->I;
        for (int64_t i = c0; i < c1; i += 8) st8_(g + i, silu8_(ld8_(g + i)) * ld8_(u + i));
    }
}

/* SwiGLU: y [M, H] = (silu(g) * u) @ Wd^T with g | u = x @ Wgu^T (Wgu [2I, H]: gate rows then up rows, Wd [H, I]);
 * silu(g) * u = (g * (1 / (1 + e^-g))) * u with cpu_vec.h's exp. H % 8 == 0 and I % 8 == 0. */
int nextn_mlp_f32(int64_t M, int64_t H, int64_t I, const float *x, int64_t ldx, const float *Wgu, const float *Wd,
                  float *y) {
    if (H % 8 || I % 8 || !nextn_linear_ok()) return 1;
    float *gu = malloc(sizeof(float) * (size_t)(M * 2 * I)), *xp;
    if (!gu || maybe_pack_(M, H, x, ldx, &xp)) {
        free(gu);
        return 2;
    }
    gate_up_job_ j = {M, H, I, ldx, x, xp, Wgu, gu};
    nextn_par_(gate_up_item_, &j, (I + NB - 1) / NB, M * 2 * I * H);
    free(xp);
    const int rc = gemm_(M, H, I, gu, 2 * I, Wd, y);
    free(gu);
    return rc;
}
