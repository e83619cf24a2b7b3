"""Row-wise elementwise pieces of the step forward that involve a transcendental function, fused: the SwiGLU
activation (`silu_mul`), the GDN gates (`gdn_gates`: decay g and beta from in_proj_a / in_proj_b) and the MoE
combine (`moe_combine`: the routed experts' outputs weighted and summed in a fixed order, plus the sigmoid-gated
shared expert).

Why kernels and not torch ops: on a GPU a torch elementwise op computes every element the same way, but on a CPU
torch evaluates sigmoid / silu / softplus with a vectorised routine for most elements and a scalar one for the
tail, so an element's last bit depends on where it sits in the tensor (that is, on the batch). These kernels
compute one fixed-size block per program, so an element's value depends on its own inputs only, on any device;
and on the GPU they save launches inside the captured step.

Rounding points follow the torch modules (qwen35.py MLP / GatedDeltaNet, moe.py) so the twins stay close to
the model's own path; the twins are the same math in torch (fp32 for fp32 / bf16 models, fp64 for fp64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton

SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x above it returns x


def _acc(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """Twin: gu [..., 2I] = gate | up -> silu(gate) * up [..., I] in gu's dtype (silu rounded to the dtype first,
    as `F.silu(gate) * up` does)."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: a, b [..., nv] (model dtype); neg_a = -exp(A_log), dt_bias [nv] in the state dtype ->
    (g = neg_a * softplus(a + dt_bias), beta = sigmoid(b) rounded to the model dtype), both in the state dtype."""
    sdt = neg_a.dtype
    beta = torch.sigmoid(b).to(sdt)
    g = neg_a * F.softplus(a.to(sdt) + dt_bias)
    return g, beta


def moe_combine_ref(y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, shared: torch.Tensor,
                    shared_gate: torch.Tensor) -> torch.Tensor:
    """Twin: routed = sum_j w[n, j] * y[inv[n*k + j]] accumulated in fp32 in order j = 0..k-1, rounded to the
    dtype; out = routed + (sigmoid(shared_gate[n]) * shared[n]) with the gate and the product rounded to the dtype.
    y [N*k, H] (expert outputs in sorted-by-expert order), inv [N*k] (routing slot -> sorted row), w [N, k],
    shared [N, H], shared_gate [N, 1]. Returns [N, H] in shared's dtype."""
    N, k = w.shape
    dt, acc_t = shared.dtype, _acc(shared.dtype)
    ys = y[inv.long()].view(N, k, -1).to(acc_t)
    wf = w.to(acc_t)
    acc = ys[:, 0] * wf[:, 0:1]
    for j in range(1, k):
        acc = acc + ys[:, j] * wf[:, j:j + 1]
    sf = shared_gate.to(acc_t)
    gate = (1.0 / (1.0 + torch.exp(-sf))).to(dt)
    return (acc.to(dt).to(acc_t) + (gate.to(acc_t) * shared.to(acc_t)).to(dt).to(acc_t)).to(dt)


if HAS_TRITON:
    from ._triton import cast_rn

    @triton.jit
    def _silu_mul_kernel(gu, y, I, sg, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < I
        g = tl.load(gu + row * sg + c, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu + row * sg + I + c, mask=ok, other=0.0).to(tl.float32)
        s = cast_rn(g / (1.0 + tl.exp(-g)), y.dtype.element_ty).to(tl.float32)
        tl.store(y + row * sy + c, cast_rn(s * u, y.dtype.element_ty), mask=ok)

    @triton.jit
    def _gdn_gates_kernel(a, b, neg_a, dt_bias, g, beta, NV, sa, sb, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (row, token) of [N, T]
        h = tl.arange(0, BLOCK)
        ok = h < NV
        bv = tl.load(b + row * sb + h, mask=ok, other=0.0)
        sig = 1.0 / (1.0 + tl.exp(-bv.to(tl.float32)))
        tl.store(beta + row * NV + h, cast_rn(sig, bv.dtype).to(tl.float32), mask=ok)
        x = tl.load(a + row * sa + h, mask=ok, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=ok, other=0.0)
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        lp = tl.log(u) - ((u - 1.0) - e) / u  # log1p(e), accurate when e is tiny
        sp = tl.where(x > 20.0, x, lp)
        tl.store(g + row * NV + h, tl.load(neg_a + h, mask=ok, other=0.0) * sp, mask=ok)

    @triton.jit
    def _moe_combine_kernel(y, inv, w, shared, sgate, out, H, sy, sw, ssh, so,
                            K: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < H
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(K):
            r = tl.load(inv + n * K + j).to(tl.int64)
            wj = tl.load(w + n * sw + j).to(tl.float32)
            acc += tl.load(y + r * sy + c, mask=ok, other=0.0).to(tl.float32) * wj
        dt = out.dtype.element_ty
        sg = tl.load(sgate + n).to(tl.float32)
        gate = cast_rn(1.0 / (1.0 + tl.exp(-sg)), dt).to(tl.float32)
        sh = cast_rn(gate * tl.load(shared + n * ssh + c, mask=ok, other=0.0).to(tl.float32), dt).to(tl.float32)
        tl.store(out + n * so + c, cast_rn(cast_rn(acc, dt).to(tl.float32) + sh, dt), mask=ok)


def _rows2(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_mul(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: gu [..., 2I] (gate | up, last dim contiguous) -> silu(gate) * up [..., I] (gu's dtype)."""
    check_triton(gu)
    I = gu.shape[-1] // 2
    g2 = _rows2(gu)
    y = out if out is not None else torch.empty(*gu.shape[:-1], I, dtype=gu.dtype, device=gu.device)
    y2 = y.view(-1, I)
    if g2.shape[0]:
        cfg = launch.get("silu_mul", gu.dtype, gu.device)
        _silu_mul_kernel[(g2.shape[0], cdiv(I, cfg["BLOCK"]))](g2, y2, I, g2.stride(0), y2.stride(0), **cfg.kwargs())
    return y


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `gdn_gates_ref`: a, b [..., nv] (views of the fused input projection are fine; last dim
    contiguous), neg_a, dt_bias [nv] fp32 -> (g, beta) fp32 [..., nv], contiguous."""
    check_triton(a, b)
    nv = a.shape[-1]
    assert neg_a.dtype == torch.float32 and dt_bias.dtype == torch.float32
    a2, b2 = _rows2(a), _rows2(b)
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if a2.shape[0]:
        _gdn_gates_kernel[(a2.shape[0],)](a2, b2, neg_a, dt_bias, g, beta, nv, a2.stride(0), b2.stride(0),
                                          **launch.get("gdn_gates", a.dtype, a.device, nv=nv).kwargs())
    return g, beta


def moe_combine(y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, shared: torch.Tensor,
                shared_gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `moe_combine_ref` (same arguments; y, shared last dim contiguous): one program per
    (token, column block) sums that token's k expert rows in routing-slot order, so a token's result never
    depends on the other tokens or on how the experts were grouped. `out`: a preallocated contiguous [N, H]."""
    check_triton(y, shared)
    N, k = w.shape
    H = shared.shape[-1]
    assert y.stride(-1) == 1 and shared.stride(-1) == 1 and w.stride(-1) == 1
    out = out if out is not None else torch.empty(N, H, dtype=shared.dtype, device=shared.device)
    if N:
        sg = shared_gate.reshape(N)
        cfg = launch.get("moe_combine", shared.dtype, shared.device)
        _moe_combine_kernel[(N, cdiv(H, cfg["BLOCK"]))](y, inv, w, shared, sg, out, H, y.stride(0), w.stride(0),
                                                        shared.stride(0), out.stride(0), K=k, **cfg.kwargs())
    return out
