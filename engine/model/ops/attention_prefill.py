"""Prefill attention over the state pool: N rows x T query tokens at positions pos0[i] + t, each attending the keys
[0, pos0[i] + t] of its pool slot (causal mask computed in the kernel, never materialised), GQA, with the fused
output gate of attention.py.

Layout (as attention.py): q, gate [N, T, nh, hd] (post q_norm + RoPE); k_cache, v_cache [S, L, nkv, hd] (engine/
cache.py KVPool) with the chunk's own K/V already written (`attention.write_kv`); query head h uses kv head
h // (nh / nkv). One program per (row, kv head, block of BLOCK_M flattened (token, head-in-group) query rows)
walks the keys from 0 in blocks of BLOCK_N at absolute multiples of BLOCK_N, with an online softmax.

Contract (the prefill grid's batch invariance): query t of row i gives bitwise the same output whatever T is,
wherever the chunk starts (pos0 alignment), and whatever the other rows are. How: every query visits the same
key blocks in the same order (from key 0, boundaries at absolute multiples of BLOCK_N: a fixed KV split, one
pass); a block that holds none of a query's keys (it is there for later queries of the tile) leaves that
query's running max, sum and accumulator exactly unchanged (p = 0, rescale factor exactly 1); the rows of a
tile are independent (MMA rows; under the interpreter an explicit per-row product). BLOCK_N comes from the
launch table (per dtype, head_dim and device: fixed per process), never from T or N.

Its rounding differs from the decode kernel's (attention.py splits the keys by the query's own key count):
prefill is shared by plain and speculative decoding, so it never has to match decode.

Twin: attention.py `attention_ref` (the same semantics). Called through ops.attention_prefill by the model's attention
layers (engine/model/qwen35.py `GatedAttention.forward`, trunk and MTP head) in every host prefill forward on the
kernel path (`FwdCtx.prefill_kernels`), after `write_kv` put the block's K/V in the pool.
"""
from __future__ import annotations

import math

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, tl, triton
from .attention import attention_ref, check_args

prefill_attention_ref = attention_ref  # the twin: the same arguments and semantics

if HAS_TRITON:
    from ._triton import cast_rn
    from .attention import online_block, query_tile

    @triton.jit(do_not_specialize=["T"])
    def _attn_prefill_kernel(q, kc, vc, gate, slot, pos0, o, T, NKV, R, sm_scale_log2,
                             sqn, sqt, sqh, sks, skl, skh, svs, svl, svh, sgn, sgt, sgh, son, sot, soh,
                             HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             GATED: tl.constexpr, IEEE: tl.constexpr):
        i, j, s, t, h, m_ok, n_t = query_tile(slot, pos0, T, NKV, R, BLOCK_M)  # query t: keys [0, n_t)
        i64 = i.to(tl.int64)
        hi = tl.max(tl.where(m_ok, n_t, 0), axis=0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        qt = tl.load(q + i64 * sqn + t[:, None] * sqt + h[:, None] * sqh + d[None, :],
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        k_base = kc + s * sks + j * skh
        v_base = vc + s * svs + j * svh
        for b in range(0, hi, BLOCK_N):  # blocks at absolute multiples of BLOCK_N, from key 0 for every query
            kk = b + tl.arange(0, BLOCK_N)
            causal = kk[None, :] < n_t[:, None]
            m_i, l_i, acc = online_block(qt, k_base, v_base, kk, hi, skl, svl, d, d_ok, causal, m_i, l_i, acc,
                                         sm_scale_log2, BLOCK_M, BLOCK_N, IEEE)
        y = cast_rn(acc / l_i[:, None], o.dtype.element_ty)
        out_mask = m_ok[:, None] & d_ok[None, :]
        if GATED:
            gv = tl.load(gate + i64 * sgn + t[:, None] * sgt + h[:, None] * sgh + d[None, :], mask=out_mask,
                         other=0.0).to(tl.float32)
            sig = cast_rn(1.0 / (1.0 + tl.exp(-gv)), o.dtype.element_ty)
            y = cast_rn(y.to(tl.float32) * sig.to(tl.float32), o.dtype.element_ty)
        tl.store(o + i64 * son + t[:, None] * sot + h[:, None] * soh + d[None, :], y, mask=out_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                      pos0: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: o [N, T, nh, hd] (q's dtype) = softmax(q k^T * scale, causal per query) v [* sigmoid(gate)].

    q, gate [N, T, nh, hd] (last dim contiguous); k_cache, v_cache [S, L, nkv, hd] (last dim contiguous) with the
    chunk's K/V written; slot, pos0 [N] int on q's device; the caller guarantees pos0[i] + T <= L. `out`: a
    preallocated o. No host sync."""
    N, T, nh, hd, nkv = check_args(q, k_cache, v_cache, gate)
    R = nh // nkv
    o = out if out is not None else torch.empty(N, T, nh, hd, dtype=q.dtype, device=q.device)
    if N == 0 or T == 0:
        return o
    cfg = launch.get("attention_prefill", k_cache.dtype, q.device, hd=hd)
    g = gate if gate is not None else o
    _attn_prefill_kernel[(N * nkv, cdiv(T * R, cfg["BLOCK_M"]))](
        q, k_cache, v_cache, g, slot, pos0, o, T, nkv, R, scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), g.stride(0), g.stride(1), g.stride(2),
        o.stride(0), o.stride(1), o.stride(2), HD=hd, GATED=gate is not None, IEEE=q.dtype == torch.float32,
        **cfg.kwargs())
    return o
