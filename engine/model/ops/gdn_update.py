"""Gated DeltaNet over the state pool: the recurrent update of T = 1..W new tokens per row (decode, verify,
per-position states kept for rollback), the causal depthwise conv1d update, and the chunked prefill choice.

Pool layout (pool_layout.md): rec [S, W, nv, dk, dv] fp32, conv [S, W, C, Kc-1] (model dtype); row i reads
its live state at slot[i], cur[i] *before* anything is written, and the state after its new token t goes to
slot t (rec[slot[i], t], conv[slot[i], t]) for every t < T, padding tokens included (dead slots).
Each kernel program owns one (row, head, dv block) / (row, channel block) region and reads its initial state
into registers before it writes any slot, so slot t == cur[i] is safe. Rows must not share a slot (give
bucket-padding rows a scratch slot of their own).

Contract (batch invariance): the kernels run the same per-token update, in the same order, for every T, so
T single-token launches (each reading the previous launch's slot 0) give bitwise the states and outputs of
one T-token launch, whatever the other rows are.

Twins: `gdn_update_ref` / `conv_update_ref`, built on gdn.py's `gdn_recurrent_step` / `causal_conv_window`
(the twin conv rounds in the model dtype after each tap; the kernel sums the taps in fp32 and rounds once).

Chunked GDN for prefill (`gdn_prefill`): the choice, and why.
  * Prefill is shared by plain and speculative decoding (both paths prefill a prompt with the same chunking),
    so its rounding never has to match the per-token recurrence: any correct kernel is exact-safe, as long
    as the runtime chunks a prompt the same way whatever else is in the round.
  * Default: our torch chunked (WY) form, `gdn.gdn_chunked`: it is tested against the recurrence in CI, runs
    on every device, and needs no extra package.
  * Opt-in `backend="fla"`: fla-core's `chunk_gated_delta_rule` (the Hopper-tuned triton kernel vLLM and
    SGLang run for this model). It is not the default because it cannot be tested here (no GPU; fla-core
    next to triton on a CPU machine breaks transformers' Qwen3.5, see environment.md section 3), it has to
    travel to the GPU machine as a wheel, and it is an extra dependency for a path whose speed only matters
    for long prompts.
  * Our own Triton chunk kernel over the state pool is gdn_prefill.py (the same WY form, chunks on the
    prefill grid); bench/gpu.py times it at the 9B shape.
"""
from __future__ import annotations

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton
from .gdn import causal_conv_window, gdn_chunked, gdn_recurrent, l2norm


def _expand_qk(q: torch.Tensor, k: torch.Tensor, nv: int, qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, nk, dk] -> fp32 [N, T, nv, dk] (value head h uses key head h // (nv / nk)), optionally l2-normed
    (q also scaled by dk^-0.5)."""
    r = nv // q.shape[2]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(sdt).repeat_interleave(r, dim=2), k.to(sdt).repeat_interleave(r, dim=2)
    if qk_l2norm:
        q, k = l2norm(q) * (q.shape[-1] ** -0.5), l2norm(k)
    return q, k


def gdn_update_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, qk_l2norm: bool = False) -> torch.Tensor:
    """Twin of `gdn_update` (same arguments): returns o [N, T, nv, dv] in rec's dtype, writes rec[slot, t]."""
    N, T = q.shape[:2]
    q, k = _expand_qk(q, k, v.shape[2], qk_l2norm)
    sdt = rec.dtype
    slot, cur = slot.to(torch.int64), cur.to(torch.int64)
    state = rec[slot, cur]  # [N, nv, dk, dv] (a copy: read before any write)
    states = torch.empty(T, *state.shape, dtype=sdt, device=rec.device)
    o, _ = gdn_recurrent(q, k, v.to(sdt), g.to(sdt), beta.to(sdt), state, states)
    rec[slot[:, None], torch.arange(T, device=rec.device)[None, :]] = states.transpose(0, 1)
    return o


def conv_update_ref(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                    cur: torch.Tensor) -> torch.Tensor:
    """Twin of `conv_update` (same arguments): returns SiLU(conv) y [N, T, C] in x's dtype, writes conv[slot, t]."""
    T = x.shape[1]
    kc = weight.shape[-1]
    slot, cur = slot.to(torch.int64), cur.to(torch.int64)
    y, window = causal_conv_window(x.transpose(1, 2), conv[slot, cur], weight.to(x.dtype))  # [N, C, T], [N, C, Kc-1+T]
    states = window.unfold(-1, kc - 1, 1)[:, :, 1:T + 1]  # [N, C, T, Kc-1]: state after token t
    conv[slot[:, None], torch.arange(T, device=x.device)[None, :]] = states.transpose(1, 2).to(conv.dtype)
    return y.transpose(1, 2)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor | None, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GDN for prefill (see the module docstring for the choice). q, k [B, T, nv, dk] (l2-normed, q
    scaled, heads already expanded to nv), v [B, T, nv, dv], g, beta [B, T, nv], state [B, nv, dk, dv] fp32 or
    None -> (o [B, T, nv, dv] fp32, final state). backend "torch" (default) or "fla" (CUDA + fla-core)."""
    if backend == "torch":
        return gdn_chunked(q, k, v, g, beta, state)
    if backend != "fla":
        raise ValueError(f"unknown GDN prefill backend {backend!r} (torch, fla)")
    if not q.is_cuda:
        raise ValueError("the fla GDN prefill backend needs CUDA tensors")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional; never imported on CPU

    o, s = chunk_gated_delta_rule(q, k, v, g.float(), beta.float(), scale=1.0, initial_state=state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=False)
    return o.float(), s


if HAS_TRITON:
    from ._triton import cast_rn

    @triton.jit(do_not_specialize=["T"])
    def _gdn_kernel(q, k, v, g, beta, rec, slot, cur, o, T, NV, R, scale,
                    sqn, sqt, sqh, skn, skt, skh, svn, svt, svh, sgn, sgt, sbn, sbt, srs, srw, srh, son, sot, soh,
                    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr):
        pid = tl.program_id(0)
        i = pid // NV
        h = pid % NV
        kh = h // R
        dk = tl.arange(0, BK)
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        k_ok = dk < DK
        v_ok = dv < DV
        s_ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(slot + i).to(tl.int64)
        c0 = tl.load(cur + i).to(tl.int64)
        st = rec + s * srs + h * srh + dk[:, None] * DV + dv[None, :]
        S = tl.load(st + c0 * srw, mask=s_ok, other=0.0).to(tl.float32)  # [BK, BV], read before any write
        i64 = i.to(tl.int64)
        for t in range(T):
            qt = tl.load(q + i64 * sqn + t * sqt + kh * sqh + dk, mask=k_ok, other=0.0).to(tl.float32)
            kt = tl.load(k + i64 * skn + t * skt + kh * skh + dk, mask=k_ok, other=0.0).to(tl.float32)
            if L2NORM:
                qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6) * scale
                kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
            vt = tl.load(v + i64 * svn + t * svt + h * svh + dv, mask=v_ok, other=0.0).to(tl.float32)
            gt = tl.load(g + i64 * sgn + t * sgt + h).to(tl.float32)
            bt = tl.load(beta + i64 * sbn + t * sbt + h).to(tl.float32)
            S = S * tl.exp(gt)
            u = tl.sum(kt[:, None] * S, axis=0)  # [BV]
            delta = bt * (vt - u)
            S = S + kt[:, None] * delta[None, :]
            ot = tl.sum(qt[:, None] * S, axis=0)
            tl.store(o + i64 * son + t * sot + h * soh + dv, cast_rn(ot, o.dtype.element_ty), mask=v_ok)
            tl.store(st + t * srw, S, mask=s_ok)

    @triton.jit(do_not_specialize=["T"])
    def _conv_kernel(x, conv, w, slot, cur, y, T, C, sxn, sxt, scs, scw, scc, swc, syn, syt,
                     KC: tl.constexpr, BC: tl.constexpr):
        tl.static_assert(KC == 4, "conv_update kernel: Kc == 4 (every Qwen3.5 config)")
        i = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = c < C
        s = tl.load(slot + i).to(tl.int64)
        c0 = tl.load(cur + i).to(tl.int64)
        base = conv + s * scs + c * scc
        s0 = tl.load(base + c0 * scw, mask=ok, other=0.0).to(tl.float32)  # oldest input, read before any write
        s1 = tl.load(base + c0 * scw + 1, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(base + c0 * scw + 2, mask=ok, other=0.0).to(tl.float32)
        w0 = tl.load(w + c * swc, mask=ok, other=0.0).to(tl.float32)
        w1 = tl.load(w + c * swc + 1, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w + c * swc + 2, mask=ok, other=0.0).to(tl.float32)
        w3 = tl.load(w + c * swc + 3, mask=ok, other=0.0).to(tl.float32)  # multiplies the current token
        for t in range(T):
            xt = tl.load(x + i * sxn + t * sxt + c, mask=ok, other=0.0).to(tl.float32)
            acc = s0 * w0
            acc = acc + s1 * w1
            acc = acc + s2 * w2
            acc = acc + xt * w3
            yt = acc / (1.0 + tl.exp(-acc))
            tl.store(y + i * syn + t * syt + c, cast_rn(yt, y.dtype.element_ty), mask=ok)
            s0 = s1
            s1 = s2
            s2 = xt
            tl.store(base + t * scw, cast_rn(s0, conv.dtype.element_ty), mask=ok)
            tl.store(base + t * scw + 1, cast_rn(s1, conv.dtype.element_ty), mask=ok)
            tl.store(base + t * scw + 2, cast_rn(s2, conv.dtype.element_ty), mask=ok)


def gdn_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, qk_l2norm: bool = False,
               out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: gated delta rule over T new tokens per row, state in the pool.

    q, k [N, T, nk, dk]: l2-normed (q scaled by dk^-0.5) or, with qk_l2norm=True, raw (the kernel normalises
    in fp32, per token, per row); v [N, T, nv, dv]; g (log decay), beta [N, T, nv]; last dims contiguous;
    rec [S, W, nv, dk, dv] fp32 contiguous; slot, cur [N] int. Returns o [N, T, nv, dv] (out_dtype);
    writes rec[slot[i], t] for t < T. `out`: a preallocated o (e.g. a CUDA-graph static buffer). No host sync."""
    check_triton(q, k, v)
    N, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    assert rec.dtype == torch.float32 and rec.is_contiguous() and rec.shape[2:] == (nv, dk, dv)
    assert nv % nk == 0 and T <= rec.shape[1], (q.shape, v.shape, rec.shape)
    for t_ in (q, k, v):
        assert t_.stride(-1) == 1, "last dim must be contiguous"
    o = out if out is not None else torch.empty(N, T, nv, dv, dtype=out_dtype, device=q.device)
    if N == 0 or T == 0:
        return o
    cfg = launch.get("gdn_update", rec.dtype, q.device, dk=dk, dv=dv)  # BV dv columns of the state per program
    grid = (N * nv, cdiv(dv, cfg["BV"]))
    _gdn_kernel[grid](q, k, v, g, beta, rec, slot, cur, o, T, nv, nv // nk, dk ** -0.5,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
                      rec.stride(0), rec.stride(1), rec.stride(2), o.stride(0), o.stride(1), o.stride(2),
                      DK=dk, DV=dv, L2NORM=qk_l2norm, **cfg.kwargs())
    return o


def conv_update(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                cur: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: causal depthwise conv1d + SiLU over T new inputs per row, window state in the pool.

    x [N, T, C] raw (pre-conv) in_proj_qkv output (last dim contiguous); conv [S, W, C, Kc-1] contiguous;
    weight [C, Kc] (tap Kc-1 multiplies the current token; Kc == 4); slot, cur [N] int. Returns y [N, T, C]
    in x's dtype (taps summed in fp32 in tap order); writes conv[slot[i], t] = the last Kc-1 inputs after
    token t. `out`: a preallocated y. No host sync."""
    check_triton(x, conv)
    N, T, C = x.shape
    kc = weight.shape[-1]
    if kc != 4:
        raise NotImplementedError(f"conv_update kernel supports Kc == 4 (got {kc}); use conv_update_ref")
    assert conv.is_contiguous() and conv.shape[2:] == (C, kc - 1) and T <= conv.shape[1]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    y = out if out is not None else torch.empty(N, T, C, dtype=x.dtype, device=x.device)
    if N == 0 or T == 0:
        return y
    cfg = launch.get("conv_update", x.dtype, x.device)
    _conv_kernel[(N, cdiv(C, cfg["BC"]))](x, conv, weight, slot, cur, y, T, C, x.stride(0), x.stride(1),
                                          conv.stride(0), conv.stride(1), conv.stride(2), weight.stride(0),
                                          y.stride(0), y.stride(1), KC=kc, **cfg.kwargs())
    return y
