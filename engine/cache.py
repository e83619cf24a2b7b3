"""Preallocated per-sequence caches: attention KV, GDN conv + recurrent state, per-position GDN states for
spec-decode rollback, and the MTP head's own KV (`MtpScratch`).

Rollback is O(state): attention KV rolls back by length (rows past it are dead and get overwritten);
GDN layers restore the state recorded after the last kept token during the current window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.config import Qwen35Config


@dataclass
class KVBuffer:
    """K/V rows of one full-attention layer: k, v [1, capacity, nkv, hd]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def alloc(cls, cfg: Qwen35Config, capacity: int, device: torch.device | str, dtype: torch.dtype) -> "KVBuffer":
        shape = (1, capacity, cfg.num_key_value_heads, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))


class GdnLayerCache:
    """One GDN layer: conv [1, C, Kc-1] (last raw qkv inputs, model dtype), rec [1, nv, dk, dv] (fp32),
    and window slots win_conv [W+1, 1, C, Kc-1], win_rec [W+1, 1, nv, dk, dv] for per-position states."""

    def __init__(self, cfg: Qwen35Config, window: int, device: torch.device | str, dtype: torch.dtype):
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        C, kc = cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim
        rec_shape = (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.conv = torch.zeros(1, C, kc - 1, device=device, dtype=dtype)
        self.rec = torch.zeros(rec_shape, device=device, dtype=sdt)
        self.win_conv = torch.zeros(window + 1, 1, C, kc - 1, device=device, dtype=dtype)
        self.win_rec = torch.zeros(window + 1, *rec_shape, device=device, dtype=sdt)

    def grow(self, window: int) -> None:
        """Enlarge the window to `window` tokens, keeping recorded slots."""
        old = self.win_conv.shape[0]
        wc = self.win_conv.new_zeros(window + 1, *self.win_conv.shape[1:])
        wr = self.win_rec.new_zeros(window + 1, *self.win_rec.shape[1:])
        wc[:old], wr[:old] = self.win_conv, self.win_rec
        self.win_conv, self.win_rec = wc, wr


class ModelCache:
    """All trunk-layer caches of one sequence (batch 1), sized for `max_len` positions.

    `length` is the number of tokens whose K/V and GDN state are in the cache. `snapshot()` opens a rollback
    window at the current length; forwards with record=True then keep per-position GDN states, and
    `rollback(n)` returns to any length n in [window base, length] without replaying anything.
    """

    def __init__(self, cfg: Qwen35Config, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, window: int = 8):
        self.cfg, self.max_len, self.device, self.dtype = cfg, max_len, device, dtype
        self.layers: list[KVBuffer | GdnLayerCache] = [
            KVBuffer.alloc(cfg, max_len, device, dtype) if t == "full_attention" else GdnLayerCache(cfg, window, device, dtype)
            for t in cfg.layer_types
        ]
        self.window = window
        self.length = 0
        self._base: int | None = None

    @property
    def gdn_layers(self) -> list[GdnLayerCache]:
        return [c for c in self.layers if isinstance(c, GdnLayerCache)]

    def snapshot(self) -> None:
        """Open a rollback window at the current length (copies each GDN state into window slot 0)."""
        self._base = self.length
        for c in self.gdn_layers:
            c.win_conv[0].copy_(c.conv)
            c.win_rec[0].copy_(c.rec)

    def window_slot(self, pos0: int, T: int) -> int:
        """Slot offset (pos0 - base) where a recording forward of T tokens at pos0 stores its states."""
        if self._base is None or pos0 < self._base:
            raise RuntimeError("recording forward outside a snapshot window")
        off = pos0 - self._base
        if off + T > self.window:
            self.window = off + T
            for c in self.gdn_layers:
                c.grow(self.window)
        return off

    def rollback(self, n: int) -> None:
        """Return to length n (window base <= n <= length); restores GDN states recorded after token n-1."""
        if n == self.length:
            return
        if self._base is None or not (self._base <= n < self.length):
            raise RuntimeError(f"cannot roll back to {n}: window base {self._base}, length {self.length}")
        j = n - self._base
        for c in self.gdn_layers:
            c.conv.copy_(c.win_conv[j])
            c.rec.copy_(c.win_rec[j])
        self.length = n

    def close_window(self) -> None:
        """Forget the rollback window (after a round committed)."""
        self._base = None

    def check_room(self, T: int) -> None:
        """Raise if T more tokens would not fit in max_len."""
        if self.length + T > self.max_len:
            raise ValueError(f"sequence of {self.length + T} tokens exceeds the cache's max length {self.max_len}")

    def state_tensors(self) -> list[torch.Tensor]:
        """The live state up to `length` (KV rows [:length], conv, rec), for comparisons in tests."""
        out: list[torch.Tensor] = []
        for c in self.layers:
            if isinstance(c, KVBuffer):
                out += [c.k[:, :self.length], c.v[:, :self.length]]
            else:
                out += [c.conv, c.rec]
        return out

    def nbytes(self) -> int:
        tot = 0
        for c in self.layers:
            ts = [c.k, c.v] if isinstance(c, KVBuffer) else [c.conv, c.rec, c.win_conv, c.win_rec]
            tot += sum(t.numel() * t.element_size() for t in ts)
        return tot


class MtpScratch:
    """The MTP head's own KV (one full-attention layer), persistent over the committed sequence.

    Row i holds the head's K/V for MTP row i = (token i+1, trunk hidden h_i) at RoPE position i.
    `length` counts rows that are final (filled from exact trunk hiddens); rows past it are draft scratch.
    """

    def __init__(self, cfg: Qwen35Config, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.kv = KVBuffer.alloc(cfg, max_len, device, dtype)
        self.length = 0
        self.max_len = max_len

    def set_len(self, n: int) -> None:
        """Truncate to n final rows (drops draft rows)."""
        self.length = n
