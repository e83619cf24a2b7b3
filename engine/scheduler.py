"""Continuous batching: which sessions run, prompt prefill in grid blocks under a token budget, the state pool and
the prefix cache.

`Scheduler.step()` is the worker's unit of work: ONE speculative round over every running session
(`engine.spec.spec_round`: drafts for all rows, one verify forward, one host copy), then prefill blocks of joining
sessions, up to `max_num_batched_tokens` tokens per step in all (the round's N x (k+1) tokens count first), so a
long prompt never freezes the running streams for longer than one block. A prompt's blocks are those of the fixed
grid (`engine.cache.PREFILL_GRID`, `engine.prefill`): the budget decides how many blocks a session gets in a step,
never where a block splits (a step with a joining prompt runs at least one block). On the kernel path, and on the C path
while the prefix cache writes a session's blocks, a session's granted blocks run as one row of one forward
(`_prefill_blocks`; at most K+1 while the prefix cache writes), rows of several sessions packed together; elsewhere the
blocks of a step run in waves (the first block of every session granted one, then the second, ...), each wave one
forward when the model's prefill is row-wise (`engine.prefill.packs_rows`), else one forward per session. A session
joins (`add`) once it holds a pool slot and leaves between steps; its slot is returned the moment it finishes, fails or
is removed.

The prefix cache (`engine.cache.PrefixCache`, on when `prefix_cache_bytes` > 0): a joining session resumes from the
longest cached run of its prompt's grid blocks (copied into its slot; sessions that want prompt logprobs prefill
everything), and every session writes each grid block it completes: once the MTP head has the rows of the block
whose forward reached the boundary (its state live, or kept in a spare window slot for a block inside a row), or,
where decode steps reach the states a prefill does (`engine.prefill.steps_match_prefill`), after the round whose
commit crossed it (the GDN state is captured at once from its recorded window slot, the rest once the
MTP head has written the block's rows). A hit gives the same bits as a miss: the blocks are those a prefill of the
same tokens computes. There too (a forward that stops anywhere computes what one that runs on does), every session
keeps two tails (`PrefixCache.insert_tail`: a block's first positions): TAIL_MARGIN tokens before its prompt's end (the
block holding that position stops there first: `SessionState.block_len`) and at the end of its generated tokens (its
last round's state, captured when it finishes), so the next turn of a conversation resumes where the two turns part.

On CUDA (with triton) the round's forwards replay CUDA graphs (engine/graphs.py `GraphRunner`): the scheduler
picks the batch-size buckets (`graph_buckets(max_num_seqs)`) and reserves the scratch pool slots that bucket
padding rows write to (`padding_rows(buckets)` extra slots, never handed to a session).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import (PREFILL_GRID, TAIL_MARGIN, GdnPool, PrefixCache, PrefixCacheStats, StatePool, block_keys,
                    pool_bytes, tail_key)
from .draft import rides
from .encoder import ImageEncoder, image_patches
from .graphs import EAGER, GraphRunner, StepRunner, graph_buckets, padding_rows
from .images import VisionStats
from .kpolicy import KPolicy, KPolicySpec, SpecKStats, profile_costs
from .model.ops import cpu
from .model.ops import dispatch as ops
from .model.qwen35 import Qwen35ForCausalLM
from .prefill import flush_mtp_rows, packs_rows, prefill_kernels, prefill_rows, splits_rows, steps_match_prefill
from .spec import SpecSession, spec_round

log = logging.getLogger("nextn.scheduler")

#: Fraction of the free memory the state pool may take (the rest: activations, logits, the allocator).
POOL_MEMORY_FRACTION = 0.8
#: Without a prefix-cache budget: this fraction of the memory left free after the state pool ...
PREFIX_CACHE_MEMORY_FRACTION = 0.4
#: ... and at most this much host RAM on a CPU.
PREFIX_CACHE_CPU_CAP = 8 << 30
#: The encoder cache's default budget (image embeddings kept by content hash).
ENCODER_CACHE_BYTES = 512 * 2**20
#: The vision tower's work per step at most, in patch-blocks (patches x vision blocks; the step's first block always
#: runs): 4096 is one of the 12 blocks of a 1024 x 1024 picture, so an image is encoded across steps a few blocks
#: at a time and running streams keep decoding meanwhile.
ENCODER_PATCH_BLOCKS_PER_STEP = 4096
#: `spec_k_stats` rebuilds the controller's cost table (for /health) at most this often: the worker asks every step.
COST_TABLE_EVERY_S = 1.0


class PoolTooLarge(RuntimeError):
    """The state pool does not fit in the device's free memory; the message says which setting to lower."""


def pool_capacity(max_model_len: int, k: int) -> int:
    """Positions per slot: the context plus the K + 1 tokens a last verify may write past it, rounded to 16."""
    return -(-(max_model_len + k + 1) // 16) * 16


def free_memory(device: torch.device | str) -> int:
    """Bytes free on `device` now (CUDA: the driver's figure; CPU: MemAvailable)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


@dataclass
class StepResult:
    """What one step did: new tokens per session (each session once, in order), and the sessions that left
    (finished, failed) during it; those are closed (slot freed) already."""

    emitted: list[tuple[SpecSession, list[int]]] = field(default_factory=list)
    finished: list[SpecSession] = field(default_factory=list)


@dataclass
class _Writes:
    """A session's prefix-cache bookkeeping: its blocks' chain keys so far, the next block to write, and blocks whose
    GDN state was captured after a round while their MTP rows are not written yet ((block, reserved id))."""

    keys: list[bytes] = field(default_factory=list)
    next: int = 0
    pending: list[tuple[int, int]] = field(default_factory=list)
    #: tails captured, not written yet ((boundary position, reserved id)): the prompt's end, the generation's end
    tail: tuple[int, int] | None = None
    gen_tail: tuple[int, int] | None = None


class Scheduler:
    """Owns the state pool, the prefix cache and the batch. Not thread-safe: one thread (the worker) calls
    everything."""

    def __init__(self, model: Qwen35ForCausalLM, *, max_num_seqs: int, max_model_len: int, k: int,
                 max_num_batched_tokens: int, step_graphs: bool | None = None, prefix_cache_bytes: int | None = 0,
                 encoder_cache_bytes: int = ENCODER_CACHE_BYTES,
                 encoder_patch_blocks_per_step: int = ENCODER_PATCH_BLOCKS_PER_STEP,
                 spec_policy: KPolicySpec | None = None, spec_costs: dict[tuple[int, int], float] | None = None):
        """step_graphs: run the round through a `GraphRunner` (None: when the model is on the kernel path, i.e.
        CUDA with triton; on a CPU it executes the same static-buffer bodies without capturing, for tests).
        prefix_cache_bytes: the prefix cache's memory budget (0: no cache; None: PREFIX_CACHE_MEMORY_FRACTION of the
        memory left free after the state pool, at most PREFIX_CACHE_CPU_CAP on a CPU).
        encoder_cache_bytes: the encoder cache's budget (image embeddings by content hash; 0: none), when the model
        has a vision tower. encoder_patch_blocks_per_step: the tower's work per step (patches x vision blocks; the
        step's first block always runs): joining sessions' images are encoded between rounds under it, an image
        across several steps when it needs more, and a session's prefill waits until its images are encoded.
        spec_policy: None runs every session at its own k (fixed K); else the speculation controller
        (`engine.kpolicy`) sets each row's k every round, at most this scheduler's k (its k_max is taken from
        `k`). Adaptive, it needs the cost table: `spec_costs` ({(bucket, T): seconds}) or, when None, profiled
        (`profile_speculation`: at once without CUDA graphs; with them, the caller calls it after capturing)."""
        cfg = model.config
        self.model = model
        self.k = k if cfg.has_mtp else 0
        self.max_num_batched_tokens = max_num_batched_tokens
        device = model.lm_head.weight.device
        capacity = pool_capacity(max_model_len, self.k)
        graphs = ops.use_triton(model.lm_head.weight) if step_graphs is None else step_graphs
        self.buckets = graph_buckets(max_num_seqs) if graphs else []
        n_scratch = padding_rows(self.buckets)
        #: bytes the pool reserves, by part ("kv", "gdn", "mtp"), scratch rows for graph padding included
        self.reserved = pool_bytes(cfg, max_num_seqs + n_scratch, capacity, self.k + 1, cfg.dtype, self.k > 0)
        need = sum(self.reserved.values())
        avail = free_memory(device)
        if need > POOL_MEMORY_FRACTION * avail:
            raise PoolTooLarge(
                f"the state pool for --max-num-seqs {max_num_seqs} x --max-model-len {max_model_len} (K={self.k}) "
                f"needs {need / 2**30:.2f} GiB but {avail / 2**30:.2f} GiB is free on {device}: lower --max-num-seqs "
                f"or --max-model-len")
        self.pool = StatePool(cfg, max_num_seqs + n_scratch, capacity, self.k + 1, device, cfg.dtype, mtp=self.k > 0)
        scratch = [self.pool.alloc() for _ in range(n_scratch)]  # bucket padding rows' slots, held for good
        self.runner: StepRunner = GraphRunner(model, self.pool, self.buckets, scratch) if graphs else EAGER
        self.running: list[SpecSession] = []
        self.joining: collections.deque[SpecSession] = collections.deque()
        #: one prefill forward may carry several sessions' blocks (on the kernel path, `_forwards` asks again: the
        #: startup self-check runs after this and may hand a prefill kernel to its twin)
        self._prefill_kernels = prefill_kernels(model) if ops.use_triton(model.lm_head.weight) else None
        self.packs = packs_rows(model, self._prefill_kernels)
        tower, icfg = model.vision, model.image_config
        self.encoder = ImageEncoder(tower, icfg, cfg.dtype, encoder_cache_bytes) if tower is not None \
            and icfg is not None else None
        self.encoder_patch_blocks_per_step = encoder_patch_blocks_per_step
        self._patches_left = 0  # the step's encoder budget left
        self._encoded = False  # an image was encoded this step
        if prefix_cache_bytes is None:
            prefix_cache_bytes = int(PREFIX_CACHE_MEMORY_FRACTION * max(0, avail - need))
            if torch.device(device).type == "cpu":
                prefix_cache_bytes = min(prefix_cache_bytes, PREFIX_CACHE_CPU_CAP)
        self.cache: PrefixCache | None = None
        self._writes: dict[SpecSession, _Writes] = {}
        self._readers: set[SpecSession] = set()  # joining sessions that may still resume further (none prefilled)
        self._pkeys: dict[SpecSession, list[bytes]] = {}  # joining sessions' full prompt blocks' chain keys
        self._decode_blocks = False
        #: prompt work a step left for later so its first tokens leave first (`settle`)
        self._deferred: list[Callable[[], None]] = []
        if prefix_cache_bytes > 0:
            identity = f"{cfg!r}|{cfg.dtype}|{device}|{'row-wise' if self.packs else 'per-row'}|{id(model)}"
            self.cache = PrefixCache(self.pool, prefix_cache_bytes, identity)
            self._decode_blocks = steps_match_prefill(model)
        self._tails = self._decode_blocks  # tails need a block that splits anywhere with the same bits
        # ... and where a row may carry several blocks (C path), a session the cache writes prefills the blocks it was
        # granted, its tail cut too, as one row (each inner boundary's state kept in a spare window slot)
        self._c_multiblock = self._tails and splits_rows(model) and self.pool.window >= 2
        #: the speculation controller (None: fixed K); `spec_k_counts[k]`: rounds x rows that drafted k
        self.policy: KPolicy | None = None
        self.spec_k_counts = [0] * (self.k + 1)
        #: each running session's `engine.draft.rides` (fixed for its life): the controller's free rows
        self._free: dict[SpecSession, bool] = {}
        self._table: dict[str, dict[str, float]] = {}
        self._table_at = -math.inf
        #: the last round's (rows, T, start, seconds of the round alone, seconds of its step's one-off work since),
        #: its time fed back at the next step's start
        self._open: tuple[list[SpecSession], int, float, float, float] | None = None
        self._cost_buckets = self.buckets or graph_buckets(max_num_seqs)
        if spec_policy is not None and self.k > 0:
            spec = dataclasses.replace(spec_policy, k_max=self.k)
            self.policy = KPolicy(spec, dict(spec_costs or {}), self._cost_buckets)
            if spec.adaptive and spec_costs is None and not graphs:
                self.profile_speculation()

    # -- speculation controller ---------------------------------------------------------------------------------
    def profile_speculation(self) -> dict[tuple[int, int], float]:
        """Time one round's forwards (verify of B x T tokens and the drafts of width T) for the cost table at a few
        batch-size buckets and T = 1..k+1, on pool slots no session holds (their contents are garbage until written);
        returns the table. Only while no session runs (startup)."""
        assert self.policy is not None and not self.running and not self.joining
        model, pool, H = self.model, self.pool, self.model.config.hidden_size
        dev = model.lm_head.weight.device
        sync = torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)

        def run(n: int, T: int) -> None:
            slots = [pool.alloc() for _ in range(min(n, pool.num_free))]
            try:
                m, z = len(slots), [0] * len(slots)
                if T > 1 and pool.mtp is not None:
                    h = torch.zeros(m, T, H, dtype=pool.dtype, device=dev)  # [m, T, H]
                    self.runner.draft(model, pool, torch.zeros(m, T, dtype=torch.long, device=dev), h, slots, z,
                                      [T - 1] * m)
                    for _ in range(T - 2):
                        self.runner.draft(model, pool, torch.zeros(m, 1, dtype=torch.long, device=dev), h[:, :1],
                                          slots, z, None)
                self.runner.verify(model, pool, torch.zeros(m, T, dtype=torch.long, device=dev), slots, z, z)
                sync()
            finally:
                for sl in slots:
                    pool.free(sl)

        t0 = time.perf_counter()
        with torch.inference_mode():
            self.policy.cost = profile_costs(run, self._cost_buckets, self.k + 1)
        self._table_at = -math.inf  # the next `spec_k_stats` shows the new table
        log.info("%s; cost table profiled in %.2f s (ms per round by batch bucket and width T): %s",
                 self.policy.spec.describe(), time.perf_counter() - t0, self.policy.table())
        return self.policy.cost

    def spec_k_stats(self) -> SpecKStats:
        """Rows x rounds by drafted k since start, and the controller's cost table (ms; {} with fixed K; rebuilt at
        most every COST_TABLE_EVERY_S seconds)."""
        pol = self.policy
        if pol is not None and pol.spec.adaptive and time.monotonic() - self._table_at >= COST_TABLE_EVERY_S:
            self._table, self._table_at = pol.table(), time.monotonic()
        return SpecKStats(tuple(self.spec_k_counts), self._table)

    def _plan_round(self) -> int:
        """Set each running row's k for this round (the controller's choice, when there is one); returns T. A
        seeded sampled row keeps its k: its draws depend on the k of every round (equal in distribution for any
        k, but the same seed must give the same text), and the controller's choices depend on measured times."""
        pol = self.policy
        rows = [s for s in self.running if s.sampling.greedy or s.sampling.seed is None]
        if rows and pol is not None and (pol.cost or not pol.spec.adaptive):
            ks = pol.resting(rows)  # a quiet spell's round: plain, planned in O(1)
            if ks is None:
                left = [max(1, s.max_new_tokens - len(s.emitted)) for s in rows]
                ks = pol.plan(rows, [self._free.get(s, False) for s in rows], left)
            for s, k in zip(rows, ks):
                s.k_next = k
        return max((s.k_round() for s in self.running), default=0) + 1

    def _observe_round(self, rows: list[SpecSession], before: list[tuple[int, int]], ks: list[int], T: int,
                       start: float, seconds: float) -> None:
        """Feed the round's outcome back: each row's drafts / accepted (its telemetry's change); its time waits for
        `_close_round`."""
        for k in ks:
            self.spec_k_counts[min(k, self.k)] += 1
        pol = self.policy
        if pol is None or not pol.spec.adaptive or not pol.cost:
            return
        if T == 1:  # no row drafted: only the rows the controller has not met are news
            pol.observe_plain([s for s in rows if s.error is None and s.k_next is not None])
        else:
            pol.observe_round([(s, s.telem.drafted - d0, s.telem.accepted - a0) for s, (d0, a0) in zip(rows, before)
                               if s.error is None and s.k_next is not None])
        self._open = (rows, T, start, seconds, 0.0)

    def _aside(self, since: float) -> None:
        """The time from `since` to now went to work a session does once (prefill, an image's encoding, a finished
        row's last MTP rows and cache writes): no width's cost, kept out of the open round's."""
        if self._open is not None:
            self._open = (*self._open[:4], self._open[4] + time.perf_counter() - since)

    def _close_round(self, now: float) -> None:
        """Feed the last round's time back: from its start to now (this step's start) when a row of it still runs
        (its caller went on at once: the interval is what a round at its width costs, the host's work between rounds
        and the server's relay of the tokens included) less its step's one-off work (`_aside`: whichever width that
        fell on looked dearer for dozens of rounds), else the round alone."""
        o, self._open = self._open, None
        if o is None or self.policy is None:
            return
        rows, T, start, seconds, aside = o
        going = self.running
        self.policy.observe_time(len(rows), T, now - start - aside if any(s in going for s in rows) else seconds)

    def describe(self) -> str:
        """One line: what the state pool reserved, and the prefix cache's budget."""
        mib = {k: v / 2**20 for k, v in self.reserved.items()}
        p = self.pool
        kernel = cpu.describe(p.device, p.dtype) if any(isinstance(c, GdnPool) for c in p.layers) else None
        pc = self.cache
        cache = (f"prefix cache: up to {pc.capacity} blocks of {PREFILL_GRID} tokens "
                 f"({pc.stats.capacity_bytes / 2**20:.1f} MiB, {pc.block_bytes / 2**20:.2f} MiB a block; generated "
                 f"tokens' blocks {'kept' if self._decode_blocks else 'not kept: decode steps round differently'}; "
                 f"{f'prompt tails {TAIL_MARGIN} tokens before the end' if self._tails else 'no tails'})"
                 if pc is not None else "prefix cache: off")
        return (f"state pool: {p.slots} slots x {p.capacity} positions, {p.window} GDN state slots each: "
                f"KV {mib['kv']:.1f} MiB, GDN {mib['gdn']:.1f} MiB, MTP {mib['mtp']:.1f} MiB "
                f"({sum(mib.values()):.1f} MiB on {p.device})" + (f"; {kernel}" if kernel else "") + f"; {cache}; "
                f"prefill grid {PREFILL_GRID} tokens, {'rows packed' if self.packs else 'one row'} per forward"
                + (f"; images: encoder cache {self.encoder.cache.capacity_bytes / 2**20:.0f} MiB, up to "
                   f"{self.encoder_patch_blocks_per_step} patch-blocks encoded a step"
                   if self.encoder is not None else ""))

    @property
    def has_room(self) -> bool:
        """A session could join now (a pool slot is free)."""
        return self.pool.num_free > 0

    @property
    def num_sessions(self) -> int:
        return len(self.running) + len(self.joining)

    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters and size now (None when it is off)."""
        return None if self.cache is None else PrefixCacheStats(**vars(self.cache.stats))

    def vision_stats(self) -> VisionStats | None:
        """The image counters since start (images encoded, encoder-cache hits, seconds encoding; a copy), or None
        when the model has no vision tower."""
        return None if self.encoder is None else VisionStats(**vars(self.encoder.stats))

    def add(self, sess: SpecSession) -> None:
        """A new session (built on this scheduler's pool) joins: it resumes from the longest cached prefix of its
        prompt, and the rest prefills in grid blocks from the next step."""
        assert sess.pool is self.pool, "sessions must be built with pool=scheduler.pool"
        if self.policy is not None:
            self.policy.observe_flow(1 if self.num_sessions else 0, 0, self.num_sessions)
        if self.cache is not None and sess.cache.length == 0:
            self._pkeys[sess] = block_keys(sess.prompt_ids, len(sess.prompt_ids) // PREFILL_GRID, self.cache.root,
                                           images=sess.image_keys)
            if sess.k > 0 or self.pool.mtp is None:  # a plain session in an MTP pool writes no MTP rows
                self._writes[sess] = _Writes(keys=list(self._pkeys[sess]))
                sess.tail_cut = self._tails
            if sess.want_prompt_logprobs is None:  # prompt logprobs need every prompt row: no resume
                self.cache.stats.queries += len(sess.prompt_ids)
                self._readers.add(sess)
                self._resume(sess)
        self.joining.append(sess)

    def remove(self, sess: SpecSession) -> None:
        """Take `sess` out of the batch and free its slot now (between steps)."""
        self.settle()
        if self.policy is not None:
            self.policy.forget(sess)
        self._free.pop(sess, None)
        was = sess in self.running or sess in self.joining
        if sess in self.running:
            self.running.remove(sess)
        elif sess in self.joining:
            self.joining.remove(sess)
        if was and self.policy is not None:  # a row that leaves early leaves as a finished one
            self.policy.observe_flow(0, 1, self.num_sessions)
        self._drop_writes(sess)
        self._readers.discard(sess)
        self._pkeys.pop(sess, None)
        sess.close()

    # -- prefix cache --------------------------------------------------------------------------------------------
    def _row_failed(self, sess: SpecSession, err: Exception, where: str) -> None:
        """A prefix-cache path raised for `sess` alone: that session fails (its request gets the error; the step
        closes it, which frees its slot and releases its reserved blocks) and the batch goes on. The cache's index
        is only ever extended by a complete block, so what it holds stays valid for every later request."""
        log.error("prefix cache: %s failed for one session (%s: %s); that request fails alone", where,
                  type(err).__name__, err, exc_info=(type(err), err, err.__traceback__))
        sess.fail(err)

    def _resume(self, sess: SpecSession) -> None:
        """Restore the longest cached run of `sess`'s prompt blocks into its slot, when it is longer than what the
        session holds (a session that has prefilled nothing itself looks again each step: blocks a session ahead of
        it computed may have landed). If that raises, `sess` alone fails (`_row_failed`)."""
        if sess.error is not None:
            return
        try:
            self._resume_row(sess)
        except Exception as e:  # noqa: BLE001 - one session's lookup / restore fails that session only
            self._row_failed(sess, e, "resume")

    def _resume_row(self, sess: SpecSession) -> None:
        pc, prompt = self.cache, sess.prompt_ids
        assert pc is not None
        keys = self._pkeys[sess]
        ids = pc.lookup(prompt, keys)
        tail = pc.lookup_tail(prompt, keys, ids, sess.image_keys) if self._tails else None
        n = len(ids) * PREFILL_GRID + (tail[1] if tail else 0)
        if n <= sess.cached_tokens:
            return
        carrier = pc.restore(ids, sess.slot, sess.cache.cur, sess.slot if sess.scratch is not None else None,
                             sess.cached_tokens // PREFILL_GRID, tail)
        pc.stats.hits += n - sess.cached_tokens
        sess.resume(n, carrier)
        w = self._writes.get(sess)
        if w is not None:
            w.next = len(ids)

    def _writer(self, sess: SpecSession) -> _Writes | None:
        w = self._writes.get(sess)
        return None if w is None or sess.error is not None else w

    def _keys(self, sess: SpecSession, w: _Writes, n: int) -> list[bytes]:
        assert self.cache is not None
        if len(w.keys) < n:
            w.keys = block_keys(sess.committed, n, self.cache.root, w.keys, images=sess.image_keys)
        return w.keys

    def _write_prefilled(self, rows: list[SpecSession], at: dict[SpecSession, int] | None = None,
                         ends: dict[SpecSession, tuple[int, int, torch.Tensor]] | None = None) -> None:
        """After a prefill block: cache the block each row just completed (its GDN and conv state at the boundary are
        in window slot at[row], default the live one: a block that ended its forward; ends[row]: the row's cache
        length, prompt tokens left and last pre-norm hidden at the block's end, default now). A row whose write
        raises fails alone (`_row_failed`)."""
        pc = self.cache
        at, ends = at or {}, ends or {}
        for s in rows:
            w = self._writer(s)
            L, left, last_pre = ends.get(s) or (s.cache.length, s.prefill_left, s.last_pre)
            if w is not None and self._tails and left == TAIL_MARGIN and L % PREFILL_GRID and w.tail is None:
                self._capture_tail(s, w, "tail", L, at.get(s, s.cache.cur), last_pre)
                self._write_tails(s)
            if w is None or L % PREFILL_GRID or L // PREFILL_GRID <= w.next:
                continue
            b = L // PREFILL_GRID - 1
            try:
                keys = self._keys(s, w, b + 1)
                pc.insert(keys, s.committed, b, s.slot, s.slot if s.scratch is not None else None,
                          window_slot=at.get(s, s.cache.cur), pre_last=last_pre)
            except Exception as e:  # noqa: BLE001 - one session's block write fails that session only
                self._row_failed(s, e, "writing a prefilled block")
                continue
            w.next = b + 1

    def _capture_tail(self, s: SpecSession, w: _Writes, which: str, B: int, window_slot: int,
                      pre_last: torch.Tensor) -> None:
        """Capture the GDN state at position B (off the prefill grid) from `window_slot` and its
        carrier into `w`'s prompt-end (`which` "tail") or generation-end ("gen_tail") tail, reserving a block the
        first time (none free: no tail). If that raises, `s` alone fails."""
        pc = self.cache
        assert pc is not None
        old = getattr(w, which)
        bid = old[1] if old is not None else None
        try:
            if bid is None:
                bid = pc.reserve()
                if bid is None:
                    return
            pc.capture_state(bid, s.slot, window_slot, pre_last)
        except Exception as e:  # noqa: BLE001 - one session's capture fails that session only
            if bid is not None:
                pc.release(bid)
            setattr(w, which, None)
            self._row_failed(s, e, "capturing a tail")
            return
        setattr(w, which, (B, bid))

    def _write_tails(self, s: SpecSession, final: bool = False) -> None:
        """Write `s`'s captured tails whose MTP rows (up to the boundary - 2) are in the scratch: the prompt-end one
        at once, the generation-end one only when `final` (the session finished; no later boundary replaces it). A
        tail whose block was written whole meanwhile, or (final) whose rows never came, is given back. A write that
        raises fails `s`, or (final: its answer is complete) is only logged."""
        pc, w = self.cache, self._writes.get(s)
        if pc is None or w is None:
            return
        for which in ("tail", "gen_tail"):
            got = getattr(w, which)
            if got is None or (which == "gen_tail" and not final):
                continue
            B, bid = got
            b, t = divmod(B, PREFILL_GRID)
            ready = s.error is None and (s.scratch is None or s.scratch.length >= B - 1)
            if not ready and not final:
                continue
            setattr(w, which, None)
            if not ready or b < w.next:
                pc.release(bid)
                continue
            try:
                pc.insert_tail(self._keys(s, w, b), s.committed, b, t, s.slot,
                               s.slot if s.scratch is not None else None, bid, s.image_keys)
            except Exception as e:  # noqa: BLE001 - one session's tail write fails that session only
                pc.release(bid)  # (a no-op where the insert placed or gave it back)
                if final:
                    log.exception("writing a finished session's tail failed; it is not cached")
                else:
                    self._row_failed(s, e, "writing a tail")

    def _capture_decoded(self, rows: list[SpecSession], before: list[int]) -> None:
        """After a round (decode steps that reach prefill's states): for each grid boundary a row's commit crossed,
        capture the GDN state there now (its recorded window slot is overwritten by the next round) into a
        reserved block, written in full once the MTP head has the block's rows (`_finish_pending`); and (tails) for
        a row the round finished, the state at its end, written as its generation tail once the step flushed its
        MTP rows."""
        pc = self.cache
        for s, n in zip(rows, before):
            w = self._writer(s)
            if w is None:
                continue
            for B in range((n // PREFILL_GRID + 1) * PREFILL_GRID, s.cache.length + 1, PREFILL_GRID):
                b = B // PREFILL_GRID - 1
                if b < w.next:
                    continue
                bid = None
                try:
                    bid = pc.reserve()
                    if bid is None:
                        break
                    # the verify forward's token t (position n + t) left its state in window slot t
                    pc.capture_state(bid, s.slot, B - 1 - n, s.round_pre[B - 1 - n])
                except Exception as e:  # noqa: BLE001 - one session's capture fails that session only
                    if bid is not None:
                        pc.release(bid)
                    self._row_failed(s, e, "capturing a decoded block")
                    break
                w.pending.append((b, bid))
                w.next = b + 1
            B = s.cache.length
            if self._tails and s.finished and s.error is None and B > n and B % PREFILL_GRID \
                    and B // PREFILL_GRID >= w.next:  # a row that finished: the state at its end
                # the verify forward's token t (position n + t) left its state in window slot t
                self._capture_tail(s, w, "gen_tail", B, B - 1 - n, s.round_pre[B - 1 - n])

    def _finish_pending(self, rows: list[SpecSession]) -> None:
        """Write in full every captured block whose MTP rows (up to its boundary - 2) are now in the scratch."""
        pc = self.cache
        for s in rows:
            w = self._writes.get(s)
            if w is None:
                continue
            keep = []
            for b, bid in w.pending:
                if s.error is not None:
                    pc.release(bid)
                elif s.scratch is None or s.scratch.length >= (b + 1) * PREFILL_GRID - 1:
                    key, had = None, False
                    try:
                        key = self._keys(s, w, b + 1)[b]
                        had = pc.contains(key)
                        pc.insert(self._keys(s, w, b + 1), s.committed, b, s.slot,
                                  s.slot if s.scratch is not None else None, bid=bid)
                    except Exception as e:  # noqa: BLE001 - one session's block write fails that session only
                        # the reserved block goes back unless the insert may have placed or released it already
                        # (its key was or now is indexed): a block lost to the budget, never one held twice
                        if key is None or not (had or pc.contains(key)):
                            pc.release(bid)
                        self._row_failed(s, e, "writing a decoded block")
                else:
                    keep.append((b, bid))
            w.pending = keep
            self._write_tails(s)

    def _skip_cached(self, s: SpecSession) -> None:
        """Give back the captured blocks and generation tail of `s` (finished) that the cache holds already (an
        earlier request wrote the same rows; they become the most recently used): its last MTP rows are flushed
        only for what is left to write."""
        pc, w = self.cache, self._writes.get(s)
        if pc is None or w is None or s.error is not None:
            return
        try:
            held = [pc.refresh(self._keys(s, w, b + 1)[b]) for b, _ in w.pending]
            b, t = divmod(w.gen_tail[0], PREFILL_GRID) if w.gen_tail is not None else (0, 0)
            tail = t > 0 and pc.refresh(tail_key(s.committed, b, t, pc.root, self._keys(s, w, b), s.image_keys))
        except Exception:  # noqa: BLE001 - a shortcut only: the writes go the usual way, which handles failures
            return
        for (_, bid), h in zip(w.pending, held):
            if h:
                pc.release(bid)
        w.pending = [x for x, h in zip(w.pending, held) if not h]
        if tail:
            pc.release(w.gen_tail[1])
            w.gen_tail = None

    def _drop_writes(self, sess: SpecSession) -> None:
        w = self._writes.pop(sess, None)
        if w is not None:
            for _, bid in w.pending + [t for t in (w.tail, w.gen_tail) if t is not None]:
                self.cache.release(bid)

    # -- images --------------------------------------------------------------------------------------------------
    def _images_ready(self, s: SpecSession) -> bool:
        """Whether `s` holds every image embedding its prefill still needs; encodes (or takes from the encoder
        cache) those missing while the step's patch-block budget lasts, a slice of vision blocks at a time (the
        step's first block whatever its size; an image larger than the budget takes several steps). An image that
        fails to encode fails its session."""
        missing = s.images_missing()
        if not missing:
            return True
        enc = self.encoder
        if enc is None:  # (a session with images needs a tower to be built at all)
            s.fail(RuntimeError("the model has no vision tower"))
            return False
        for k in missing:
            inp = s.images[k]
            emb = enc.cached(inp)
            if emb is None:
                if self._encoded and image_patches(inp) > self._patches_left:
                    return False  # not one more block of it fits this step
                try:
                    emb, spent = enc.advance(inp, self._patches_left)
                except Exception as e:  # noqa: BLE001 - an image that cannot be encoded fails its own request
                    s.fail(e)
                    return False
                self._patches_left -= spent
                self._encoded = True
                if emb is None:
                    return False  # blocks left: it resumes next step
            s.set_image_embedding(k, emb)
        return True

    # -- the step ------------------------------------------------------------------------------------------------
    def _grants(self, budget: int) -> list[tuple[SpecSession, int]]:
        """How many grid blocks each joining session prefills this step, in arrival order: blocks while they fit
        in the budget, and the first one of the step whatever its size (a block never splits), unless the running
        rows used the whole budget. With the prefix cache, a session that has prefilled nothing yet first resumes
        from blocks that landed since it joined, and waits while a session ahead of it still has to compute its
        next block (the same prompt prefix arriving twice is computed once)."""
        out: list[tuple[SpecSession, int]] = []
        failed: list[tuple[SpecSession, int]] = []  # sessions whose image failed: they leave this step
        coming: set[bytes] = set()  # full prompt blocks that sessions ahead in the queue will compute and cache
        for s in self.joining:
            if s.finished:  # failed while joining (`_resume`): the step retires it
                continue
            keys = self._pkeys.get(s)
            if keys is not None:
                b = s.cache.length // PREFILL_GRID
                if s in self._readers:
                    if s.prefill_tokens:  # it computes its own blocks now: no resume any more
                        self._readers.discard(s)
                    else:
                        self._resume(s)
                        if s.finished:
                            continue
                        b = s.cache.length // PREFILL_GRID
                        if b < (len(s.prompt_ids) - 1) // PREFILL_GRID and keys[b] in coming:
                            continue  # a session ahead computes this block: take it from the cache later
            if s.images and not self._images_ready(s):
                if s.finished:
                    failed.append((s, 0))
                continue  # it waits for its images; later prompts may go first
            if keys is not None and s in self._writes:
                coming.update(keys[b:])
            pos, left, n = s.cache.length, s.prefill_left, 0
            while left > 0:
                c = s.block_len(pos, left)
                first = not out and n == 0
                if c > budget and not (first and (budget > 0 or not self.running)):
                    break
                budget -= c
                pos, left, n = pos + c, left - c, n + 1
            if n:
                out.append((s, n))
            if left > 0:
                break  # arrival order: a later prompt never overtakes one that waits for budget
        return out + failed

    def _forwards(self, rows: list[SpecSession]) -> list[list[SpecSession]]:
        """One wave's forwards, in order: one row each unless the model's prefill is row-wise (`packs_rows`, asked again
        on the kernel path: a kernel that fell back to its twin since ends the packing); then a
        row joins the previous forward while its padded size (rows x longest block) stays within
        max_num_batched_tokens and every row's slot has room for the padding, else it starts the next one."""
        if not self.packs or (self._prefill_kernels is not None
                              and not packs_rows(self.model, self._prefill_kernels)):
            return [[s] for s in rows]
        out: list[list[SpecSession]] = []
        for s in rows:
            if out:
                group = out[-1]
                T = max(x.next_chunk_len for x in (*group, s))
                if (len(group) + 1) * T <= self.max_num_batched_tokens and \
                        all(x.cache.length + T <= self.pool.capacity for x in (*group, s)):
                    group.append(s)
                    continue
            out.append([s])
        return out

    def _multiblock(self) -> bool:
        """Whether a session's granted blocks may share one forward as one row: on the kernel path while every prefill
        kernel runs (the GDN kernel restarts its chunks at each block: bits as one block per forward); on the C path
        while the prefix cache keeps blocks and tails (`splits_rows`: the recurrence runs token by token, each inner
        boundary's state kept in a window slot of its own, so only a session the cache writes carries several:
        `_blocks_per_row`). The torch path prefills one block per forward, in waves."""
        if self._c_multiblock:
            return self.packs
        return self.packs and self._prefill_kernels is not None and packs_rows(self.model, self._prefill_kernels)

    def _blocks_per_row(self, s: SpecSession, n: int) -> int:
        """How many of its n granted blocks session s prefills in its next forward (`_multiblock`): all of them, at
        most K+1 while the prefix cache writes its blocks (each inner boundary's state waits in one of the other K
        window slots until the block is cached), one for a session with images (its embeddings and M-RoPE rows go
        block by block) and, on the C path, for a session the cache does not write (no slot keeps its boundaries),
        and no more than fit max_num_batched_tokens (at least one)."""
        if s.images:
            return 1
        if self._writer(s) is not None:
            n = min(n, self.pool.window)
        elif self._prefill_kernels is None:
            return 1
        while n > 1 and s.chunks_len(n) > self.max_num_batched_tokens:
            n -= 1
        return max(1, n)

    def _prefill_blocks(self, grants: list[tuple[SpecSession, int]]) -> None:
        """Prefill the granted blocks. Multi-block (`_multiblock`): each session's blocks in as few forwards as
        `_blocks_per_row` allows, one row each, several sessions' rows packed into one forward while its padded
        tokens stay within max_num_batched_tokens and every row's slot has room; the prefix cache writes each
        block (and on the C path the prompt's tail) as soon as its MTP rows are written (`prefill_rows`
        after_block), from the window slot its boundary state was kept in. Elsewhere: one block per session per
        wave (`_prefill`)."""
        if not self._multiblock():
            for wave in range(max((n for _, n in grants), default=0)):
                rows = [s for s, n in grants if n > wave and s.prefilling and not s.finished]
                if rows:
                    self._prefill(rows)
            return
        left = {s: n for s, n in grants if n > 0}
        while True:
            rows = [s for s in left if left[s] > 0 and s.prefilling and not s.finished]
            if not rows:
                return
            take = {s: self._blocks_per_row(s, left[s]) for s in rows}
            groups: list[list[SpecSession]] = []
            for s in rows:
                if groups:
                    g = groups[-1]
                    T = max(x.chunks_len(take[x]) for x in (*g, s))
                    if (len(g) + 1) * T <= self.max_num_batched_tokens and \
                            all(x.cache.length + T <= self.pool.capacity for x in (*g, s)):
                        g.append(s)
                        continue
                groups.append([s])
            for g in groups:
                self._prefill_row_blocks(g, [take[s] for s in g])
            for s in rows:
                left[s] -= take[s]

    def _prefill_row_blocks(self, group: list[SpecSession], blocks: list[int]) -> None:
        """One forward of `group`, blocks[i] blocks of session i in its row (kernel path: grid blocks; C path: a
        block cut at the prompt's tail and the rest); the prefix cache writes each completed block or tail
        (`_write_prefilled`), an inner boundary's from the window slot it was kept in."""
        keep: list[list[int]] = []
        for s, n in zip(group, blocks):
            free = [w for w in range(self.pool.window) if w != s.cache.cur] if self._writer(s) is not None else []
            keep.append((free + [-1] * n)[:n - 1])
        kept = {s: k for s, k in zip(group, keep)}
        last = {s: n - 1 for s, n in zip(group, blocks)}

        def at(j: int, rows: list[SpecSession]) -> dict[SpecSession, int]:
            return {s: kept[s][j] for s in rows if j < last[s] and j < len(kept[s]) and kept[s][j] >= 0}

        self._prefill_group(group, blocks, keep, at)

    def _prefill_group(self, group: list[SpecSession], blocks: list[int] | None = None,
                       keep: list[list[int]] | None = None,
                       at: Callable[[int, list[SpecSession]], dict[SpecSession, int]] | None = None) -> None:
        """`prefill_rows` of one forward, then (prefix cache) each completed block written from window slot
        at(j, rows)[row] (default the live one). When the forward ends every row's prompt (nothing later in the step
        touches these rows) and no row has images, the first tokens leave at once and the prompts' MTP head forwards
        and block writes wait for `settle` (each write with its block's end state). A failing forward fails every
        row of it."""
        last_forward = all(s.chunks_len(n) == s.prefill_left for s, n in zip(group, blocks or [1] * len(group)))
        later = self._deferred if last_forward and not any(s.images for s in group) else None

        def written(j: int, rows: list[SpecSession]) -> None:
            if self.cache is None:
                return
            slots = at(j, rows) if at is not None else None
            if later is None:
                self._write_prefilled(rows, slots)
            else:
                ends = {s: (s.cache.length, s.prefill_left, s.last_pre) for s in rows}
                later.append(functools.partial(self._write_prefilled, rows, slots, ends))

        try:
            prefill_rows(self.model, group, blocks, keep, written, defer=later)
        except Exception as e:  # noqa: BLE001 - the batched part failed: every row of it is in doubt
            for s in group:
                s.fail(e)

    def settle(self) -> None:
        """Run what prefill steps left for later (`_prefill_group`): the prompts' MTP head forwards, in the forwards
        they would have run in at once, and the prefix-cache writes of their blocks, in order. Each step runs it
        first, a step that finishes a session runs it before the session leaves, and `remove` before anything
        else; a session that failed meanwhile is skipped (a head forward that raises fails its rows)."""
        work, self._deferred = self._deferred, []
        for run in work:
            run()

    def _prefill(self, rows: list[SpecSession]) -> None:
        """One block of each row's prompt (one wave), in the forwards `_forwards` chooses. A prompt that fails fails
        its own request; a failing batched forward fails the sessions of that forward."""
        for group in self._forwards(rows):
            self._prefill_group(group)

    def step(self) -> StepResult:
        """One round for the running sessions, then prefill blocks under the token budget."""
        res = StepResult()
        self._close_round(time.perf_counter())
        self.settle()
        self._patches_left, self._encoded = self.encoder_patch_blocks_per_step, False
        if self.encoder is not None and self.encoder.pending():  # partial encodes of sessions that left are dropped
            self.encoder.keep_pending({s.images[k].hash for s in self.joining if not s.finished
                                       for k in s.images_missing()})
        counts = {s: len(s.emitted) for s in self.running}
        T = self._plan_round()
        budget = self.max_num_batched_tokens - sum(s.k_round() + 1 for s in self.running)
        if self.running:
            before = [s.cache.length for s in self.running]
            rows, ks = list(self.running), [s.k_round() for s in self.running]
            tel = [(s.telem.drafted, s.telem.accepted) for s in rows] if T > 1 else []  # (T = 1: no drafts)
            t0 = time.perf_counter()
            try:
                spec_round(self.model, self.running, self.runner)
            except Exception as e:  # noqa: BLE001 - the batched part failed: every row of it is in doubt
                for s in self.running:
                    s.fail(e)
            self._observe_round(rows, tel, ks, T, t0, time.perf_counter() - t0)
            if self._decode_blocks:
                self._capture_decoded(self.running, before)
                self._finish_pending(self.running)
        t1 = time.perf_counter()
        self._prefill_blocks(self._grants(budget))
        self._aside(t1)
        for s in list(self.joining):  # prefilled, or failed (a prefill, or a prefix-cache path while joining)
            if not s.prefilling or s.finished:
                self.joining.remove(s)
                self._readers.discard(s)
                self._pkeys.pop(s, None)
                counts[s] = 0
                self.running.append(s)
                self._free[s] = rides(s)
        for s, before_n in counts.items():
            if len(s.emitted) > before_n:
                res.emitted.append((s, s.emitted[before_n:]))
        done = [s for s in self.running if s.finished]
        t2 = time.perf_counter()
        if done:
            self.settle()
        if done and self._decode_blocks:
            for s in done:
                self._skip_cached(s)
            ready = [s for s in done if s.error is None and (w := self._writes.get(s)) is not None
                     and (w.pending or w.tail or w.gen_tail)]
            if ready:
                queued, t3 = sum(s.mtp_ready for s in ready), time.perf_counter()
                try:  # the last round's MTP rows, which no next round will write: they complete captured blocks
                    flush_mtp_rows(self.model, ready)
                except Exception:  # noqa: BLE001 - the session's answer is complete; only its blocks are lost
                    log.exception("writing a finished session's MTP rows failed; its last blocks are not cached")
                else:
                    if self.policy is not None:  # the price of the MTP rows plain rounds deferred
                        self.policy.observe_deferred(queued, time.perf_counter() - t3)
                    self._finish_pending(ready)
                    for s in ready:
                        self._write_tails(s, final=True)
        for s in done:
            self.running.remove(s)
            if self.policy is not None:
                self.policy.forget(s)
            self._free.pop(s, None)
            self._drop_writes(s)
            s.close()
            res.finished.append(s)
        if done and self.policy is not None:
            self.policy.observe_flow(0, len(done), self.num_sessions)
        if done:
            self._aside(t2)
        return res
