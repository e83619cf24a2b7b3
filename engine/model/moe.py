"""Qwen3.5 MoE block: softmax top-k router (renormalised), fused 3-D experts, sigmoid-gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config


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
        from .qwen35 import fuse_linears

        self._w_gu = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [N, E]
        p = torch.softmax(logits, dim=-1, dtype=torch.float32 if x.dtype != torch.float64 else torch.float64)
        w, idx = torch.topk(p, self.top_k, dim=-1)  # [N, k]
        w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx


class Experts(nn.Module):
    """`mlp.experts`: gate_up_proj [E, 2*Im, H] (gate rows first), down_proj [E, H, Im]."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        E, Im, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Im, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Im))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing weights/ids [N, k] -> sum_e w_e * expert_e(x) [N, H].

        Few tokens (decode, verify): each token-slot gathers its expert's weights and runs a batched matmul, so
        routing never needs the host (no per-layer sync). Many tokens (prefill): tokens grouped by expert."""
        N, k = idx.shape
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


class SparseMoeBlock(nn.Module):
    """y = routed(x) + sigmoid(x . shared_expert_gate) * shared_expert(x)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        w, idx = self.gate(flat)
        y = self.experts(flat, w, idx) + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.reshape(shape)
