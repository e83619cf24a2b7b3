"""The CPU kernels, in C, built with the system C compiler on first use and called through ctypes: the Gated
DeltaNet token step (cpu_gdn.c), the gated attention token step and the zero-centred RMSNorm (cpu_attn.c), the
small-M GEMM and the SwiGLU MLP built on it (cpu_linear.c, AVX2 + FMA or portable C; its tiles of two or more rows
run 16 lanes wide on a CPU with AVX-512, with the same bits) and the greedy pick over logits rows (cpu_sample.c,
torch.argmax's picks); cpu_vec.h holds the vector type and the exp they share, cpu_arch.h which code is built.

Why: on a CPU a small model's decode step is bound by op dispatch, not arithmetic. The torch path spends ~60 aten
calls per GDN layer per token between the input projection and the output projection (conv, l2norm, gates,
recurrence, gated norm, the state writes), ~30 per attention layer between its two projections (q / k norms, RoPE,
the K/V writes, SDPA and its mask, the gate) and 7 per RMSNorm; each kernel does its part in one call
(bench/RESULTS.md). torch's GEMM (MKL) rounds a row differently with the row count; cpu_linear.c's does not.

Contract: `attn_step` computes what GatedAttention's torch path computes over the KV pool for step forwards
(decode, verify, MTP drafts) and prefill blocks of any length, and
`rms_norm` what norm.rms_norm_ref computes, both for fp32. `gdn_step` computes what GatedDeltaNet's torch path
computes over the pool for those forwards, for fp32 models: row i reads window slot read[i] of pool slot slots[i];
in a recording forward the state after token t goes to window slot write0[i] + t, in a prefill chunk every token
updates window slot write0[i] and `lens` marks the right padding. It rounds differently from the torch twin
(tests/test_ops_cpu.py bounds the difference), but every (row, token) runs the same code in the same order, so a
row's outputs are bitwise the same alone or in any batch and at any T: verify (T = K+1) and plain decode (T = 1)
agree bitwise, which is what exactness needs. The same holds for `attn_step` (its sums run in fixed lanes and a
fixed tree, whatever the batch, T or the row's neighbours), `rms_norm` (row by row) and `linear_or_none` /
`mlp_or_none` (each output element is one fixed sequence of FMAs and a fixed tree, whatever tile computes it, 8 or
16 lanes wide): with all of them a dense model's step forward is bitwise invariant to the batch and to T
(bench/batch_invariance.py).

The build: `cc -O3 -ffp-contract=off -shared -fPIC` (and -mavx2 on a CPU that has it: the same IEEE operations,
eight lanes at a time), cached by the sources' and flags' hash under
~/.cache/nextn/kernels (a temporary directory when that is not writable). Without a C compiler, or when the build
fails, `available()` is False (logged once) and the model keeps the torch path. `set_enabled(False)` turns the
kernels off for the process (the A/B benchmarks and the twin tests use it).

Two builds of the same sources (cpu_arch.h): the x86 one (the GEMM in AVX2 + FMA intrinsics, AVX-512 tiles,
MXCSR) on x86 CPUs, and the portable one (-DNEXTN_PORTABLE: plain C and vector extensions, the GEMM's lanes through
C99 fmaf) on every other CPU (aarch64) and on an x86 CPU with FMA but no AVX2 (built with -mfma there, so fmaf is
the instruction). They give every output the same bits (tests/test_ops_cpu_portable.py). The GEMM runs only where
the fused multiply-add is an instruction: an x86 CPU without FMA keeps torch's GEMM (with glibc's software fmaf
the portable GEMM costs ~70 ns a multiply-add, hundreds of times torch's), and its prefill then carries one
session per forward (engine/prefill.py `packs_rows`). The choice is logged once; `use_portable_build()` forces the
portable build (tests).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
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

SOURCES = tuple(Path(__file__).with_name(f) for f in ("cpu_gdn.c", "cpu_attn.c", "cpu_linear.c", "cpu_par.c",
                                                      "cpu_sample.c"))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("cpu_vec.h", "cpu_par.h", "cpu_arch.h"))
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _x86_features() -> set[str]:
    """Which of AVX2 and FMA this x86 CPU has (Linux /proc/cpuinfo; none when it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return {"avx2", "fma"} & set(line.split())
    except OSError:
        pass
    return set()


def _portable_reason() -> str | None:
    """Why this machine takes the portable build (None: the x86 one; see the module docstring)."""
    if _force_portable:
        return "forced by use_portable_build"
    if not X86:
        return f"{platform.machine() or 'this CPU'} is not x86"
    if _x86_features() == {"fma"}:
        return "an x86 CPU with FMA but without AVX2"
    return None


def _flags(portable: bool) -> tuple[str, ...]:
    """The compiler flags of a build. x86: -mavx2 when the CPU has AVX2 (the 8-lane sums then run as one vector op;
    no -mfma: the intrinsics ask for FMA themselves, and with -ffp-contract=off every other sum is the same IEEE
    operations either way). Portable: -DNEXTN_PORTABLE (the x86 code off, cpu_arch.h), and -mfma on an x86 CPU with
    FMA, so that fmaf is the instruction (without it, a call to libm)."""
    if not portable:
        return (*FLAGS, *(("-mavx2",) if "avx2" in _x86_features() else ()))
    return (*FLAGS, "-DNEXTN_PORTABLE", *(("-mfma",) if X86 and "fma" in _x86_features() else ()))


_MAX_KC = 16  # cpu_gdn.c's MAX_KC

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True
_why = ""  # why the kernel is unavailable (set by a failed build)
_gemm = False  # cpu_linear.c's GEMM runs (nextn_linear_ok: AVX2 + FMA, or a portable build with hardware FMA)
_force_portable = False  # use_portable_build
_threads = 1  # threads the kernels may use (cpu_par.c: 1 or 2), applied to the library when it is built
_wide = True  # the GEMM's 16-lane tiles where the CPU has AVX-512 (set_wide), applied when it is built
MAX_THREADS = 2  # cpu_par.c runs the calling thread and one helper


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


def _build(portable: bool | None = None) -> ctypes.CDLL | None:
    """The library built (or found in the cache) from the portable or the x86 code (None: the one this machine
    takes, logged when portable), its functions typed; None when it cannot be had (logged)."""
    if portable is None:
        why = _portable_reason()
        if why:
            log.info("CPU kernels: the portable build (%s)", why)
        portable = why is not None
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _unavailable("no C compiler (cc) on PATH")
        return None
    try:  # no writable cache nor temporary directory (a read-only root file system), an unreadable source
        src = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
        flags = _flags(portable)
        key = hashlib.sha256(src + " ".join(flags).encode() + platform.machine().encode() + cc.encode()).hexdigest()
        so = _cache_dir() / f"nextn_cpu-{key[:16]}.so"
    except OSError as e:
        _unavailable(f"no place to build it: {e}", logging.WARNING)
        return None
    if not so.exists():
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        try:
            subprocess.run([cc, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], check=True, capture_output=True,
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
                   ctypes.c_float, ctypes.c_float, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr]
    fn.restype = ctypes.c_int
    fn = lib.nextn_attn_step_f32
    fn.argtypes = [i64, i64, ptr, i64, ptr, ptr, ctypes.c_float, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64,
                   i64, i64, ctypes.c_float, ptr]
    fn.restype = ctypes.c_int
    fn = lib.nextn_sigmoid_f32
    fn.argtypes = [i64, ptr, ptr]
    fn.restype = ctypes.c_int
    fn = lib.nextn_rms_norm_f32
    fn.argtypes = [i64, i64, ptr, i64, ptr, ctypes.c_float, ptr]
    fn.restype = ctypes.c_int
    lib.nextn_linear_ok.argtypes, lib.nextn_linear_ok.restype = [], ctypes.c_int
    lib.nextn_portable.argtypes, lib.nextn_portable.restype = [], ctypes.c_int
    fn = lib.nextn_linear_f32
    fn.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr]
    fn.restype = ctypes.c_int
    fn = lib.nextn_mlp_f32
    fn.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    fn = lib.nextn_argmax_f32
    fn.argtypes = [i64, i64, ptr, i64, ptr]
    fn.restype = ctypes.c_int
    lib.nextn_set_threads.argtypes, lib.nextn_set_threads.restype = [ctypes.c_int], ctypes.c_int
    lib.nextn_set_threads(_threads)
    lib.nextn_linear_set_wide.argtypes, lib.nextn_linear_set_wide.restype = [ctypes.c_int], ctypes.c_int
    lib.nextn_linear_set_wide(int(_wide))
    log.info("CPU kernel ready: %s", so)
    return lib


def _get() -> ctypes.CDLL | None:
    global _lib, _tried, _gemm
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _build()
                _gemm = _lib is not None and bool(_lib.nextn_linear_ok())
                if _lib is not None and not _gemm:
                    log.info("CPU GEMM off (%s): torch's GEMM runs, and prefill carries one session per forward",
                             _no_gemm_reason())
                _tried = True
    return _lib


def _no_gemm_reason() -> str:
    return ("no hardware FMA: a software fmaf is hundreds of times slower than torch's GEMM" if _lib is not None
            and _lib.nextn_portable() else "this CPU lacks AVX2 + FMA")


def use_portable_build(on: bool = True) -> None:
    """Tests only: build the kernels from their portable code (-DNEXTN_PORTABLE, as on a CPU that is not x86) from
    the next build on. Call it before anything builds the library: RuntimeError once a library of the other kind is
    loaded. (Serving never calls it: the build is chosen by the machine, see the module docstring.)"""
    global _force_portable
    if _tried and _lib is not None and bool(_lib.nextn_portable()) != on:
        raise RuntimeError("the CPU kernels are already loaded from the other build")
    _force_portable = bool(on)


def portable() -> bool:
    """Whether the loaded library is the portable build (builds it on the first call; False when unavailable)."""
    lib = _get()
    return lib is not None and bool(lib.nextn_portable())


def _lib_or_raise() -> ctypes.CDLL:
    """The built library for a kernel call that was asked for explicitly (RuntimeError when off or unavailable)."""
    lib = _get()
    if lib is None or not _enabled:
        raise RuntimeError("CPU kernel unavailable")
    return lib


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernel is enabled and built for a model on `device` (builds it on the first call). Never for a
    device other than the CPU: a CUDA model neither builds nor runs the C kernels (every decision below checks the
    tensors' device before it would build)."""
    return torch.device(device).type == "cpu" and _enabled and _get() is not None


def set_threads(n: int) -> int:
    """Let the kernels use up to `n` threads (capped at MAX_THREADS): a GEMM's column blocks, a token step's rows and
    the MLP's gate|up blocks are then shared by the calling thread and one helper (cpu_par.c) when a job is large
    enough to repay the hand-off. Each item is computed by the same code on either thread, so no bit depends on it.
    Returns the previous setting."""
    global _threads
    prev, _threads = _threads, max(1, min(MAX_THREADS, int(n)))
    if _lib is not None:
        _lib.nextn_set_threads(_threads)
    return prev


def set_wide(on: bool) -> bool:
    """Whether the GEMM may use its 16-lane (AVX-512) tiles on a CPU that has them (default on). They give the same
    bits as the 8-lane tiles (cpu_linear.c), so this only changes the speed: the A/B benchmark and the test that
    compares the two bitwise turn them off. Returns whether they are used now (False on a CPU without AVX-512)."""
    global _wide
    _wide = bool(on)
    lib = _get()
    return bool(lib.nextn_linear_set_wide(int(_wide))) if lib is not None else False


def configure(*, torch_threads: int | None, kernel_threads: int | None, enabled: bool) -> None:
    """The serving process's CPU settings in one call (`nextn serve` and its engine process): torch's intra-op
    threads (None: torch's default), the kernels' threads (`set_threads`; None: as they are) and whether the
    kernels run at all (`set_enabled`)."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    if kernel_threads is not None:
        set_threads(kernel_threads)
    set_enabled(enabled)


def threads() -> int:
    """The threads the kernels may use (`set_threads`)."""
    return _threads


def set_enabled(on: bool) -> bool:
    """Turn the kernel on or off for this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(on)
    return prev


def describe(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """For the startup log: whether a model on `device` in `dtype` runs the C kernels or torch ops for the GDN and
    attention token steps and the RMSNorms (None off the CPU). Builds the kernels now when they will be used, so
    the first request does not wait for the compiler."""
    what = "GDN / attention token steps, RMSNorm, step GEMMs"
    if torch.device(device).type != "cpu":
        return None
    if dtype != torch.float32:
        return f"{what}: torch ops (the C kernels are float32 only; the model is {dtype})"
    if not _enabled:
        return f"{what}: torch ops (--no-cpu-kernel)"
    if _get() is None:
        return f"{what}: torch ops (C kernels unavailable: {_why})"
    gemm = f"; GEMMs: torch ({_no_gemm_reason()})" if not _gemm else \
        "; GEMM tiles: 16 lanes (AVX-512)" if _lib.nextn_linear_set_wide(int(_wide)) else ""  # type: ignore
    build = ", portable build" if _lib.nextn_portable() else ""  # type: ignore
    return (f"{what}: C kernels (engine/model/ops/cpu_gdn.c, cpu_attn.c, cpu_linear.c, cpu_sample.c{build}) on "
            f"{_threads} thread{'s' if _threads > 1 else ''}{gemm}")


def usable(x: torch.Tensor, kc: int) -> bool:
    """Whether `gdn_step` takes this forward: fp32 CPU activations that need no gradient (the kernel has no
    backward), a supported conv width, the kernel available."""
    return 2 <= kc <= _MAX_KC and takes(x)


@functools.lru_cache(maxsize=None)
def _qscale(dk: int) -> float:
    """dk^-1/2 as the fp32 number the torch path multiplies by (passed to C as that float)."""
    return float(torch.tensor(dk ** -0.5, dtype=torch.float32))


def _i64s(v: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(v))(*v)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., K] as rows of K floats for the C code: (a tensor holding them, the row pitch in elements). Row r
    (leading dims flattened) starts at r * pitch; a copy when the rows are not one pitch apart. The pitch of a
    contiguous x is K whatever the stride torch reports for a size-1 dimension."""
    K = x.shape[-1]
    if x.is_contiguous():
        return x, K
    x2 = x.reshape(-1, K)
    if x2.stride(-1) == 1 and x2.shape[0] > 1 and x2.stride(0) >= K:
        return x2, x2.stride(0)
    return x2.contiguous(), K


def gdn_step(proj: torch.Tensor, conv_w: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, slots: list[int],
             read: list[int], write0: list[int], neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
             norm_eps: float, nk: int, dk: int, nv: int, dv: int, record: bool = True,
             lens: list[int] | None = None, seg: list[list[int]] | None = None,
             keep: list[list[int]] | None = None) -> torch.Tensor:
    """The GDN token step of N rows x T tokens (see the module docstring), from the fused input projection's
    output to the gated RMSNorm's output. record: the state after token t goes to window slot write0[i] + t;
    otherwise every token updates window slot write0[i] (a prefill chunk), and `lens` (each row's real tokens,
    <= T; None: T) marks the right padding, which leaves the state alone and outputs zeros. seg, keep (not
    recording; `FwdCtx.seg` / `keep`): row i carries the blocks seg[i] (their lengths add up to its real tokens),
    block j < last updating window slot keep[i][j] (a slot of its own, neither read[i] nor write0[i]) and the last
    write0[i]: one call with the bits of one call per block, each inner boundary's state left in its slot.

    proj [N, T, P] fp32 (qkv | z | b | a, last dim contiguous); conv_w [C, Kc]; conv [S, W, C, Kc-1] and
    rec [S, W, nv, dk, dv] fp32 pools (each slot contiguous); neg_a = -exp(A_log), dt_bias, [nv]; norm_w [dv].
    Returns [N, T, nv * dv] fp32."""
    lib = _lib_or_raise()
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
    if lens is not None and not (len(lens) == N and all(0 <= n <= T for n in lens)):
        raise ValueError("gdn_step: lens must give each row's real tokens, 0..T")
    bend = bslot = None
    B = 0
    if seg is not None:
        if record or keep is None or not len(seg) == len(keep) == N:
            raise ValueError("gdn_step: seg and keep name every row's blocks of a forward that does not record")
        B = max(len(k) for k in keep)
        ends, slots_at = [], []
        for i, (blocks, kept) in enumerate(zip(seg, keep)):
            real = T if lens is None else lens[i]
            if len(kept) != len(blocks) - 1 or sum(blocks) != real or any(n < 1 for n in blocks):
                raise ValueError("gdn_step: a row's blocks must cover its real tokens, one kept slot between two")
            if any(not 0 <= w < W or w in (read[i], write0[i]) for w in kept) or len(set(kept)) < len(kept):
                raise ValueError("gdn_step: each inner block boundary's state needs a window slot of its own")
            at = list(itertools.accumulate(blocks))[:-1]
            ends += at + [-1] * (B - len(at))
            slots_at += list(kept) + [-1] * (B - len(kept))
        bend, bslot = _i64s(ends), _i64s(slots_at)
    span = T if record else 1  # window slots written from write0
    for s_, r_, w_ in zip(slots, read, write0):
        if not (0 <= s_ < S and 0 <= r_ < W and 0 <= w_ and w_ + span <= W):
            raise IndexError(f"pool slot {s_} / window slots {r_}, {w_}..{w_ + span - 1} outside [{S}, {W}]")
    proj, pitch = _rows(proj)
    out = torch.empty(N, T, nv * dv, dtype=f32)
    qscale = _qscale(dk)
    rc = lib.nextn_gdn_step_f32(N, T, proj.data_ptr(), pitch, conv_w.data_ptr(), conv.data_ptr(),
                                conv.stride(0), conv.stride(1), rec.data_ptr(), rec.stride(0), rec.stride(1),
                                _i64s(slots), _i64s(read), _i64s(write0), neg_a.data_ptr(), dt_bias.data_ptr(),
                                norm_w.data_ptr(), norm_eps, qscale, C, kc, nk, dk, nv, dv, int(record),
                                None if lens is None else _i64s(lens), bend, bslot, B, out.data_ptr())
    if rc:
        raise RuntimeError(f"CPU GDN kernel failed (code {rc})")
    return out



def attn_step(qkv: torch.Tensor, q_w1: torch.Tensor, k_w1: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], pos0: list[int],
              nh: int, nkv: int, hd: int, scale: float) -> torch.Tensor:
    """The gated attention token step of N rows x T tokens (cpu_attn.c), from the fused projection's output to
    o_proj's input: q / k RMSNorm (q_w1, k_w1 = 1 + their weights, [hd]), RoPE on the first R dims, K / V
    written at positions pos0[i].. of pool slot slots[i], causal attention of each row over its own cached keys,
    times sigmoid(gate). cos, sin: each token's RoPE row [N, T, R], or a table [L', R] of rows by position (token
    t of row i takes row pos0[i] + t; L' > max(pos0) + T - 1; `rope_table`'s, as a step forward passes it).

    qkv [N, T, 2 nh hd + 2 nkv hd] fp32 (q|gate per head, then k, then v; last dim contiguous); k_cache, v_cache
    [S, L, nkv, hd] fp32 (each slot contiguous). Returns [N, T, nh * hd] fp32."""
    lib = _lib_or_raise()
    N, T, P = qkv.shape
    S, L = k_cache.shape[:2]
    R = cos.shape[-1]
    f32 = torch.float32
    by_pos = cos.dim() == 2
    if not (qkv.dtype == k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype == q_w1.dtype == k_w1.dtype
            == f32 and P == 2 * nh * hd + 2 * nkv * hd and nkv >= 1 and nh % nkv == 0
            and k_cache.shape == v_cache.shape == (S, L, nkv, hd) and k_cache.stride() == v_cache.stride()
            and k_cache.stride()[1:] == (nkv * hd, hd, 1) and cos.shape == sin.shape
            and (by_pos or cos.shape == (N, T, R))
            and 0 <= R <= hd and R % 2 == 0 and q_w1.shape == k_w1.shape == (hd,)
            and q_w1.stride() == k_w1.stride() == (1,)):
        raise ValueError("attn_step: inconsistent shapes, dtypes or layouts (see its docstring)")
    if not len(slots) == len(pos0) == len(set(slots)) == N:
        raise ValueError("attn_step: one distinct pool slot and position per row")
    for s_, p_ in zip(slots, pos0):
        if not (0 <= s_ < S and 0 <= p_ and p_ + T <= L):
            raise IndexError(f"pool slot {s_} / positions {p_}..{p_ + T - 1} outside [{S}, {L}]")
        if by_pos and p_ + T > cos.shape[0]:
            raise IndexError(f"positions {p_}..{p_ + T - 1} outside the RoPE table's {cos.shape[0]} rows")
    qkv, pitch = _rows(qkv)
    cos, sin = cos.contiguous(), sin.contiguous()  # (contiguous: row r of the flattened [rows, R] at r * R)
    out = torch.empty(N, T, nh * hd, dtype=f32)
    rc = lib.nextn_attn_step_f32(N, T, qkv.data_ptr(), pitch, q_w1.data_ptr(), k_w1.data_ptr(), eps,
                                 cos.data_ptr(), sin.data_ptr(), R, int(by_pos), k_cache.data_ptr(),
                                 v_cache.data_ptr(), k_cache.stride(0), _i64s(slots), _i64s(pos0), nh, nkv, hd, scale,
                                 out.data_ptr())
    if rc:
        raise RuntimeError(f"CPU attention kernel failed (code {rc})")
    return out


def takes(x: torch.Tensor) -> bool:
    """Whether `attn_step` and `rms_norm` take x: fp32 CPU activations that need no gradient (the kernels have no
    backward), the kernel available."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and _enabled \
        and _get() is not None


def rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w1 over the last dim (cpu_attn.c): x [..., H] fp32 (any layout), w1 = 1 + the
    weight [H] fp32 contiguous. Returns a new contiguous tensor of x's shape."""
    lib = _lib_or_raise()
    H = x.shape[-1]
    if not (x.dtype == w1.dtype == torch.float32 and w1.shape == (H,) and w1.is_contiguous()):
        raise ValueError("rms_norm: x [..., H] and w1 [H] must be float32, w1 contiguous")
    y = torch.empty(*x.shape, dtype=torch.float32)  # (unpacked: parsing a torch.Size costs ~2 us more a call)
    x2, pitch = _rows(x)  # rows of a view (q / k heads inside a projection): one pitch, or a copy
    if H:
        lib.nextn_rms_norm_f32(x.numel() // H, H, x2.data_ptr(), pitch, w1.data_ptr(), eps, y.data_ptr())
    return y


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) element by element (cpu_attn.c, cpu_vec.h's exp): x fp32 (any shape and layout); a new
    contiguous tensor. An element's bits never depend on the tensor's size or its index, unlike torch.sigmoid's
    (vectorised body and scalar tail round differently)."""
    lib = _lib_or_raise()
    if x.dtype != torch.float32:
        raise ValueError("sigmoid: x must be float32")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        lib.nextn_sigmoid_f32(x.numel(), x.data_ptr(), y.data_ptr())
    return y


def gemm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear_or_none` computes x @ w^T: fp32 CPU tensors that need no gradient, the GEMM built (AVX2 + FMA,
    or the portable build on a CPU with hardware FMA),
    w contiguous [N, K] with K a multiple of 8 (decided by w and the machine alone, never by the row count)."""
    return (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and _enabled
            and not x.requires_grad and not w.requires_grad and w.dim() == 2 and w.shape[1] > 0 and w.shape[1] % 8 == 0
            and x.shape[-1] == w.shape[1] and w.is_contiguous() and (_gemm if _tried else _get() is not None and _gemm))


def linear_or_none(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] @ w [N, K]^T -> [..., N] fp32 (cpu_linear.c), or None when `gemm_takes(x, w)` is False (the
    caller's GEMM then runs). Each output element is summed in a fixed order, so a row's bits never depend on the
    other rows. The checks are the hot path's: one pass, no duplicate validation."""
    if not gemm_takes(x, w):
        return None
    N, K = w.shape
    x2, pitch = _rows(x)
    M = x.numel() // K
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    if M and _lib.nextn_linear_f32(M, N, K, x2.data_ptr(), pitch, w.data_ptr(), y.data_ptr()):  # type: ignore
        raise RuntimeError("CPU GEMM failed")
    return y


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear_or_none` that raises (ValueError) instead of returning None."""
    y = linear_or_none(x, w)
    if y is None:
        raise ValueError("linear: x [..., K], w [N, K] float32 CPU, w contiguous, K a multiple of 8, no gradient, "
                         "the GEMM available (hardware FMA)")
    return y


def mlp_or_none(x: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU down(silu(gate(x)) * up(x)) in one call (cpu_linear.c), or None when the GEMM does not take it (see
    `gemm_takes`): x [..., H], w_gu [2I, H] (gate rows then up rows), w_down [H, I], contiguous fp32, H and I
    multiples of 8. Returns [..., H]."""
    if not (gemm_takes(x, w_gu) and w_down.dtype == torch.float32 and not w_down.requires_grad
            and w_down.shape == (x.shape[-1], w_gu.shape[0] // 2) and w_gu.shape[0] % 16 == 0
            and w_down.is_contiguous()):
        return None
    H, I = w_down.shape
    x2, pitch = _rows(x)
    M = x.numel() // H
    y = torch.empty(*x.shape, dtype=torch.float32)
    if M and _lib.nextn_mlp_f32(M, H, I, x2.data_ptr(), pitch, w_gu.data_ptr(), w_down.data_ptr(),  # type: ignore
                                y.data_ptr()):
        raise RuntimeError("CPU MLP failed")
    return y


def argmax_or_none(logits: torch.Tensor) -> torch.Tensor | None:
    """The greedy pick of each row of logits [N, V] (cpu_sample.c), exactly torch.argmax(dim=-1)'s: the lowest
    index of the maximum (-0.0 ties +0.0), the first NaN of a row that has one. [N] int64, or None when the kernel
    does not take it (see `takes`; V == 0 or >= 2^31), and the caller's torch.argmax runs. torch's runs ~7x slower
    at [32, 2112] on one thread (bench/RESULTS.md)."""
    if not (logits.dim() == 2 and 0 < logits.shape[1] < 2 ** 31 and takes(logits)):
        return None
    x, pitch = _rows(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if _lib.nextn_argmax_f32(logits.shape[0], logits.shape[1], x.data_ptr(), pitch, out.data_ptr()):  # type: ignore
        raise RuntimeError("CPU argmax failed")
    return out
