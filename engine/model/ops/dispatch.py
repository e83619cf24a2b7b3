"""One entry point per op: the Triton kernel for CUDA tensors when triton is installed, else the torch twin.

CPU (and CUDA without triton) always runs the twins, so this module imports and works without triton.
The kernels' contracts (batch invariance, pool layout, what the caller passes) are in their modules:
matmul.py, attention.py, gdn_update.py, norm.py, sample.py.
"""
from __future__ import annotations

import torch

from . import attention as _attn
from . import gdn_update as _gdn
from . import matmul as _mm
from . import norm as _norm
from . import sample as _sample
from ._triton import HAS_TRITON

__all__ = ["HAS_TRITON", "use_triton", "linear", "grouped_linear", "rms_norm", "add_rms_norm", "gated_rms_norm",
           "attention", "gdn_update", "conv_update", "argmax", "sample"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton kernels: triton importable and t on a CUDA device."""
    return HAS_TRITON and t.is_cuda


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] (batch-invariant on CUDA; the LM head passes out_dtype=fp32)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = (_mm.matmul if use_triton(x) else _mm.matmul_ref)(x2, w, out_dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MoE experts: sorted row m of expert e -> x[rows[m]] @ w[e]^T (see matmul.grouped_matmul)."""
    return (_mm.grouped_matmul if use_triton(x) else _mm.grouped_matmul_ref)(x, w, offsets, rows, out_dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (_norm.rms_norm if use_triton(x) else _norm.rms_norm_ref)(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (_norm.add_rms_norm if use_triton(x) else _norm.add_rms_norm_ref)(x, residual, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (_norm.gated_rms_norm if use_triton(x) else _norm.gated_rms_norm_ref)(x, z, w, eps)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, pos0: torch.Tensor,
              scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    return (_attn.attention if use_triton(q) else _attn.attention_ref)(q, k_cache, v_cache, slot, pos0, scale, gate)


def gdn_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, qk_l2norm: bool = False) -> torch.Tensor:
    fn = _gdn.gdn_update if use_triton(q) else _gdn.gdn_update_ref
    return fn(q, k, v, g, beta, rec, slot, cur, qk_l2norm=qk_l2norm)


def conv_update(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                cur: torch.Tensor) -> torch.Tensor:
    fast = use_triton(x) and weight.shape[-1] == 4  # the kernel is written for Kc == 4 (every Qwen3.5 config)
    return (_gdn.conv_update if fast else _gdn.conv_update_ref)(x, conv, weight, slot, cur)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return (_sample.argmax if use_triton(logits) else _sample.argmax_ref)(logits)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
           offset: torch.Tensor) -> torch.Tensor:
    fn = _sample.sample if use_triton(logits) else _sample.sample_ref
    return fn(logits, inv_temperature, threshold, seed, offset)
