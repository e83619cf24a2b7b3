"""Qwen3.5 text decoder (dense and MoE) + its MTP (NextN) head, in torch.

Module and parameter names follow the HF checkpoint (`model.*`, `lm_head.*`, `mtp.*`) so a state dict loads
unchanged. Hybrid stack: Gated DeltaNet ("linear_attention") and gated full attention layers, pre-norm with
zero-centred (1+w) RMSNorm. One forward handles three cases, chosen by the caller:
  * no cache (training / oracle): causal over the batch, chunked GDN;
  * a `FwdCtx` over a `StatePool` with record=False (prefill chunks): KV written at each row's pos0..,
    GDN state read from and written back to the row's live window slot (T == 1 -> recurrent step,
    T > 1 -> chunked form; on a CPU in fp32, blocks of any length run the C kernels below, the recurrence token
    by token, so a block's rows are computed as a step forward computes them);
  * a `FwdCtx` with record=True (a step forward: spec verify, decode and MTP drafts, N rows x T tokens; on a CPU
    in fp32 its attention and GDN layers run ops/cpu.py's C kernels): GDN runs the recurrent step per
    token and writes the state after each token to its own window slot, so the session keeps any prefix in
    O(1) (it only chooses which slot is live).
Rows of one forward are independent sequences in different pool slots; each row's queries see only its own
cached keys (a per-row causal mask), the GDN recurrence and every projection are row-wise. Rows may be right-padded
(`FwdCtx`): padding never reaches a real row's outputs or final state.

Two implementations of the same math, chosen per tensor by `ops.use_triton` (CUDA with triton installed):
  * the torch path (CPU): F.linear, one SDPA call over all rows (each row masked to its own keys), the torch GDN
    recurrence; unchanged by the kernel path. Its rounding may depend on the batch (bench/RESULTS.md measures it).
    An fp32 model's step forwards (`ctx.record`) and prefill blocks (`FwdCtx.cpu_kernels`) run ops/cpu.py's
    C kernels instead where they apply: the GEMMs (AVX2 + FMA), the dense MLP, the RMSNorms, the attention and GDN
    token steps, each row-wise with fixed sum orders, so a dense model's verify logits are bitwise the same alone,
    in any batch and at any T (and a short prompt's prefill state the same however it is chunked);
  * the kernel path: every linear (the fused projections, the LM head with fp32 logits, the MoE experts grouped
    by expert) is the batch-invariant Triton matmul, in the tiling of the forward's kind (`FwdCtx.phase`: "step"
    for decode, verify and drafts, "prefill" for prompt blocks and the MTP head's prompt rows), norms and activations are fused row-wise kernels, and a
    step forward (decode, verify, MTP draft) built with `FwdCtx.from_tensors` runs attention over the pool and
    the GDN conv + recurrent update as kernels on device tensors only (no host values), so it can be captured
    in a CUDA graph (engine/graphs.py). A row's outputs then do not depend on the other rows nor on T
    (pool_layout.md). Prefill blocks keep a host `FwdCtx` (shared by spec and plain) and run on the prefill grid's
    kernels (`FwdCtx.prefill_kernels`): K/V written by `ops.write_kv`, attention as ops.attention_prefill (the causal
    mask computed in the kernel, the gate fused), the GDN conv as the torch path's, then its recurrence as
    ops.gdn_prefill (chunks of 64 from the block's first token), so a block's bits depend on the block alone, not on
    the batch, the load or how many blocks one forward carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config
from .moe import MLP, SparseMoeBlock
from .ops import dispatch as ops
from .ops import cpu
from .ops.gdn import causal_conv_window, gdn_chunked, gdn_recurrent_step, l2norm
from .ops.gdn_prefill import NO_BOUND
from .ops.fuse import fuse_linears
from .ops.matmul_fp8 import FP8
from .ops.norm import as_dtype, const, one_plus

if TYPE_CHECKING:
    from ..cache import GdnPool, KVPool, ModelCache, StatePool


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, ctx: FwdCtx | None = None) -> torch.Tensor:
        """`ctx`: the forward's context; in a step forward (`ctx.record`: decode, verify, MTP drafts) or a short
        prefill block (`ctx.cpu_kernels`) fp32 CPU rows take ops/cpu.py's C kernel. The cache-free forward keeps the
        torch twin."""
        if ctx is not None and ctx.cpu_kernels and cpu.takes(x):
            return cpu.rms_norm(x, one_plus(self.weight, x.dtype), self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain-scale RMSNorm of x (norm before gate) times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


def matmul_phase(ctx: FwdCtx | None) -> str:
    """The kernel path's matmul tiling for a forward of context `ctx` (engine/model/ops/matmul.py): "prefill" for a
    host forward that writes final states only (a prompt's grid block, the MTP head's prompt rows), "step" for every
    other (decode, verify, MTP drafts, the cache-free forward). Chosen by the forward's kind, never by its rows."""
    return ctx.phase if ctx is not None else "step"


def linear(x: torch.Tensor, w: torch.Tensor, ctx: FwdCtx | None = None, phase: str | None = None) -> torch.Tensor:
    """x @ w^T: the batch-invariant kernel on the kernel path (tiling `phase`, default `matmul_phase(ctx)`),
    F.linear on the torch path; in a step forward or a prefill block (`ctx.cpu_kernels`) of an fp32 CPU model,
    ops/cpu.py's batch-invariant C GEMM when this CPU has AVX2 + FMA. An FP8 weight (kept only where the kernel
    path runs, engine/loader.py) takes ops.linear's FP8 matmul."""
    if ops.use_triton(x) or w.dtype == FP8:
        return ops.linear(x, w, phase=phase or matmul_phase(ctx))
    if ctx is not None and ctx.cpu_kernels:
        y = cpu.linear_or_none(x, w)
        if y is not None:
            return y
    return F.linear(x, w)


def pin_attributes(root: nn.Module) -> None:
    """Make every module's submodules and parameters plain instance attributes too, so that the forward's
    `self.weight` / `self.mlp` reads skip `nn.Module.__getattr__` (a Python call per read, ~70 per plain decode
    step: ~7 % of the step of a small model on CPU, bench/RESULTS.md). The copies stay right after in-place
    edits, `.to()` / `.data =` (the same Parameter objects) and a reassignment (`m.weight = nn.Parameter(...)`,
    `m.sub = Module()`: `nn.Module.__setattr__` drops the copy); not after writing into `_parameters` /
    `_modules` directly or `del m.weight`, which nothing in nextn does."""
    for m in root.modules():
        for name, v in (*m._modules.items(), *m._parameters.items()):
            m.__dict__[name] = v  # a None too (nn.Linear's absent bias)


_ROPE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(cfg, n: int, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [>= n, rotary_dim] for positions 0.. (computed once per process and grown on demand; a row is
    bitwise what `rope_cos_sin` gives for that position)."""
    key = (cfg.rotary_dim, cfg.rope_theta, str(device), dtype)
    tab = _ROPE.get(key)
    if tab is None or tab[0].shape[0] < n:
        size = max(n, 2 * tab[0].shape[0] if tab is not None else 4096)
        tab = _ROPE[key] = rope_cos_sin(torch.arange(size, device=device), cfg.rotary_dim, cfg.rope_theta, dtype)
    return tab


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE tables for integer `positions` [..., T]: cos, sin [..., T, rotary_dim] (fp32 math, cast to dtype)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, R]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of each head (rotate_half style). x: [B, T, heads, hd]; cos/sin: [B or 1, T, R]."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


class _Lazy:
    """A `FwdCtx` index tensor or the RoPE rows (stored as `_<name>`): an N-row host context builds it, with the
    others, on first read (`FwdCtx._index`); one host row has no index tensors (None); a kernel-path context was
    given it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, ctx: FwdCtx | None, owner: type | None = None):
        if ctx is None:
            return self
        if getattr(ctx, self.attr) is None and ctx.slots is not None and len(ctx.slots) > 1:
            ctx._index()
        return getattr(ctx, self.attr)


@dataclass
class FwdCtx:
    """Where the N rows of one cached forward live in a `StatePool` (host lists; the torch path's index tensors are
    derived from them on first use, none for one row: the torch path reads a single row's host values directly).

    Row i's T new tokens sit at positions pos0[i].. of pool slot slots[i]. GDN layers read the state in window
    slot read[i]; with record=True the state after token t goes to window slot write0[i] + t, else only the final
    state goes to write0[i]. Rows shorter than T are padding at the end (their extra outputs are ignored; their
    K/V land past the row's length and their states in window slots that are never made live). A forward that
    writes only final states (record=False, batched prefill) names each row's real length in `lens`: GDN layers
    then make the padding tokens leave the state unchanged (decay 1, beta 0) and keep the conv window of token
    lens[i] - 1, so a row's final state is that of its own tokens.

    An N-row host context builds its index tensors and gathered RoPE rows (`slot_t`, `read_t`, `write_t`,
    `kv_slot`, `kv_pos`, `rope`, `lens_t`) when the torch path first reads one: a step forward that runs
    ops/cpu.py's C kernels reads only the host lists and `rope_tab`, so it builds none (~64 us a context at N = 8
    on the CPU box, four contexts a round).

    `from_tensors` builds the kernel path's step context instead: device tensors only (the host lists are None),
    `kernels` True, record semantics with write0 = 0 (the pool layout's step contract)."""

    slots: list[int] | None
    pos0: list[int] | None
    read: list[int] | None
    write0: list[int] | None
    T: int
    record: bool
    _slot_t: torch.Tensor | None  # [N] long (None: a one-row host forward, or not built yet)
    _read_t: torch.Tensor | None  # [N] long (as _slot_t)
    _write_t: torch.Tensor | None  # [N, T] long (record) or [N] long
    _kv_slot: torch.Tensor | None  # [N*T] long: pool slot of each new token
    _kv_pos: torch.Tensor | None  # [N*T] long: its position
    _rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [N, T, R] (None: N host rows, not built yet)
    pos0_t: torch.Tensor | None = None  # [N] long (kernel path)
    kernels: bool = False  # a `from_tensors` step context: attention and GDN run as kernels over the pool
    _masks: torch.Tensor | None = None  # [N, T, max S] bool, built by the first `causal_mask` call
    _flat: dict | None = None  # (width, what) -> flat pool-row indices, built by the first `flat` call
    _consecutive: bool | None = None  # the rows' slots are consecutive and ascending (set by the first `rows` call)
    lens: list[int] | None = None  # record=False, N rows: each row's real token count (None: all T)
    _lens_t: torch.Tensor | None = None  # [N] long, when lens is set (built on first use)
    device: torch.device | str | None = None  # host contexts: where the index tensors go
    rope_tab: tuple[torch.Tensor, torch.Tensor] | None = None  # host contexts: cos, sin [>= max(pos0) + T, R]
    _grid: tuple[torch.Tensor, ...] | None = None  # slot, pos0, read, write0 [N] long (`grid_index`)
    rope_rows: bool = False  # host contexts: `rope` was given row by row (M-RoPE, a rope delta), not by position
    seg: list[list[int]] | None = None  # kernel-path prefill: row i's grid blocks' lengths (None: one block a row)
    keep: list[list[int]] | None = None  # ... and the window slot for the state at each inner boundary (-1: none)
    _bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # `block_bounds`, built once per forward

    @classmethod
    def make(cls, cfg, device: torch.device | str, dtype: torch.dtype, slots: list[int], pos0: list[int],
             read: list[int], write0: list[int], T: int, record: bool, lens: list[int] | None = None,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None,
             rope_delta: list[int] | None = None, seg: list[list[int]] | None = None,
             keep: list[list[int]] | None = None) -> FwdCtx:
        """The context of a host-driven forward: the host lists and the RoPE table (`rope_tab`). One row: no index
        tensors (None), RoPE rows as a slice of the table; N rows: the index tensors and gathered RoPE rows when
        the torch path first reads them. lens: N rows with record=False, their real lengths (<= T; the rest is
        right padding).

        Rotary positions other than the cache positions (sessions with images; the KV / GDN index stays pos0..):
        `rope` = each token's cos, sin rows [N, T, R] given (a prompt's M-RoPE rows, `engine.session`), or
        `rope_delta` [N] = row i's tokens rotate at position pos0[i] + rope_delta[i] + t (decode, verify and drafts
        after a prompt with images). Both go to every path as rows (`rope_rows`); a delta of all zeros is the
        plain context, so a text-only forward keeps its bits.

        seg, keep (a prefill forward whose rows carry several blocks of one prompt: grid blocks on the kernel path; on
        the C path a prompt block cut at the prompt's tail, `engine.prefill.splits_rows`): row i's blocks' lengths
        (summing to its length) and, for each boundary between two of them, the window slot that receives the GDN
        and conv state there (-1: not kept; never read[i] or write0[i]); see `block_bounds`."""
        N = len(slots)
        if seg is not None:
            assert len(seg) == N and all(sum(b) == (T if lens is None else lens[i]) for i, b in enumerate(seg))
            keep = keep if keep is not None else [[-1] * (len(b) - 1) for b in seg]
            assert all(len(k) == len(b) - 1 for k, b in zip(keep, seg))
            if all(len(b) == 1 for b in seg):
                seg = keep = None
        assert lens is None or (not record and len(lens) == N and max(lens) <= T)
        if rope is None and rope_delta is not None and any(rope_delta):
            at = [p + d for p, d in zip(pos0, rope_delta)]
            assert min(at) >= 0, "rotary positions must be >= 0"
            cos, sin = rope_table(cfg, max(at) + T, device, dtype)
            positions = torch.tensor(at, device=device)[:, None] + torch.arange(T, device=device)  # [N, T]
            rope = cos[positions], sin[positions]  # [N, T, R] each
        if N == 1:
            assert lens is None or lens[0] == T
            p0 = pos0[0]
            tab = cos, sin = rope_table(cfg, p0 + T, device, dtype)
            return cls(slots, pos0, read, write0, T, record, None, None, None, None, None,
                       rope if rope is not None else (cos[None, p0:p0 + T], sin[None, p0:p0 + T]), device=device,
                       rope_tab=tab, rope_rows=rope is not None, seg=seg, keep=keep)
        return cls(slots, pos0, read, write0, T, record, None, None, None, None, None, rope,
                   lens=list(lens) if lens is not None and min(lens) < T else None, device=device,
                   rope_tab=rope_table(cfg, max(pos0) + T, device, dtype), rope_rows=rope is not None, seg=seg,
                   keep=keep)

    def _index(self) -> None:
        """N host rows: the index tensors and the gathered RoPE rows, once."""
        assert self.slots is not None and self.pos0 is not None and self.rope_tab is not None
        N, T, dev = len(self.slots), self.T, self.device
        ar = torch.arange(T, device=dev)
        slot_t = torch.tensor(self.slots, device=dev)
        positions = torch.tensor(self.pos0, device=dev)[:, None] + ar  # [N, T]
        write_t = torch.tensor(self.write0, device=dev)
        self._slot_t, self._read_t = slot_t, torch.tensor(self.read, device=dev)
        self._write_t = write_t[:, None] + ar if self.record else write_t  # [N, T] or [N]
        self._kv_slot, self._kv_pos = slot_t.repeat_interleave(T), positions.reshape(N * T)
        if not self.rope_rows:  # (given rows stay)
            self._rope = (self.rope_tab[0][positions], self.rope_tab[1][positions])  # [N, T, R] each

    slot_t = _Lazy()  # [N] long: each row's pool slot (None for one host row)
    read_t = _Lazy()  # [N] long: each row's read window slot (kernel path: its live slot)
    write_t = _Lazy()  # [N, T] long with record (the window slot after each token), else [N]
    kv_slot = _Lazy()  # [N*T] long: the pool slot of each new token (row-major)
    kv_pos = _Lazy()  # [N*T] long: its position
    rope = _Lazy()  # cos, sin [N, T, R]: each token's RoPE row (set for one host row and the kernel path)

    @property
    def lens_t(self) -> torch.Tensor | None:
        """[N] long: `lens` as a tensor (None when lens is None)."""
        if self._lens_t is None and self.lens is not None:
            self._lens_t = torch.tensor(self.lens, device=self.device)
        return self._lens_t

    @property
    def phase(self) -> str:
        """The kernel path's matmul tiling for this forward: "prefill" for a host forward that writes final states
        only (`record` False: a prompt's grid block, the MTP head's prompt rows), else "step" (ops/matmul.py). A
        function of the forward's kind alone, so every row of a packed prefill and the same block alone run the same
        tiling."""
        return "prefill" if not self.kernels and not self.record else "step"

    @property
    def cpu_kernels(self) -> bool:
        """Whether this forward may run ops/cpu.py's C kernels (each op still checks dtype, device and the build):
        every host forward over the pool (step forwards: decode, verify, MTP drafts; prefill blocks of any length),
        never the kernel path's step context."""
        return not self.kernels

    def prefill_kernels(self, name: str, t: torch.Tensor) -> bool:
        """Whether a layer of this forward runs op `name` ("attention_prefill" or "gdn_prefill") as its prefill-grid
        kernel: a host forward that writes final states only (a prompt's grid block, the MTP head's prefill rows; any
        T) on tensors that kernel takes (`ops.use_kernel`: CUDA with triton, and the kernel not fallen back; on a CPU
        only inside the tests' `ops.force_kernels`). Never a step forward (`record`, or the kernel path's `kernels`)."""
        return not self.kernels and not self.record and ops.use_kernel(name, t)

    def grid_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host forwards on the prefill kernels (`prefill_kernels`): slot, pos0, read, write0 [N] long on the
        forward's device (one row too), built once per forward for all of its layers."""
        assert self.slots is not None and self.pos0 is not None and self.read is not None and self.write0 is not None
        if self._grid is None:
            self._grid = tuple(torch.tensor(v, device=self.device)  # [N] long each
                               for v in (self.slots, self.pos0, self.read, self.write0))
        return self._grid  # type: ignore[return-value]

    def block_bounds(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A prefill forward whose rows carry several grid blocks (`seg`): bounds [N, B] int32 (row i's inner block
        starts as offsets in the row, ascending, padded past every row's length) and keep [N, B] int32 (the window
        slot for the state at each, -1: none), as ops.gdn_prefill takes them; None for one block a row. Built once
        per forward for all of its layers."""
        if self.seg is None:
            return None
        if self._bounds is None:
            B = max(len(b) for b in self.seg)  # inner boundaries + at least one pad a row
            bounds, keep = [], []
            for blocks, kept in zip(self.seg, self.keep or []):
                at = [sum(blocks[:j + 1]) for j in range(len(blocks) - 1)]
                bounds.append(at + [NO_BOUND] * (B - len(at)))
                keep.append(list(kept) + [-1] * (B - len(kept)))
            self._bounds = (torch.tensor(bounds, dtype=torch.int32, device=self.device),  # [N, B]
                            torch.tensor(keep, dtype=torch.int32, device=self.device))  # [N, B]
        return self._bounds

    def kept_bounds(self) -> list[tuple[int, int, int]]:
        """(row i, offset e in the row, window slot w) of every inner block boundary whose state is kept (`keep`):
        the state after the row's token e-1 goes to window slot w of row i's pool slot."""
        if self.seg is None or self.keep is None:
            return []
        return [(i, sum(blocks[:j + 1]), w) for i, (blocks, kept) in enumerate(zip(self.seg, self.keep))
                for j, w in enumerate(kept) if w >= 0]

    def causal_masks(self, device: torch.device | str) -> torch.Tensor:
        """Host forwards: every row's attention mask [N, T, max(pos0) + T] (query t of row i sees keys
        0..pos0[i] + t), built once per forward for all of its attention layers."""
        assert self.pos0 is not None
        if self._masks is None:
            q = torch.tensor(self.pos0, device=device)[:, None] + torch.arange(self.T, device=device)  # [N, T]
            self._masks = torch.arange(max(self.pos0) + self.T, device=device) <= q[..., None]  # [N, T, S]
        return self._masks

    def causal_mask(self, i: int, device: torch.device | str) -> torch.Tensor:
        """Row i's mask [T, pos0[i] + T] (a view of `causal_masks`)."""
        return self.causal_masks(device)[i, :, :self.pos0[i] + self.T]

    def rows(self, pool: torch.Tensor, S: int) -> torch.Tensor:
        """N-row host forwards: positions :S of the rows' slots of a pool tensor [slots, capacity, ...] ->
        [N, S, ...]; a view when the slots are consecutive and ascending (the usual case: slots are handed out
        in order), else a gather."""
        assert self.slots is not None and len(self.slots) > 1
        if self._consecutive is None:  # decided once per forward, for all of its attention layers
            lo = self.slots[0]
            self._consecutive = self.slots == list(range(lo, lo + len(self.slots)))
        if self._consecutive:
            return pool[self.slots[0]:self.slots[0] + len(self.slots), :S]
        return pool[:, :S].index_select(0, self.slot_t)

    def flat(self, width: int, what: str) -> torch.Tensor:
        """N-row host forwards: indices into a pool tensor viewed as [slots * width, ...] (its first two dims
        flattened; width = the pool's window or capacity), built once per forward and width for every layer.
        what: "read" [N] (row i's read window slot), "write" [N*T] with record (window slot write0[i] + t of row
        i, row-major) or [N] without, "kv" [N*T] (position pos0[i] + t of row i). Distinct rows hold distinct
        slots, so no index repeats: `index_copy_` with them is a plain scatter."""
        assert self.slot_t is not None
        key = (width, what)
        if self._flat is None:
            self._flat = {}
        idx = self._flat.get(key)
        if idx is None:
            if what == "read":
                idx = self.slot_t * width + self.read_t  # [N]
            elif what == "write_tmajor":  # record: the "write" slots ordered token-major ([T, N] flattened)
                idx = self.flat(width, "write").view(len(self.slot_t), self.T).t().reshape(-1)
            elif what == "write":
                base = self.slot_t[:, None] if self.record else self.slot_t
                idx = (base * width + self.write_t).reshape(-1)  # [N*T] or [N]
            else:
                idx = self.kv_slot * width + self.kv_pos  # [N*T]
            self._flat[key] = idx
        return idx

    @classmethod
    def from_tensors(cls, slot: torch.Tensor, pos0: torch.Tensor, cur: torch.Tensor, T: int,
                     rope_tab: tuple[torch.Tensor, torch.Tensor], rope_delta: torch.Tensor | None = None) -> FwdCtx:
        """Kernel-path step context from device tensors alone (capturable in a CUDA graph: no host values).

        slot, pos0, cur [N] long: row i's pool slot, the position of its first new token, its live GDN window slot.
        GDN layers read window slot cur[i] and write the state after token t to window slot t (pool_layout.md);
        attention writes K/V at pos0[i] + t. rope_tab: `rope_table(...)` covering every position used (the pool's
        capacity), gathered here on the device. rope_delta [N] long (optional, a device tensor too): row i's tokens
        rotate at pos0[i] + rope_delta[i] + t (a session with images), while K/V stay at pos0[i] + t."""
        positions = pos0[:, None] + torch.arange(T, device=pos0.device)  # [N, T]
        if rope_delta is not None:
            positions = positions + rope_delta[:, None]  # [N, T] rotary positions
        cos, sin = rope_tab
        return cls(None, None, None, None, T, True, slot, cur, None, None, None, (cos[positions], sin[positions]),
                   pos0, True)


class GatedAttention(nn.Module):
    """Gated GQA full attention: q|gate per head, q/k RMSNorm, partial RoPE, sigmoid(gate) before o_proj."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, 2 * self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self._w_qkv: torch.Tensor | None = None  # fused q|k|v weight (`fuse`)

    def fuse(self) -> None:
        """Serve with one q|k|v GEMM (the separate weights become views of it)."""
        self._w_qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, ctx: FwdCtx | None, kv: "KVPool | None",
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [N, T, H] -> [N, T, H]. Without `ctx`: causal self-attention over each row (`rope` = tables for
        positions 0..T-1). With `ctx` and `kv`: row i's K/V are written at kv[slot_i, pos0_i..] and its queries
        attend its own cached keys [0, pos0_i + t] (a kernel-path step context: the pool attention kernel; a host
        prefill forward whose tensors the kernels take, `ctx.prefill_kernels`: the prefill attention kernel, causal
        mask computed in it, gate fused). Elsewhere on a CPU, for fp32 and when ops/cpu.py's C kernels are built, step
        forwards (`ctx.record`: decode, verify, MTP drafts) and prefill blocks (`ctx.cpu_kernels`) run everything
        between the two projections as one C call."""
        N, T, _ = x.shape
        nq, nk = 2 * self.nh * self.hd, self.nkv * self.hd
        grid = ctx is not None and kv is not None and ctx.prefill_kernels("attention_prefill", x)
        if self._w_qkv is not None:
            qkv = linear(x, self._w_qkv, ctx)  # [N, T, nq + 2 nk]
            if not grid and ctx is not None and kv is not None and ctx.cpu_kernels and cpu.takes(qkv):  # fused C
                assert ctx.slots is not None and ctx.pos0 is not None and ctx.rope_tab is not None  # a host context
                o = cpu.attn_step(qkv, one_plus(self.q_norm.weight, qkv.dtype), one_plus(self.k_norm.weight, qkv.dtype),
                                  self.q_norm.eps, *(ctx.rope if ctx.rope_rows else ctx.rope_tab), kv.k, kv.v,
                                  ctx.slots, ctx.pos0, self.nh, self.nkv,
                                  self.hd, self.hd ** -0.5)  # [N, T, nh*hd]
                return linear(o, self.o_proj.weight, ctx)
            qg, k, v = qkv.split([nq, nk, nk], dim=-1)
        else:
            ph = matmul_phase(ctx)
            qg, k, v = (linear(x, m.weight, phase=ph) for m in (self.q_proj, self.k_proj, self.v_proj))
        qg = qg.view(N, T, self.nh, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd:]  # [N, T, nh, hd] each (views)
        q = self.q_norm(q)  # [N, T, nh, hd]
        k = self.k_norm(k.reshape(N, T, self.nkv, self.hd))  # [N, T, nkv, hd]
        v = v.reshape(N, T, self.nkv, self.hd)
        cos, sin = ctx.rope if ctx is not None else rope
        qk = apply_partial_rope(torch.cat([q, k], dim=2), cos, sin)  # [N, T, nh + nkv, hd]: one rotation for both
        q, k = qk[:, :, :self.nh], qk[:, :, self.nh:]
        gqa = self.nh != self.nkv
        if ctx is not None and (ctx.kernels or grid):  # the pool's K/V through a kernel: step, or prefill grid
            assert kv is not None
            slot, pos0 = (ctx.slot_t, ctx.pos0_t) if ctx.kernels else ctx.grid_index()[:2]  # [N] each
            ops.write_kv(kv.k, kv.v, k, v, slot, pos0)
            attend = ops.attention if ctx.kernels else ops.attention_prefill
            o = attend(q, kv.k, kv.v, slot, pos0, self.hd ** -0.5, gate)  # gated, [N, T, nh, hd]
            return linear(o.reshape(N, T, self.nh * self.hd), self.o_proj.weight, phase=ctx.phase)
        if ctx is None or kv is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=T > 1, scale=self.hd ** -0.5, enable_gqa=gqa)
            o = o.transpose(1, 2)  # [N, T, nh, hd]
        else:
            if N == 1:  # one row: plain slice writes
                p0 = ctx.pos0[0]
                kv.k[ctx.slots[0], p0:p0 + T] = k[0]
                kv.v[ctx.slots[0], p0:p0 + T] = v[0]
            else:
                at = ctx.flat(kv.k.shape[1], "kv")  # [N*T] rows of the pool viewed as [slots * capacity, ...]
                kv.k_rows.index_copy_(0, at, k.reshape(N * T, self.nkv, self.hd))
                kv.v_rows.index_copy_(0, at, v.reshape(N * T, self.nkv, self.hd))
            if N == 1:  # one row over its own keys (views, no copies)
                sl, S = ctx.slots[0], ctx.pos0[0] + T
                mask = None if T == 1 else ctx.causal_mask(0, x.device)  # [T, S]
                o = F.scaled_dot_product_attention(q.transpose(1, 2), kv.k[sl:sl + 1, :S].transpose(1, 2),
                                                   kv.v[sl:sl + 1, :S].transpose(1, 2), attn_mask=mask,
                                                   scale=self.hd ** -0.5, enable_gqa=gqa)  # [1, nh, T, hd]
            else:  # every row in one call over the longest row's span; row i's mask hides keys past pos0[i] + t
                S = max(ctx.pos0) + T
                o = F.scaled_dot_product_attention(q.transpose(1, 2), ctx.rows(kv.k, S).transpose(1, 2),
                                                   ctx.rows(kv.v, S).transpose(1, 2),
                                                   attn_mask=ctx.causal_masks(x.device)[:, None],  # [N, 1, T, S]
                                                   scale=self.hd ** -0.5, enable_gqa=gqa)  # [N, nh, T, hd]
            o = o.transpose(1, 2)  # [N, T, nh, hd]
        gate = gate.reshape(N, T, self.nh * self.hd)
        return linear(o.reshape(N, T, self.nh * self.hd) * torch.sigmoid(gate), self.o_proj.weight,
                      phase=matmul_phase(ctx))


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention mixer (separate in_proj_qkv / z / b / a, depthwise causal conv, gated delta rule)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.nk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.nv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.kc = cfg.linear_conv_kernel_dim
        H, C = cfg.hidden_size, cfg.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.nv, bias=False)
        self.in_proj_a = nn.Linear(H, self.nv, bias=False)
        self.conv1d = nn.Conv1d(C, C, self.kc, groups=C, bias=False, padding=self.kc - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, H, bias=False)
        self._w_in: torch.Tensor | None = None  # fused qkv|z|b|a weight (`fuse`)
        self._decay: tuple[torch.Tensor, torch.Tensor] | None = None  # -exp(A_log), dt_bias (`fuse`)
        self._split = [C, self.nv * self.dv, self.nv, self.nv]

    @property
    def fused(self) -> bool:
        """Whether `fuse` ran (the C path's fused step, and its several blocks a row, need it)."""
        return self._w_in is not None

    def fuse(self) -> None:
        """Serve with one input GEMM for qkv|z|b|a (the separate weights become views of it), and the decay's
        constant factors -exp(A_log), dt_bias in the state dtype computed once."""
        self._w_in = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self._decay = self._decay_consts()

    def _decay_consts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-exp(A_log), dt_bias in the state dtype (fp32; fp64 for fp64 models)."""
        if self._decay is not None:
            return self._decay
        sdt = torch.float64 if self.A_log.dtype == torch.float64 else torch.float32
        return -self.A_log.detach().to(sdt).exp(), self.dt_bias.detach().to(sdt)

    def forward(self, x: torch.Tensor, ctx: FwdCtx | None, st: "GdnPool | None") -> torch.Tensor:
        """x: [N, T, H] -> [N, T, H]. Without `ctx`: zero initial state, chunked form. With `ctx`: conv and
        recurrent state read from window slot read_i of row i's pool slot; recording forwards run the recurrent
        step per token and write every per-position state, others write the final state (see `FwdCtx`). On a CPU, for
        fp32 and when ops/cpu.py's C kernel is built, step forwards and prefill blocks (`ctx.cpu_kernels`; padding rows
        through `lens`, a row's several blocks through `seg` / `keep`) run as that one fused call from the input
        projection to the gated norm, token by token. A host prefill forward whose tensors the kernels take
        (`ctx.prefill_kernels`) keeps the conv below and runs the recurrence as the chunked GDN kernel on the prefill
        grid (`_prefill_kernel`)."""
        N, T, _ = x.shape
        dt = x.dtype
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        grid = ctx is not None and st is not None and ctx.prefill_kernels("gdn_prefill", x)
        if self._w_in is not None:
            proj = linear(x, self._w_in, ctx)  # [N, T, C + nv*dv + 2 nv]
            if not grid and ctx is not None and st is not None and ctx.cpu_kernels \
                    and cpu.usable(proj, self.kc):  # fused C
                assert ctx.slots is not None and ctx.read is not None and ctx.write0 is not None
                # (ctx.seg: a row's blocks one after the other, each inner boundary's state in its ctx.keep slot)
                o = cpu.gdn_step(proj, self.conv1d.weight[:, 0, :], st.conv, st.rec, ctx.slots, ctx.read,
                                 ctx.write0, *self._decay_consts(), self.norm.weight, self.norm.eps, self.nk,
                                 self.dk, self.nv, self.dv, ctx.record, ctx.lens, ctx.seg, ctx.keep)  # [N, T, nv*dv]
                return linear(o, self.out_proj.weight, ctx)
            qkv, z, b, a = proj.split(self._split, dim=-1)
        if ctx is not None and ctx.seg is not None and not grid:
            raise ValueError("several blocks in one row need the prefill kernels or the C kernel (FwdCtx.seg)")
        else:
            qkv, z, b, a = (linear(x, m.weight, phase=matmul_phase(ctx))
                            for m in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        z = z.reshape(N, T, self.nv, self.dv)
        if ctx is not None and ctx.kernels:
            assert st is not None
            return self._step_kernels(qkv, z, b, a, self.conv1d.weight[:, 0, :], ctx, st)
        live = ctx is not None and st is not None
        if live and N == 1:  # one row: read the live slot through a view (no gather)
            conv_state = st.conv[ctx.slots[0], ctx.read[0]][None]
        elif live:  # N rows: the pool's [slots * window] rows, gathered / scattered by flat index
            rd, wr = ctx.flat(st.conv.shape[1], "read"), ctx.flat(st.conv.shape[1], "write")
            conv_state = st.conv_rows.index_select(0, rd)  # [N, C, Kc-1]
        else:
            conv_state = qkv.new_zeros(N, qkv.shape[-1], self.kc - 1)
        y, window = causal_conv_window(qkv.transpose(1, 2), conv_state, self.conv1d.weight)  # [N, C, T], [N, C, Kc-1+T]
        y = y.transpose(1, 2)  # [N, T, C]
        if grid:
            o = self._prefill_kernel(y, b, a, ctx, st)  # [N, T, nv, dv] in dt
            self._write_conv_end(window, ctx, st)
            for i, e, w in ctx.kept_bounds():  # the conv state at each kept block boundary: after token e-1
                st.conv[ctx.slots[i], w] = window[i, :, e:e + self.kc - 1]  # [C, Kc-1]
            return linear(self.norm(o, z).reshape(N, T, self.nv * self.dv), self.out_proj.weight, phase=ctx.phase)
        Kd = self.nk * self.dk
        qk = l2norm(as_dtype(y[..., :2 * Kd].reshape(N, T, 2 * self.nk, self.dk), sdt))  # q and k heads in one pass
        r = self.nv // self.nk
        if r > 1:  # each key head serves r value heads: q and k repeated in one copy
            qk = qk.repeat_interleave(r, dim=2)  # [N, T, 2 nv, dk]
        q, k = qk[:, :, :self.nv] * const(self.dk ** -0.5, qk), qk[:, :, self.nv:]  # [N, T, nv, dk] each
        v = as_dtype(y[..., 2 * Kd:].reshape(N, T, self.nv, self.dv), sdt)
        beta = as_dtype(torch.sigmoid(b), sdt)
        neg_a, dt_bias = self._decay_consts()
        g = neg_a * F.softplus(as_dtype(a, sdt) + dt_bias)  # [N, T, nv] log decay
        if live and ctx.lens_t is not None:  # right padding: its tokens keep the state (decay 1, beta 0)
            real = (torch.arange(T, device=x.device) < ctx.lens_t[:, None])[..., None]  # [N, T, 1]
            g, beta = g.where(real, 0.0), beta.where(real, 0.0)
        if not live:
            o, _ = gdn_chunked(q, k, v, g, beta, None)
        elif ctx.record:
            # the state after token t is written straight to its place: one row, its window slot write0 + t of
            # the pool; N rows, plane t of a [T, N, ...] buffer that one scatter then moves to the pool. The state
            # read (a view of the live slot for one row) is consumed by step 0 before any write.
            s = st.rec[ctx.slots[0], ctx.read[0]][None] if N == 1 else st.rec_rows.index_select(0, rd)
            if N == 1:
                w0 = ctx.write0[0]
                dst = st.rec[ctx.slots[0], w0:w0 + T]  # [T, nv, dk, dv] (pool view)
            else:
                dst = s.new_empty(T, *s.shape)  # [T, N, nv, dk, dv]
            outs = []
            for t in range(T):
                o_t, s = gdn_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s,
                                            out=dst[t:t + 1] if N == 1 else dst[t])
                outs.append(o_t)
            if N > 1:  # every row's per-position states in one scatter (indices in the buffer's t-major order)
                st.rec_rows.index_copy_(0, ctx.flat(st.rec.shape[1], "write_tmajor"), dst.flatten(0, 1))
            o = torch.stack(outs, dim=1) if T > 1 else outs[0][:, None]  # [N, T, nv, dv]
            # conv state after token t = window[..., t+1 : t+Kc]: all T of them in one strided write
            states = window.unfold(-1, self.kc - 1, 1)[:, :, 1:T + 1].permute(0, 2, 1, 3)  # [N, T, C, Kc-1]
            if N == 1:
                st.conv[ctx.slots[0], ctx.write0[0]:ctx.write0[0] + T] = states[0]
            else:
                st.conv_rows.index_copy_(0, wr, states.flatten(0, 1))  # [N*T, C, Kc-1]
        else:
            s0 = st.rec[ctx.slots[0], ctx.read[0]][None] if N == 1 else st.rec_rows.index_select(0, rd)
            if T == 1:
                o, s = gdn_recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
                o = o[:, None]
            else:
                o, s = gdn_chunked(q, k, v, g, beta, s0)
            if N == 1:
                st.rec[ctx.slots[0], ctx.write0[0]] = s[0]
            else:
                st.rec_rows.index_copy_(0, wr, s)
            self._write_conv_end(window, ctx, st)
        o = self.norm(as_dtype(o, dt), z)  # [N, T, nv, dv]
        return linear(o.reshape(N, T, self.nv * self.dv), self.out_proj.weight, phase=matmul_phase(ctx))

    def _write_conv_end(self, window: torch.Tensor, ctx: FwdCtx, st: "GdnPool") -> None:
        """A forward that writes final states only: each row's conv state after its last real token (window
        [N, C, Kc-1+T] from `causal_conv_window`; `ctx.lens` for padded rows) to window slot write0[i]."""
        N, T = window.shape[0], ctx.T
        if N == 1:
            st.conv[ctx.slots[0], ctx.write0[0]] = window[0, :, T:]
            return
        if ctx.lens_t is None:
            conv_end = window[..., T:]  # [N, C, Kc-1]
        else:  # the window after each row's last real token: window[i, :, lens[i] : lens[i] + Kc-1]
            at = ctx.lens_t[:, None, None] + torch.arange(self.kc - 1, device=window.device)  # [N, 1, Kc-1]
            conv_end = window.gather(-1, at.expand(N, window.shape[1], self.kc - 1))
        st.conv_rows.index_copy_(0, ctx.flat(st.conv.shape[1], "write"), conv_end)

    def _prefill_kernel(self, y: torch.Tensor, b: torch.Tensor, a: torch.Tensor, ctx: FwdCtx,
                        st: "GdnPool") -> torch.Tensor:
        """Host prefill forward on the kernels (`ctx.prefill_kernels`): the gates' kernel, then the chunked GDN kernel
        on the prefill grid (ops.gdn_prefill: chunks of 64 from each block's first token, `ctx.seg`) from window slot
        read[i] to write0[i] (the states at kept block boundaries to their window slots, `ctx.keep`), padding (`ctx.lens`) left out of the state and zero in o. y [N, T, C] the conv output (after
        SiLU), b, a [N, T, nv] -> o [N, T, nv, dv] in y's dtype."""
        N, T, _ = y.shape
        y = y.contiguous()  # [N, T, C]: the kernel reads q, k, v rows with a unit last stride
        Kd = self.nk * self.dk
        q = y[..., :Kd].view(N, T, self.nk, self.dk)
        k = y[..., Kd:2 * Kd].view(N, T, self.nk, self.dk)
        v = y[..., 2 * Kd:].view(N, T, self.nv, self.dv)
        g, beta = ops.gdn_gates(a, b, *self._decay_consts())  # [N, T, nv] fp32 each
        slot, _, read, write = ctx.grid_index()
        bk = ctx.block_bounds()  # several blocks a row: chunks restart at each block, kept states written
        o = ops.gdn_prefill(q, k, v, g, beta, st.rec, slot, read, write, ctx.lens_t, qk_l2norm=True,
                            out_dtype=y.dtype, bounds=None if bk is None else bk[0],
                            keep=None if bk is None else bk[1])  # [N, T, nv, dv]
        if ctx.lens_t is None:
            return o
        # the kernel leaves a row's columns past its length unwritten: zeros there, so the padding's later ops
        # (norms, MLP, router) read numbers, never stale memory
        real = torch.arange(T, device=y.device) < ctx.lens_t[:, None]  # [N, T]
        return o.where(real[..., None, None], 0.0)

    def _step_kernels(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                      ctx: FwdCtx, st: "GdnPool") -> torch.Tensor:
        """Kernel-path step: conv update and the GDN recurrence over the pool, reading window slot cur[i] and
        writing the state after token t to window slot t; the same per-token update for every T."""
        N, T, _ = qkv.shape
        y = ops.conv_update(qkv, st.conv, w, ctx.slot_t, ctx.read_t)  # [N, T, C] after SiLU
        Kd = self.nk * self.dk
        q = y[..., :Kd].view(N, T, self.nk, self.dk)
        k = y[..., Kd:2 * Kd].view(N, T, self.nk, self.dk)
        v = y[..., 2 * Kd:].view(N, T, self.nv, self.dv)
        g, beta = ops.gdn_gates(a, b, *self._decay_consts())  # [N, T, nv] fp32 each
        o = ops.gdn_update(q, k, v, g, beta, st.rec, ctx.slot_t, ctx.read_t, qk_l2norm=True,
                           out_dtype=qkv.dtype)  # [N, T, nv, dv]
        o = self.norm(o, z)
        return linear(o.reshape(N, T, self.nv * self.dv), self.out_proj.weight)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: mixer (GDN or gated attention) then MLP / MoE."""

    def __init__(self, cfg: Qwen35Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: FwdCtx | None, layer_state,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = self.input_layernorm(x, ctx)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, ctx, layer_state)
        else:
            h = self.self_attn(h, ctx, layer_state, rope)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x, ctx), ctx)


class TextModel(nn.Module):
    """`model.*`: embeddings, the decoder stack and the final norm."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpHead(nn.Module):
    """`mtp.*`: NextN head. x = fc([norm_e(embed(tok)); norm_h(hidden)]) -> one full-attention layer -> norm."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, ctx: FwdCtx | None, kv: "KVPool | None",
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """emb, hidden: [N, T, H] (embedding of token i+1, trunk hidden of row i) -> head hidden after mtp.norm."""
        x = linear(torch.cat([self.pre_fc_norm_embedding(emb, ctx), self.pre_fc_norm_hidden(hidden, ctx)], dim=-1),
                   self.fc.weight, ctx)
        x = self.layers[0](x, ctx, kv, rope)
        return self.norm(x, ctx)


class Qwen35ForCausalLM(nn.Module):
    """Text model + lm_head (+ MTP head when the config has one)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MtpHead(cfg) if cfg.has_mtp else None
        self.vision = None  # the vision tower (engine/model/vision.py), `attach_vision`
        self.image_config = None  # its engine/images.py ImageConfig

    def attach_vision(self, tower: nn.Module | None, image_config) -> None:
        """Serve images with `tower` (a VisionTower on this model's device, in its dtype) and `image_config` (an
        engine.images.ImageConfig); None, None: text only. The tower is held beside the text model, not as a
        submodule: the text model's parameters, state dict and fusing stay its own."""
        self.__dict__["vision"] = tower
        self.__dict__["image_config"] = image_config

    def fuse(self) -> None:
        """Inference layout: one GEMM per group of projections that read the same input (GDN qkv|z|b|a,
        attention q|k|v, MLP gate|up). Parameters keep their HF names as views of the fused weights. Then
        `pin_attributes`."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse"):
                m.fuse()
        pin_attributes(self)

    def forward_step(self, ids: torch.Tensor, ctx: FwdCtx, pool: "StatePool",
                     embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ids [N, T] at the rows and positions `ctx` names in `pool` -> pre-final-norm hidden [N, T, H].
        Writes every layer's K/V and GDN states as `ctx` says; the caller does the sessions' bookkeeping.
        embeds [N, T, H]: the input embeddings to use instead of embed_tokens(ids) (image rows in a prompt)."""
        x = self.model.embed_tokens(ids) if embeds is None else embeds
        for layer, st in zip(self.model.layers, pool.layers):
            x = layer(x, ctx, st)
        return x

    def forward_hidden(self, ids: torch.Tensor, pos0: int = 0, cache: "ModelCache | None" = None,
                       record: bool = False) -> torch.Tensor:
        """ids [B, T] -> pre-final-norm hidden [B, T, H]. Without a cache: causal over each row. With `cache`
        (B == 1): tokens sit at positions pos0..; record=True keeps per-position GDN states inside the cache's
        snapshot window, record=False updates the live state in place. Does not advance cache.length."""
        if cache is None:
            x = self.model.embed_tokens(ids)
            cfg = self.config
            rope = rope_cos_sin(torch.arange(ids.shape[1], device=ids.device), cfg.rotary_dim, cfg.rope_theta,
                                x.dtype)
            rope = (rope[0][None], rope[1][None])
            for layer in self.model.layers:
                x = layer(x, None, None, rope)
            return x
        T = ids.shape[1]
        write0 = cache.window_slot(pos0, T) if record else cache.cur
        ctx = FwdCtx.make(self.config, ids.device, self.model.embed_tokens.weight.dtype, [cache.slot], [pos0],
                          [cache.cur], [write0], T, record)
        h = self.forward_step(ids, ctx, cache.pool)
        cache.cur = write0 + T - 1 if record else write0
        return h

    def logits(self, h_post: torch.Tensor, out: torch.Tensor | None = None,
               ctx: FwdCtx | None = None) -> torch.Tensor:
        """Post-norm hidden [..., H] -> fp32 logits [..., V] (kernel path: the batch-invariant matmul, fp32 out,
        written into `out` when given). `ctx`: the forward's context (the CPU GEMM, see `linear`; the kernel path's
        tiling, `matmul_phase`: a prompt row's logits run the prefill tiling)."""
        if ops.use_triton(h_post):
            return ops.linear(h_post, self.lm_head.weight, out_dtype=torch.float32, out=out, phase=matmul_phase(ctx))
        y = linear(h_post, self.lm_head.weight, ctx).float()
        return y if out is None else out.copy_(y)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward (training / oracle): ids [B, T] -> logits [B, T, V]."""
        return self.logits(self.model.norm(self.forward_hidden(ids)))

    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, pos0: "int | FwdCtx" = 0,
                    kv: "KVPool | None" = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """MTP rows: next_ids [N, T] (token i+1), hidden [N, T, H] (trunk hidden at i) -> head hidden [N, T, H]
        (post mtp.norm). `pos0` is a `FwdCtx` over the MTP KV pool `kv`, or (one sequence) the int position of
        row 0 in slot 0 of `kv`. Without `kv`: causal over the rows, positions from 0. Logits: `self.logits(result)`.
        embeds [N, T, H]: the embeddings of next_ids to use instead of embed_tokens(next_ids) (image rows)."""
        assert self.mtp is not None, "model has no MTP head"
        emb = self.model.embed_tokens(next_ids) if embeds is None else embeds
        T = next_ids.shape[1]
        if kv is None:
            cos, sin = rope_cos_sin(torch.arange(T, device=next_ids.device), self.config.rotary_dim,
                                    self.config.rope_theta, emb.dtype)
            return self.mtp(emb, hidden, None, None, (cos[None], sin[None]))
        ctx = pos0 if isinstance(pos0, FwdCtx) else FwdCtx.make(
            self.config, next_ids.device, emb.dtype, [0], [pos0], [0], [0], T, False)
        return self.mtp(emb, hidden, ctx, kv)
