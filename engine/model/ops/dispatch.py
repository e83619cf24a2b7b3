"""One entry point per op: the Triton kernel for CUDA tensors when triton is installed, else the torch twin.

CPU (and CUDA without triton) runs the twins, so this module imports and works without triton; one exception:
`argmax` of fp32 CPU logits runs cpu.py's C pick when it is built, which picks exactly what torch.argmax picks.
The kernels' contracts (batch invariance, pool layout, what the caller passes) are in their modules:
matmul.py, matmul_fp8.py, attention.py, gdn_update.py, norm.py, sample.py, act.py, and the prefill pair gdn_prefill.py and
attention_prefill.py (chunked GDN and causal attention over prompt chunks on the prefill grid). `linear` and
`grouped_linear` take FP8 weights too (float8_e4m3fn with block scales, matmul_fp8.py): the W8A16 kernel, or its twin.

Per kernel fallback: the startup self-check (engine/selfcheck.py) compiles each kernel on the device and compares
it with its twin; a kernel that fails is handed to `fall_back(name, why)` and this process runs that op's twin
from then on (`kernel_impls()` says which ops run what). A twin on CUDA is correct but not batch-invariant (torch
picks its GEMM and reduction strategy by shape), so exactness across batch sizes then holds only where the
kernels still run; `--kernels strict` refuses to serve instead.

Tests only: `force_kernels()` makes `use_triton` true for CPU tensors too, so the model's whole kernel path
(engine/model/qwen35.py, moe.py, engine/graphs.py) runs on a CPU under TRITON_INTERPRET=1. Nothing in the serving
path enters it; outside it, CPU tensors take the torch path (and `argmax` the C pick above).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import act as _act
from . import attention as _attn
from . import attention_prefill as _attnp
from . import cpu as _cpu
from . import gdn_prefill as _gdnp
from . import gdn_update as _gdn
from . import matmul as _mm
from . import matmul_fp8 as _fp8
from . import norm as _norm
from . import sample as _sample
from ._triton import HAS_TRITON

__all__ = ["HAS_TRITON", "KERNELS", "use_triton", "use_kernel", "fall_back", "kernel_impls", "mismatch", "tolerance",
           "bounds", "Accumulation", "Bounds",
           "force_kernels", "linear", "grouped_linear", "fp8_linear", "rms_norm", "add_rms_norm", "gated_rms_norm",
           "attention", "attention_prefill", "write_kv", "gdn_update", "gdn_prefill", "conv_update", "gdn_gates", "silu_mul",
           "moe_combine", "argmax", "sample"]

#: the ops below that have a Triton kernel (the names of the startup self-check, the fallbacks, the
#: `nextn_kernel_info` gauge and /health)
KERNELS = ("matmul", "grouped_matmul", "rms_norm", "add_rms_norm", "gated_rms_norm", "attention", "gdn_update",
           "conv_update", "gdn_gates", "silu_mul", "moe_combine", "argmax", "sample", "gdn_prefill",
           "attention_prefill", "matmul_fp8")

_FORCED = False
_TWIN: dict[str, str] = {}  # kernel -> why this process runs its twin instead

#: kernel vs twin, per element, before the accumulation allowance: (rtol, atol) when both are fp32 (or fp64); any
#: 16-bit side: about one bf16 rounding step
TOL_FP32 = (1e-5, 1e-5)
TOL_16BIT = (1.6e-2, 1e-2)
#: unit roundoffs: fp32 sums; a dot operand rounded to TF32 (10 stored mantissa bits) or to bf16 / fp16
U_FP32, U_TF32, U_BF16, U_FP16 = 2.0 ** -24, 2.0 ** -11, 2.0 ** -9, 2.0 ** -12
#: the accumulation allowance in units of the expected noise (`Accumulation.noise`): per element (the largest of
#: up to ~10^6 outputs of a check, about 5 standard deviations, with room for MMA adders that truncate), and for the
#: whole output's norm (an average: no tail to cover). tests/test_tolerance.py measures the margins.
C_ELEM, C_NORM = 16.0, 4.0


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton kernels: triton importable and t on a CUDA device (or, inside the
    test-only `force_kernels()`, on any device). The model's path choice; each op also asks `use_kernel`."""
    return HAS_TRITON and (t.is_cuda or _FORCED)


def use_kernel(name: str, t: torch.Tensor) -> bool:
    """Whether op `name` on `t` runs its Triton kernel: the kernel path, and the kernel not replaced by its twin."""
    return use_triton(t) and name not in _TWIN


def fall_back(name: str, why: str) -> None:
    """From now on this process runs op `name`'s torch twin instead of its kernel (`why`: one line, kept for
    `kernel_impls` readers). Raises KeyError for a name not in KERNELS."""
    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r}")
    _TWIN[name] = why


def kernel_impls() -> dict[str, str]:
    """Each kernel's implementation on the kernel path in this process: "triton", or "torch" after a fallback."""
    return {k: "torch" if k in _TWIN else "triton" for k in KERNELS}


def reset_fallbacks() -> None:
    """Every kernel back on (tests: a fallback is for the life of the process)."""
    _TWIN.clear()


def tolerance(got: torch.dtype, want: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) a kernel's output of dtype `got` must meet per element against its twin's of dtype `want`,
    before the accumulation allowance (`bounds`): the kernel tests' rule for small inputs."""
    wide = (torch.float32, torch.float64)
    return TOL_FP32 if got in wide and want in wide else TOL_16BIT


@dataclass(frozen=True)
class Accumulation:
    """How a kernel computes an output element, as far as its difference from the twin goes: `k`, the length of the
    longest chain of fp32 sums feeding it (a GEMM's K, a norm's row, a recurrence's terms); `operand_u`, the unit
    roundoff of dot operands the kernel rounds and its twin does not (0: exact products, as bf16 x bf16 into fp32
    or IEEE fp32 dots; U_TF32: TF32 dots; U_BF16: an fp32 operand cast to bf16, as attention's probabilities).

    `noise` is the expected |kernel - twin| relative to the output's RMS for random zero-mean inputs (the self-
    check's): U_FP32 sqrt(k) for two fp32 summation orders (the random-walk bound; a GPU's MMA order vs
    cuBLAS's), plus operand_u for the rounded operands."""

    k: int = 1
    operand_u: float = 0.0

    @property
    def noise(self) -> float:
        return U_FP32 * math.sqrt(max(1, self.k)) + self.operand_u


@dataclass(frozen=True)
class Bounds:
    """What `mismatch` allows: per element |got - want| <= atol + rtol |want| + elem * rms(want), and for the whole
    output ||got - want||_2 <= norm * ||want||_2."""

    rtol: float
    atol: float
    elem: float
    norm: float


_WIDE = (torch.float32, torch.float64)


def _half_ulp(dtype: torch.dtype) -> float:
    """Half of the smallest relative spacing of `dtype` (2^-mantissa_bits / 2): a 1-ulp error in every element
    moves the whole output by at least twice this, relative to its norm."""
    return {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}.get(dtype, 2.0 ** -25)


def bounds(got: torch.dtype, want: torch.dtype, acc: Accumulation = Accumulation()) -> Bounds:
    """The tolerance of a kernel's output (dtype `got`) against its twin's (`want`), following the dtype, the
    reduction length and the accumulation mode (`acc`):

    * per element: `tolerance`'s (rtol, atol) plus C_ELEM * acc.noise * rms(want) (the accumulation noise is
      absolute, at the scale of the whole output, not of the element: an output near 0 gets the same allowance);
    * for the norm of the difference: C_NORM * acc.noise, but for a 16-bit output never below half an ulp
      (`_half_ulp`) and for fp32 never below TOL_FP32's rtol. Two correct roundings of nearly equal fp32 values
      differ by one ulp only where a rounding boundary falls between them (a fraction of about noise / ulp of the
      elements), so a correct kernel stays far below this while a defect that moves every element by one ulp of a
      16-bit output, or rounds an fp32 output or partial sum through bf16, lands above it."""
    rtol, atol = tolerance(got, want)
    n = acc.noise
    floor = max(_half_ulp(got), _half_ulp(want)) if got not in _WIDE or want not in _WIDE else TOL_FP32[0]
    return Bounds(rtol, atol, C_ELEM * n, max(floor, C_NORM * n))


def mismatch(got: torch.Tensor, want: torch.Tensor, acc: Accumulation = Accumulation()) -> str | None:
    """Why a kernel's output `got` does not match its twin's `want` (None: it does): a shape difference, NaN
    where the twin has a number (an element not written into a NaN-poisoned buffer, or bad math), integers that
    differ, or floats beyond `bounds(got.dtype, want.dtype, acc)` (per element, or in norm)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != twin's {tuple(want.shape)}"
    if not got.is_floating_point():
        bad = int((got != want.to(got.dtype)).sum())
        return f"{bad} of {got.numel()} values differ from the twin's" if bad else None
    g, w = got.double(), want.double()
    nan = g.isnan() & ~w.isnan()
    if nan.any():
        return f"{int(nan.sum())} of {got.numel()} outputs are NaN (not written, or bad math)"
    b = bounds(got.dtype, want.dtype, acc)
    both = g.isnan() & w.isnan()
    g, w = g.masked_fill(both, 0.0), w.masked_fill(both, 0.0)
    rms = w.square().mean().sqrt().item() if w.numel() else 0.0
    err = (g - w).abs()
    bad = err > b.atol + b.rtol * w.abs() + b.elem * rms
    if bad.any():
        return f"{int(bad.sum())} of {got.numel()} outputs off the twin by up to {err[bad].max().item():.3g} " \
               f"(rtol {b.rtol:g}, atol {b.atol:g}, {b.elem:.3g} x rms {rms:.3g})"
    rel = err.norm().item() / max(w.norm().item(), 1e-30)
    if rel > b.norm:
        return f"off the twin by {rel:.3g} of the output's norm (bound {b.norm:.3g}: dtype " \
               f"{str(got.dtype).removeprefix('torch.')}, reduction k={acc.k}, operand roundoff {acc.operand_u:g})"
    return None


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
           out: torch.Tensor | None = None, phase: str = "step") -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N] (batch-invariant on CUDA; the LM head passes out_dtype=fp32).
    `out`: a contiguous [..., N] buffer to write (a CUDA graph's static logits). `phase`: the kernel's tiling,
    "step" (decode, verify, drafts) or "prefill" (prompt chunks; matmul.py)."""
    if _fp8.is_fp8(w):
        return fp8_linear(x, w, out_dtype, out, phase)
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(-1, w.shape[0])
    if use_kernel("matmul", x):
        y = _mm.matmul(x2, w, out_dtype, out=out2, phase=phase)
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
        fn = _fp8.grouped_matmul_fp8 if use_kernel("matmul_fp8", x) else _fp8.grouped_matmul_fp8_ref
        return fn(x, w, scale, offsets, rows, srows, out_dtype)
    fn = _mm.grouped_matmul if use_kernel("grouped_matmul", x) else _mm.grouped_matmul_ref
    return fn(x, w, offsets, rows, out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None, phase: str = "step") -> torch.Tensor:
    """x [..., K] @ w^T for an FP8 weight w [N, K] (float8_e4m3fn with its block scales, matmul_fp8.mark): the
    W8A16 kernel where the kernels run (and it passed its startup check), else the twin (dequantize, then the
    fp32-accumulated matmul). `phase`: the kernel's tiling, as `linear`'s."""
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(-1, w.shape[0])
    scale, rows = _fp8.scales(w)
    if use_kernel("matmul_fp8", x):
        y = _fp8.matmul_fp8(x2, w, scale, rows, out_dtype, out=out2, phase=phase)
    else:
        y = _fp8.matmul_fp8_ref(x2, w, scale, rows, out_dtype)
        y = y if out2 is None else out2.copy_(y)
    return y.view(*x.shape[:-1], w.shape[0])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (_norm.rms_norm if use_kernel("rms_norm", x) else _norm.rms_norm_ref)(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (_norm.add_rms_norm if use_kernel("add_rms_norm", x) else _norm.add_rms_norm_ref)(x, residual, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (_norm.gated_rms_norm if use_kernel("gated_rms_norm", x) else _norm.gated_rms_norm_ref)(x, z, w, eps)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, pos0: torch.Tensor,
              scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    fn = _attn.attention if use_kernel("attention", q) else _attn.attention_ref
    return fn(q, k_cache, v_cache, slot, pos0, scale, gate)


write_kv = _attn.write_kv  # device-side scatter (torch on every device)


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                      pos0: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt chunks: query t of row i attends keys [0, pos0[i] + t] of its slot (attention_prefill.py)."""
    fn = _attnp.prefill_attention if use_kernel("attention_prefill", q) else _attnp.prefill_attention_ref
    return fn(q, k_cache, v_cache, slot, pos0, scale, gate)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, dst: torch.Tensor,
                lens: torch.Tensor | None = None, qk_l2norm: bool = False,
                out_dtype: torch.dtype | None = None, bounds: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt chunks: chunked GDN over N rows x T tokens from rec[slot, cur], final state to rec[slot, dst], chunks
    restarting at each row's block `bounds` (state there to window slot `keep`); o [N, T, nv, dv] in out_dtype
    (default rec's dtype) (gdn_prefill.py)."""
    if use_kernel("gdn_prefill", q):
        return _gdnp.chunked_gdn(q, k, v, g, beta, rec, slot, cur, dst, lens, qk_l2norm=qk_l2norm,
                                 out_dtype=out_dtype or rec.dtype, bounds=bounds, keep=keep)
    o = _gdnp.chunked_gdn_ref(q, k, v, g, beta, rec, slot, cur, dst, lens, qk_l2norm=qk_l2norm, bounds=bounds,
                              keep=keep)
    return o if out_dtype is None else o.to(out_dtype)


def gdn_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               rec: torch.Tensor, slot: torch.Tensor, cur: torch.Tensor, qk_l2norm: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """o [N, T, nv, dv] in out_dtype (default rec's dtype); writes rec[slot, t] (gdn_update.py)."""
    if use_kernel("gdn_update", q):
        return _gdn.gdn_update(q, k, v, g, beta, rec, slot, cur, qk_l2norm=qk_l2norm,
                               out_dtype=out_dtype or rec.dtype)
    o = _gdn.gdn_update_ref(q, k, v, g, beta, rec, slot, cur, qk_l2norm=qk_l2norm)
    return o if out_dtype is None else o.to(out_dtype)


def conv_update(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                cur: torch.Tensor) -> torch.Tensor:
    fast = use_kernel("conv_update", x) and weight.shape[-1] == 4  # the kernel is for Kc == 4 (every Qwen3.5 config)
    return (_gdn.conv_update if fast else _gdn.conv_update_ref)(x, conv, weight, slot, cur)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (_act.gdn_gates if use_kernel("gdn_gates", a) else _act.gdn_gates_ref)(a, b, neg_a, dt_bias)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return (_act.silu_mul if use_kernel("silu_mul", gu) else _act.silu_mul_ref)(gu)


def moe_combine(y: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, shared: torch.Tensor,
                shared_gate: torch.Tensor) -> torch.Tensor:
    return (_act.moe_combine if use_kernel("moe_combine", y) else _act.moe_combine_ref)(y, inv, w, shared, shared_gate)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if use_kernel("argmax", logits):
        return _sample.argmax(logits)
    out = _cpu.argmax_or_none(logits)  # fp32 on the CPU: the C kernel, torch.argmax's picks exactly
    return out if out is not None else _sample.argmax_ref(logits)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
           offset: torch.Tensor) -> torch.Tensor:
    fn = _sample.sample if use_kernel("sample", logits) else _sample.sample_ref
    return fn(logits, inv_temperature, threshold, seed, offset)
