"""Batch-invariant matmul y = x @ w^T (every linear layer, the LM head) and its grouped-by-expert form (MoE).

Contract (batch invariance): row m of y depends only on x[m] and w, never on how many rows the launch has or
what the other rows hold. The kernel gets this from a tiling fixed per weight shape: the block sizes come from
the launch table (launch.py: per dtype and device, never per M) and the K split (`matmul_config`) is a
function of (N, K) and the tiling only, every K block is accumulated in fp32 in the same order for every row,
and a K split (when N alone gives too few programs) is reduced by a second kernel that sums the fixed number
of fp32 partials in index order. Nothing is chosen from M.

Two tilings (`phase`): "step" (decode, verify, MTP drafts; the default) and "prefill" (prompt chunks: larger
tiles). Each is batch-invariant per row; they may round a row differently from each other, so verify and
decode both use "step", and a prompt chunk always "prefill" (launch.py says why).

Twins: `matmul_ref`, `grouped_matmul_ref` (fp32 accumulate, output dtype of x unless `out_dtype`).
"""
from __future__ import annotations

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton

TARGET_PROGRAMS = 264  # about two waves of an H200's 132 SMs; only sets the K split, from (N, K)
MIN_K_BLOCKS_PER_SPLIT = 4
PHASES = ("step", "prefill")


def matmul_config(N: int, K: int, cfg: launch.Launch | None = None) -> tuple[int, int]:
    """(k_per_split, split_k) for a weight [N, K] under the tiling `cfg` (default: the interpreter's "step"
    tiling): a function of the weight shape and the tiling only (never of M)."""
    cfg = cfg if cfg is not None else launch.choose("matmul/step", torch.float32, None)
    bk = cfg["BK"]
    k_blocks = cdiv(K, bk)
    n_tiles = cdiv(N, cfg["BN"])
    split = max(1, min(k_blocks // MIN_K_BLOCKS_PER_SPLIT, TARGET_PROGRAMS // n_tiles))
    per = cdiv(k_blocks, split)  # K blocks per split; no empty split
    return per * bk, cdiv(k_blocks, per)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def matmul_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin: x [M, K] @ w[N, K]^T accumulated in fp32 (fp64 for fp64), cast to out_dtype (default x.dtype)."""
    acc = _acc_dtype(x.dtype)
    return (x.to(acc) @ w.to(acc).T).to(out_dtype or x.dtype)


def group_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing ids idx [T, k] -> (order [T*k] int64, offsets [E+1] int32), device-side, no host sync.

    order lists the flat (token * k + j) routing slots sorted by expert (stable, so token order within an
    expert); expert e owns sorted rows offsets[e]:offsets[e+1]. The token of sorted row m is order[m] // k."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


def grouped_matmul_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin: sorted row m of expert e (offsets[e] <= m < offsets[e+1]) -> x[rows[m]] @ w[e]^T.

    x [R, K] (rows None: x is already in sorted order), w [E, N, K], offsets [E+1]. Returns y [M, N]."""
    xs = x if rows is None else x[rows]
    y = torch.empty(xs.shape[0], w.shape[1], dtype=out_dtype or x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            y[a:b] = matmul_ref(xs[a:b], w[e], out_dtype)
    return y


if HAS_TRITON:
    from ._triton import cast_rn, mm

    @triton.jit
    def tile_rows(pid_m, rows, tile_expert, tile_row0, offsets, M, E, BM: tl.constexpr, GROUPED: tl.constexpr,
                  GATHER: tl.constexpr):
        """The rows of M tile pid_m: (e, rm [BM], m_ok [BM], xr [BM] int64). Grouped: e is the tile's expert (E for a
        spare tile of the static grid, which the caller skips), its rows run from tile_row0[pid_m] to its expert's
        last; dense: e = 0, rows pid_m * BM.. below M. xr: the x row each output row reads (rows[rm] when GATHER)."""
        if GROUPED:
            e = tl.load(tile_expert + pid_m)
            row0 = tl.load(tile_row0 + pid_m)
            row_end = tl.load(offsets + tl.minimum(e, E - 1) + 1)
        else:
            e = 0
            row0 = pid_m * BM
            row_end = M
        rm = row0 + tl.arange(0, BM)
        m_ok = rm < row_end
        if GATHER:
            xr = tl.load(rows + rm, mask=m_ok, other=0).to(tl.int64)
        else:
            xr = rm.to(tl.int64)
        return e, rm, m_ok, xr

    @triton.jit
    def store_tile(y, part, acc, rm, rn, m_ok, n_ok, pid_k, M, N, sym, syn, SPLIT: tl.constexpr):
        """The fp32 tile acc [BM, BN] to y[rm, rn] in y's dtype, or (SPLIT) to the partials part[pid_k, rm, rn]."""
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT:
            offs = (pid_k.to(tl.int64) * M + rm[:, None]) * N + rn[None, :]
            tl.store(part + offs, acc, mask=out_mask)
        else:
            tl.store(y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, cast_rn(acc, y.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x, w, y, part, rows, tile_expert, tile_row0, offsets, M, N, K, E, K_PER_SPLIT,
                       sxm, sxk, swe, swn, swk, sym, syn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUPED: tl.constexpr,
                       GATHER: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        e, rm, m_ok, xr = tile_rows(pid_m, rows, tile_expert, tile_row0, offsets, M, E, BM, GROUPED, GATHER)
        if GROUPED:
            if e >= E:  # spare tile of the static grid
                return
            w = w + e.to(tl.int64) * swe
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + rk
            k_ok = kk < k_hi
            a = tl.load(x + xr[:, None] * sxm + kk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + rn[None, :].to(tl.int64) * swn + kk[:, None] * swk, mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0)
            acc = mm(a, b, acc, IEEE)
        store_tile(y, part, acc, rm, rn, m_ok, n_ok, pid_k, M, N, sym, syn, SPLIT)

    @triton.jit(do_not_specialize=["MN"])
    def _split_reduce_kernel(part, y, MN, N, S, sym, syn, BLOCK: tl.constexpr):
        """y[m, n] = sum over s = 0..S-1 (in order) of part[s, m, n], cast to y's dtype. MN = M * N."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        p = part + offs
        for _ in range(S):
            acc += tl.load(p, mask=ok, other=0.0)
            p += MN
        m = offs // N
        n = offs % N
        tl.store(y + m * sym + n * syn, cast_rn(acc, y.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, M: int, N: int, K: int, split_k: int | None,
            grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, rows: torch.Tensor | None,
            cfg: launch.Launch, m_tiles: int) -> None:
    k_per, split = matmul_config(N, K, cfg)
    if split_k is not None:  # explicit override (tests, prefill); still never derived from M
        k_per = cdiv(cdiv(K, cfg["BK"]), split_k) * cfg["BK"]
        split = cdiv(K, k_per)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    dummy = y
    te, tr, offs, E = grouped if grouped is not None else (dummy, dummy, dummy, 1)
    swe = w.stride(0) if grouped is not None else 0
    swn, swk = w.stride(-2), w.stride(-1)
    grid = (m_tiles, cdiv(N, cfg["BN"]), split)
    _matmul_kernel[grid](x, w, y, part, rows if rows is not None else dummy, te, tr, offs, M, N, K, E, k_per,
                         x.stride(0), x.stride(1), swe, swn, swk, y.stride(0), y.stride(1),
                         GROUPED=grouped is not None, GATHER=rows is not None, SPLIT=split > 1,
                         IEEE=x.dtype == torch.float32, **cfg.kwargs())
    if split > 1:
        red = launch.get("matmul/split_reduce", y.dtype, y.device)
        _split_reduce_kernel[(cdiv(M * N, red["BLOCK"]),)](part, y, M * N, N, split, y.stride(0), y.stride(1),
                                                           **red.kwargs())


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, split_k: int | None = None,
           out: torch.Tensor | None = None, phase: str = "step") -> torch.Tensor:
    """Triton: x [M, K] @ w [N, K]^T -> y [M, N] (fp32 accumulate; out_dtype default x.dtype, fp32 for logits).

    Any strides. `split_k` overrides the (N, K)-derived K split (still independent of M). `out`: a [M, N]
    buffer to write (static buffers under CUDA graphs). `phase`: the tiling family, "step" (decode, verify,
    drafts) or "prefill" (prompt chunks); see the module docstring."""
    check_triton(x, w)
    if phase not in PHASES:
        raise ValueError(f"unknown matmul phase {phase!r} ({', '.join(PHASES)})")
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, (x.shape, w.shape)
    y = out if out is not None else torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = launch.get(f"matmul/{phase}", x.dtype, x.device)
    if phase == "prefill" and split_k is None:
        split_k = 1  # prompt chunks bring rows enough to fill the device: never a K split (fixed, not from M)
    _launch(x, w, y, M, N, K, split_k, None, None, cfg, cdiv(M, cfg["BM"]))
    return y


def expert_tiles(offsets: torch.Tensor, M: int, block_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Static tile map for the grouped kernel, device-side: (tile_expert [n], tile_row0 [n], n) with
    n = cdiv(M, block_m) + min(E, M) (an upper bound, so the grid does not depend on the routing);
    spare tiles have expert E. block_m: the grouped tiling's BM (default: the table's for this device)."""
    if block_m is None:
        block_m = launch.get("matmul/grouped", torch.float32, offsets.device)["BM"]
    E = offsets.numel() - 1
    n = cdiv(M, block_m) + min(E, M)
    offsets = offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)  # [E]
    t = torch.arange(n, device=offsets.device)
    e = torch.searchsorted(tile_end, t, right=True)  # [n], E for spare tiles
    ec = e.clamp(max=E - 1)
    row0 = offsets[ec] + (t - (tile_end - tiles)[ec]) * block_m
    return e.to(torch.int32), row0.to(torch.int32), n


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: sorted row m of expert e -> x[rows[m]] @ w[e]^T, y [M, N] in sorted order.

    x [R, K]; w [E, N, K]; offsets [E+1] int (from `group_by_expert`; offsets[E] == M); rows [M] int64 gather
    indices into x (None: x is already sorted, M = R). No host sync: the grid is an upper bound. `out`: a
    preallocated y."""
    check_triton(x, w)
    M = rows.numel() if rows is not None else x.shape[0]
    E, N, K = w.shape
    y = out if out is not None else torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = launch.get("matmul/grouped", x.dtype, x.device)
    te, tr, n = expert_tiles(offsets, M, cfg["BM"])
    offs = offsets.to(device=x.device, dtype=torch.int32)
    _launch(x, w, y, M, N, K, None, (te, tr, offs, E), rows, cfg, n)
    return y
