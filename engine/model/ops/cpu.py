"""The CPU kernel: the Gated DeltaNet token step in C (cpu_gdn.c), built with the system C compiler on first use
and called through ctypes.

Why: on a CPU a small model's decode step is bound by op dispatch, not arithmetic. The torch path spends ~60 aten
calls per GDN layer per token between the input projection and the output projection (conv, l2norm, gates,
recurrence, gated norm, the state writes); the kernel does all of it in one call (bench/RESULTS.md).

Contract: `gdn_step` computes what GatedDeltaNet's torch path computes for a recording forward (and a one-token
non-recording one) over the pool, for fp32 models: row i reads window slot read[i] of pool slot slots[i], the state
after token t goes to window slot write0[i] + t. It rounds differently from the torch twin (tests/test_ops_cpu.py
bounds the difference), but every (row, token) runs the same code in the same order, so a row's outputs are
bitwise the same alone or in any batch and at any T: verify (T = K+1) and plain decode (T = 1) agree bitwise, which
is what exactness needs.

The build: `cc -O3 -ffp-contract=off -shared -fPIC`, cached by the source's and flags' hash under
~/.cache/nextn/kernels (a temporary directory when that is not writable). Without a C compiler, or when the build
fails, `available()` is False (logged once) and the model keeps the torch path. `set_enabled(False)` turns the
kernel off for the process (the A/B benchmarks and the twin tests use it).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("nextn.cpu_kernels")

SOURCE = Path(__file__).with_name("cpu_gdn.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_MAX_KC = 16  # cpu_gdn.c's MAX_KC

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True
_why = ""  # why the kernel is unavailable (set by a failed build)


def _cache_dir() -> Path:
    try:
        d = Path.home() / ".cache" / "nextn" / "kernels"  # RuntimeError: no home directory (an unknown uid)
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return d
    except (OSError, RuntimeError):
        return Path(tempfile.mkdtemp(prefix="nextn-kernels-"))


def _unavailable(why: str, level: int = logging.INFO) -> None:
    global _why
    _why = why
    log.log(level, "CPU kernel unavailable (%s); the torch path runs", why)


def _build() -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _unavailable("no C compiler (cc) on PATH")
        return None
    try:  # no writable cache nor temporary directory (a read-only root file system), an unreadable source
        src = SOURCE.read_bytes()
        key = hashlib.sha256(src + " ".join(FLAGS).encode() + platform.machine().encode() + cc.encode()).hexdigest()
        so = _cache_dir() / f"cpu_gdn-{key[:16]}.so"
    except OSError as e:
        _unavailable(f"no place to build it: {e}", logging.WARNING)
        return None
    if not so.exists():
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        try:
            subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, so)  # atomic: concurrent builders each write their own temporary file
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            _unavailable(f"build failed: {e}" + (f": {err.decode(errors='replace')[:500]}" if err else ""),
                         logging.WARNING)
            tmp.unlink(missing_ok=True)
            return None
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        _unavailable(f"load failed: {e}", logging.WARNING)
        return None
    fn = lib.nextn_gdn_step_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                   ctypes.c_float, ctypes.c_float, i64, i64, i64, i64, i64, i64, ptr]
    fn.restype = ctypes.c_int
    log.info("CPU kernel ready: %s", so)
    return lib


def _get() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _build()
                _tried = True
    return _lib


def available() -> bool:
    """Whether the kernel is enabled and built (builds it on the first call)."""
    return _enabled and _get() is not None


def set_enabled(on: bool) -> bool:
    """Turn the kernel on or off for this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(on)
    return prev


def describe(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """For the startup log: which GDN token step a model on `device` in `dtype` runs (None off the CPU).
    Builds the kernel now when it will be used, so the first request does not wait for the compiler."""
    if torch.device(device).type != "cpu":
        return None
    if dtype != torch.float32:
        return f"GDN token step: torch ops (the C kernel is float32 only; the model is {dtype})"
    if not _enabled:
        return "GDN token step: torch ops (--no-cpu-kernel)"
    if _get() is None:
        return f"GDN token step: torch ops (C kernel unavailable: {_why})"
    return "GDN token step: C kernel (engine/model/ops/cpu_gdn.c)"


def usable(x: torch.Tensor, kc: int) -> bool:
    """Whether `gdn_step` takes this forward: fp32 CPU activations that need no gradient (the kernel has no
    backward), a supported conv width, the kernel available."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and 2 <= kc <= _MAX_KC
            and available())


@functools.lru_cache(maxsize=None)
def _qscale(dk: int) -> float:
    """dk^-1/2 as the fp32 number the torch path multiplies by (passed to C as that float)."""
    return float(torch.tensor(dk ** -0.5, dtype=torch.float32))


def _i64s(v: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(v))(*v)


def gdn_step(proj: torch.Tensor, conv_w: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, slots: list[int],
             read: list[int], write0: list[int], neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
             norm_eps: float, nk: int, dk: int, nv: int, dv: int) -> torch.Tensor:
    """The GDN token step of N rows x T tokens (see the module docstring), from the fused input projection's
    output to the gated RMSNorm's output.

    proj [N, T, P] fp32 (qkv | z | b | a, last dim contiguous); conv_w [C, Kc]; conv [S, W, C, Kc-1] and
    rec [S, W, nv, dk, dv] fp32 pools (each slot contiguous); neg_a = -exp(A_log), dt_bias, [nv]; norm_w [dv].
    Returns [N, T, nv * dv] fp32."""
    lib = _get()
    if lib is None or not _enabled:
        raise RuntimeError("CPU kernel unavailable")
    N, T, P = proj.shape
    C, kc = conv_w.shape
    S, W = conv.shape[:2]
    f32 = torch.float32
    # the C code trusts every size, stride and index it is given: check them all here (real raises, not asserts)
    if not (proj.dtype == conv.dtype == rec.dtype == conv_w.dtype == neg_a.dtype == dt_bias.dtype == norm_w.dtype
            == f32 and C == 2 * nk * dk + nv * dv and P == C + nv * dv + 2 * nv and 2 <= kc <= _MAX_KC
            and conv.shape[2:] == (C, kc - 1) and rec.shape == (S, W, nv, dk, dv)
            and conv.stride()[2:] == (kc - 1, 1) and rec.stride()[2:] == (dk * dv, dv, 1)
            and conv_w.stride() == (kc, 1) and neg_a.shape == dt_bias.shape == (nv,) and norm_w.shape == (dv,)
            and neg_a.stride() == dt_bias.stride() == norm_w.stride() == (1,)):
        raise ValueError("gdn_step: inconsistent shapes, dtypes or layouts (see its docstring)")
    if not len(slots) == len(read) == len(write0) == len(set(slots)) == N:
        raise ValueError("gdn_step: one distinct pool slot, read and write slot per row")
    for s_, r_, w_ in zip(slots, read, write0):
        if not (0 <= s_ < S and 0 <= r_ < W and 0 <= w_ and w_ + T <= W):
            raise IndexError(f"pool slot {s_} / window slots {r_}, {w_}..{w_ + T - 1} outside [{S}, {W}]")
    if proj.stride(-1) != 1 or proj.stride(0) != T * proj.stride(1):
        proj = proj.contiguous()
    out = torch.empty(N, T, nv * dv, dtype=f32)
    qscale = _qscale(dk)
    rc = lib.nextn_gdn_step_f32(N, T, proj.data_ptr(), proj.stride(1), conv_w.data_ptr(), conv.data_ptr(),
                                conv.stride(0), conv.stride(1), rec.data_ptr(), rec.stride(0), rec.stride(1),
                                _i64s(slots), _i64s(read), _i64s(write0), neg_a.data_ptr(), dt_bias.data_ptr(),
                                norm_w.data_ptr(), norm_eps, qscale, C, kc, nk, dk, nv, dv, out.data_ptr())
    if rc:
        raise RuntimeError(f"CPU GDN kernel failed (code {rc})")
    return out
