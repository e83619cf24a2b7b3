"""One entry point per op: the Triton kernel for CUDA tensors when triton is installed, else the torch twin.

CPU (and CUDA without triton) runs the twins, so this module imports and works without triton; one exception:
`argmax` of fp32 CPU logits runs cpu.py's C pick when it is built, which picks exactly what torch.argmax picks.
The kernels' contracts (batch invariance, pool layout, what the caller passes) are in their modules:
matmul.py, matmul_fp8.py, attention.py, gdn_update.py, norm.py, sample.py, act.py. `linear` and `grouped_linear`
take FP8 weights too (float8_e4m3fn with block scales, matmul_fp8.py): the W8A16 kernel, or its twin.

Tests only: `force_kernels()` makes `use_triton` true for CPU tensors too, so the model's whole kernel path
(engine/model/qwen35.py, moe.py, engine/graphs.py) runs on a CPU under TRITON_INTERPRET=1. Nothing in the serving
path enters it; outside it, CPU tensors take the torch path (and `argmax` the C pick above).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import act as _act
from . import attention as _attn
from . import cpu as _cpu
from . import gdn_update as _gdn
from . import matmul as _mm
from . import matmul_fp8 as _fp8
from . import norm as _norm
from . import sample as _sample
from ._triton import HAS_TRITON

__all__ = ["HAS_TRITON", "use_triton", "force_kernels", "linear", "grouped_linear", "fp8_linear", "rms_norm",
           "add_rms_norm", "gated_rms_norm", "attention", "write_kv", "gdn_update", "conv_update", "gdn_gates",
           "silu_mul", "moe_combine", "argmax", "sample"]

_FORCED = False


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton kernels: triton importable and t on a CUDA device (or, inside the
    test-only `force_kernels()`, on any device)."""
    return HAS_TRITON and (t.is_cuda or _FORCED)


@contextlib.contextmanager
def force_kernels() -> Iterator[None]:
    """TEST ONLY: run the Triton kernels (and the model's kernel path) on CPU tensors, under TRITON_INTERPRET=1
    (set before the kernel modules are imported; tests/conftest.py does). Not reentrant-safe across threads."""
    global _FORCED
    if not HAS_TRITON:
        raise RuntimeError("force_kernels() needs triton (pip install triton)")
    prev, _FORCED = _FORCED, True
    try:
        yield
    finally:
        _FORCED = prev


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] (batch-invariant on CUDA; the LM head passes out_dtype=fp32).
    `out`: a contiguous [..., N] buffer to write (a CUDA graph's static logits). An FP8 weight: `fp8_linear`."""
    if _fp8.is_fp8(w):
        return fp8_linear(x, w, out_dtype, out)
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(-1, w.shape[0])
    if use_triton(x):
        y = _mm.matmul(x2, w, out_dtype, out=out2)
    else:
        y = _mm.matmul_ref(x2, w, out_dtype)
        y = y if out2 is None else out2.copy_(y)
    return y.view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MoE experts: sorted row m of expert e -> x[rows[m]] @ w[e]^T (see matmul.grouped_matmul; FP8 experts:
    matmul_fp8.grouped_matmul_fp8)."""
    if _fp8.is_fp8(w):
        scale, srows = _fp8.scales(w)
        fn = _fp8.grouped_matmul_fp8 if use_triton(x) else _fp8.grouped_matmul_fp8_ref
        return fn(x, w, scale, offsets, rows, srows, out_dtype)
    return (_mm.grouped_matmul if use_triton(x) else _mm.grouped_matmul_ref)(x, w, offsets, rows, out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w^T for an FP8 weight w [N, K] (float8_e4m3fn with its block scales, matmul_fp8.mark): the
    W8A16 kernel where the kernels run, else the twin (dequantize, then the fp32-accumulated matmul)."""
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(-1, w.shape[0])
    scale, rows = _fp8.scales(w)
    if use_triton(x):
        y = _fp8.matmul_fp8(x2, w, scale, rows, out_dtype, out=out2)
    else:
        y = _fp8.matmul_fp8_ref(x2, w, scale, rows, out_dtype)
        y = y if out2 is None else out2.copy_(y)
    return y.view(*x.shape[:-1], w.shape[0])


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


write_kv = _attn.write_kv  # device-side scatter (torch on every device)


def gdn_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, qk_l2norm: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """o [N, T, nv, dv] in out_dtype (default rec's dtype); writes rec[slot, t] (gdn_update.py)."""
    if use_triton(q):
        return _gdn.gdn_update(q, k, v, g, beta, rec, slot, cur, qk_l2norm=qk_l2norm,
                               out_dtype=out_dtype or rec.dtype)
    o = _gdn.gdn_update_ref(q, k, v, g, beta, rec, slot, cur, qk_l2norm=qk_l2norm)
    return o if out_dtype is None else o.to(out_dtype)


def conv_update(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                cur: torch.Tensor) -> torch.Tensor:
    fast = use_triton(x) and weight.shape[-1] == 4  # the kernel is written for Kc == 4 (every Qwen3.5 config)
    return (_gdn.conv_update if fast else _gdn.conv_update_ref)(x, conv, weight, slot, cur)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (_act.gdn_gates if use_triton(a) else _act.gdn_gates_ref)(a, b, neg_a, dt_bias)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return (_act.silu_mul if use_triton(gu) else _act.silu_mul_ref)(gu)


def moe_combine(y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, shared: torch.Tensor,
                shared_gate: torch.Tensor) -> torch.Tensor:
    return (_act.moe_combine if use_triton(y) else _act.moe_combine_ref)(y, inv, w, shared, shared_gate)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if use_triton(logits):
        return _sample.argmax(logits)
    out = _cpu.argmax_or_none(logits)  # fp32 on the CPU: the C kernel, torch.argmax's picks exactly
    return out if out is not None else _sample.argmax_ref(logits)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
           offset: torch.Tensor) -> torch.Tensor:
    fn = _sample.sample if use_triton(logits) else _sample.sample_ref
    return fn(logits, inv_temperature, threshold, seed, offset)
