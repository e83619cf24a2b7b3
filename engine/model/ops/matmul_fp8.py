"""W8A16 matmul for Qwen's block-128 FP8 weights: y = x @ w^T with w kept in FP8 (every FP8 linear on the kernel
path), and its grouped-by-expert form (the MoE experts).

The format (Qwen's "-FP8" releases; config.json `quantization_config` = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128], ...}): a weight q float8_e4m3fn [..., N, K] comes
with `weight_scale_inv` [..., ceil(N/128), ceil(K/128)] (fp32 or bf16), and the weight it stands for is
    w[n, k] = float(q[n, k]) * scale[n // 128, k // 128]        (an fp32 product; edge blocks are partial).
`dequantize` computes exactly that and casts it to the model dtype; a CPU load serves those weights.

An FP8 weight travels as the Parameter holding q (float8_e4m3fn), with its fp32 block scales and an optional scale
row map attached (`mark`, read by `scales`): rows [N] int32 names the scale row of each weight row. A single
weight has none (row n reads scale row n // 128); a fused weight (q|k|v, gate|up) whose pieces do not end on
128-row boundaries gets one (`fuse`), so any pieces fuse and keep their own blocks.

Numerics: the kernel dequantizes each [BK, BN] weight tile to the activation dtype, as cast(q * scale)
(the same fp32 product and rounding as `dequantize`), then accumulates x @ tile in fp32 as matmul.py does: the
weights it multiplies are bitwise those of the dequantized model. The K tile is the format's block (128), so each
K tile reads one scale per weight row.

Launch configs: the launch table's "matmul_fp8/step", "matmul_fp8/prefill" and "matmul_fp8/grouped" (launch.py),
the two dense families with matmul.py's meaning of `phase`.

Contract (batch invariance, as matmul.py): row m of y depends only on x[m] and the weight: tiles and the K split
(`fp8_config`) are functions of (N, K) and the per-process tiling only, every K block is accumulated in fp32 in the same order for every row,
and a K split is reduced by matmul.py's split-reduce kernel in index order. Nothing is chosen from M.

The FP8 decode on the device: `tl` converts float8e4nv natively on compute capability >= 8.9 (Ada, Hopper,
Blackwell); older GPUs (and the interpreter) decode the e4m3 bits with integer ops (`_decode`), which gives the same
values (every e4m3fn code but NaN is exact in fp32).

Twins: `matmul_fp8_ref`, `grouped_matmul_fp8_ref` (dequantize to x's dtype, then matmul.py's twins).
"""
from __future__ import annotations

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton
from .matmul import PHASES, TARGET_PROGRAMS, expert_tiles, grouped_matmul_ref, matmul_ref

FP8 = torch.float8_e4m3fn
BLOCK = launch.FP8_BK  # the format's block edge (weight_block_size [128, 128]); every config's K tile
MIN_K_BLOCKS_PER_SPLIT = 2  # 256 elements of K per split at least, as matmul.py's 4 x 64


def is_fp8(w: torch.Tensor) -> bool:
    """Whether `w` is an FP8 weight (float8_e4m3fn, its scales attached by `mark`)."""
    return w.dtype == FP8


def mark(w: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attach the block scales (fp32 [..., NB, KB]) and the optional scale row map (int32 [N]) to the FP8 weight w
    [..., N, K]; returns w."""
    w.fp8_scale = scale  # type: ignore[attr-defined]
    w.fp8_rows = rows  # type: ignore[attr-defined]
    return w


def scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, rows) of an FP8 weight made by `mark` (ValueError for an FP8 tensor without them)."""
    s = getattr(w, "fp8_scale", None)
    if s is None:
        raise ValueError("an FP8 weight without its block scales (engine.model.ops.matmul_fp8.mark)")
    return s, w.fp8_rows  # type: ignore[attr-defined]


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of a weight of `shape` [..., N, K]: [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = shape
    return (*lead, cdiv(n, BLOCK), cdiv(k, BLOCK))


def dequantize(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight an FP8 tensor stands for: float(q[..., n, k]) * scale[..., r(n), k // 128] in fp32 (r(n) = rows[n],
    or n // 128 without a row map), cast to `dtype`. q [..., N, K] float8_e4m3fn, scale [..., NB, KB]."""
    N, K = q.shape[-2:]
    r = rows.long() if rows is not None else torch.arange(N, device=q.device) // BLOCK  # [N]
    s = scale.float().index_select(-2, r.to(scale.device)).repeat_interleave(BLOCK, dim=-1)[..., :K]  # [..., N, K]
    return (q.float() * s).to(dtype)


def fuse(ws: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One FP8 weight [sum N_i, K] from FP8 weights [N_i, K] (marked): q rows and scale rows concatenated, with a
    row map when a piece before the last does not end on a 128-row boundary (or already has one). Returns the
    fused weight and each piece as a marked view of its rows (its own scales)."""
    q = torch.cat(ws).contiguous()  # [N, K]
    parts = [scales(w) for w in ws]
    scale = torch.cat([s for s, _ in parts]).contiguous()  # [sum NB_i, KB]
    aligned = all(r is None for _, r in parts) and all(w.shape[0] % BLOCK == 0 for w in ws[:-1])
    rows = None
    if not aligned:
        maps, base = [], 0
        for w, (s, r) in zip(ws, parts):
            own = r if r is not None else torch.arange(w.shape[0], device=q.device, dtype=torch.int32) // BLOCK
            maps.append(own.to(q.device, torch.int32) + base)
            base += s.shape[0]
        rows = torch.cat(maps)  # [N] int32
    views, at = [], 0
    for w, (s, r) in zip(ws, parts):
        views.append(mark(q[at:at + w.shape[0]], s, r))
        at += w.shape[0]
    return mark(q, scale, rows), views


def fp8_config(N: int, K: int, cfg: launch.Launch | None = None) -> tuple[int, int]:
    """(k_per_split, split_k) for an FP8 weight [N, K] under the tiling `cfg` (default: the interpreter's "step"
    tiling): a function of the weight shape and the tiling only (never of M); each split starts on a scale
    block (BK is the format's block in every config)."""
    cfg = cfg if cfg is not None else launch.choose("matmul_fp8/step", torch.float32, None)
    k_blocks = cdiv(K, cfg["BK"])
    split = max(1, min(k_blocks // MIN_K_BLOCKS_PER_SPLIT, TARGET_PROGRAMS // cdiv(N, cfg["BN"])))
    per = cdiv(k_blocks, split)  # K blocks per split; no empty split
    return per * cfg["BK"], cdiv(k_blocks, per)


def matmul_fp8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin: x [M, K] @ dequantize(q, scale, rows, x.dtype)^T (fp32 accumulate), cast to out_dtype (default x's)."""
    return matmul_ref(x, dequantize(q, scale, rows, x.dtype), out_dtype)


def grouped_matmul_fp8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                           rows: torch.Tensor | None = None, srows: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of `grouped_matmul_fp8`: matmul.grouped_matmul_ref over the dequantized experts."""
    return grouped_matmul_ref(x, dequantize(q, scale, srows, x.dtype), offsets, rows, out_dtype)


def _native(q: torch.Tensor) -> bool:
    """Whether the kernel converts q's float8e4nv natively (a CUDA device of compute capability >= 8.9)."""
    cc = launch.capability(q.device)
    return cc is not None and cc >= (8, 9)


if HAS_TRITON:
    from ._triton import cast_rn, mm
    from .matmul import _split_reduce_kernel, store_tile, tile_rows

    @triton.jit
    def _decode(b, NATIVE: tl.constexpr):
        """FP8 e4m3fn tile -> fp32. NATIVE: b holds float8e4nv; else its bits as uint8 (sign, 4 exponent bits with
        bias 7, 3 mantissa bits; exponent 0 is subnormal): value = mantissa * 2^(exponent - 10), both exact."""
        if NATIVE:
            return b.to(tl.float32)
        else:
            u = b.to(tl.int32)
            e = (u >> 3) & 15
            m = u & 7
            mant = tl.where(e > 0, m | 8, m).to(tl.float32)
            p2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, 1) - 10)
            v = mant * p2
            return tl.where((u & 128) != 0, -v, v)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_fp8_kernel(x, q, s, srows, y, part, rows, tile_expert, tile_row0, offsets, M, N, K, E, K_PER_SPLIT,
                           sxm, sxk, sqe, sqn, sqk, sse, ssn, ssk, sym, syn,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUPED: tl.constexpr,
                           GATHER: tl.constexpr, SPLIT: tl.constexpr, ROWMAP: tl.constexpr, NATIVE: tl.constexpr,
                           IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        e, rm, m_ok, xr = tile_rows(pid_m, rows, tile_expert, tile_row0, offsets, M, E, BM, GROUPED, GATHER)
        if GROUPED:
            if e >= E:  # spare tile of the static grid
                return
            q = q + e.to(tl.int64) * sqe
            s = s + e.to(tl.int64) * sse
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        if ROWMAP:
            sr = tl.load(srows + rn, mask=n_ok, other=0)
        else:
            sr = rn // BK
        s_row = s + sr.to(tl.int64) * ssn  # [BN] the scale row of each weight row
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + rk
            k_ok = kk < k_hi
            a = tl.load(x + xr[:, None] * sxm + kk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[None, :] & k_ok[:, None]
            b = tl.load(q + rn[None, :].to(tl.int64) * sqn + kk[:, None] * sqk, mask=w_ok)  # [BK, BN] fp8
            sc = tl.load(s_row + (k0 // BK) * ssk, mask=n_ok, other=0.0)  # [BN] fp32: k0 starts a scale block
            w = tl.where(w_ok, _decode(b, NATIVE) * sc[None, :], 0.0)
            w = cast_rn(w, x.dtype.element_ty)  # [BK, BN] the dequantized tile
            acc = mm(a, w, acc, IEEE)
        store_tile(y, part, acc, rm, rn, m_ok, n_ok, pid_k, M, N, sym, syn, SPLIT)


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, srows: torch.Tensor | None) -> None:
    check_triton(x)
    if q.dtype != FP8 or scale.dtype != torch.float32:
        raise TypeError(f"FP8 matmul takes a float8_e4m3fn weight and fp32 scales, got {q.dtype} and {scale.dtype}")
    want = scale_shape(q.shape)
    if scale.shape[:-2] != q.shape[:-2] or scale.shape[-1] != want[-1] or srows is None and scale.shape[-2] != want[-2]:
        raise ValueError(f"scale {tuple(scale.shape)} does not fit weight {tuple(q.shape)} (want {want})")
    if srows is not None and (srows.dtype != torch.int32 or srows.numel() != q.shape[-2]):
        raise ValueError("rows: int32 [N], the scale row of each weight row")


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, srows: torch.Tensor | None, y: torch.Tensor,
            M: int, N: int, K: int, split_k: int | None,
            grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, rows: torch.Tensor | None,
            cfg: launch.Launch, m_tiles: int) -> None:
    k_per, split = fp8_config(N, K, cfg)
    if split_k is not None:  # explicit override (tests, prefill); still never derived from M, still on scale blocks
        k_per = cdiv(cdiv(K, cfg["BK"]), split_k) * cfg["BK"]
        split = cdiv(K, k_per)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    native = _native(q)
    qk = q if native else q.view(torch.uint8)
    te, tr, offs, E = grouped if grouped is not None else (y, y, y, 1)
    sqe, sse = (q.stride(0), scale.stride(0)) if grouped is not None else (0, 0)
    grid = (m_tiles, cdiv(N, cfg["BN"]), split)
    _matmul_fp8_kernel[grid](x, qk, scale, srows if srows is not None else y, y, part,
                             rows if rows is not None else y, te, tr, offs, M, N, K, E, k_per,
                             x.stride(0), x.stride(1), sqe, q.stride(-2), q.stride(-1), sse, scale.stride(-2),
                             scale.stride(-1), y.stride(0), y.stride(1),
                             GROUPED=grouped is not None, GATHER=rows is not None, SPLIT=split > 1,
                             ROWMAP=srows is not None, NATIVE=native, IEEE=x.dtype == torch.float32,
                             **cfg.kwargs())
    if split > 1:
        red = launch.get("matmul/split_reduce", y.dtype, y.device)
        _split_reduce_kernel[(cdiv(M * N, red["BLOCK"]),)](part, y, M * N, N, split, y.stride(0), y.stride(1),
                                                           **red.kwargs())


def matmul_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, split_k: int | None = None,
               out: torch.Tensor | None = None, phase: str = "step") -> torch.Tensor:
    """Triton: x [M, K] @ dequantize(q, scale, rows, x.dtype)^T -> y [M, N] (fp32 accumulate; out_dtype default
    x.dtype, fp32 for logits). q float8_e4m3fn [N, K], scale fp32 [ceil(N/128), ceil(K/128)] (or the rows its row
    map names), rows None or int32 [N]. Any strides of x and y. `split_k` overrides the (N, K)-derived K split.
    `out`: a [M, N] buffer to write (static buffers under CUDA graphs). `phase`: the tiling family, "step" or
    "prefill" (matmul.py's contract: a prompt chunk never has a K split)."""
    _check(x, q, scale, rows)
    if phase not in PHASES:
        raise ValueError(f"unknown matmul phase {phase!r} ({', '.join(PHASES)})")
    M, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == K, (x.shape, q.shape)
    y = out if out is not None else torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = launch.get(f"matmul_fp8/{phase}", x.dtype, x.device)
    if phase == "prefill" and split_k is None:
        split_k = 1  # as matmul.py: prompt chunks never take a K split (fixed, not from M)
    _launch(x, q, scale, rows, y, M, N, K, split_k, None, None, cfg, cdiv(M, cfg["BM"]))
    return y


def grouped_matmul_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                       rows: torch.Tensor | None = None, srows: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton: sorted row m of expert e -> x[rows[m]] @ dequantize(q[e], scale[e], srows)^T, y [M, N] in sorted
    order (matmul.grouped_matmul's contract). q float8_e4m3fn [E, N, K], scale fp32 [E, NB, KB], srows None or
    int32 [N] (every expert's scale row map); offsets [E+1] from `group_by_expert`; rows [M] gather indices."""
    _check(x, q, scale, srows)
    M = rows.numel() if rows is not None else x.shape[0]
    E, N, K = q.shape
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = launch.get("matmul_fp8/grouped", x.dtype, x.device)
    te, tr, n = expert_tiles(offsets, M, cfg["BM"])
    offs = offsets.to(device=x.device, dtype=torch.int32)
    _launch(x, q, scale, srows, y, M, N, K, None, (te, tr, offs, E), rows, cfg, n)
    return y
