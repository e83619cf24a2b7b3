"""Shared bits of the kernel tests (tests/test_ops_*.py): device, dtypes, tolerances, the triton skip."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine.model.ops._triton import HAS_TRITON
from engine.model.ops.dispatch import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: kernels run under TRITON_INTERPRET=1 (conftest)
DTYPES = [torch.float32, torch.bfloat16]

needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason="triton is not installed: the Triton kernels are tested only with it (pip install -e '.[test]'; "
           "on a CPU-only machine they run under TRITON_INTERPRET=1)")


def rand(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator | None = None,
         scale: float = 1.0) -> torch.Tensor:
    """Standard-normal test data (made in fp32 on the CPU, then moved), times `scale`."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def nans(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A NaN-poisoned output buffer: any element a kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Kernel vs twin: tight in fp32, about one bf16 rounding step in bf16; never NaN."""
    assert not got.isnan().any(), "output has NaN (an element was not written, or bad math)"
    rtol, atol = tolerance(got.dtype, want.dtype)  # the startup self-check's rule (engine/selfcheck.py)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got, want), f"{what}: not bitwise equal (max diff {(got.float() - want.float()).abs().max()})"


@contextlib.contextmanager
def spy(obj, name: str) -> Iterator[list[tuple[tuple, object]]]:
    """Inside: every call of `obj.name` is appended as (positional args, result); restored on exit."""
    calls: list[tuple[tuple, object]] = []
    real = getattr(obj, name)

    def wrapper(*a, **k):
        y = real(*a, **k)
        calls.append((a, y))
        return y

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        setattr(obj, name, real)


@contextlib.contextmanager
def cpu_kernel(name: str, on: bool) -> Iterator[None]:
    """Inside (under inference mode): ops/cpu.py's C kernels on or off, and `cpu.<name>` must run exactly once when
    on (the forward took the kernel) and never when off."""
    from engine.model.ops import cpu

    prev = cpu.set_enabled(on)
    try:
        with spy(cpu, name) as calls, torch.inference_mode():
            yield
    finally:
        cpu.set_enabled(prev)
    assert len(calls) == (1 if on else 0), "the kernel did not run" if on else "the kernel ran"
