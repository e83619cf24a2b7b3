"""Gated DeltaNet reference ops in pure torch: causal depthwise conv, recurrent step, chunked (WY) form.

The recurrence per value head, with state S [dk, dv] kept in fp32:
    S <- exp(g_t) * S;  u = S^T k_t;  delta = beta_t * (v_t - u);  S <- S + k_t delta^T;  o_t = S^T q_t
`gdn_recurrent_step` is that update for one token; `gdn_chunked` computes the same thing for a whole
sequence with the chunked (WY / UT-transform) formulation (prefill). Verify and decode both use the step,
so a K+1-token verify runs the same recurrence, in the same order, as K+1 single-token decodes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import as_dtype, const

#: `causal_conv_window` takes the unfolded-taps form up to this many tokens (rows x T) and slices per tap above;
#: both compute every output from the same products summed in the same order, so the bits are the same
UNFOLD_ROWS = 8


def causal_conv_window(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d + SiLU over new inputs with a carried window.

    x: [B, C, T] raw (pre-conv) channels of the new tokens; state: [B, C, Kc-1] the previous Kc-1 raw inputs;
    weight: [C, Kc] or the conv module's own [C, 1, Kc] (tap Kc-1 multiplies the current token). Returns
    (y [B, C, T] after SiLU, window [B, C, Kc-1+T] = cat(state, x)); the state after token t is
    window[..., t+1 : t+Kc]. The sum is an explicit, fixed-order sum over taps (((p0 + p1) + p2) + ...), so
    every T gives bitwise the same per-token result.
    """
    kc, (B, _, T) = weight.shape[-1], x.shape
    window = torch.cat([as_dtype(state, x.dtype), x], dim=-1)  # [B, C, Kc-1+T]
    w = weight if weight.dim() == 3 else weight[:, None, :]  # [C, 1, Kc]
    if B * T <= UNFOLD_ROWS:  # decode / verify: one product over the unfolded taps (few ops)
        taps = (window.unfold(-1, kc, 1) * w).unbind(-1)  # Kc x [B, C, T] (strided): tap j of every token
        acc = taps[0]
        for j in range(1, kc):
            acc = acc + taps[j]
    else:  # many tokens: contiguous slices per tap (strided taps would cost more than the ops they save)
        acc = window[..., 0:T] * w[..., 0]
        for j in range(1, kc):
            acc = acc + window[..., j:j + T] * w[..., j]
    return F.silu(acc), window


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    ss = torch.sum(x * x, -1, keepdim=True)  # [..., 1]
    return x * ss.add_(const(eps, x)).rsqrt_()


def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule.

    q, k: [B, H, dk] (l2-normed; q already scaled by dk^-0.5); v: [B, H, dv]; g (log decay <= 0), beta: [B, H];
    state: [B, H, dk, dv] fp32. All math in fp32. Returns (o [B, H, dv] fp32, new state [B, H, dk, dv]); the new
    state is written into `out` [B, H, dk, dv] when given (it may alias `state`'s storage: state is read first).
    """
    s = state * g.exp()[..., None, None]  # [B, H, dk, dv]
    u = (k.unsqueeze(-2) @ s).squeeze(-2)  # [B, H, dv]
    delta = beta[..., None] * (v - u)  # [B, H, dv]
    s = torch.add(s, k.unsqueeze(-1) * delta.unsqueeze(-2), out=out)  # [B, H, dk, dv]
    o = (q.unsqueeze(-2) @ s).squeeze(-2)  # [B, H, dv]
    return o, s


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, states_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule over T tokens.

    q, k: [B, T, H, dk]; v: [B, T, H, dv]; g, beta: [B, T, H]; state: [B, H, dk, dv] fp32.
    If `states_out` [T, B, H, dk, dv] is given, the state after token t is written to states_out[t].
    Returns (o [B, T, H, dv] fp32, final state).
    """
    outs = []
    for t in range(q.shape[1]):
        o, state = gdn_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        if states_out is not None:
            states_out[t].copy_(state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor | None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (same math as `gdn_recurrent`, different rounding), differentiable.

    Shapes as in `gdn_recurrent`; `state` None means zeros. Within a chunk with cumulative log decay G and
    start state S0, the per-token deltas solve (I + A) D = beta*V - beta*exp(G)*K S0 with
    A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t (unit lower triangular system); then
    O = exp(G) Q S0 + tril(Q K^T * exp(G_t - G_s)) D and S_end = exp(G_C) S0 + (K * exp(G_C - G))^T D.
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    f32 = torch.float32 if q.dtype != torch.float64 else torch.float64
    q, k, v, g, beta = (t.transpose(1, 2).to(f32) for t in (q, k, v, g, beta))  # [B, H, T, *]
    s = torch.zeros(B, H, dk, dv, dtype=f32, device=q.device) if state is None else state.to(f32)
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk]
        gc, bc = g[:, :, c0:c0 + chunk], beta[:, :, c0:c0 + chunk]
        C = qc.shape[2]
        G = gc.cumsum(dim=-1)  # [B, H, C]
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf"))
        decay = diff.exp()  # [B, H, C, C], zero above the diagonal
        strict = incl & ~torch.eye(C, dtype=torch.bool, device=q.device)
        A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
        M = A + torch.eye(C, dtype=f32, device=q.device)
        eg = G.exp()[..., None]  # [B, H, C, 1]
        rhs = torch.cat([bc[..., None] * vc, bc[..., None] * eg * kc], dim=-1)  # [B, H, C, dv+dk]
        sol = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        U, W = sol[..., :dv], sol[..., dv:]
        D = U - W @ s  # [B, H, C, dv]
        o = eg * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ D  # [B, H, C, dv]
        g_end = G[..., -1:]  # [B, H, 1]
        s = g_end.exp()[..., None] * s + (kc * (g_end - G).exp()[..., None]).transpose(-1, -2) @ D
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2), s  # [B, T, H, dv], [B, H, dk, dv]
