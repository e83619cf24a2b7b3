"""Decode state, preallocated once: the `StatePool` (every session's attention KV, GDN conv + recurrent states
with per-position slots, the MTP head's KV) and per-session handles into it (`ModelCache`, `MtpScratch`).

Layout (one pool slot per session; L positions, W per-position GDN state slots):
  attention layer   k, v  [S, L, nkv, hd]        model dtype; row p = position p of the slot's sequence
  GDN layer         conv  [S, W, C, Kc-1]        model dtype (the last Kc-1 raw conv inputs)
                    rec   [S, W, nv, dk, dv]     fp32 (fp64 for fp64 models)
  MTP head          k, v  [S, L, nkv, hd]
A session's live GDN state sits in window slot `cur`. A forward reads slot `cur` of each row and writes the
state after its token t to slot `write0 + t` (recording forwards: spec verify, decode) or only the final state
to slot `write0` (prefill chunks). Rollback is O(1): attention KV rolls back by length (rows past it are dead and
get overwritten), GDN by choosing which recorded slot becomes `cur`; nothing is copied or replayed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.config import Qwen35Config


class PoolFull(RuntimeError):
    """No free slot in the state pool."""


@dataclass
class KVPool:
    """K/V rows of one full-attention layer: k, v [S, L, nkv, hd]."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        self.k_rows, self.v_rows = self.k.flatten(0, 1), self.v.flatten(0, 1)  # [S * L, nkv, hd] views

    @classmethod
    def alloc(cls, cfg: Qwen35Config, slots: int, capacity: int, device: torch.device | str,
              dtype: torch.dtype) -> KVPool:
        shape = (slots, capacity, cfg.num_key_value_heads, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))


@dataclass
class GdnPool:
    """One GDN layer: conv [S, W, C, Kc-1] (model dtype) and rec [S, W, nv, dk, dv] (fp32, fp64 for fp64)."""

    conv: torch.Tensor
    rec: torch.Tensor

    def __post_init__(self) -> None:
        self.conv_rows, self.rec_rows = self.conv.flatten(0, 1), self.rec.flatten(0, 1)  # [S * W, ...] views

    @classmethod
    def alloc(cls, cfg: Qwen35Config, slots: int, window: int, device: torch.device | str,
              dtype: torch.dtype) -> GdnPool:
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        conv = torch.zeros(slots, window, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, device=device, dtype=dtype)
        rec = torch.zeros(slots, window, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, device=device, dtype=sdt)
        return cls(conv, rec)


def pool_bytes(cfg: Qwen35Config, slots: int, capacity: int, window: int, dtype: torch.dtype,
               mtp: bool) -> dict[str, int]:
    """Bytes a `StatePool` of this shape reserves, by part ("kv", "gdn", "mtp")."""
    esz = torch.empty((), dtype=dtype).element_size()
    ssz = 8 if dtype == torch.float64 else 4
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * esz
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    n_gdn = len(cfg.layer_types) - n_attn
    gdn_slot = (cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * esz
                + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * ssz)
    return {"kv": n_attn * slots * capacity * kv_row, "gdn": n_gdn * slots * window * gdn_slot,
            "mtp": slots * capacity * kv_row if mtp else 0}


class StatePool:
    """Every session's decode state, allocated once (`slots` sessions, `capacity` positions, `window` GDN state
    slots each); `alloc()` hands out a free slot index, `free(i)` returns it."""

    def __init__(self, cfg: Qwen35Config, slots: int, capacity: int, window: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, mtp: bool = True):
        if slots < 1 or capacity < 1 or window < 1:
            raise ValueError("a state pool needs at least one slot, position and window slot")
        self.cfg, self.slots, self.capacity, self.window = cfg, slots, capacity, window
        self.device, self.dtype = device, dtype
        self.layers: list[KVPool | GdnPool] = [
            KVPool.alloc(cfg, slots, capacity, device, dtype) if t == "full_attention"
            else GdnPool.alloc(cfg, slots, window, device, dtype) for t in cfg.layer_types]
        self.mtp: KVPool | None = KVPool.alloc(cfg, slots, capacity, device, dtype) if mtp and cfg.has_mtp else None
        self._free = list(range(slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free slot index (its contents are garbage until written). Raises `PoolFull`."""
        if not self._free:
            raise PoolFull(f"all {self.slots} state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        """Return `slot` (idempotence is the caller's job: a slot must be freed once)."""
        assert 0 <= slot < self.slots and slot not in self._free, slot
        self._free.append(slot)

    def nbytes(self) -> int:
        ts = [t for c in self.layers for t in ((c.k, c.v) if isinstance(c, KVPool) else (c.conv, c.rec))]
        if self.mtp is not None:
            ts += [self.mtp.k, self.mtp.v]
        return sum(t.numel() * t.element_size() for t in ts)


class ModelCache:
    """One sequence's trunk state: a handle on one slot of a `StatePool` (its own one-slot pool when built
    standalone). `length` tokens have their K/V and GDN state in the cache; `cur` is the live GDN window slot.

    Two ways to roll back, both O(1):
      * spec rounds (`keep(n, slot)`): a recording forward wrote the state after each of its tokens to window
        slots 0..T-1; keeping the first n tokens selects the slot that holds the state after the last of them;
      * snapshot windows (`snapshot()`, recording forwards, `rollback(n)`): the state at the snapshot goes to
        slot 0 and later recorded tokens to slots 1.., so any length in [base, length] can be restored.
    """

    def __init__(self, cfg: Qwen35Config, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, window: int = 8, *, pool: StatePool | None = None,
                 slot: int | None = None):
        if pool is None:
            pool = StatePool(cfg, 1, max_len, window + 1, device, dtype, mtp=False)
            slot = pool.alloc()
        assert slot is not None
        self.cfg, self.pool, self.slot = cfg, pool, slot
        self.max_len = min(max_len, pool.capacity)
        self.device, self.dtype = pool.device, pool.dtype
        self.length = 0
        self.cur = 0
        self._base: int | None = None

    @property
    def layers(self) -> list[KVPool | GdnPool]:
        return self.pool.layers

    def reset(self) -> None:
        """Forget the sequence (a recycled slot starts empty: GDN state zero)."""
        self.length, self.cur, self._base = 0, 0, None
        for c in self.pool.layers:
            if isinstance(c, GdnPool):
                c.conv[self.slot, 0].zero_()
                c.rec[self.slot, 0].zero_()

    def keep(self, n: int, state_slot: int) -> None:
        """Spec rollback: keep the first n tokens; `state_slot` holds the GDN state after token n-1."""
        self.length, self.cur = n, state_slot

    # -- snapshot windows (tests, the forward's single-sequence API) -----------------------------------------
    def snapshot(self) -> None:
        """Open a rollback window at the current length: the live state moves to window slot 0."""
        if self.cur != 0:
            for c in self.pool.layers:
                if isinstance(c, GdnPool):
                    c.conv[self.slot, 0].copy_(c.conv[self.slot, self.cur])
                    c.rec[self.slot, 0].copy_(c.rec[self.slot, self.cur])
            self.cur = 0
        self._base = self.length

    def window_slot(self, pos0: int, T: int) -> int:
        """Window slot written after token 0 of a recording forward of T tokens at pos0 (inside a snapshot)."""
        if self._base is None or pos0 < self._base:
            raise RuntimeError("recording forward outside a snapshot window")
        off = 1 + pos0 - self._base
        if off + T > self.pool.window:
            raise RuntimeError(f"recording {T} tokens at window offset {off} exceeds the {self.pool.window}-slot window")
        return off

    def rollback(self, n: int) -> None:
        """Return to length n (window base <= n <= length)."""
        if n == self.length:
            return
        if self._base is None or not (self._base <= n < self.length):
            raise RuntimeError(f"cannot roll back to {n}: window base {self._base}, length {self.length}")
        self.keep(n, n - self._base)

    def close_window(self) -> None:
        """Forget the rollback window."""
        self._base = None

    def check_room(self, T: int) -> None:
        """Raise if T more tokens would not fit in max_len."""
        if self.length + T > self.max_len:
            raise ValueError(f"sequence of {self.length + T} tokens exceeds the cache's max length {self.max_len}")

    def state_tensors(self) -> list[torch.Tensor]:
        """The live state (KV rows [:length], conv, rec of the live slot), each with a leading batch dim of 1."""
        out: list[torch.Tensor] = []
        s = self.slot
        for c in self.pool.layers:
            if isinstance(c, KVPool):
                out += [c.k[s:s + 1, :self.length], c.v[s:s + 1, :self.length]]
            else:
                out += [c.conv[s, self.cur][None], c.rec[s, self.cur][None]]
        return out

    def nbytes(self) -> int:
        return self.pool.nbytes() // self.pool.slots


class MtpScratch:
    """The MTP head's own KV (one full-attention layer) for one sequence, persistent over the committed sequence:
    a handle on the pool's MTP slot (or its own buffer when standalone).

    Row i holds the head's K/V for MTP row i = (token i+1, trunk hidden h_i) at RoPE position i.
    `length` counts rows that are final (filled from exact trunk hiddens); rows past it are draft scratch.
    """

    def __init__(self, cfg: Qwen35Config, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, *, pool: StatePool | None = None, slot: int = 0):
        if pool is None:
            self.kv, self.slot = KVPool.alloc(cfg, 1, max_len, device, dtype), 0
        else:
            assert pool.mtp is not None, "the pool has no MTP part"
            self.kv, self.slot = pool.mtp, slot
        self.length = 0
        self.max_len = min(max_len, self.kv.k.shape[1])

    def set_len(self, n: int) -> None:
        """Truncate to n final rows (drops draft rows)."""
        self.length = n

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of rows [0, n): [1, n, nkv, hd] each."""
        s = self.slot
        return self.kv.k[s:s + 1, :n], self.kv.v[s:s + 1, :n]
