/* nextn CPU kernels: the greedy pick over rows of logits, as torch.argmax(dim=-1) picks (engine/model/ops/cpu.py
 * `argmax_or_none`; its twin is sample.argmax_ref): the lowest index of the row's maximum, where -0.0 ties +0.0;
 * a row holding a NaN picks its first NaN (torch takes NaN as larger than every number).
 *
 * One pass per row: 32 lanes (four independent sets of eight) each keep the largest value they have seen and the
 * first index holding it (a strictly larger value replaces both, so a lane keeps its earliest maximum), and note
 * NaNs; the lanes are then merged (a larger value, or the same value at a lower index) and the row's last V % 8
 * values follow in order. Rows under 32 values are scanned one value at a time.
 * A row with a NaN is scanned again for its first one. */
#include <stdint.h>

#include "cpu_vec.h"

/* lane set `a` takes x[i .. i + 8): a strictly larger value replaces the lane's value and index */
#define TAKE_(a, off)                                                                 \
    do {                                                                              \
        const v8 v = ld8_(x + i + (off));                                             \
        const v8i at = base + (off), gt = (v8i)(v > m[a]); /* false for a NaN */     \
        m[a] = (v8)(((v8i)v & gt) | ((v8i)m[a] & ~gt));                               \
        idx[a] = (at & gt) | (idx[a] & ~gt);                                          \
        nan_ |= (v8i)(v != v);                                                        \
    } while (0)

static int64_t argmax_row_(int64_t V, const float *x) {
    int64_t best = 0, i = 0;
    int nan = 0;
    if (V >= 32) {  /* four lane sets (independent chains), each starting from its own first chunk */
        const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
        v8 m[4];
        v8i idx[4], nan_ = {0}, base = lane;
        for (int a = 0; a < 4; a++) {
            m[a] = ld8_(x + 8 * a);
            idx[a] = lane + 8 * a;
            nan_ |= (v8i)(m[a] != m[a]);
        }
        for (i = 32; i + 32 <= V; i += 32) {
            base = lane + (int32_t)i;
            TAKE_(0, 0); TAKE_(1, 8); TAKE_(2, 16); TAKE_(3, 24);
        }
        for (; i + 8 <= V; i += 8) {
            base = lane + (int32_t)i;
            TAKE_(0, 0);
        }
        float bv = m[0][0];
        best = idx[0][0];
        for (int a = 0; a < 4; a++)  /* the largest value, at its lowest index */
            for (int l = 0; l < 8; l++) {
                nan |= nan_[l] != 0;
                if (m[a][l] > bv || (m[a][l] == bv && idx[a][l] < best)) {
                    bv = m[a][l];
                    best = idx[a][l];
                }
            }
        for (; i < V; i++) {  /* the tail: later indices, so only a strictly larger value wins */
            if (x[i] != x[i]) nan = 1;
            else if (x[i] > bv) {
                bv = x[i];
                best = i;
            }
        }
    } else {
        for (i = 0; i < V; i++) {
            if (x[i] != x[i]) nan = 1;
            else if (x[i] > x[best]) best = i;  /* a NaN at 0 is found below */
        }
    }
    if (nan)
        for (i = 0; i < V; i++)
            if (x[i] != x[i]) return i;
    return best;
}

/* out[r] = the greedy pick of row r of x [N, V] (rows ldx floats apart), 1 <= V < 2^31 */
int nextn_argmax_f32(int64_t N, int64_t V, const float *x, int64_t ldx, int64_t *out) {
    if (V < 1 || V >= ((int64_t)1 << 31)) return 1;
    for (int64_t r = 0; r < N; r++) out[r] = argmax_row_(V, x + r * ldx);
    return 0;
}
