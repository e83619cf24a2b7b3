"""Fusing bias-free linears that read the same input into one weight (one GEMM instead of several), shared by the
dense model (engine/model/qwen35.py: attention q|k|v, GDN qkv|z|b|a) and the MLP / MoE blocks (moe.py: gate|up)."""
from __future__ import annotations

import torch
from torch import nn

from .matmul_fp8 import FP8, mark
from .matmul_fp8 import fuse as fuse_fp8
from .matmul_fp8 import scales as fp8_scales


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor | None:
    """One weight [sum out, in] for several bias-free linears that read the same input; each linear's weight
    becomes a view of its rows (so a state dict and in-place edits still see the same numbers). One GEMM then
    replaces len(linears) of them. FP8 weights fuse with their block scales (any row counts: matmul_fp8.fuse); a
    mix of FP8 and unquantized weights (the GDN's a / b projections stay bf16 in Qwen's FP8 releases) is left
    unfused: None, and the caller runs one GEMM per linear."""
    fp8 = [m.weight.dtype == FP8 for m in linears]
    if any(fp8):
        if not all(fp8):
            return None
        w, views = fuse_fp8([m.weight for m in linears])
        for m, v in zip(linears, views):
            m.weight = mark(nn.Parameter(v, requires_grad=False), *fp8_scales(v))
        return w
    w = torch.cat([m.weight.detach() for m in linears]).contiguous()  # [sum out, in]
    r = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[r:r + n], requires_grad=False)
        r += n
    return w
