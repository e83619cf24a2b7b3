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

import array
import collections
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .model.config import Qwen35Config

log = logging.getLogger("nextn.cache")


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


# ----------------------------------------------------------------------------------------------- prefix cache
#: The prefill grid: a prompt is prefilled in blocks whose boundaries are the absolute positions that are multiples
#: of PREFILL_GRID (only the prompt's last block may end off the grid), whatever the token budget, the batch or K;
#: the prefix cache keeps the state at these boundaries. 256 = 4 chunks of the GDN chunked form (64 tokens), so the
#: GPU's chunk boundaries fall on the grid; large enough that the recurrent state a block keeps (one GDN state per
#: layer: 18 MiB at the 0.8B shape, 48 MiB at 9B) is paid per 256 tokens of KV, small enough that a shared system
#: prompt or a conversation's history hits to within 255 tokens of where it diverges.
PREFILL_GRID = 256


#: A request's prompt keeps its state TAIL_MARGIN tokens before its end, and its generated tokens at their end: the
#: prefix cache keeps a "tail" there, the first t positions of a grid block (any 0 < t < PREFILL_GRID), so a
#: conversation's next turn resumes where it parts from the previous one instead of up to 255 tokens before. Tails are
#: kept where a forward that stops at any position computes the bits of one that runs on (the C path), so where they
#: are is only the index's choice; on the kernel path they would have to be on the GDN chunk (64), where chunks
#: restart.
#: A prompt's tail is taken this many tokens before its end: a chat template's generation prompt ends the prompt, and
#: the next turn renders that place otherwise. Qwen3.5's `<|im_start|>assistant\n<think>\n\n</think>\n\n` (thinking
#: off) is followed by the 4 tokens of the empty think block, which a later turn's history leaves out, so 4 puts the
#: tail exactly where the two turns part (thinking on, `<think>\n`: 2 tokens before).
TAIL_MARGIN = 4


def _block_hash(prev: bytes, tokens: list[int], lo: int, hi: int, images: Sequence[tuple[int, int, str]],
                tail: bool = False) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array.array("q", tokens[lo:hi]).tobytes())
    for start, count, digest in images:
        a, b = max(start, lo), min(start + count, hi)
        if a < b:
            h.update(f"|image {digest} {a - start} {b - a}".encode())
    if tail:
        h.update(f"|tail {hi - lo}".encode())
    return h.digest()


def block_keys(tokens: list[int], n: int, root: bytes, prev: list[bytes] | None = None,
               images: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
    """The hash-chain keys of the first n grid blocks of `tokens`: key_b = H(key_{b-1} | block b's token ids |
    the images whose pads it holds), key_{-1} = `root` (the model's identity). images: (first pad's index, pad
    count, content hash) of each image of the sequence (`SessionState.image_keys`); a block holding pads of an
    image adds its hash and the offset and count of those pads in the image, so two different images of the same
    size never share a block while the same image in another conversation does. Without images the key is the
    token ids' alone. `prev`: keys already known for the first blocks (extended, not recomputed)."""
    keys = list(prev or [])
    G = PREFILL_GRID
    for b in range(len(keys), n):
        keys.append(_block_hash(keys[-1] if keys else root, tokens, b * G, (b + 1) * G, images))
    return keys


def tail_key(tokens: list[int], b: int, t: int, root: bytes, keys: list[bytes],
             images: Sequence[tuple[int, int, str]] = ()) -> bytes:
    """The key of the tail of grid block b that holds its first t positions (0 < t < PREFILL_GRID):
    H(key_{b-1} | those token ids | their images | "tail" t), never equal to a whole block's key. keys:
    `block_keys` of at least the first b blocks."""
    return _block_hash(keys[b - 1] if b else root, tokens, b * PREFILL_GRID, b * PREFILL_GRID + t, images, True)


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters (prompt tokens looked up and found, since start: vLLM's semantics) and its
    size now: `blocks` indexed and their `bytes`, `resident_bytes` of the slabs allocated so far (indexed, reserved
    and free blocks: the memory the cache takes, which it keeps until exit), the byte budget."""

    queries: int = 0
    hits: int = 0
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    resident_bytes: int = 0


@dataclass
class _Entry:
    bid: int  # arena block id
    parent: bytes | None  # the previous block's key (None: the first block)
    parent_bid: int | None  # the previous block's arena id (a hit follows these links)
    tokens: tuple[int, ...]  # this block's token ids (compared on every hit; a tail's first t)
    children: int = 0  # cached blocks and tails whose parent this is (only leaves are evicted)


class PrefixCache:
    """Exact prefix cache over the prefill grid: for each cached block b (positions bG..(b+1)G-1 of a token
    sequence, keyed by the hash chain of its ids, `block_keys`) the state a session needs to resume at B = (b+1)G:
    every attention layer's K/V rows of the block, each GDN layer's conv and recurrent state at B, the MTP head's
    K/V rows bG-1 .. B-2 (rows whose next token lies inside the block) and the trunk's pre-norm hidden of position
    B-1 (the carrier of MTP row B-1, whose next token is the resuming prompt's). Resuming copies those into the
    session's pool slot (`restore`); nothing is shared by reference, so a session never holds a block.

    Tails: the same for the first t positions of a block (0 < t < G: the state at bG + t),
    keyed by `tail_key` under the chain of the blocks before it and kept as a leaf of that chain (`insert_tail`,
    `lookup_tail`). The scheduler keeps them where a forward that stops at any position computes the bits one that
    runs on does (the C path: `engine.prefill.steps_match_prefill`), TAIL_MARGIN tokens before the end of a request's
    prompt and at the end of its generated tokens, so a conversation's next turn resumes where it parts from the
    previous one. The index knows the tail lengths cached under each chain (`_tail_lens`), so a
    lookup hashes only those.

    What a key collision can do: a key is a 128-bit hash, and the index holds at most one block per key, so two
    sequences whose keys collide cannot both be cached (the second is not inserted). It cannot return state computed
    from other tokens: a block is inserted only under the chain of blocks that the inserting session's own tokens
    verify (each earlier block's tokens compared, each link checked), and a hit follows the links block id by block
    id and compares every block's tokens with the query's; so the blocks of a hit, and the state each was computed
    from, are those of exactly the query's tokens.

    Memory: at most `max_bytes`, in slabs of blocks allocated when first needed (host RAM for a CPU pool, device
    memory for a CUDA one). When full, the least recently used block without cached children is evicted (a hit
    touches its chain from the leaf to the root, so a parent is never older than its children). Not thread-safe:
    the scheduler's thread alone calls it."""

    SLAB = 16  # blocks per slab

    def __init__(self, pool: StatePool, max_bytes: int, identity: str):
        cfg = pool.cfg
        self.cfg, self.pool, self.device, self.dtype = cfg, pool, pool.device, pool.dtype
        self.mtp = pool.mtp is not None
        G = PREFILL_GRID
        esz = torch.empty((), dtype=pool.dtype).element_size()
        per = pool_bytes(cfg, 1, G, 1, pool.dtype, self.mtp)
        self.block_bytes = sum(per.values()) + cfg.hidden_size * esz
        self.capacity = max(0, int(max_bytes) // self.block_bytes)
        self.root = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self._slabs: list[list[torch.Tensor]] = []
        self._free: list[int] = []
        self._index: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # oldest first
        self._reserved: set[int] = set()
        #: parent key (None: the first block) -> how many tails of each length the index holds under it
        self._tail_lens: dict[bytes | None, collections.Counter[int]] = {}
        self.stats = PrefixCacheStats(capacity_bytes=self.capacity * self.block_bytes)

    # -- arena -------------------------------------------------------------------------------------------------
    def _slab(self, n: int) -> list[torch.Tensor]:
        """One slab of n blocks, tensors in pool.layers order (attention: k, v [n, G, nkv, hd]; GDN: conv, rec), then
        the MTP k, v and the carrier [n, H]."""
        cfg, G, dev, dt = self.cfg, PREFILL_GRID, self.device, self.dtype
        out: list[torch.Tensor] = []
        for c in self.pool.layers:
            if isinstance(c, KVPool):
                out += [torch.empty(n, G, *c.k.shape[2:], device=dev, dtype=dt) for _ in range(2)]
            else:
                out += [torch.empty(n, *c.conv.shape[2:], device=dev, dtype=c.conv.dtype),
                        torch.empty(n, *c.rec.shape[2:], device=dev, dtype=c.rec.dtype)]
        if self.mtp:
            out += [torch.empty(n, G, *self.pool.mtp.k.shape[2:], device=dev, dtype=dt) for _ in range(2)]
        out.append(torch.empty(n, cfg.hidden_size, device=dev, dtype=dt))
        return out

    def _alloc(self) -> int | None:
        """A free block id (a new slab when none is free and the budget allows, else an evicted leaf's), or None."""
        if not self._free:
            have = len(self._slabs) * self.SLAB
            if have < self.capacity:
                n = min(self.SLAB, self.capacity - have)
                try:
                    with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
                        slab = self._slab(n)
                    self._slabs.append(slab)
                    self._free.extend(range(have + n - 1, have - 1, -1))
                    self.stats.resident_bytes += sum(t.numel() * t.element_size() for t in slab)
                except (torch.OutOfMemoryError, RuntimeError) as e:  # the device filled up: keep what we have
                    log.warning("prefix cache: no memory for more blocks (%s); it stays at %d blocks", e, have)
                    self.capacity = have
                    self.stats.capacity_bytes = have * self.block_bytes
            if not self._free:
                self._evict_one()
        return self._free.pop() if self._free else None

    def _parts(self, bid: int) -> list[torch.Tensor]:
        s, r = divmod(bid, self.SLAB)
        return [t[r] for t in self._slabs[s]]

    def _evict_one(self) -> None:
        for key, e in self._index.items():  # oldest first; a parent is never older than its children
            if e.children == 0:
                del self._index[key]
                if len(e.tokens) < PREFILL_GRID:  # a tail
                    lens = self._tail_lens[e.parent]
                    lens[len(e.tokens)] -= 1
                    if lens[len(e.tokens)] == 0:
                        del lens[len(e.tokens)]
                        if not lens:
                            del self._tail_lens[e.parent]
                if e.parent is not None and e.parent in self._index:
                    self._index[e.parent].children -= 1
                self._free.append(e.bid)
                self._count()
                return

    def _count(self) -> None:
        self.stats.blocks = len(self._index)
        self.stats.bytes = len(self._index) * self.block_bytes

    def _touch(self, key: bytes | None) -> None:
        """Make `key` and its ancestors the most recently used, the root last."""
        while key is not None and key in self._index:
            self._index.move_to_end(key)
            key = self._index[key].parent

    # -- use ---------------------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], keys: list[bytes]) -> list[int]:
        """The arena ids of the longest cached chain of `tokens`' grid blocks (keys: `block_keys` of at least the
        blocks asked about), leaving at least one token to prefill (the prompt's last row gives the first token's
        logits); touches the chain. Each block's tokens equal the query's and its parent link names the block before
        it in the chain (see the class: what a collision can do). The caller counts the query in `stats`."""
        n = min(len(keys), (len(tokens) - 1) // PREFILL_GRID)
        ids = self._chain(tokens, keys, n)
        self._touch(keys[len(ids) - 1] if ids else None)
        return ids

    def _chain(self, tokens: list[int], keys: list[bytes], n: int) -> list[int]:
        """The arena ids of the longest run of blocks 0..n-1 of `tokens` that the index holds, verified: each one's
        tokens are the query's, its parent's key and block id those of the block before it."""
        G = PREFILL_GRID
        ids: list[int] = []
        parent: bytes | None = None
        for b in range(n):
            e = self._index.get(keys[b])
            if e is None or e.parent != parent or e.parent_bid != (ids[-1] if ids else None) \
                    or e.tokens != tuple(tokens[b * G:(b + 1) * G]):
                break
            ids.append(e.bid)
            parent = keys[b]
        return ids

    def lookup_tail(self, tokens: list[int], keys: list[bytes], ids: list[int],
                    images: Sequence[tuple[int, int, str]] = ()) -> tuple[int, int] | None:
        """The longest cached tail of grid block n = len(ids) of `tokens` (ids: `lookup`'s chain of blocks 0..n-1,
        keys: their `block_keys`), leaving at least one token to prefill, as (arena id, t); None if none. Verified as
        a chain's blocks are (its tokens, its parent's key and id); touches it and its chain."""
        n, G = len(ids), PREFILL_GRID
        for t in sorted(self._tail_lens.get(keys[n - 1] if n else None, ()), reverse=True):
            if n * G + t > len(tokens) - 1:
                continue
            key = tail_key(tokens, n, t, self.root, keys, images)
            e = self._index.get(key)
            if e is None or e.parent != (keys[n - 1] if n else None) or e.parent_bid != (ids[-1] if ids else None) \
                    or e.tokens != tuple(tokens[n * G:n * G + t]):
                continue
            self._touch(key)
            return e.bid, t
        return None

    def restore(self, ids: list[int], slot: int, window_slot: int, mtp_slot: int | None,
                first: int = 0, tail: tuple[int, int] | None = None) -> torch.Tensor:
        """Copy the chain `ids` (from `lookup`) into pool slot `slot`: K/V rows 0..nG-1, the GDN state at nG into
        window slot `window_slot`, and (mtp_slot not None) the MTP head's K/V rows 0..nG-2 into that MTP slot;
        `first` > 0: the slot holds blocks 0..first-1 already (their rows are not copied again). tail: (id, t) from
        `lookup_tail`: then block n's first t rows too, and the state at nG + t. Returns the pre-norm hidden of the
        last position restored [H]. The full blocks' rows go in one gather per tensor (`_gather`)."""
        G, pool = PREFILL_GRID, self.pool
        blocks = [(b, bid, G) for b, bid in enumerate(ids)] + ([(len(ids), tail[0], tail[1])] if tail else [])
        full = [bid for b, bid, t in blocks if t == G and b >= first]  # blocks first.. of the chain, in order
        b0, n = first, len(full)
        if full:
            i = 0
            for c in pool.layers:
                if isinstance(c, KVPool):
                    for dst, part in ((c.k, i), (c.v, i + 1)):
                        self._gather(full, part, dst[slot, b0 * G:(b0 + n) * G].view(n, G, *dst.shape[2:]))
                i += 2
            if mtp_slot is not None:
                for dst, part in ((pool.mtp.k, i), (pool.mtp.v, i + 1)):
                    if b0 == 0:  # block 0's MTP rows start at its second position
                        dst[mtp_slot, :n * G - 1] = self._gather(full, part).flatten(0, 1)[1:]
                    else:
                        self._gather(full, part, dst[mtp_slot, b0 * G - 1:(b0 + n) * G - 1].view(n, G, *dst.shape[2:]))
        b, bid, t = blocks[-1]
        parts = self._parts(bid)
        if b >= first or t < G:  # the last block: a tail's rows, and the GDN state where the chain ends
            i = 0
            for c in pool.layers:
                if isinstance(c, KVPool):
                    if t < G:
                        c.k[slot, b * G:b * G + t] = parts[i][:t]
                        c.v[slot, b * G:b * G + t] = parts[i + 1][:t]
                else:
                    c.conv[slot, window_slot] = parts[i]
                    c.rec[slot, window_slot] = parts[i + 1]
                i += 2
            if mtp_slot is not None and t < G:
                j = 1 if b == 0 else 0
                pool.mtp.k[mtp_slot, b * G - 1 + j:b * G + t - 1] = parts[i][j:t]
                pool.mtp.v[mtp_slot, b * G - 1 + j:b * G + t - 1] = parts[i + 1][j:t]
        return parts[-1].clone()  # [H]

    def _gather(self, bids: list[int], part: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `part` of blocks `bids`, stacked in order [len(bids), ...], into `out` when given (contiguous): one
        index_select when they share a slab, else one stack."""
        rows = [divmod(bid, self.SLAB) for bid in bids]
        if all(s == rows[0][0] for s, _ in rows):
            src = self._slabs[rows[0][0]][part]
            idx = torch.tensor([r for _, r in rows], device=src.device)
            return torch.index_select(src, 0, idx) if out is None else torch.index_select(src, 0, idx, out=out)
        views = [self._slabs[s][part][r] for s, r in rows]
        return torch.stack(views) if out is None else torch.stack(views, out=out)

    def reserve(self) -> int | None:
        """A block id held outside the index (a block whose GDN state is captured before the rest is ready:
        `capture_state`, then `insert(..., bid=)` or `release`); None when the cache has no room."""
        bid = self._alloc()
        if bid is not None:
            self._reserved.add(bid)
        return bid

    def release(self, bid: int) -> None:
        """Give back a reserved id that will not be inserted (a no-op for an id no longer reserved: inserted or given
        back already)."""
        if bid in self._reserved:
            self._reserved.discard(bid)
            self._free.append(bid)

    def capture_state(self, bid: int, slot: int, window_slot: int, pre_last: torch.Tensor) -> None:
        """Copy the GDN states in window slot `window_slot` of pool slot `slot` and the carrier `pre_last` [H] into
        block `bid` (reserved, or about to be inserted)."""
        parts, i = self._parts(bid), 0
        for c in self.pool.layers:
            if isinstance(c, GdnPool):
                parts[i].copy_(c.conv[slot, window_slot])
                parts[i + 1].copy_(c.rec[slot, window_slot])
            i += 2
        parts[-1].copy_(pre_last)

    def _store_rows(self, bid: int, slot: int, mtp_slot: int | None, b: int, t: int) -> None:
        """Copy the first t positions of grid block b of pool slot `slot` into block `bid`: every attention layer's
        K/V rows bG..bG+t-1 and (mtp_slot not None) the MTP head's rows bG-1..bG+t-2 (`restore`'s inverse)."""
        G, pool = PREFILL_GRID, self.pool
        parts, i = self._parts(bid), 0
        for c in pool.layers:
            if isinstance(c, KVPool):
                parts[i][:t].copy_(c.k[slot, b * G:b * G + t])  # [t, nkv, hd]
                parts[i + 1][:t].copy_(c.v[slot, b * G:b * G + t])  # [t, nkv, hd]
            i += 2
        if mtp_slot is not None:
            j = 1 if b == 0 else 0
            parts[i][j:t] = pool.mtp.k[mtp_slot, b * G - 1 + j:b * G + t - 1]  # [t - j, nkv, hd]
            parts[i + 1][j:t] = pool.mtp.v[mtp_slot, b * G - 1 + j:b * G + t - 1]  # [t - j, nkv, hd]

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def refresh(self, key: bytes) -> bool:
        """Whether `key` (a block's or a tail's) is cached; if it is, it and its ancestors become the most recently
        used, as a write of the same rows would make them."""
        self._touch(key)
        return key in self._index

    def insert(self, keys: list[bytes], tokens: list[int], b: int, slot: int, mtp_slot: int | None, *,
               window_slot: int | None = None, pre_last: torch.Tensor | None = None, bid: int | None = None) -> bool:
        """Cache block b of a session in pool slot `slot` whose sequence starts with `tokens` (at least (b+1)G of
        them) and whose chain keys are `keys` (at least b+1): K/V rows bG..(b+1)G-1 and (mtp_slot not None) MTP rows
        bG-1..(b+1)G-2 are copied from the pool; the GDN state and carrier come from window slot `window_slot` and
        `pre_last` (the state at (b+1)G is live there now), or were captured into the reserved `bid` already.
        A block already cached, or whose earlier blocks the index does not hold as `tokens`' own (evicted meanwhile,
        or a key collision), is not inserted; a reserved `bid` is then released. Returns whether it was inserted."""
        G, key = PREFILL_GRID, keys[b]
        parent = keys[b - 1] if b > 0 else None
        if bid is None and (window_slot is None or pre_last is None):
            raise ValueError("insert: give the live window slot and the carrier, or a captured block id")
        if key in self._index or len(self._chain(tokens, keys, b)) < b or (mtp_slot is None) == self.mtp:
            if bid is not None:
                self.release(bid)
            self._touch(key if key in self._index else None)
            return False
        captured = bid is not None
        if bid is None:
            assert window_slot is not None and pre_last is not None
            if parent is not None:
                self._touch(parent)  # not the block evicted to make room
            bid = self._alloc()
            if bid is None:
                return False
            if len(self._chain(tokens, keys, b)) < b:  # the room was made by evicting the parent
                self._free.append(bid)
                return False
        else:
            self._reserved.discard(bid)
        try:  # a copy that raises gives the block back: it is neither indexed nor lost
            if not captured:
                self.capture_state(bid, slot, window_slot, pre_last)
            self._store_rows(bid, slot, mtp_slot, b, G)
        except BaseException:
            self._free.append(bid)
            raise
        self._index[key] = _Entry(bid, parent, self._index[parent].bid if parent is not None else None,
                                  tuple(tokens[b * G:(b + 1) * G]))
        if parent is not None:
            self._index[parent].children += 1
        self._touch(key)
        self._count()
        return True

    def insert_tail(self, keys: list[bytes], tokens: list[int], b: int, t: int, slot: int, mtp_slot: int | None,
                    bid: int, images: Sequence[tuple[int, int, str]] = ()) -> bool:
        """Cache the tail of block b that holds its first t positions (0 < t < G) of a session
        in pool slot `slot` whose sequence starts with `tokens` (at least bG + t) and whose chain keys are `keys` (at
        least b): K/V rows bG..bG+t-1 and (mtp_slot not None) MTP rows bG-1..bG+t-2 from the pool; the GDN state at
        bG + t and its carrier were captured into the reserved `bid` (`capture_state`). Not inserted (and `bid`
        released) when that tail is cached already or the index does not hold the chain of blocks 0..b-1 as `tokens`'
        own. Returns whether it was inserted."""
        G = PREFILL_GRID
        try:  # whatever raises gives the reserved block back: it is neither indexed nor lost
            if not 0 < t < G:
                raise ValueError(f"a tail holds 1 to {G - 1} positions, not {t}")
            key = tail_key(tokens, b, t, self.root, keys, images)
            ids = self._chain(tokens, keys, b)
            if key in self._index or len(ids) < b or (mtp_slot is None) == self.mtp:
                self.release(bid)
                self._touch(key if key in self._index else None)
                return False
            self._store_rows(bid, slot, mtp_slot, b, t)
        except BaseException:
            self.release(bid)
            raise
        self._reserved.discard(bid)
        parent = keys[b - 1] if b else None
        self._index[key] = _Entry(bid, parent, ids[-1] if ids else None, tuple(tokens[b * G:b * G + t]))
        self._tail_lens.setdefault(parent, collections.Counter())[t] += 1
        if parent is not None:
            self._index[parent].children += 1
        self._touch(key)
        self._count()
        return True
