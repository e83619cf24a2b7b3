/* nextn CPU kernel: one Gated DeltaNet token step per (row, token), fused from the input projection's output to
 * the gated RMSNorm's output, over the state pool (engine/model/ops/cpu.py builds and calls it; its torch twin
 * is the model's torch path, engine/model/qwen35.py GatedDeltaNet.forward).
 *
 * Per row i and token t (t = 0..T-1, in order):
 *   conv:  window = [state_c[0..Kc-2], x_t[c]]; acc = ((w0*win0 + w1*win1) + w2*win2) + ...; y = silu(acc);
 *          the new state is window[1..Kc-1]
 *   q, k:  l2-normalised per key head (eps 1e-6), q times qscale (dk^-1/2 in fp32, from the caller); value
 *          head h reads key head h / (nv / nk)
 *   gates: beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias))
 *   rule:  S <- decay * S; u = S^T k; delta = beta * (v - u); S <- S + k delta^T; o = S^T q
 *   norm:  out = w * (o * rsqrt(mean(o^2) + eps)) * silu(z), per value head
 * Token 0 reads the state in window slot read[i] of pool slot slots[i]; with record, the state after token t is
 * written to window slot write0[i] + t, else every token updates window slot write0[i] in place (a prefill chunk:
 * only the final state is kept); either may be slot read[i]: every state element is read before it is written.
 * lens (NULL: T for every row) names each row's real tokens: tokens t >= lens[i] are right padding, they leave the
 * state alone and their outputs are zeros. B > 0 (not recording: a prefill row that carries several blocks of one
 * prompt): bend[i * B + j] is where row i's inner block j ends (offsets in the row, ascending; -1 past the last) and
 * bslot[i * B + j] the window slot that block's tokens update in place, so its end state stays there; the row's last
 * block updates write0[i], and a block's first token reads the slot the previous block left. Each token runs the
 * same code whichever slot it reads and writes, so the row has the bits of one call per block.
 *
 * silu is x / (1 + e^-x) with cpu_vec.h's exp; the state's columns run eight at a time, G groups of eight side by
 * side (each column still summed over the key dimension in order, so the grouping changes no bit). Every
 * (row, token) runs the same code in the same order whatever N and T are, and no sum is reordered (compiled
 * without -ffast-math, with -ffp-contract=off), so a row's bits never depend on the batch or on T.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_par.h"
#include "cpu_vec.h"

#define MAX_KC 16
#define G 4  /* the state's column groups of eight updated together (independent sums: the adds' latency overlaps) */

static inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y = x * rsqrt(sum(x^2) + eps) over n */
static void l2norm_(const float *x, float *y, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * scale;
}

/* columns [0, 8 ng) of one head's state (rows dv apart): s = decay * s0 and u = s^T k, each column summed over
 * a in order; the ng groups of eight are independent sums side by side. Inlined with ng constant. */
static inline __attribute__((always_inline)) void decay_u_(const int ng, int64_t dk, int64_t dv, const float *s0,
                                                           float *s, const float *k, float decay, float *u) {
    v8 uj[G];
    for (int g = 0; g < ng; g++) uj[g] = splat8_(0.0f);
    for (int64_t a = 0; a < dk; a++) {
        const float ka = k[a];
        for (int g = 0; g < ng; g++) {
            const v8 sv = ld8_(s0 + a * dv + 8 * g) * decay;
            st8_(s + a * dv + 8 * g, sv);
            uj[g] = uj[g] + sv * ka;
        }
    }
    for (int g = 0; g < ng; g++) st8_(u + 8 * g, uj[g]);
}

/* the same columns: s += k delta^T and o = s^T q, each column summed over a in order */
static inline __attribute__((always_inline)) void update_o_(const int ng, int64_t dk, int64_t dv, float *s,
                                                            const float *k, const float *q, const float *delta,
                                                            float *o) {
    v8 dj[G], oj[G];
    for (int g = 0; g < ng; g++) {
        dj[g] = ld8_(delta + 8 * g);
        oj[g] = splat8_(0.0f);
    }
    for (int64_t a = 0; a < dk; a++) {
        const float ka = k[a], qa = q[a];
        for (int g = 0; g < ng; g++) {
            const v8 sv = ld8_(s + a * dv + 8 * g) + ka * dj[g];
            st8_(s + a * dv + 8 * g, sv);
            oj[g] = oj[g] + sv * qa;
        }
    }
    for (int g = 0; g < ng; g++) st8_(o + 8 * g, oj[g]);
}

typedef struct {
    int64_t N, T, proj_row, conv_slot, conv_win, rec_slot, rec_win, C, Kc, nk, dk, nv, dv, record;
    const float *proj, *convw, *neg_a, *dt_bias, *norm_w;
    float *conv, *rec, *out, norm_eps, qscale;
    const int64_t *slots, *read, *write0, *lens, *bend, *bslot;
    int64_t B;
} gdn_job_;

/* the window slot token t of row i updates in place (a forward that does not record): its block's (bend / bslot),
 * write0[i] for the row's last block */
static inline int64_t wslot_(const gdn_job_ *J, int64_t i, int64_t t) {
    for (int64_t j = 0; j < J->B; j++) {
        const int64_t e = J->bend[i * J->B + j];
        if (e < 0) break;
        if (t < e) return J->bslot[i * J->B + j];
    }
    return J->write0[i];
}

/* row i's T tokens, in order */
static void gdn_row_(void *arg, int64_t i) {
    const gdn_job_ *J = arg;
    const int64_t T = J->T, proj_row = J->proj_row, conv_slot = J->conv_slot, conv_win = J->conv_win;
    const int64_t rec_slot = J->rec_slot, rec_win = J->rec_win, C = J->C, Kc = J->Kc, nk = J->nk, dk = J->dk;
    const int64_t nv = J->nv, dv = J->dv;
    const float *proj = J->proj, *convw = J->convw, *neg_a = J->neg_a, *dt_bias = J->dt_bias, *norm_w = J->norm_w;
    float *conv = J->conv, *rec = J->rec, *out = J->out;
    const float norm_eps = J->norm_eps, qscale = J->qscale;
    const int64_t *slots = J->slots, *read = J->read, *write0 = J->write0;
    const int64_t len = J->lens ? J->lens[i] : T;
    const int64_t Kd = nk * dk, r = nv / nk, S1 = Kc - 1, zoff = C, boff = C + nv * dv, aoff = boff + nv;
    float y[C + 2 * Kd + 3 * dv];  /* scratch (a few KB for Qwen3.5 sizes) */
    float *qn = y + C, *kn = qn + Kd, *u = kn + Kd, *o = u + dv, *delta = o + dv;
    if (len < T) memset(out + (i * T + len) * nv * dv, 0, sizeof(float) * (size_t)((T - len) * nv * dv));
    if (len == 0 && !J->record && read[i] != write0[i]) {  /* no real token: the state moves to write0 unchanged */
        memcpy(rec + slots[i] * rec_slot + write0[i] * rec_win, rec + slots[i] * rec_slot + read[i] * rec_win,
               sizeof(float) * (size_t)(nv * dk * dv));
        memcpy(conv + slots[i] * conv_slot + write0[i] * conv_win, conv + slots[i] * conv_slot + read[i] * conv_win,
               sizeof(float) * (size_t)(C * (Kc - 1)));
    }
    for (int64_t t = 0, dst_w = read[i]; t < len; t++) {
        const float *xp = proj + (i * T + t) * proj_row;
        const int64_t src_w = dst_w;  /* token t reads what token t-1 wrote (token 0: read[i]) */
        dst_w = J->record ? write0[i] + t : wslot_(J, i, t);
        const float *cs = conv + slots[i] * conv_slot + src_w * conv_win;
        float *cd = conv + slots[i] * conv_slot + dst_w * conv_win;
        if (Kc == 4) {  /* every Qwen3.5 config: the same products and sums as below, unrolled */
            for (int64_t c = 0; c < C; c++) {
                const float s0 = cs[c * 3], s1 = cs[c * 3 + 1], s2 = cs[c * 3 + 2], xc = xp[c];
                const float *w = convw + c * 4;
                y[c] = ((s0 * w[0] + s1 * w[1]) + s2 * w[2]) + xc * w[3];
                cd[c * 3] = s1;
                cd[c * 3 + 1] = s2;
                cd[c * 3 + 2] = xc;
            }
        }
        for (int64_t c = 0; Kc != 4 && c < C; c++) {
            float win[MAX_KC];
            memcpy(win, cs + c * S1, sizeof(float) * (size_t)S1);
            win[S1] = xp[c];
            const float *w = convw + c * Kc;
            float acc = win[0] * w[0];
            for (int64_t j = 1; j < Kc; j++) acc = acc + win[j] * w[j];
            y[c] = acc;
            memcpy(cd + c * S1, win + 1, sizeof(float) * (size_t)S1);
        }
        silu_n_(y, C);
        for (int64_t h = 0; h < nk; h++) {
            l2norm_(y + h * dk, qn + h * dk, dk, qscale);
            l2norm_(y + Kd + h * dk, kn + h * dk, dk, 1.0f);
        }
        const float *rs = rec + slots[i] * rec_slot + src_w * rec_win;
        float *rd = rec + slots[i] * rec_slot + dst_w * rec_win;
        float *op = out + (i * T + t) * nv * dv;
        for (int64_t h = 0; h < nv; h++) {
            const float *q = qn + (h / r) * dk, *k = kn + (h / r) * dk, *v = y + 2 * Kd + h * dv;
            const float beta = sigmoidf_(xp[boff + h]);
            const float decay = expf(neg_a[h] * softplusf_(xp[aoff + h] + dt_bias[h]));
            const float *s0 = rs + h * dk * dv;
            float *s = rd + h * dk * dv;
            int64_t j = 0;
            for (; j + 8 * G <= dv; j += 8 * G) decay_u_(G, dk, dv, s0 + j, s + j, k, decay, u + j);
            for (; j + 8 <= dv; j += 8) decay_u_(1, dk, dv, s0 + j, s + j, k, decay, u + j);
            for (; j < dv; j++) {
                u[j] = 0.0f;
                for (int64_t a = 0; a < dk; a++) {
                    const float sv = s0[a * dv + j] * decay;
                    s[a * dv + j] = sv;
                    u[j] = u[j] + sv * k[a];
                }
            }
            for (j = 0; j < dv; j++) delta[j] = beta * (v[j] - u[j]);
            for (j = 0; j + 8 * G <= dv; j += 8 * G) update_o_(G, dk, dv, s + j, k, q, delta + j, o + j);
            for (; j + 8 <= dv; j += 8) update_o_(1, dk, dv, s + j, k, q, delta + j, o + j);
            for (; j < dv; j++) {
                o[j] = 0.0f;
                for (int64_t a = 0; a < dk; a++) {
                    const float sv = s[a * dv + j] + k[a] * delta[j];
                    s[a * dv + j] = sv;
                    o[j] = o[j] + sv * q[a];
                }
            }
            float ss = 0.0f;
            for (j = 0; j < dv; j++) ss += o[j] * o[j];
            const float rn = 1.0f / sqrtf(ss / (float)dv + norm_eps);
            const float *z = xp + zoff + h * dv;
            for (j = 0; j < dv; j++) o[j] = norm_w[j] * (o[j] * rn);
            for (j = 0; j + 8 <= dv; j += 8) st8_(op + h * dv + j, ld8_(o + j) * silu8_(ld8_(z + j)));
            if (j < dv) stn_(op + h * dv + j, ldn_(o + j, dv - j, 0.0f) * silu8_(ldn_(z + j, dv - j, 0.0f)), dv - j);
        }
    }
}

int nextn_gdn_step_f32(int64_t N, int64_t T, const float *proj, int64_t proj_row, const float *convw,
                       float *conv, int64_t conv_slot, int64_t conv_win, float *rec, int64_t rec_slot,
                       int64_t rec_win, const int64_t *slots, const int64_t *read, const int64_t *write0,
                       const float *neg_a, const float *dt_bias, const float *norm_w, float norm_eps, float qscale,
                       int64_t C, int64_t Kc, int64_t nk, int64_t dk, int64_t nv, int64_t dv, int64_t record,
                       const int64_t *lens, const int64_t *bend, const int64_t *bslot, int64_t B, float *out) {
    if (Kc < 2 || Kc > MAX_KC || nk < 1 || nv % nk != 0 || B < 0 || (B > 0 && (record || !bend || !bslot))) return 1;
    gdn_job_ j = {N, T, proj_row, conv_slot, conv_win, rec_slot, rec_win, C, Kc, nk, dk, nv, dv, record != 0, proj,
                  convw, neg_a, dt_bias, norm_w, conv, rec, out, norm_eps, qscale, slots, read, write0, lens, bend,
                  bslot, B};
    /* rows are independent; the work estimate counts the recurrence's serial latency (a token step costs about
     * what 8x its multiply-adds cost in a GEMM) */
    nextn_par_(gdn_row_, &j, N, N * T * (nv * dk * dv * 3 + C * Kc) * 8);
    return 0;
}
