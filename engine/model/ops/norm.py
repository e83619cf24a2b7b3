"""Fused RMSNorms of Qwen3.5: the zero-centred (1 + w) RMSNorm (with an optional fused residual add) and the
GDN output's gated RMSNorm (plain w, times silu(z)).

Numerics follow engine/model/qwen35.py's RMSNorm / GatedRMSNorm: mean of squares and scaling in fp32, cast
back to the input dtype at the same points. One program normalises one row with a fixed block, so a row's
result never depends on the number of rows (torch's own reductions may change strategy with the row count).

Twins: `rms_norm_ref`, `add_rms_norm_ref`, `gated_rms_norm_ref`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton


def _f(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float64, torch.float32) else x.float()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` (x itself when it already is: a no-op `.to` still costs a dispatch per call)."""
    return x if x.dtype == dtype else x.to(dtype)


_CONST: dict[tuple, torch.Tensor] = {}  # (value, dtype, device) -> 0-dim tensor


def const(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-dim tensor of like's dtype and device, made once: an op with it computes what the op with
    the Python number computes (a number is cast to the tensor's dtype), without wrapping a scalar on every
    call (~3 us each on a small CPU tensor)."""
    key = (value, like.dtype, like.device)
    t = _CONST.get(key)
    if t is None:
        with torch.inference_mode(False):  # a normal tensor: usable inside and outside inference mode
            t = _CONST[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return t


def one_plus(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1 + w in `dtype` (the zero-centred norm's scale), kept on the weight (attribute `_nextn_one_plus`) and
    recomputed when the weight's version, storage or the dtype changes (an in-place edit, `.data =`, a device
    move)."""
    if w.is_inference() or w.requires_grad:  # no version counter / a graph to keep: compute it
        return 1.0 + as_dtype(w, dtype)
    key = (w._version, w.data_ptr(), dtype)
    hit = getattr(w, "_nextn_one_plus", None)
    if hit is None or hit[0] != key:
        with torch.inference_mode(False):
            hit = (key, 1.0 + as_dtype(w.detach(), dtype))
        w._nextn_one_plus = hit
    return hit[1]


def _rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """xf * rsqrt(mean(xf^2) + eps) over the last dim: the arithmetic (and so the bits) of torch's CPU
    `F.rms_norm`, written out because that function costs ~1.7x these ops at decode sizes: pow(x, 2) is x * x,
    and CPU `mean` is `sum(...).div_(n)` (tests/test_ops_norm_sample.py checks the bits). Row-wise: a row's
    result does not depend on the other rows."""
    ms = torch.sum(xf * xf, -1, keepdim=True)  # [..., 1]
    ms.div_(const(float(xf.shape[-1]), xf)).add_(const(eps, xf))
    return xf * ms.rsqrt_()


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (fp64 for fp64), cast to x's dtype. x [..., H], w [H]."""
    xf = _f(x)
    return as_dtype(_rms(xf, eps) * one_plus(w, xf.dtype), x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: s = x + residual (in x's dtype) -> (rms_norm(s), s)."""
    s = x + residual
    return rms_norm_ref(s, w, eps), s


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin: (w * (x * rsqrt(mean(x^2) + eps)).to(dt)) * silu(z in fp32), cast to dt. x, z [..., D], w [D]."""
    dt = x.dtype
    y = w * as_dtype(_rms(_f(x), eps), dt)
    return as_dtype(y * F.silu(as_dtype(z, torch.float64 if dt == torch.float64 else torch.float32)), dt)


if HAS_TRITON:
    from ._triton import cast_rn

    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_kernel(x, res, w, y, s_out, z, H, eps, sx, sr, sy, ss, sz, n_rows,
                         BLOCK: tl.constexpr, MODE: tl.constexpr, RESIDUAL: tl.constexpr, ROWS: tl.constexpr):
        """MODE 0: (1 + w) RMSNorm; MODE 1: gated (plain w, times silu(z)). A [ROWS, BLOCK] tile, each row
        reduced on its own (ROWS > 1 only under the interpreter, whose cost is per program and per op)."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
        c = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        ok = (c < H) & (row < n_rows)
        xv = tl.load(x + row * sx + c, mask=ok, other=0.0)
        if RESIDUAL:
            xv = cast_rn(xv.to(tl.float32) + tl.load(res + row * sr + c, mask=ok, other=0.0).to(tl.float32),
                         x.dtype.element_ty)
            tl.store(s_out + row * ss + c, xv, mask=ok)
        xf = xv.to(tl.float32)
        n = xf * tl.rsqrt(tl.sum(xf * xf, axis=1)[:, None] / H + eps)
        wv = tl.load(w + c, mask=c < H, other=0.0)
        if MODE == 0:
            out = n * (1.0 + wv.to(tl.float32))
        else:
            # w * n.to(dt) in the promoted dtype of (w, dt), as the torch module computes it; then silu(z) in fp32
            n = wv.to(tl.float32) * cast_rn(n, y.dtype.element_ty).to(tl.float32)
            if wv.dtype != tl.float32:
                n = cast_rn(n, wv.dtype).to(tl.float32)
            zf = tl.load(z + row * sz + c, mask=ok, other=0.0).to(tl.float32)
            out = n * (zf / (1.0 + tl.exp(-zf)))
        tl.store(y + row * sy + c, cast_rn(out, y.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> a 2-D [rows, H] view (a copy only when the leading dims cannot be flattened)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, w: torch.Tensor, eps: float, mode: int, res: torch.Tensor | None = None,
            z: torch.Tensor | None = None, out: torch.Tensor | None = None,
            out_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_triton(x)
    H = x.shape[-1]
    x2 = _rows(x)
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, H)
    r2 = _rows(res) if res is not None else x2
    s = (out_sum if out_sum is not None else torch.empty_like(y)) if res is not None else None
    s2 = s.view(-1, H) if s is not None else y2
    z2 = _rows(z) if z is not None else x2
    n = x2.shape[0]
    if n:
        cfg = launch.get("rms_norm", x.dtype, x.device, H=H)  # ROWS rows per program, BLOCK >= H columns
        _rms_norm_kernel[(cdiv(n, cfg["ROWS"]),)](x2, r2, w, y2, s2, z2, H, eps, x2.stride(0), r2.stride(0),
                                                  y2.stride(0), s2.stride(0), z2.stride(0), n, MODE=mode,
                                                  RESIDUAL=res is not None, **cfg.kwargs())
    return y, s


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `rms_norm_ref`: x [..., H] (any leading strides, last dim contiguous), w [H].
    `out`: a preallocated contiguous result (here and below)."""
    return _launch(x, w, eps, 0, out=out)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, out_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `add_rms_norm_ref`: (rms_norm(x + residual), x + residual) in one pass."""
    y, s = _launch(x, w, eps, 0, res=residual, out=out, out_sum=out_sum)
    assert s is not None
    return y, s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `gated_rms_norm_ref`: x, z [..., D] (e.g. [N, T, nv, dv] per value head), w [D]."""
    return _launch(x, w, eps, 1, z=z, out=out)[0]
