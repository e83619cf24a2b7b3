"""Chunked gated delta rule for prefill over the state pool: N rows x T tokens in chunks of 64 (the WY / UT-transform
chunk form), each row starting from its recurrent state in the pool and writing its final state back.

The math per value head (gdn.py `gdn_chunked`, the twin's core): within a chunk of C tokens with start state S
(fp32 [dk, dv]), cumulative log decay G_t = g_1 + ... + g_t and decay[t, s] = exp(G_t - G_s) (s <= t),
    A[t, s] = beta_t (k_t . k_s) decay[t, s] for s < t        (strictly lower triangular)
    T = (I + A)^-1                                            (the UT transform, by forward substitution)
    U = T (beta V),  W = T (beta exp(G) K)                    (the WY form of the chunk's updates)
    D = U - W S                                               (the deltas, given the start state)
    O = exp(G) (Q S) + (Q K^T * decay) D                      (causal within the chunk)
    S <- exp(G_C) S + (K * exp(G_C - G))^T D
Written here from that recurrence (tests check it against the token-by-token step, gdn.py `gdn_recurrent_step`).

Pool and grid contract: rec [S, W, nv, dk, dv] fp32; row i reads rec[slot[i], cur[i]] before anything is written
and writes its state after its last token to rec[slot[i], dst[i]] (dst may equal cur). Row i has lens[i] <= T
tokens (the rest of its T columns is padding: not read past lens[i], not written). Chunks are counted from the
row's first token and restart at each block boundary the caller names (`bounds`: where a new prefill-grid block
starts inside the row), so a row carrying several grid blocks of one prompt runs each block's chunks exactly as a
call of that block alone would: a prompt prefilled in one call or in calls split at its block boundaries gives
bitwise the same outputs and states. The state at a boundary is written to the window slot `keep` names for it (the
prefix cache keeps each block's state), and a row's result never depends on the other rows (one program per (row,
value head, dv block) walks that row's chunks in order).

Twin: `chunked_gdn_ref` (gdn.py `gdn_chunked` per block of each row, fp32). Called through ops.gdn_prefill by the
model's GDN layers (engine/model/qwen35.py `GatedDeltaNet._prefill_kernel`) in every host prefill forward on the
kernel path (`FwdCtx.prefill_kernels`): the grid blocks a session is granted in a step, one row
(engine/session.py `next_chunks`), with the row's block boundaries from `FwdCtx.seg`.
"""
from __future__ import annotations

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton
from .gdn import gdn_chunked
from .gdn_update import _expand_qk

CHUNK = launch.choose("gdn_prefill", torch.float32, None, dk=128, dv=128)["CHUNK"]  # 64 on every device
NO_BOUND = 2 ** 30  # a `bounds` pad: past every row's tokens


def chunked_gdn_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, dst: torch.Tensor,
                    lens: torch.Tensor | None = None, qk_l2norm: bool = False, bounds: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `chunked_gdn` (same arguments): o [N, T, nv, dv] fp32 (zeros past lens[i]); writes rec[slot, dst] and
    the kept boundary states rec[slot, keep[i, j]]. Each block between row i's bounds runs as its own call would."""
    N, T = q.shape[:2]
    qe, ke = _expand_qk(q, k, v.shape[2], qk_l2norm)  # fp32 [N, T, nv, dk]
    n_tok = [T] * N if lens is None else lens.tolist()
    slot, cur, dst = slot.to(torch.int64), cur.to(torch.int64), dst.to(torch.int64)
    start = rec[slot, cur]  # [N, nv, dk, dv]: every row's state read before any write
    o = torch.zeros(N, T, v.shape[2], v.shape[3], dtype=rec.dtype, device=q.device)
    for i, n in enumerate(n_tok):
        cuts = [] if bounds is None else [int(b) for b in bounds[i].tolist() if 0 < b < n]
        slots = [] if keep is None else [int(w) for w in keep[i].tolist()]
        si = start[i:i + 1]  # [1, nv, dk, dv]
        for j, (a, e) in enumerate(zip([0] + cuts, cuts + [n])):
            row = [t[i:i + 1, a:e] for t in (qe, ke)] + [t[i:i + 1, a:e].to(rec.dtype) for t in (v, g, beta)]
            oi, si = gdn_chunked(*row, si, chunk=CHUNK)
            o[i, a:e] = oi[0]
            if e < n and slots[j] >= 0:
                rec[slot[i], slots[j]] = si[0]
        rec[slot[i], dst[i]] = si[0]
    return o


if HAS_TRITON:
    from ._triton import cast_rn, mm

    @triton.jit(do_not_specialize=["T"])
    def _gdn_chunk_kernel(q, k, v, g, beta, rec, slot, cur, dst, lens, bounds, keep, o, T, NV, R, scale,
                          sqn, sqt, sqh, skn, skt, skh, svn, svt, svh, sgn, sgt, sbn, sbt, srs, srw, srh,
                          son, sot, soh, sbd, skp,
                          DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, L2NORM: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        i = pid // NV
        h = pid % NV
        kh = h // R
        i64 = i.to(tl.int64)
        dk = tl.arange(0, BK)
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        k_ok = dk < DK
        v_ok = dv < DV
        s_ok = k_ok[:, None] & v_ok[None, :]
        r = tl.arange(0, CHUNK)  # token within the chunk
        lower = r[:, None] > r[None, :]
        incl = r[:, None] >= r[None, :]
        s = tl.load(slot + i).to(tl.int64)
        n = tl.load(lens + i).to(tl.int32)
        st = rec + s * srs + h * srh + dk[:, None] * DV + dv[None, :]
        S = tl.load(st + tl.load(cur + i).to(tl.int64) * srw, mask=s_ok, other=0.0).to(tl.float32)  # [BK, BV]
        c = n * 0  # the chunk's first token (int32, carried by the loop)
        jb = c  # the next block boundary's index in bounds[i]
        nb = tl.load(bounds + i64 * sbd).to(tl.int32)  # its offset in the row (past n: none left)
        while c < n:
            e = tl.minimum(tl.minimum(c + CHUNK, n), nb)  # chunks restart at every block boundary
            t = c + r
            t_ok = t < e
            qk_mask = t_ok[:, None] & k_ok[None, :]
            Q = tl.load(q + i64 * sqn + t[:, None] * sqt + kh * sqh + dk[None, :], mask=qk_mask, other=0.0)
            K = tl.load(k + i64 * skn + t[:, None] * skt + kh * skh + dk[None, :], mask=qk_mask, other=0.0)
            Q, K = Q.to(tl.float32), K.to(tl.float32)  # [C, BK] each
            if L2NORM:
                Q = Q * (tl.rsqrt(tl.sum(Q * Q, axis=1) + 1e-6) * scale)[:, None]
                K = K * tl.rsqrt(tl.sum(K * K, axis=1) + 1e-6)[:, None]
            V = tl.load(v + i64 * svn + t[:, None] * svt + h * svh + dv[None, :], mask=t_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)  # [C, BV]
            gl = tl.load(g + i64 * sgn + t * sgt + h, mask=t_ok, other=0.0).to(tl.float32)  # padding: no decay
            b = tl.load(beta + i64 * sbn + t * sbt + h, mask=t_ok, other=0.0).to(tl.float32)  # padding: no update
            G = tl.cumsum(gl, axis=0)  # [C]
            decay = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)  # [C, C]
            kkt = mm(K, tl.trans(K), tl.zeros((CHUNK, CHUNK), tl.float32), IEEE)
            A = tl.where(lower, b[:, None] * kkt * decay, 0.0)
            Ti = tl.zeros((CHUNK, CHUNK), tl.float32)  # (I + A)^-1, row by row (forward substitution)
            for j in range(CHUNK):
                a_j = tl.sum(tl.where(r[:, None] == j, A, 0.0), axis=0)  # row j of A
                row = (r == j).to(tl.float32) - tl.sum(a_j[:, None] * Ti, axis=0)
                Ti = tl.where(r[:, None] == j, row[None, :], Ti)
            eg = tl.exp(G)
            U = mm(Ti, b[:, None] * V, tl.zeros((CHUNK, BV), tl.float32), IEEE)
            Wm = mm(Ti, (b * eg)[:, None] * K, tl.zeros((CHUNK, BK), tl.float32), IEEE)
            D = U - mm(Wm, S, tl.zeros((CHUNK, BV), tl.float32), IEEE)  # [C, BV]
            qkt = mm(Q, tl.trans(K), tl.zeros((CHUNK, CHUNK), tl.float32), IEEE) * decay
            O = mm(qkt, D, eg[:, None] * mm(Q, S, tl.zeros((CHUNK, BV), tl.float32), IEEE), IEEE)
            tl.store(o + i64 * son + t[:, None] * sot + h * soh + dv[None, :], cast_rn(O, o.dtype.element_ty),
                     mask=t_ok[:, None] & v_ok[None, :])
            g_end = tl.sum(tl.where(r == CHUNK - 1, G, 0.0), axis=0)  # G at the chunk's last valid token
            Kd = K * tl.exp(g_end - G)[:, None]
            S = mm(tl.trans(Kd), D, S * tl.exp(g_end), IEEE)
            at_b = e == nb  # a block ends inside the row: keep its state where asked (window slot >= 0), go on
            w = tl.where(at_b, tl.load(keep + i64 * skp + jb).to(tl.int64), -1)  # -1: nothing to keep here
            tl.store(st + tl.maximum(w, 0) * srw, S, mask=s_ok & ((dk[:, None] * 0 + w) >= 0))
            jb = tl.where(at_b, jb + 1, jb)
            nb = tl.load(bounds + i64 * sbd + jb).to(tl.int32)  # a row's bounds end with a pad: jb stays in range
            c = e
        tl.store(st + tl.load(dst + i).to(tl.int64) * srw, S, mask=s_ok)


def chunked_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, dst: torch.Tensor,
                lens: torch.Tensor | None = None, qk_l2norm: bool = False, out_dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None, bounds: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: the chunked gated delta rule over N rows x T tokens, states in the pool (module docstring).

    q, k [N, T, nk, dk]: l2-normed (q scaled by dk^-0.5) or, with qk_l2norm=True, raw (normalised in fp32 per
    token); v [N, T, nv, dv] (value head h uses key head h // (nv / nk)); g (log decay), beta [N, T, nv];
    last dims contiguous; rec [S, W, nv, dk, dv] fp32 contiguous; slot, cur, dst [N] int; lens [N] int
    (None: T for every row). bounds [N, B] int32 (None: no bounds): row i's block boundaries, the offsets in the row
    where a new prefill-grid block starts, ascending, padded with values > T, every row with at least one pad: the
    chunking restarts at each, so every block computes what it computes alone in a call of its own; keep [N, B]
    int32: the window slot that receives the state at boundary j of row i (-1: not kept; never cur[i]).
    Returns o [N, T, nv, dv] in out_dtype (columns past lens[i] not written; `out`: a preallocated o); writes
    rec[slot[i], dst[i]] and the kept states. No host sync."""
    check_triton(q, k, v)
    N, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    assert rec.dtype == torch.float32 and rec.is_contiguous() and rec.shape[2:] == (nv, dk, dv)
    assert nv % nk == 0, (q.shape, v.shape)
    for t_ in (q, k, v):
        assert t_.stride(-1) == 1, "last dim must be contiguous"
    o = out if out is not None else torch.empty(N, T, nv, dv, dtype=out_dtype, device=q.device)
    if N == 0 or T == 0:
        return o
    if lens is None:
        lens = torch.full((N,), T, dtype=torch.int32, device=q.device)
    if bounds is None:
        bounds = torch.full((N, 1), NO_BOUND, dtype=torch.int32, device=q.device)
        keep = torch.full((N, 1), -1, dtype=torch.int32, device=q.device)
    assert keep is not None and keep.shape == bounds.shape and bounds.stride(1) == keep.stride(1) == 1
    cfg = launch.get("gdn_prefill", v.dtype, q.device, dk=dk, dv=dv)
    _gdn_chunk_kernel[(N * nv, cdiv(dv, cfg["BV"]))](
        q, k, v, g, beta, rec, slot, cur, dst, lens, bounds, keep, o, T, nv, nv // nk, dk ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), rec.stride(0), rec.stride(1),
        rec.stride(2), o.stride(0), o.stride(1), o.stride(2), bounds.stride(0), keep.stride(0), DK=dk, DV=dv, L2NORM=qk_l2norm, **cfg.kwargs())
    return o
