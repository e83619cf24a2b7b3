/* nextn CPU kernels: the gated attention token step over the KV pool, and the zero-centred RMSNorm
 * (engine/model/ops/cpu.py builds and calls them; their torch twins are GatedAttention.forward's torch path in
 * engine/model/qwen35.py and norm.rms_norm_ref).
 *
 * nextn_attn_step_f32, per row i and token t (t = 0..T-1, in order), from the fused q|gate, k, v projection to
 * the gated attention output (o_proj's input):
 *   q, k:  per head, x * rsqrt(mean(x^2) + eps) * w1 (w1 = 1 + weight, from the caller); then NeoX RoPE on the
 *          first R dims: x[j] * cos[j] + rot[j] * sin[j], rot = (-x[R/2..R-1], x[0..R/2-1]); cos / sin are the
 *          token's row (i * T + t) of per-token rows, or with by_pos row pos0[i] + t of a table by position
 *   cache: k and v of token t go to position pos0[i] + t of pool slot slots[i]
 *   attn:  query head h reads kv head h / (nh / nkv) over positions 0..pos0[i] + t: s_j = (q . k_j) * scale,
 *          p = softmax(s), o = sum_j p_j v_j
 *   gate:  out = o * sigmoid(gate)
 * nextn_rms_norm_f32: y = x * rsqrt(sum(x^2) / H + eps) * w1, per row.
 * nextn_sigmoid_f32: y = 1 / (1 + e^-x), element by element, the same bits wherever an element sits.
 *
 * Every (row, token) runs the same code in the same order whatever N and T are, and no sum is reordered by the
 * compiler (no -ffast-math, -ffp-contract=off; the 8-lane partial sums are written out), so a row's bits never
 * depend on the batch or on T.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_par.h"
#include "cpu_vec.h"

/* sum of a[j] * b[j], j < n: eight partial sums (lane l takes j = l mod 8 in order), then hsum8_'s fixed tree */
static inline float dot_(const float *a, const float *b, int64_t n) {
    v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) acc = acc + ld8_(a + j) * ld8_(b + j);
    for (int l = 0; j < n; j++, l++) acc[l] = acc[l] + a[j] * b[j];
    return hsum8_(acc);
}

/* lanes of a | b (0-7: a's, 8-15: b's) as one eight-lane vector */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF8_(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF8_(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* hsum8_ of eight accumulators at once, lane j holding a[j]'s sum: the same additions of the same operands, the
 * lanes of several accumulators side by side (x_q = l_q + l_(q+4), then x0 + x2 and x1 + x3, then their sum) */
static inline v8 hsum8x8_(const v8 *a) {
    v8 s[4], t[2];
    for (int e = 0; e < 4; e++)  /* [a(2e)'s x0..x3 | a(2e+1)'s x0..x3] */
        s[e] = SHUF8_(a[2 * e], a[2 * e + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUF8_(a[2 * e], a[2 * e + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int f = 0; f < 2; f++)  /* x0 + x2, x1 + x3 of a(4f), a(4f+2), a(4f+1), a(4f+3), in that order */
        t[f] = SHUF8_(s[2 * f], s[2 * f + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUF8_(s[2 * f], s[2 * f + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 u = SHUF8_(t[0], t[1], 0, 2, 8, 10, 4, 6, 12, 14)
               + SHUF8_(t[0], t[1], 1, 3, 9, 11, 5, 7, 13, 15);  /* the sums of a0 a2 a4 a6 a1 a3 a5 a7 */
    return SHUF8_(u, u, 0, 4, 1, 5, 2, 6, 3, 7);
}

/* p[e] = (q . k_e) * scale for the eight keys k_e = k + e * kd (hd % 8 == 0): the eight trees in one vector
 * (hsum8x8_), the same per-key sums as dot_ */
static inline void score8_(const float *q, const float *k, int64_t kd, int64_t hd, float scale, float *p) {
    v8 a[8];
    for (int e = 0; e < 8; e++) a[e] = splat8_(0.0f);
    for (int64_t d = 0; d < hd; d += 8) {
        const v8 qv = ld8_(q + d);
        for (int e = 0; e < 8; e++) a[e] = a[e] + qv * ld8_(k + e * kd + d);
    }
    st8_(p, hsum8x8_(a) * scale);
}

/* p[j] <- softmax(p)[j], j < n: the max in eight lanes then across them (the same value as one pass in order, a
 * max of the same numbers; only the sign of a zero maximum may differ, which changes no p[j] - m), e^(p_j - m) per
 * lane, their sum in eight lanes (lane l takes j = l mod 8 in order) and hsum8_'s tree, then one multiply each */
static void softmax_(float *p, int64_t n) {
    int64_t j;
    v8 mv = splat8_(-INFINITY);
    for (j = 0; j + 8 <= n; j += 8) {
        const v8 x = ld8_(p + j);
        const v8i gt = x > mv;  /* x > mv ? x : mv, lane by lane (a NaN is never taken, as below) */
        mv = (v8)(((v8i)x & gt) | ((v8i)mv & ~gt));
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    for (j = 0; j + 8 <= n; j += 8) {
        const v8 e = exp8_(ld8_(p + j) - m);
        memcpy(p + j, &e, sizeof e);
        acc = acc + e;
    }
    if (j < n) {  /* the tail as one padded vector: the same per-lane operations */
        const v8 e = exp8_(ldn_(p + j, n - j, m) - m);
        for (int64_t i = j; i < n; i++) {
            p[i] = e[i - j];
            acc[i - j] = acc[i - j] + e[i - j];
        }
    }
    const float inv = 1.0f / hsum8_(acc);
    for (j = 0; j < n; j++) p[j] = p[j] * inv;
}

/* o = softmax(scale * q . k_j) . v_j over keys j < n of one kv head (rows kd floats apart); p: n floats of
 * scratch. Sums run over j ascending in eight lanes (lane l takes j = l mod 8) then a fixed tree; the score of
 * key j is dot_(q, k_j) whichever loop computes it. */
static void attend_(const float *q, const float *k, const float *v, int64_t kd, int64_t n, int64_t hd, float scale,
                    float *p, float *o) {
    int64_t j = 0;
    if (hd % 8 == 0) {  /* eight, then four keys at a time: the same per-key sums as dot_, independent chains */
        for (; j + 8 <= n; j += 8) score8_(q, k + j * kd, kd, hd, scale, p + j);
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + j * kd, *k1 = k0 + kd, *k2 = k1 + kd, *k3 = k2 + kd;
            v8 a0 = {0, 0, 0, 0, 0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < hd; d += 8) {
                const v8 qv = ld8_(q + d);
                a0 = a0 + qv * ld8_(k0 + d);
                a1 = a1 + qv * ld8_(k1 + d);
                a2 = a2 + qv * ld8_(k2 + d);
                a3 = a3 + qv * ld8_(k3 + d);
            }
            p[j] = hsum8_(a0) * scale;
            p[j + 1] = hsum8_(a1) * scale;
            p[j + 2] = hsum8_(a2) * scale;
            p[j + 3] = hsum8_(a3) * scale;
        }
    }
    for (; j < n; j++) p[j] = dot_(q, k + j * kd, hd) * scale;
    softmax_(p, n);
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) {  /* as below, for o[d..d+15] in one pass over the keys (c[e][u]: chain e of the
                                      * u-th eight dims) */
        v8 c[4][2];
        for (int e = 0; e < 4; e++) c[e][0] = c[e][1] = splat8_(0.0f);
        for (j = 0; j + 4 <= n; j += 4)
            for (int e = 0; e < 4; e++) {
                const float pe = p[j + e], *vr = v + (j + e) * kd + d;
                c[e][0] = c[e][0] + pe * ld8_(vr);
                c[e][1] = c[e][1] + pe * ld8_(vr + 8);
            }
        for (int e = 0; j + e < n; e++) {  /* e < 3 */
            const float pe = p[j + e], *vr = v + (j + e) * kd + d;
            c[e][0] = c[e][0] + pe * ld8_(vr);
            c[e][1] = c[e][1] + pe * ld8_(vr + 8);
        }
        for (int u = 0; u < 2; u++) st8_(o + d + 8 * u, (c[0][u] + c[1][u]) + (c[2][u] + c[3][u]));
    }
    for (; d + 8 <= hd; d += 8) {  /* o[d..d+7] = sum_j p_j v_j: four chains (j mod 4), then (c0 + c1) + (c2 + c3) */
        v8 c0 = {0, 0, 0, 0, 0, 0, 0, 0}, c1 = c0, c2 = c0, c3 = c0;
        const float *vd = v + d;
        for (j = 0; j + 4 <= n; j += 4) {
            c0 = c0 + p[j] * ld8_(vd + j * kd);
            c1 = c1 + p[j + 1] * ld8_(vd + (j + 1) * kd);
            c2 = c2 + p[j + 2] * ld8_(vd + (j + 2) * kd);
            c3 = c3 + p[j + 3] * ld8_(vd + (j + 3) * kd);
        }
        if (j < n) c0 = c0 + p[j] * ld8_(vd + j * kd);
        if (j + 1 < n) c1 = c1 + p[j + 1] * ld8_(vd + (j + 1) * kd);
        if (j + 2 < n) c2 = c2 + p[j + 2] * ld8_(vd + (j + 2) * kd);
        const v8 r = (c0 + c1) + (c2 + c3);
        memcpy(o + d, &r, sizeof r);
    }
    for (; d < hd; d++) {  /* the same chains, one lane */
        float c[4] = {0, 0, 0, 0};
        for (j = 0; j < n; j++) c[j % 4] = c[j % 4] + p[j] * v[j * kd + d];
        o[d] = (c[0] + c[1]) + (c[2] + c[3]);
    }
}

static inline void rms_(const float *x, const float *w1, float eps, int64_t n, float *y) {
    const float r = 1.0f / sqrtf(dot_(x, x, n) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) y[j] = (x[j] * r) * w1[j];
}

/* y = rms(x) then rotate the first R dims with cos / sin [R] */
static inline void rms_rope_(const float *x, const float *w1, float eps, int64_t n, const float *c,
                             const float *s, int64_t R, float *y) {
    float tmp[R > 0 ? R : 1];
    rms_(x, w1, eps, n, y);
    const int64_t h = R / 2;
    for (int64_t j = 0; j < R; j++) {
        const float rot = j < h ? -y[j + h] : y[j - h];
        tmp[j] = y[j] * c[j] + rot * s[j];
    }
    memcpy(y, tmp, sizeof(float) * (size_t)R);
}

/* op = o * sigmoid(gate), hd floats (the tail as one padded vector: the same per-lane operations) */
static inline void gated_(const float *o, const float *gate, int64_t hd, float *op) {
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) st8_(op + d, ld8_(o + d) * (1.0f / (1.0f + exp8_(-ld8_(gate + d)))));
    if (d < hd)
        stn_(op + d, ldn_(o + d, hd - d, 0.0f) * (1.0f / (1.0f + exp8_(-ldn_(gate + d, hd - d, 0.0f)))), hd - d);
}

typedef struct {
    int64_t T, qkv_row, R, by_pos, cache_slot, nh, nkv, hd;
    const float *qkv, *qw1, *kw1, *cos, *sin;
    float *kc, *vc, *out, eps, scale;
    const int64_t *slots, *pos0;
    _Atomic int err;
    float *qbuf;  /* the blocked path: [N * T, nh, hd] normed, rotated queries */
} attn_job_;

/* row i's T tokens, in order */
static void attn_row_(void *arg, int64_t i) {
    attn_job_ *J = arg;
    const int64_t T = J->T, R = J->R, nh = J->nh, nkv = J->nkv, hd = J->hd, g = nh / nkv, kd = nkv * hd;
    const float eps = J->eps, scale = J->scale;
    float *p = malloc(sizeof(float) * (size_t)(J->pos0[i] + T + 2 * hd));
    if (!p) {
        J->err = 2;
        return;
    }
    float *q = p + J->pos0[i] + T, *o = q + hd;
    float *ks = J->kc + J->slots[i] * J->cache_slot, *vs = J->vc + J->slots[i] * J->cache_slot;
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = i * T + t, pos = J->pos0[i] + t;
        const int64_t rr = J->by_pos ? pos : row;  /* the RoPE row: by position (a table) or by token */
        const float *x = J->qkv + row * J->qkv_row, *c = J->cos + rr * R, *s = J->sin + rr * R;
        for (int64_t h = 0; h < nkv; h++) {
            rms_rope_(x + 2 * nh * hd + h * hd, J->kw1, eps, hd, c, s, R, ks + pos * kd + h * hd);
            memcpy(vs + pos * kd + h * hd, x + 2 * nh * hd + kd + h * hd, sizeof(float) * (size_t)hd);
        }
        for (int64_t h = 0; h < nh; h++) {
            const int64_t kh = h / g;
            rms_rope_(x + h * 2 * hd, J->qw1, eps, hd, c, s, R, q);
            attend_(q, ks + kh * hd, vs + kh * hd, kd, pos + 1, hd, scale, p, o);
            gated_(o, x + h * 2 * hd + hd, hd, J->out + row * nh * hd + h * hd);
        }
    }
    free(p);
}


/* The blocked path (a prefill block: T >= BLOCKED_MIN_T): the same numbers as attn_row_, computed in an order that
 * reuses each K and V row for many queries. First every (row, token) writes its K / V and its normed, rotated
 * queries (attn_prep_); then each work item takes one row, one kv head and TOK_BLOCK tokens: the g * TOK_BLOCK
 * queries that read that kv head, over KEY_CHUNK keys at a time (attn_block_): eight keys' scores against every
 * query while those keys sit in L1, then the chunk's V packed by 16-dim tile (its rows are nkv * hd floats apart,
 * which maps a chunk's rows onto a few cache sets) and each tile's keys summed into every query's chains in
 * registers (pv_tile_). A query's scores are dot_'s sums (score8_ or dot_), its softmax is softmax_, and its
 * output's four chains per dim take keys j = e mod 4 in ascending order, then (c0 + c1) + (c2 + c3): attend_'s
 * operations on the same operands, only interleaved with other queries'. So a token's output is bitwise the same
 * on either path, alone or in any batch. TOK_BLOCK 16 and KEY_CHUNK 64: the fastest pair measured at Qwen3.5-0.8B's
 * heads (8 on 2, hd 256) for a 256-token block at positions 1k and 4k (bench/RESULTS.md, "Long-prompt prefill"). */
#define BLOCKED_MIN_T 16
#define TOK_BLOCK 16
#define KEY_CHUNK 64

/* row i = item / T, token t = item % T: K / V to the cache, the queries to qbuf */
static void attn_prep_(void *arg, int64_t item) {
    attn_job_ *J = arg;
    const int64_t T = J->T, R = J->R, nh = J->nh, nkv = J->nkv, hd = J->hd, kd = nkv * hd;
    const int64_t i = item / T, t = item % T, row = i * T + t, pos = J->pos0[i] + t;
    const int64_t rr = J->by_pos ? pos : row;
    const float *x = J->qkv + row * J->qkv_row, *c = J->cos + rr * R, *s = J->sin + rr * R;
    float *ks = J->kc + J->slots[i] * J->cache_slot, *vs = J->vc + J->slots[i] * J->cache_slot;
    for (int64_t h = 0; h < nkv; h++) {
        rms_rope_(x + 2 * nh * hd + h * hd, J->kw1, J->eps, hd, c, s, R, ks + pos * kd + h * hd);
        memcpy(vs + pos * kd + h * hd, x + 2 * nh * hd + kd + h * hd, sizeof(float) * (size_t)hd);
    }
    for (int64_t h = 0; h < nh; h++) rms_rope_(x + h * 2 * hd, J->qw1, J->eps, hd, c, s, R, J->qbuf + (row * nh + h) * hd);
}

/* keys j0 <= j < hi (j0 a multiple of 4) of one 16-dim tile into the four chains c (chain e = j mod 4, rows hd
 * apart): c_e += p_j * v_j, keys in ascending order per chain, as attend_ adds them; vt: the tile's packed keys
 * ([KEY_CHUNK, 16], key j at row j - j0), the sums held in registers over the chunk */
static void pv_tile_(const float *p, const float *vt, int64_t j0, int64_t hi, float *c, int64_t hd) {
    v8 a[4][2];
    for (int e = 0; e < 4; e++)
        for (int u = 0; u < 2; u++) a[e][u] = ld8_(c + e * hd + 8 * u);
    int64_t j = j0;
    for (; j + 4 <= hi; j += 4)
        for (int e = 0; e < 4; e++) {
            const v8 pe = splat8_(p[j + e]);
            const float *vr = vt + (j + e - j0) * 16;
            a[e][0] = a[e][0] + pe * ld8_(vr);
            a[e][1] = a[e][1] + pe * ld8_(vr + 8);
        }
    for (int e = 0; j < hi; j++, e++) {
        const v8 pe = splat8_(p[j]);
        const float *vr = vt + (j - j0) * 16;
        a[e][0] = a[e][0] + pe * ld8_(vr);
        a[e][1] = a[e][1] + pe * ld8_(vr + 8);
    }
    for (int e = 0; e < 4; e++)
        for (int u = 0; u < 2; u++) st8_(c + e * hd + 8 * u, a[e][u]);
}

/* row i, kv head kh, tokens [t0, t1) (the item's index decodes to them): every query of those tokens that reads kv
 * head kh, attended and gated into `out` */
static void attn_block_(void *arg, int64_t item) {
    attn_job_ *J = arg;
    const int64_t T = J->T, nh = J->nh, nkv = J->nkv, hd = J->hd, kd = nkv * hd, g = nh / nkv;
    const int64_t nb = (T + TOK_BLOCK - 1) / TOK_BLOCK, i = item / (nkv * nb), kh = item / nb % nkv;
    const int64_t t0 = item % nb * TOK_BLOCK, t1 = t0 + TOK_BLOCK < T ? t0 + TOK_BLOCK : T, Q = g * (t1 - t0);
    const int64_t p0 = J->pos0[i], nmax = p0 + t1, pitch = (nmax + 7) & ~(int64_t)7;
    const float *k = J->kc + J->slots[i] * J->cache_slot + kh * hd, *v = J->vc + J->slots[i] * J->cache_slot + kh * hd;
    const float scale = J->scale;
    float *P = malloc(sizeof(float) * (size_t)(Q * pitch + Q * 4 * hd + hd + KEY_CHUNK * hd));
    if (!P) {
        J->err = 2;
        return;
    }
    float *acc = P + Q * pitch, *o = acc + Q * 4 * hd, *vp = o + hd;
    /* query q: token t0 + q / g, head kh * g + q % g, keys 0 .. p0 + t */
#define QROW_(q) (J->qbuf + ((i * T + t0 + (q) / g) * nh + kh * g + (q) % g) * hd)
#define NKEYS_(q) (p0 + t0 + (q) / g + 1)
    for (int64_t j0 = 0; j0 < nmax; j0 += KEY_CHUNK) {
        const int64_t j1 = j0 + KEY_CHUNK < nmax ? j0 + KEY_CHUNK : nmax;
        for (int64_t j8 = j0; j8 < j1; j8 += 8)  /* eight keys (8 hd floats, in L1) against every query */
            for (int64_t q = 0; q < Q; q++) {
                const int64_t hi = NKEYS_(q) < j1 ? NKEYS_(q) : j1;
                const float *qv = QROW_(q);
                float *p = P + q * pitch;
                if (hd % 8 == 0 && j8 + 8 <= hi)
                    score8_(qv, k + j8 * kd, kd, hd, scale, p + j8);
                else
                    for (int64_t j = j8; j < hi; j++) p[j] = dot_(qv, k + j * kd, hd) * scale;
            }
    }
    for (int64_t q = 0; q < Q; q++) softmax_(P + q * pitch, NKEYS_(q));
    memset(acc, 0, sizeof(float) * (size_t)(Q * 4 * hd));
    for (int64_t j0 = 0; j0 < nmax; j0 += KEY_CHUNK) {
        const int64_t j1 = j0 + KEY_CHUNK < nmax ? j0 + KEY_CHUNK : nmax;
        if (hd % 16 == 0) {  /* the chunk's V packed by 16-dim tile ([hd / 16, KEY_CHUNK, 16]: a tile's keys in 4 KB) */
            for (int64_t j = j0; j < j1; j++)
                for (int64_t t = 0; t < hd / 16; t++)
                    memcpy(vp + (t * KEY_CHUNK + j - j0) * 16, v + j * kd + t * 16, 16 * sizeof(float));
            for (int64_t t = 0; t < hd / 16; t++)
                for (int64_t q = 0; q < Q; q++) {
                    const int64_t hi = NKEYS_(q) < j1 ? NKEYS_(q) : j1;
                    if (hi > j0) pv_tile_(P + q * pitch, vp + t * KEY_CHUNK * 16, j0, hi, acc + q * 4 * hd + t * 16, hd);
                }
        } else
            for (int64_t q = 0; q < Q; q++) {
                const int64_t hi = NKEYS_(q) < j1 ? NKEYS_(q) : j1;
                for (int64_t j = j0; j < hi; j++) {  /* chain j mod 4 of every dim: c += p_j * v_j */
                    const float pj = P[q * pitch + j], *vr = v + j * kd;
                    float *c = acc + (q * 4 + (j & 3)) * hd;
                    for (int64_t d = 0; d < hd; d++) c[d] = c[d] + pj * vr[d];
                }
            }
    }
    for (int64_t q = 0; q < Q; q++) {
        const float *c = acc + q * 4 * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = (c[d] + c[hd + d]) + (c[2 * hd + d] + c[3 * hd + d]);
        const int64_t row = i * T + t0 + q / g, h = kh * g + q % g;
        gated_(o, J->qkv + row * J->qkv_row + h * 2 * hd + hd, hd, J->out + row * nh * hd + h * hd);
    }
#undef QROW_
#undef NKEYS_
    free(P);
}

int nextn_attn_step_f32(int64_t N, int64_t T, const float *qkv, int64_t qkv_row, const float *qw1,
                        const float *kw1, float eps, const float *cos, const float *sin, int64_t R, int64_t by_pos,
                        float *kc, float *vc, int64_t cache_slot, const int64_t *slots, const int64_t *pos0,
                        int64_t nh, int64_t nkv, int64_t hd, float scale, float *out) {
    if (nkv < 1 || nh % nkv != 0 || R < 0 || R > hd || R % 2) return 1;
    int64_t smax = 0;
    for (int64_t i = 0; i < N; i++) smax = pos0[i] + T > smax ? pos0[i] + T : smax;
    attn_job_ j = {T, qkv_row, R, by_pos != 0, cache_slot, nh, nkv, hd, qkv, qw1, kw1, cos, sin, kc, vc, out, eps,
                   scale, slots, pos0, 0, NULL};
    if (T < BLOCKED_MIN_T) {  /* a step: each row's tokens in order (rows are independent: distinct pool slots) */
        nextn_par_(attn_row_, &j, N, N * T * nh * hd * 2 * smax);
        return j.err;
    }
    j.qbuf = malloc(sizeof(float) * (size_t)(N * T * nh * hd));
    if (!j.qbuf) return 2;
    nextn_par_(attn_prep_, &j, N * T, N * T * (nh + nkv) * hd * 4);
    const int64_t nb = (T + TOK_BLOCK - 1) / TOK_BLOCK;
    nextn_par_(attn_block_, &j, N * nkv * nb, N * T * nh * hd * 2 * smax);
    free(j.qbuf);
    return j.err;
}

int nextn_rms_norm_f32(int64_t rows, int64_t H, const float *x, int64_t ldx, const float *w1, float eps,
                       float *y) {
    for (int64_t i = 0; i < rows; i++) rms_(x + i * ldx, w1, eps, H, y + i * H);
    return 0;
}

/* y[i] = 1 / (1 + e^-x[i]), i < n, with cpu_vec.h's exp: the same operations for every element wherever it sits
 * (the tail as one padded vector), so an element's bits do not depend on n or its index (torch's sigmoid rounds
 * its vectorised body and its scalar tail differently) */
int nextn_sigmoid_f32(int64_t n, const float *x, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) st8_(y + i, 1.0f / (1.0f + exp8_(-ld8_(x + i))));
    if (i < n) stn_(y + i, 1.0f / (1.0f + exp8_(-ldn_(x + i, n - i, 0.0f))), n - i);
    return 0;
}
