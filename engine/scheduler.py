"""Continuous batching: which sessions run, prompt prefill in chunks under a token budget, the state pool.

`Scheduler.step()` is the worker's unit of work: ONE speculative round over every running session
(`engine.spec.spec_round`: drafts for all rows, one verify forward, one host copy), then prefill chunks of joining
sessions, up to `max_num_batched_tokens` tokens per step in all (the round's N x (k+1) tokens count first), so a
long prompt never freezes the running streams for longer than one chunk. The chunks of every session joining in a
step go through one forward (`engine.spec.prefill_rows`, rows right-padded). A session joins (`add`) once it holds
a pool slot and leaves between steps; its slot is returned the moment it finishes, fails or is removed.

On CUDA (with triton) the round's forwards replay CUDA graphs (engine/graphs.py `GraphRunner`): the scheduler
picks the batch-size buckets (`graph_buckets(max_num_seqs)`) and reserves the scratch pool slots that bucket
padding rows write to (`padding_rows(buckets)` extra slots, never handed to a session).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from .cache import GdnPool, StatePool, pool_bytes
from .graphs import EAGER, GraphRunner, StepRunner, graph_buckets, padding_rows
from .model.ops import cpu
from .model.ops import dispatch as ops
from .model.qwen35 import Qwen35ForCausalLM
from .spec import PREFILL_CHUNK, SpecSession, prefill_rows, spec_round

#: Fraction of the free memory the state pool may take (the rest: activations, logits, the allocator).
POOL_MEMORY_FRACTION = 0.8


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


class Scheduler:
    """Owns the state pool and the batch. Not thread-safe: one thread (the worker) calls everything."""

    def __init__(self, model: Qwen35ForCausalLM, *, max_num_seqs: int, max_model_len: int, k: int,
                 max_num_batched_tokens: int, prefill_chunk: int = PREFILL_CHUNK, step_graphs: bool | None = None):
        """step_graphs: run the round through a `GraphRunner` (None: when the model is on the kernel path, i.e.
        CUDA with triton; on a CPU it executes the same static-buffer bodies without capturing, for tests)."""
        cfg = model.config
        self.model = model
        self.k = k if cfg.has_mtp else 0
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
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

    def describe(self) -> str:
        """One line: what the state pool reserved."""
        mib = {k: v / 2**20 for k, v in self.reserved.items()}
        p = self.pool
        kernel = cpu.describe(p.device, p.dtype) if any(isinstance(c, GdnPool) for c in p.layers) else None
        return (f"state pool: {p.slots} slots x {p.capacity} positions, {p.window} GDN state slots each: "
                f"KV {mib['kv']:.1f} MiB, GDN {mib['gdn']:.1f} MiB, MTP {mib['mtp']:.1f} MiB "
                f"({sum(mib.values()):.1f} MiB on {p.device})" + (f"; {kernel}" if kernel else ""))

    @property
    def has_room(self) -> bool:
        """A session could join now (a pool slot is free)."""
        return self.pool.num_free > 0

    @property
    def num_sessions(self) -> int:
        return len(self.running) + len(self.joining)

    def add(self, sess: SpecSession) -> None:
        """A new session (built on this scheduler's pool) joins: its prompt prefills in chunks from the next step."""
        assert sess.pool is self.pool, "sessions must be built with pool=scheduler.pool"
        self.joining.append(sess)

    def remove(self, sess: SpecSession) -> None:
        """Take `sess` out of the batch and free its slot now (between steps)."""
        if sess in self.running:
            self.running.remove(sess)
        elif sess in self.joining:
            self.joining.remove(sess)
        sess.close()

    def _forwards(self, group: list[SpecSession], chunks: list[int]) -> list[tuple[list[SpecSession], list[int]]]:
        """Split a step's prefill chunks into forwards, in order: a session joins the previous forward while its
        padded size (rows x longest chunk) stays within max_num_batched_tokens and every row's slot has room for
        the padding; otherwise it starts the next one."""
        out: list[tuple[list[SpecSession], list[int]]] = []
        for s, c in zip(group, chunks):
            if out:
                rows, cs = out[-1]
                T = max(max(cs), c)
                if (len(rows) + 1) * T <= self.max_num_batched_tokens and \
                        all(x.cache.length + T <= self.pool.capacity for x in (*rows, s)):
                    rows.append(s)
                    cs.append(c)
                    continue
            out.append(([s], [c]))
        return out

    def _prefill(self, group: list[SpecSession], chunks: list[int]) -> None:
        """One chunk of each session's prompt, in as few forwards as `_forwards` allows (`prefill_rows` for
        several rows, `SpecSession.prefill_chunk` for one). A prompt that fails fails its own request; a failing
        batched forward fails the sessions of that forward."""
        for rows, cs in self._forwards(group, chunks):
            if len(rows) > 1:
                try:
                    prefill_rows(self.model, rows, cs)
                except Exception as e:  # noqa: BLE001 - the batched part failed: every row of it is in doubt
                    for s in rows:
                        s.fail(e)
                continue
            try:
                rows[0].prefill_chunk(cs[0])
            except Exception as e:  # noqa: BLE001 - a prompt that fails fails its own request
                rows[0].fail(e)

    def step(self) -> StepResult:
        """One round for the running sessions, then prefill chunks under the token budget."""
        res = StepResult()
        counts = {s: len(s.emitted) for s in self.running}
        budget = self.max_num_batched_tokens - sum(s.k_round() + 1 for s in self.running)
        if self.running:
            try:
                spec_round(self.model, self.running, self.runner)
            except Exception as e:  # noqa: BLE001 - the batched part failed: every row of it is in doubt
                for s in self.running:
                    s.fail(e)
        group, chunks = [], []  # joining sessions in order, each the chunk the budget leaves it
        for s in self.joining:
            if budget <= 0 and (group or self.running):
                break
            c = min(self.prefill_chunk, s.prefill_left, max(budget, 1))
            group.append(s)
            chunks.append(c)
            budget -= c
        if group:
            self._prefill(group, chunks)
        for s in group:
            if not s.prefilling or s.finished:
                self.joining.remove(s)
                counts[s] = 0
                self.running.append(s)
        for s, before in counts.items():
            if len(s.emitted) > before:
                res.emitted.append((s, s.emitted[before:]))
        for s in [s for s in self.running if s.finished]:
            self.running.remove(s)
            s.close()
            res.finished.append(s)
        return res
