"""Attention of 1..W new queries per sequence over that sequence's cached K/V in the state pool (GQA, optional
fused output gate), batched over sequences: the decode / verify / MTP-draft attention.

Layout (pool_layout.md): q [N, T, nh, hd] (post q_norm + RoPE); k_cache, v_cache [S, L, nkv, hd] with the new
tokens' K/V already written at k_cache[slot[i], pos0[i] + t] (`write_kv`); query t of row i (absolute position
pos0[i] + t) attends keys [0, pos0[i] + t] of slot[i]; query head h uses kv head h // (nh / nkv).

Contract (batch invariance): query t of row i gives bitwise the same output whether it is launched at T = 1
(pos0' = pos0 + t) or inside a T = W launch, and whatever the other rows are. How:
  * the KV split of a query depends only on its own key count n = pos0 + t + 1: `nsplit` splits of
    `chunk(n) = max(MIN_CHUNK, round_up(cdiv(n, nsplit), BLOCK_N))` keys, chunk boundaries on absolute
    multiples of BLOCK_N, so the query's keys are visited in the same blocks in the same order in any launch;
  * a block that holds none of a query's keys (it is there for other queries of the tile) leaves that
    query's running max, sum and accumulator exactly unchanged (p = 0, rescale factor exactly 1);
  * per-query rows of a tile are independent (MMA rows; under the interpreter an explicit per-row product);
  * the splits are merged by a second kernel in split order.
The tile shape (BLOCK_M query rows x BLOCK_N keys) comes from the launch table (launch.py: per dtype, head_dim
and device, so fixed per process), never derived from T or N.

Twin: `attention_ref` (fp32 softmax, output cast to q's dtype, then `* sigmoid(gate)` in that dtype).
"""
from __future__ import annotations

import math

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton

ATTN_MIN_CHUNK = 256  # fewest keys per split (short contexts use one split); a multiple of every BLOCK_N
ATTN_SPLITS = 32  # most splits per query; keep it fixed for a process (it is part of the rounding)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor,
             pos0: torch.Tensor) -> None:
    """Scatter new K/V [N, T, nkv, hd] to k_cache/v_cache[slot[i], pos0[i] + t] (device-side, no host sync)."""
    T = k.shape[1]
    pos = pos0.to(torch.int64)[:, None] + torch.arange(T, device=k.device)  # [N, T]
    s = slot.to(torch.int64)[:, None].expand_as(pos)
    k_cache[s, pos] = k.to(k_cache.dtype)
    v_cache[s, pos] = v.to(v_cache.dtype)


def attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                  pos0: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: o [N, T, nh, hd] in q's dtype; `gate` [N, T, nh, hd] multiplies by sigmoid(gate) (in q's dtype)."""
    N, T, nh, hd = q.shape
    r = nh // k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    for i, (s, p0) in enumerate(zip(slot.tolist(), pos0.tolist())):
        n = p0 + T
        k = k_cache[s, :n].to(acc).repeat_interleave(r, dim=1)  # [n, nh, hd]
        v = v_cache[s, :n].to(acc).repeat_interleave(r, dim=1)
        sc = torch.einsum("thd,nhd->htn", q[i].to(acc), k) * scale  # [nh, T, n]
        causal = torch.arange(n, device=q.device)[None, :] <= (p0 + torch.arange(T, device=q.device))[:, None]
        p = torch.softmax(sc.masked_fill(~causal, float("-inf")), dim=-1)
        out[i] = torch.einsum("htn,nhd->thd", p, v).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out


if HAS_TRITON:
    from ._triton import cast_rn, mm

    @triton.jit
    def _chunk(n, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
        """Keys per split for a query with n keys: a function of n alone."""
        c = (n + NSPLIT - 1) // NSPLIT
        c = (c + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        return tl.maximum(c, MIN_CHUNK)

    @triton.jit
    def query_tile(slot, pos0, T, NKV, R, BLOCK_M: tl.constexpr):
        """The query tile of program (row i * NKV + kv head j, tile): BLOCK_M flat (query t, head-in-group) rows
        of row i. Returns (i, j, pool slot s, t [BM], query head h [BM], row valid [BM], key count n_t [BM])."""
        pid = tl.program_id(0)
        i = pid // NKV
        j = pid % NKV
        s = tl.load(slot + i).to(tl.int64)
        f = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        t = f // R
        h = j * R + f % R
        n_t = tl.load(pos0 + i).to(tl.int32) + t + 1  # query t sees keys [0, pos0 + t]
        return i, j, s, t, h, f < T * R, n_t

    @triton.jit
    def online_block(qt, k_base, v_base, kk, hi, skl, svl, d, d_ok, valid, m_i, l_i, acc, sm_scale_log2,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """One block of keys kk [BN] (those >= hi not loaded) of the online softmax of the query tile qt [BM, BD],
        each query's scores masked to `valid` [BM, BN]: returns the new (running max, sum, accumulator [BM, BD]).
        A query with no valid key in the block keeps all three exactly (p = 0, the rescale factor exactly 1)."""
        kv_ok = kk < hi
        kt = tl.load(k_base + kk[None, :].to(tl.int64) * skl + d[:, None],
                     mask=kv_ok[None, :] & d_ok[:, None], other=0.0)  # [BD, BN]
        sc = mm(qt, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE) * sm_scale_log2
        sc = tl.where(valid, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new > m_i, tl.exp2(m_i - m_use), 1.0)  # exactly 1 when the max did not move
        p = tl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + kk[:, None].to(tl.int64) * svl + d[None, :],
                     mask=kv_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
        acc = mm(cast_rn(p, vt.dtype), vt, acc * alpha[:, None], IEEE)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["T"])
    def _attn_split_kernel(q, kc, vc, slot, pos0, part_o, part_ml, T, NKV, R, NH, sm_scale_log2,
                           sqn, sqt, sqh, sks, skl, skh, svs, svl, svh,
                           HD: tl.constexpr, NSPLIT: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        i, j, s, t, h, m_ok, n_t = query_tile(slot, pos0, T, NKV, R, BLOCK_M)
        c = tl.program_id(2)
        chunk = _chunk(n_t, NSPLIT, BLOCK_N, MIN_CHUNK)
        lo_t = c * chunk
        hi_t = tl.minimum(lo_t + chunk, n_t)
        live = m_ok & (lo_t < n_t)
        lo = tl.min(tl.where(live, lo_t, 2147483647), axis=0)
        hi = tl.max(tl.where(live, hi_t, 0), axis=0)
        if lo >= hi:  # no query of this tile has keys in split c: nothing to write, nothing will be read
            return
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        q_ptr = q + i.to(tl.int64) * sqn + t[:, None] * sqt + h[:, None] * sqh + d[None, :]
        qt = tl.load(q_ptr, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        k_base = kc + s * sks + j * skh
        v_base = vc + s * svs + j * svh
        for b in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            kk = b + tl.arange(0, BLOCK_N)
            valid = (kk[None, :] >= lo_t[:, None]) & (kk[None, :] < hi_t[:, None])
            m_i, l_i, acc = online_block(qt, k_base, v_base, kk, hi, skl, svl, d, d_ok, valid, m_i, l_i, acc,
                                         sm_scale_log2, BLOCK_M, BLOCK_N, IEEE)
        row = ((i * T + t).to(tl.int64) * NH + h) * NSPLIT + c  # [BM] index into [N, T, nh, NSPLIT]
        tl.store(part_o + row[:, None] * HD + d[None, :], acc, mask=live[:, None] & d_ok[None, :])
        tl.store(part_ml + row * 2, m_i, mask=live)
        tl.store(part_ml + row * 2 + 1, l_i, mask=live)

    @triton.jit(do_not_specialize=["T"])
    def _attn_merge_kernel(part_o, part_ml, pos0, gate, o, T, NH, sgn, sgt, sgh, son, sot, soh,
                           HD: tl.constexpr, NSPLIT: tl.constexpr, MIN_CHUNK: tl.constexpr, SPLIT_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, GATED: tl.constexpr):
        pid = tl.program_id(0)  # (i, t, h)
        h = pid % NH
        t = (pid // NH) % T
        i = pid // (NH * T)
        n = tl.load(pos0 + i).to(tl.int32) + t + 1
        chunk = _chunk(n, NSPLIT, SPLIT_N, MIN_CHUNK)  # SPLIT_N: the split kernel's BLOCK_N
        nc = (n + chunk - 1) // chunk
        base = pid.to(tl.int64) * NSPLIT
        m_max = tl.load(part_ml + base * 2)
        for c in range(1, nc):
            m_max = tl.maximum(m_max, tl.load(part_ml + (base + c) * 2))
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        acc = tl.zeros((BLOCK_D,), tl.float32)
        l = tl.zeros_like(m_max)
        for c in range(0, nc):
            w = tl.exp2(tl.load(part_ml + (base + c) * 2) - m_max)
            l += w * tl.load(part_ml + (base + c) * 2 + 1)
            acc += w * tl.load(part_o + (base + c) * HD + d, mask=d_ok, other=0.0)
        y = cast_rn(acc / l, o.dtype.element_ty)
        if GATED:
            g = tl.load(gate + i.to(tl.int64) * sgn + t * sgt + h * sgh + d, mask=d_ok, other=0.0).to(tl.float32)
            sig = cast_rn(1.0 / (1.0 + tl.exp(-g)), o.dtype.element_ty)
            y = cast_rn(y.to(tl.float32) * sig.to(tl.float32), o.dtype.element_ty)
        tl.store(o + i.to(tl.int64) * son + t * sot + h * soh + d, y, mask=d_ok)


def check_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               gate: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Entry checks of the attention kernels' wrappers (dtypes, head shapes, contiguous last dims):
    returns (N, T, nh, hd, nkv)."""
    check_triton(q, k_cache, v_cache)
    N, T, nh, hd = q.shape
    nkv = k_cache.shape[2]
    assert nh % nkv == 0 and k_cache.shape[3] == hd and v_cache.shape == k_cache.shape
    for t_ in (q, k_cache, v_cache) + ((gate,) if gate is not None else ()):
        assert t_.stride(-1) == 1, "last dim must be contiguous"
    return N, T, nh, hd, nkv


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, pos0: torch.Tensor,
              scale: float, gate: torch.Tensor | None = None, nsplit: int = ATTN_SPLITS,
              min_chunk: int = ATTN_MIN_CHUNK, max_kv_len: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: o [N, T, nh, hd] (q's dtype) = softmax(q k^T * scale, causal per query) v [* sigmoid(gate)].

    q, gate [N, T, nh, hd] (last dim contiguous, other strides free: views of q_proj's output are fine);
    k_cache, v_cache [S, L, nkv, hd] (last dim contiguous); slot, pos0 [N] int32/int64 on q's device;
    the caller has written the new K/V (`write_kv`) and guarantees pos0[i] + T <= L. No host sync.
    `nsplit` (the most KV splits per query) and `min_chunk` (fewest keys per split, a multiple of the table's
    BLOCK_N) are part of the rounding: keep them the same for every launch whose outputs are compared.
    `max_kv_len` (default L): a bound on pos0 + T that only trims the grid (CUDA graphs: a static bound)."""
    N, T, nh, hd, nkv = check_args(q, k_cache, v_cache, gate)
    cfg = launch.get("attention", k_cache.dtype, q.device, hd=hd)
    assert min_chunk % cfg["BLOCK_N"] == 0, f"min_chunk must be a multiple of BLOCK_N ({cfg['BLOCK_N']})"
    R = nh // nkv
    o = out if out is not None else torch.empty(N, T, nh, hd, dtype=q.dtype, device=q.device)
    if N == 0 or T == 0:
        return o
    part_o = torch.empty(N * T * nh * nsplit * hd, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(N * T * nh * nsplit * 2, dtype=torch.float32, device=q.device)
    splits = min(nsplit, cdiv(max_kv_len if max_kv_len is not None else k_cache.shape[1], min_chunk))
    grid = (N * nkv, cdiv(T * R, cfg["BLOCK_M"]), splits)  # a query never has more than `splits` live splits
    _attn_split_kernel[grid](q, k_cache, v_cache, slot, pos0, part_o, part_ml, T, nkv, R, nh, scale * math.log2(math.e),
                             q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
                             k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                             HD=hd, NSPLIT=nsplit, MIN_CHUNK=min_chunk, IEEE=q.dtype == torch.float32,
                             **cfg.kwargs())
    g = gate if gate is not None else o
    _attn_merge_kernel[(N * T * nh,)](part_o, part_ml, pos0, g, o, T, nh, g.stride(0), g.stride(1), g.stride(2),
                                      o.stride(0), o.stride(1), o.stride(2), HD=hd, NSPLIT=nsplit,
                                      MIN_CHUNK=min_chunk, SPLIT_N=cfg["BLOCK_N"], GATED=gate is not None,
                                      **launch.get("attention/merge", k_cache.dtype, q.device, hd=hd).kwargs())
    return o
