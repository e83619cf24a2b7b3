"""Optional triton import shared by the kernel modules.

`HAS_TRITON` is False when triton is missing (CPU installs without it); kernel modules then define only their
pure-torch twins. `INTERPRET` mirrors TRITON_INTERPRET, which triton reads when a kernel is *decorated*: on a
machine without a GPU it must be set before the first kernel module is imported (tests/conftest.py does).
Under the interpreter the kernels emulate `tl.dot` with an explicit sequential-K product (`mm`), because the
interpreter's own dot is numpy/BLAS, whose per-row rounding depends on the row's position inside the block;
on a GPU they use `tl.dot` (MMA: per-row results independent of the other rows). `cast_rn` fixes the
interpreter's fp32 -> bf16 cast, which truncates where a GPU rounds to nearest even.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU install without triton: twins only
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_triton(*ts: torch.Tensor) -> None:
    """Entry check of every kernel wrapper: triton importable, dtypes the kernels handle."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the *_ref twins (or engine.model.ops.dispatch)")
    for t in ts:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"triton kernels take fp32/bf16/fp16 tensors, got {t.dtype}")

if HAS_TRITON:
    EMU = tl.constexpr(INTERPRET)  # kernels read it as a global constexpr

    @triton.jit
    def mm(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b with fp32 accumulation. a [BM, BK], b [BK, BN], acc [BM, BN] fp32.

        Under the interpreter: an explicit product summed over K in order, so a row's result depends only on
        that row. On a GPU: `tl.dot` (IEEE fp32 instead of TF32 for fp32 inputs, when IEEE)."""
        if EMU:
            return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def cast_rn(x, dtype: tl.constexpr):
        """fp32 x cast to `dtype` rounding to nearest even, as a GPU cast and torch do (the interpreter's
        fp32 -> bf16 cast truncates, so it is done here with integer ops first)."""
        if EMU and dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
        return x.to(dtype)
