"""Launch configs of every Triton kernel in engine/model/ops: ONE table, keyed by kernel, dtype, head sizes and the
device's compute capability, with a static shared-memory estimate per config.

Why a table: a kernel launched with Triton's defaults (num_stages 3 on CUDA, one fixed tile) compiles on one
device and fails on another. The attention kernels at head_dim 256 (every Qwen3.5 size) keep K and V tiles of
32 KB each (bf16, 64 keys) per pipeline stage, so the default 3 stages (about 200 KB) fit an H200's 227 KB and
not an A100's 163 KB nor an L4's / RTX 4090's 99 KB. Here every kernel gets its block sizes, warps and stages
from `get(kernel, dtype, device, **dims)`, chosen per shared-memory tier of the device:

    tier     compute capability                 opt-in shared memory per block
    large    sm90 (H100, H200), sm100           227 KB
    medium   sm80 (A100), sm87                  163 KB
    small    sm86, sm89 (L4, RTX 4090), sm120   99 KB   (and any capability not listed: the safe default)
    interp   a CPU tensor (TRITON_INTERPRET=1)  no limit; tiles chosen for the interpreter's speed

`smem_bytes(kernel, cfg, dtype, **dims)` is a static estimate of what the config stages through shared memory
(tests/test_launch_configs.py checks every config at Qwen3.5's shapes, 0.8B to 35B-A3B, bf16 and fp32, against
each tier's limit): the tiles a pipelined loop loads for `tl.dot`, times num_stages; a dot operand computed in
registers (converted to the MMA operand layout through shared memory); the fp32 accumulator's epilogue
conversion; the scratch of the largest cross-warp reduction. Every term is counted with no reuse between them,
so the estimate errs high. The startup self-check (engine/selfcheck.py) compiles each kernel on the device
anyway: a config the estimate misjudges fails there and its kernel falls back to its twin.

Batch invariance: nothing here is chosen from a batch size (M, N rows, T). Block sizes that are part of a
kernel's rounding (the matmul's BK and K split, the attention's BLOCK_N) are fixed per (dtype, device) and so
per process. The matmul has two families: `matmul/step` (decode, verify and the MTP draft: M = 1..B*(K+1)),
and `matmul/prefill` (prompt chunks, M >= 512: larger tiles). Each is batch-invariant per row, but they differ
from each other in tiling (and possibly in the MMA instruction, so in the rounding of a row): verify and
decode must use the same family (they do: both run `step`), and a prompt chunk always uses `prefill`, whatever
else is in the step, so a request never mixes the two for the same math.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

KB = 1024

#: opt-in shared memory per block, bytes, by compute capability (CUDA programming guide, "Compute Capabilities")
SMEM_LIMIT: dict[tuple[int, int], int] = {
    (8, 0): 163 * KB, (8, 6): 99 * KB, (8, 7): 163 * KB, (8, 9): 99 * KB,
    (9, 0): 227 * KB, (10, 0): 227 * KB, (12, 0): 99 * KB,
}
#: the device classes tests/test_launch_configs.py checks (one per tier and the laptop part the issue names)
DEVICE_CLASSES: dict[str, tuple[int, int]] = {"sm80": (8, 0), "sm89": (8, 9), "sm90": (9, 0), "sm120": (12, 0)}
LARGE, MEDIUM, SMALL, INTERP = "large", "medium", "small", "interp"


def smem_limit(cc: tuple[int, int] | None) -> int | None:
    """Opt-in shared memory per block of compute capability `cc` (None: the interpreter, no limit). A capability
    not in SMEM_LIMIT gets the smallest listed limit (99 KB)."""
    if cc is None:
        return None
    return SMEM_LIMIT.get(tuple(cc), min(SMEM_LIMIT.values()))


def tier(cc: tuple[int, int] | None) -> str:
    """The config tier of a compute capability (module docstring)."""
    lim = smem_limit(cc)
    if lim is None:
        return INTERP
    return LARGE if lim >= 227 * KB else MEDIUM if lim >= 163 * KB else SMALL


@dataclass(frozen=True)
class Launch:
    """One kernel launch config: block sizes (by the kernel's constexpr names), num_warps, num_stages."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 1

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def kwargs(self) -> dict[str, int]:
        """The launch's keyword arguments: every block constexpr, num_warps, num_stages."""
        return {**dict(self.blocks), "num_warps": self.num_warps, "num_stages": self.num_stages}


def L(num_warps: int = 4, num_stages: int = 1, **blocks: int) -> Launch:  # noqa: N802 - a table row
    return Launch(tuple(sorted(blocks.items())), num_warps, num_stages)


def _p2(n: int) -> int:
    """The next power of two >= n (Triton's block shapes are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------------------------
# The table. Each entry: the kernel function(s) it launches (module.function, for the coverage test), the config
# chooser (tier, dtype, dims) -> Launch, and the shared-memory estimate (Launch, dtype, dims) -> bytes.
# ---------------------------------------------------------------------------------------------------------------

def _matmul_step(t: str, dt: torch.dtype, d: dict) -> Launch:
    if t == INTERP:  # a row's result never depends on BM; the interpreter pays for every padded row
        return L(4, 1, BM=16, BN=64, BK=64)
    wide = dt == torch.float32
    stages = {LARGE: 3 if wide else 4, MEDIUM: 3 if wide else 4, SMALL: 2 if wide else 3}[t]
    return L(4, stages, BM=64, BN=64, BK=64)


def _matmul_prefill(t: str, dt: torch.dtype, d: dict) -> Launch:
    if t == INTERP:
        return L(4, 1, BM=16, BN=64, BK=64)
    if dt == torch.float32:
        return {LARGE: L(8, 3, BM=128, BN=64, BK=64), MEDIUM: L(4, 3, BM=64, BN=64, BK=64),
                SMALL: L(4, 2, BM=64, BN=64, BK=64)}[t]
    return {LARGE: L(8, 4, BM=128, BN=128, BK=64), MEDIUM: L(8, 2, BM=128, BN=128, BK=64),
            SMALL: L(8, 2, BM=128, BN=64, BK=64)}[t]


def _matmul_grouped(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1 if t == INTERP else 3, BM=16, BN=64, BK=64)  # MoE: a few rows per expert


def _smem_matmul(c: Launch, dt: torch.dtype, d: dict) -> int:
    # A [BM, BK] and B [BK, BN] tiles per stage (the K loop is pipelined), the fp32 accumulator's epilogue
    return c.num_stages * (c["BM"] * c["BK"] + c["BK"] * c["BN"]) * _esize(dt) + c["BM"] * c["BN"] * 4


#: the FP8 format's block edge: the W8A16 matmul's K tile (one scale column per K tile, in every config)
FP8_BK = 128


def _matmul_fp8_step(t: str, dt: torch.dtype, d: dict) -> Launch:
    """W8A16 decode / verify / drafts (matmul_fp8.py). BK is the format's block on every device."""
    if t == INTERP:
        return L(4, 1, BM=16, BN=64, BK=FP8_BK)
    if dt == torch.float32:
        return {LARGE: L(4, 3, BM=64, BN=64, BK=FP8_BK), MEDIUM: L(4, 2, BM=64, BN=64, BK=FP8_BK),
                SMALL: L(4, 2, BM=32, BN=64, BK=FP8_BK)}[t]
    return L(4, {LARGE: 4, MEDIUM: 3, SMALL: 2}[t], BM=64, BN=64, BK=FP8_BK)


def _matmul_fp8_prefill(t: str, dt: torch.dtype, d: dict) -> Launch:
    """W8A16 prompt chunks (M >= 256 rows of the grid): larger tiles where shared memory allows."""
    if t == INTERP or dt == torch.float32:  # fp32 tiles leave no room for larger ones: the step tiling
        return _matmul_fp8_step(t, dt, d)
    return {LARGE: L(8, 2, BM=128, BN=128, BK=FP8_BK), MEDIUM: L(8, 2, BM=128, BN=64, BK=FP8_BK),
            SMALL: L(4, 2, BM=64, BN=64, BK=FP8_BK)}[t]


def _matmul_fp8_grouped(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1 if t == INTERP else 2, BM=16, BN=64, BK=FP8_BK)  # MoE experts: a few rows per expert


def _smem_matmul_fp8(c: Launch, dt: torch.dtype, d: dict) -> int:
    # per stage: the activation tile A [BM, BK] (model dtype), the FP8 weight tile [BK, BN] (1 byte) and its
    # block scales [BN] (fp32); the dequantized weight tile [BK, BN] in the model dtype (a dot operand computed
    # in registers); the fp32 accumulator's epilogue
    bm, bn, bk, e = c["BM"], c["BN"], c["BK"], _esize(dt)
    return c.num_stages * (bm * bk * e + bk * bn + bn * 4) + bk * bn * e + bm * bn * 4


def _attention(t: str, dt: torch.dtype, d: dict) -> Launch:
    """Decode / verify / draft attention (split-KV). BLOCK_N is part of the rounding (fixed per process)."""
    bd = _p2(d["hd"])
    if t == INTERP:
        return L(4, 1, BLOCK_M=16, BLOCK_N=64, BLOCK_D=bd)
    big = dt == torch.float32 or bd > 256
    bn = {LARGE: 32 if big else 64, MEDIUM: 32 if big else 64, SMALL: 16 if big else 32}[t]
    return L(4, 2, BLOCK_M=16, BLOCK_N=bn, BLOCK_D=bd)


def _smem_attention(c: Launch, dt: torch.dtype, d: dict) -> int:
    # K [BD, BN] and V [BN, BD] per stage; Q [BM, BD] (a dot operand loaded once); P [BM, BN] cast to the KV
    # dtype (a dot operand computed in registers); the row max / sum reductions over [BM, BN] fp32
    bm, bn, bd, e = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"], _esize(dt)
    return c.num_stages * 2 * bd * bn * e + bm * bd * e + bm * bn * e + bm * bn * 4


def _attention_merge(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1, BLOCK_D=_p2(d["hd"]))


def _smem_vector(c: Launch, dt: torch.dtype, d: dict) -> int:
    return c["BLOCK_D"] * 4  # per-split loads of one [BD] row, no tile in shared memory


def _attention_prefill(t: str, dt: torch.dtype, d: dict) -> Launch:
    """Prefill attention (one pass over the keys, blocks at absolute multiples of BLOCK_N)."""
    bd = _p2(d["hd"])
    if t == INTERP:
        return L(4, 1, BLOCK_M=16, BLOCK_N=32, BLOCK_D=bd)
    if dt == torch.float32 or bd > 256:
        return {LARGE: L(8, 2, BLOCK_M=64, BLOCK_N=32, BLOCK_D=bd), MEDIUM: L(4, 2, BLOCK_M=32, BLOCK_N=16, BLOCK_D=bd),
                SMALL: L(4, 2, BLOCK_M=16, BLOCK_N=16, BLOCK_D=bd)}[t]
    return {LARGE: L(8, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=bd), MEDIUM: L(4, 3, BLOCK_M=64, BLOCK_N=32, BLOCK_D=bd),
            SMALL: L(4, 2, BLOCK_M=32, BLOCK_N=32, BLOCK_D=bd)}[t]


def _gdn_update(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1, BK=_p2(d["dk"]), BV=min(32, _p2(d["dv"])))


def _smem_gdn_update(c: Launch, dt: torch.dtype, d: dict) -> int:
    return c["BK"] * c["BV"] * 4  # the reduction over the state tile's dk axis (fp32)


def _gdn_prefill(t: str, dt: torch.dtype, d: dict) -> Launch:
    """Chunked GDN prefill: one program per (row, value head, dv block) walks its chunks in order. IEEE = 1 for
    every model dtype: every dot of the kernel has fp32 operands (the state, the UT transform, the normalised q/k)
    and feeds the fp32 recurrent state that later chunks, later prompt blocks and every decode step build on, so
    the dots run in IEEE fp32, never TF32 (10-bit mantissas: about 1e-3 relative per product, compounded over the
    prompt's chunks, where the fp32 pool promises fp32 states and the self-check compares them at the fp32
    accumulation tolerance, dispatch.bounds). 16 warps: IEEE dots lower to FMA loops unrolled over each thread's
    share of the tile, so more threads mean less code per thread (sm_90: 26k PTX lines and 76 s to compile at 4 warps,
    8k lines and 18 s at 16; registers 32 and no spills either way; bench/compile_targets.py)."""
    bv = min(32, _p2(d["dv"]))
    return L(16, 1, CHUNK=64, BK=_p2(d["dk"]), BV=bv, IEEE=1)


def _smem_gdn_prefill(c: Launch, dt: torch.dtype, d: dict) -> int:
    # num_stages 1: no pipelined buffers; one dot at a time converts its two fp32 operands (the largest is
    # Q [C, BK] @ K^T [BK, C]); the forward substitution reduces [C, C] fp32 tiles
    C, bk, bv = c["CHUNK"], c["BK"], c["BV"]
    biggest_dot = max(2 * C * bk, C * bk + bk * bv, bk * C + C * bv, C * C + C * max(bk, bv)) * 4
    return biggest_dot + C * C * 4


def _conv_update(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1, BC=128)


def _rms_norm(t: str, dt: torch.dtype, d: dict) -> Launch:
    H = d["H"]
    rows = 16 if t == INTERP else 1  # the interpreter pays per program; a GPU wants one row per program
    return L(4 if H <= 2048 else 8, 1, BLOCK=_p2(H), ROWS=rows)


def _smem_rms_norm(c: Launch, dt: torch.dtype, d: dict) -> int:
    return c["ROWS"] * c["BLOCK"] * 4  # the row reduction, counted as a whole fp32 tile


def _elementwise(block: int) -> Callable[[str, torch.dtype, dict], Launch]:
    return lambda t, dt, d: L(4, 1, BLOCK=block)


def _gdn_gates(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(1, 1, BLOCK=_p2(d["nv"]))


def _race_merge(t: str, dt: torch.dtype, d: dict) -> Launch:
    return L(4, 1, BLOCK=_p2(d["nch"]))


def _smem_reduce_index(c: Launch, dt: torch.dtype, d: dict) -> int:
    return next(v for k, v in c.blocks if k in ("CHUNK", "BLOCK")) * 8  # value + index of an argmax reduction


def _smem_block_fp32(c: Launch, dt: torch.dtype, d: dict) -> int:
    return c["BLOCK"] * 4  # the split reduction's store converts its [BLOCK] fp32 layout through shared memory


def _none(c: Launch, dt: torch.dtype, d: dict) -> int:
    return 0  # elementwise: no tile goes through shared memory


#: fixed across devices: which chunk a logit falls in is part of the tie-break bookkeeping (sample.py)
RACE_CHUNK = 4096


@dataclass(frozen=True)
class Entry:
    kernels: tuple[str, ...]  # "module._kernel" names this entry launches
    dims: tuple[str, ...]  # the shape dims its choice reads
    choose: Callable[[str, torch.dtype, dict], Launch]
    smem: Callable[[Launch, torch.dtype, dict], int]


TABLE: dict[str, Entry] = {
    "matmul/step": Entry(("matmul._matmul_kernel",), (), _matmul_step, _smem_matmul),
    "matmul/prefill": Entry(("matmul._matmul_kernel",), (), _matmul_prefill, _smem_matmul),
    "matmul/grouped": Entry(("matmul._matmul_kernel",), (), _matmul_grouped, _smem_matmul),
    "matmul/split_reduce": Entry(("matmul._split_reduce_kernel",), (), _elementwise(1024), _smem_block_fp32),
    "attention": Entry(("attention._attn_split_kernel",), ("hd",), _attention, _smem_attention),
    "attention/merge": Entry(("attention._attn_merge_kernel",), ("hd",), _attention_merge, _smem_vector),
    "attention_prefill": Entry(("attention_prefill._attn_prefill_kernel",), ("hd",), _attention_prefill,
                               _smem_attention),
    "gdn_update": Entry(("gdn_update._gdn_kernel",), ("dk", "dv"), _gdn_update, _smem_gdn_update),
    "conv_update": Entry(("gdn_update._conv_kernel",), (), _conv_update, _none),
    "gdn_prefill": Entry(("gdn_prefill._gdn_chunk_kernel",), ("dk", "dv"), _gdn_prefill, _smem_gdn_prefill),
    "rms_norm": Entry(("norm._rms_norm_kernel",), ("H",), _rms_norm, _smem_rms_norm),
    "silu_mul": Entry(("act._silu_mul_kernel",), (), _elementwise(1024), _none),
    "moe_combine": Entry(("act._moe_combine_kernel",), (), _elementwise(1024), _none),
    "gdn_gates": Entry(("act._gdn_gates_kernel",), ("nv",), _gdn_gates, _none),
    "race/chunk": Entry(("sample._race_chunk_kernel",), (), lambda t, dt, d: L(8, 1, CHUNK=RACE_CHUNK),
                        _smem_reduce_index),
    "race/merge": Entry(("sample._race_merge_kernel",), ("nch",), _race_merge, _smem_reduce_index),
    "matmul_fp8/step": Entry(("matmul_fp8._matmul_fp8_kernel",), (), _matmul_fp8_step, _smem_matmul_fp8),
    "matmul_fp8/prefill": Entry(("matmul_fp8._matmul_fp8_kernel",), (), _matmul_fp8_prefill, _smem_matmul_fp8),
    "matmul_fp8/grouped": Entry(("matmul_fp8._matmul_fp8_kernel",), (), _matmul_fp8_grouped, _smem_matmul_fp8),
}


_TARGET: list[tuple[tuple[int, int], list]] = []  # `compile_target`'s stack: (cc, the choices made inside)


@contextlib.contextmanager
def compile_target(cc: tuple[int, int]) -> Iterator[list[tuple[str, torch.dtype, dict, Launch]]]:
    """TOOLS ONLY (bench/compile_targets.py): inside, `capability` answers `cc` for a tensor on the "meta" device, so
    the kernel wrappers choose the launch configs (and the FP8 decode) of that target while their launches are
    recorded for compiling, not run; yields the list of (kernel, dtype, dims, config) that `get` chose for meta
    tensors, in order. Nothing in the serving path holds meta tensors."""
    chosen: list[tuple[str, torch.dtype, dict, Launch]] = []
    _TARGET.append((tuple(cc), chosen))  # type: ignore[arg-type]
    try:
        yield chosen
    finally:
        _TARGET.pop()


def capability(device: torch.device | str) -> tuple[int, int] | None:
    """Compute capability of a CUDA device (None for any other device: the interpreter's configs; a meta tensor
    inside `compile_target(cc)`: cc)."""
    dev = torch.device(device)
    if dev.type == "meta" and _TARGET:
        return _TARGET[-1][0]
    if dev.type != "cuda":
        return None
    return _cc(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cc(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def choose(kernel: str, dtype: torch.dtype, cc: tuple[int, int] | None, **dims: int) -> Launch:
    """The config of `kernel` (a TABLE key) for dtype, compute capability `cc` (None: interpreter) and the shape
    dims its entry reads (e.g. hd=256). Raises KeyError for an unknown kernel or a missing dim."""
    e = TABLE[kernel]
    return _choose(kernel, dtype, tier(cc), tuple((k, int(dims[k])) for k in e.dims))


@functools.lru_cache(maxsize=None)
def _choose(kernel: str, dtype: torch.dtype, t: str, dims: tuple[tuple[str, int], ...]) -> Launch:
    return TABLE[kernel].choose(t, dtype, dict(dims))


def get(kernel: str, dtype: torch.dtype, device: torch.device | str, **dims: int) -> Launch:
    """What a kernel wrapper launches with: `choose` for the device's compute capability."""
    cfg = choose(kernel, dtype, capability(device), **dims)
    if _TARGET and torch.device(device).type == "meta":
        _TARGET[-1][1].append((kernel, dtype, dims, cfg))
    return cfg


def smem_bytes(kernel: str, cfg: Launch, dtype: torch.dtype, **dims: int) -> int:
    """Static shared-memory estimate of `cfg` for `kernel` (module docstring)."""
    return TABLE[kernel].smem(cfg, dtype, dims)


def over_limit(cc: tuple[int, int], dtype: torch.dtype, **dims: int) -> list[tuple[str, int, int]]:
    """Every (kernel, estimate, limit) whose config for (cc, dtype, dims) is over the device's limit ([] when all
    fit). `dims` must hold every dim any entry reads (hd, dk, dv, H, nv, nch)."""
    lim = smem_limit(cc)
    assert lim is not None
    out = []
    for name, e in TABLE.items():
        sub = {k: dims[k] for k in e.dims}
        est = smem_bytes(name, choose(name, dtype, cc, **sub), dtype, **sub)
        if est > lim:
            out.append((name, est, lim))
    return out
