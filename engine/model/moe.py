"""Qwen3.5 MoE block: softmax top-k router (renormalised), fused 3-D experts, sigmoid-gated shared expert.

On the kernel path (`ops.use_triton`: CUDA with triton) every projection is the batch-invariant Triton matmul, the
experts run as two grouped matmuls over the routing slots sorted by expert (device-side grouping, no host sync),
and each token's k expert outputs are combined in routing-slot order by one kernel (`ops.moe_combine`), so a
token's output never depends on which other tokens share the step. An fp32 CPU forward over the pool does the same
on ops/cpu.py's C kernels (the router's and the shared gate's GEMMs, each expert's SwiGLU over its rows, a sigmoid
whose bits do not depend on an element's place, the k outputs summed in slot order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config
from .ops import cpu
from .ops import dispatch as ops
from .ops.fuse import fuse_linears
from .ops.matmul import group_by_expert


#: Largest gathered expert-weight working set (bytes) for the sync-free small-batch MoE path.
GATHER_BYTES = 64 * 2**20


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self._w_gu: torch.Tensor | None = None  # fused gate|up weight (`fuse`)

    def fuse(self) -> None:
        """Serve with one gate|up GEMM (the separate weights become views of it)."""
        self._w_gu = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, ctx=None, phase: str | None = None) -> torch.Tensor:
        """`ctx`: the forward's FwdCtx; in a step forward (`ctx.record`) an fp32 CPU model with fused weights runs
        the whole block as ops/cpu.py's C call (batch-invariant GEMMs), as does a prefill block
        (`ctx.cpu_kernels`). No cache: the torch path. `phase`: the kernel path's matmul tiling (default: the
        forward's, `FwdCtx.phase`; "step" without a context)."""
        if ctx is not None and ctx.cpu_kernels and self._w_gu is not None:
            y = cpu.mlp_or_none(x, self._w_gu, self.down_proj.weight)
            if y is not None:
                return y
        if ops.use_triton(x):  # kernel path: fused gate|up GEMM, fused SwiGLU, the forward's tiling (`phase`)
            ph = phase or (ctx.phase if ctx is not None else "step")
            gu = ops.linear(x, self._w_gu, phase=ph) if self._w_gu is not None else torch.cat(
                [ops.linear(x, self.gate_proj.weight, phase=ph), ops.linear(x, self.up_proj.weight, phase=ph)], dim=-1)
            return ops.linear(ops.silu_mul(gu), self.down_proj.weight, phase=ph)
        if self._w_gu is not None:
            gate, up = F.linear(x, self._w_gu).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """`mlp.gate`: logits = x W^T [N, E]; p = softmax in fp32; top-k by p; weights renormalised to sum 1."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, rowwise: bool = False, phase: str = "step") -> tuple[torch.Tensor, torch.Tensor]:
        """rowwise: an fp32 CPU forward on the C kernels (the GEMM and the renormalising sum row by row, in a fixed
        order, as on the kernel path). phase: the kernel path's matmul tiling."""
        kern = ops.use_triton(x)
        c = cpu.linear_or_none(x, self.weight) if rowwise else None
        logits = (ops.linear(x, self.weight, phase=phase) if kern else c if c is not None
                  else F.linear(x, self.weight))  # [N, E]
        p = torch.softmax(logits, dim=-1, dtype=torch.float32 if x.dtype != torch.float64 else torch.float64)
        w, idx = torch.topk(p, self.top_k, dim=-1)  # [N, k]
        if kern or c is not None:  # the k-term sum in slot order (a torch reduction may reorder it with the rows)
            s = w[:, 0]
            for j in range(1, self.top_k):
                s = s + w[:, j]
            return (w / s[:, None]).to(x.dtype), idx
        w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx


class Experts(nn.Module):
    """`mlp.experts`: gate_up_proj [E, 2*Im, H] (gate rows first), down_proj [E, H, Im]."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        E, Im, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Im, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Im))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """x [N, H], routing weights/ids [N, k] -> sum_e w_e * expert_e(x) [N, H].

        Few tokens (decode, verify): each token-slot gathers its expert's weights and runs a batched matmul, so
        routing never needs the host (no per-layer sync). Many tokens (prefill): tokens grouped by expert.
        rowwise (an fp32 CPU forward on the C kernels): each expert's rows through ops/cpu.py's SwiGLU, then each
        token's k outputs weighted and summed in slot order, so a token's bits never depend on the other tokens."""
        N, k = idx.shape
        if rowwise:
            out = self._rowwise(x, w, idx)
            if out is not None:
                return out
        if N * k * self.gate_up_proj[0].numel() * 3 // 2 * x.element_size() <= GATHER_BYTES:
            gu = self.gate_up_proj[idx]  # [N, k, 2Im, H]
            gate, up = (gu @ x[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)  # [N, k, Im] each
            y = (self.down_proj[idx] @ (F.silu(gate) * up)[..., None]).squeeze(-1)  # [N, k, H]
            return (y * w[..., None]).sum(dim=1)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w[tok, slot, None]
            out = out.index_add(0, tok, y)
        return out


    def _rowwise(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
        """The C kernels' experts (None when ops/cpu.py's GEMM does not take these shapes)."""
        N, k = idx.shape
        ys = x.new_empty(N, k, x.shape[-1])  # [N, k, H]: token t's output of its j-th routed expert
        slots = idx.tolist()  # the host routes (a CPU: no device to wait for)
        rows: dict[int, list[tuple[int, int]]] = {}
        for t, es in enumerate(slots):
            for j, e in enumerate(es):
                rows.setdefault(e, []).append((t, j))
        for e, tj in rows.items():
            tok = torch.tensor([t for t, _ in tj])
            y = cpu.mlp_or_none(x[tok], self.gate_up_proj[e], self.down_proj[e])  # [n_e, H]
            if y is None:
                return None
            ys[tok, torch.tensor([j for _, j in tj])] = y
        out = ys[:, 0] * w[:, :1]
        for j in range(1, k):
            out = out + ys[:, j] * w[:, j:j + 1]
        return out


class SparseMoeBlock(nn.Module):
    """y = routed(x) + sigmoid(x . shared_expert_gate) * shared_expert(x)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """x [..., H]; `ctx`: the forward's context. An fp32 CPU forward over the pool (`ctx.cpu_kernels`) runs the
        router's GEMM, the experts, the shared expert and its gate on ops/cpu.py's row-wise kernels; without a
        context, torch ops."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        rowwise = ctx is not None and ctx.cpu_kernels and cpu.takes(flat)
        phase = ctx.phase if ctx is not None else "step"
        w, idx = self.gate(flat, rowwise, phase)
        if ops.use_triton(flat):
            return self._forward_kernels(flat, w, idx, phase).reshape(shape)
        gate = cpu.linear_or_none(flat, self.shared_expert_gate.weight) if rowwise else None  # [N, 1]
        gate = torch.sigmoid(self.shared_expert_gate(flat)) if gate is None else cpu.sigmoid(gate)
        y = self.experts(flat, w, idx, rowwise) + gate * self.shared_expert(flat, ctx if rowwise else None)
        return y.reshape(shape)

    def _forward_kernels(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, phase: str) -> torch.Tensor:
        """Kernel path, x [N, H]: routing slots sorted by expert on the device, gate|up and down as grouped
        matmuls (one tiling for every phase), then one combine kernel (slot order) that also adds the sigmoid-gated
        shared expert; the dense GEMMs in the forward's tiling `phase`."""
        N, k = idx.shape
        ex = self.experts
        order, offsets = group_by_expert(idx, ex.gate_up_proj.shape[0])  # [N*k], [E+1]
        gu = ops.grouped_linear(x, ex.gate_up_proj, offsets, order // k)  # [N*k, 2Im], sorted by expert
        y = ops.grouped_linear(ops.silu_mul(gu), ex.down_proj, offsets)  # [N*k, H], sorted
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)  # routing slot -> sorted row
        shared_gate = ops.linear(x, self.shared_expert_gate.weight, phase=phase)  # [N, 1]
        return ops.moe_combine(y, inv, w.contiguous(), self.shared_expert(x, phase=phase), shared_gate)
