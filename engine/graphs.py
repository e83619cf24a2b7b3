"""How the batched round runs its forwards: eagerly, or replayed as CUDA graphs per batch-size bucket.

A speculative round (engine/spec.py `spec_round`) runs two kinds of forward, both through a step runner:
  * `verify(model, pool, tokens [N, T], slots, pos0, cur, delta=None)` -> (pre, post [N, T, H], logits [N, T, V]
    fp32): one trunk forward over N rows x T tokens that records the GDN state after every token in window slot t
    (T = 1 is plain decode), then the final norm and the logits of every column;
  * `draft(model, pool, tokens [A, T], hidden [A, T, H], slots, pos0, last, delta=None)` -> (h [A, 1, H], logits
    [A, V]): one MTP head forward (depth 0 writes each row's queued rows, chained depths have T = 1), the head
    hidden of row a's token last[a] (None: its only token) and its fp32 draft logits.
Rows are host lists (slots, pos0, cur, last), known on the host before the round starts. `delta` (None: all 0):
each row's rope delta (a session with images rotates its tokens at pos0 + delta + t; K/V stay at pos0 + t); in
a captured graph it is one more per-row input, never a constant of the graph.

`EagerRunner` (CPU; CUDA sessions run without a scheduler) runs the forward as is: on the torch path (CPU) with
the host `FwdCtx` the round always used, on the kernel path with a device-only `FwdCtx.from_tensors`.

`GraphRunner` (the scheduler's, on CUDA) keeps static input buffers and one CUDA graph per (kind, bucket B, T).
`capture_all()` captures every key the pool allows at startup, before any session holds a slot: per key one
eager call (it compiles the kernels; its rows are pool slots 0..B-1 at position 0, which no session holds yet)
then the capture of the same body, which records without executing. A key whose capture fails runs eagerly,
that key alone, for the life of the runner (logged once). A key not captured at startup is captured on its
first call (run eagerly, then captured).
N rows run in the smallest bucket B >= N; the B - N padding rows point at scratch pool slots of their own
(reserved by the scheduler, never a session's) at position 0 with live window slot 0, so their K/V and GDN
writes land in dead memory and every real row's result is bitwise what it is without them (the kernels'
batch invariance). A call costs one host-to-device copy of the row indices and no host sync. On a CPU the
same runner executes its bodies eagerly (tests drive it under `ops.force_kernels()`).
Outputs: logits are views of one static buffer, valid until the runner's next call; pre/post are copies
(sessions keep them as the next round's MTP carriers); the draft hidden is a view, valid until the next call.
All graphs share one memory pool: outputs are consumed before the next replay, so aliasing between one
graph's outputs and a later graph's intermediates is harmless.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .cache import StatePool
from .model.ops import dispatch as ops
from .model.qwen35 import FwdCtx, Qwen35ForCausalLM, rope_table

log = logging.getLogger(__name__)

Verify = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # pre, post [N, T, H]; logits [N, T, V] fp32
Draft = tuple[torch.Tensor, torch.Tensor]  # head hidden [A, 1, H]; logits [A, V] fp32


class StepRunner(Protocol):
    def verify(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, slots: list[int],
               pos0: list[int], cur: list[int], delta: list[int] | None = None) -> Verify: ...

    def draft(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, hidden: torch.Tensor,
              slots: list[int], pos0: list[int], last: list[int] | None, delta: list[int] | None = None) -> Draft: ...


def graph_buckets(max_rows: int) -> list[int]:
    """Batch-size buckets for 1..max_rows rows: 1, 2, 4, 8, every multiple of 8 below max_rows, and max_rows."""
    return sorted({b for b in (1, 2, 4) if b < max_rows} | set(range(8, max_rows, 8)) | {max_rows})


def padding_rows(buckets: list[int]) -> int:
    """The most padding rows any row count needs with these buckets (= scratch pool slots to reserve)."""
    most, prev = 0, 0
    for b in sorted(buckets):
        most, prev = max(most, b - prev - 1), b
    return most


def _kernel_path(model: Qwen35ForCausalLM) -> bool:
    return ops.use_triton(model.lm_head.weight)


def _rope(model: Qwen35ForCausalLM, pool: StatePool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables covering every position of the pool (a step context gathers from them on the device)."""
    return rope_table(model.config, pool.capacity, model.lm_head.weight.device, pool.dtype)


def _host_index(*cols: list[int], device: torch.device) -> torch.Tensor:
    """[len(cols), N] long from host lists, in pinned memory when bound for a GPU (an asynchronous copy)."""
    return torch.tensor(cols, dtype=torch.long, pin_memory=device.type == "cuda")


class EagerRunner:
    """The round's forwards run as they are (no static buffers, no padding)."""

    def verify(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, slots: list[int],
               pos0: list[int], cur: list[int], delta: list[int] | None = None) -> Verify:
        N, T = tokens.shape
        if _kernel_path(model):
            ix = _host_index(slots, pos0, cur, delta or [0] * N, device=tokens.device).to(tokens.device,
                                                                                       non_blocking=True)
            ctx = FwdCtx.from_tensors(ix[0], ix[1], ix[2], T, _rope(model, pool), ix[3] if delta else None)
        else:
            ctx = FwdCtx.make(model.config, tokens.device, pool.dtype, slots, pos0, cur, [0] * N, T, True,
                              rope_delta=delta)
        pre = model.forward_step(tokens, ctx, pool)  # [N, T, H]
        post = model.model.norm(pre, ctx)
        return pre, post, model.logits(post, ctx=ctx)

    def draft(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, hidden: torch.Tensor,
              slots: list[int], pos0: list[int], last: list[int] | None, delta: list[int] | None = None) -> Draft:
        A, T = tokens.shape
        dev = tokens.device
        if _kernel_path(model):
            ix = _host_index(slots, pos0, delta or [0] * A, device=dev).to(dev, non_blocking=True)
            ctx = FwdCtx.from_tensors(ix[0], ix[1], torch.zeros_like(ix[0]), T, _rope(model, pool),
                                      ix[2] if delta else None)
        else:
            # record: a step forward (the head has no GDN layer to record; its attention runs the CPU step kernel)
            ctx = FwdCtx.make(model.config, dev, pool.dtype, slots, pos0, [0] * A, [0] * A, T, True,
                              rope_delta=delta)
        hm = model.mtp_forward(tokens, hidden, ctx, pool.mtp)  # [A, T, H]
        h = hm if last is None else hm[torch.arange(A, device=dev), torch.tensor(last, device=dev)][:, None]
        return h, model.logits(h[:, 0], ctx=ctx)


EAGER = EagerRunner()


@dataclass
class _Step:
    """Static buffers of one (kind, B, T) step and its graph."""

    ix: torch.Tensor  # [5, B] long: pool slot, pos0, live window slot (verify), last row (draft), rope delta
    tokens: torch.Tensor  # [B, T] long
    hidden: torch.Tensor | None  # [B, T, H] model dtype (draft)
    out: tuple[torch.Tensor, ...] = ()
    graph: "torch.cuda.CUDAGraph | None" = None
    failed: str | None = None  # why its capture failed: this key runs eagerly from then on


@dataclass
class CaptureReport:
    """What `GraphRunner.capture_all` did: the keys captured, the keys left eager (key -> why), the seconds."""

    captured: list[str] = field(default_factory=list)
    eager: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


class GraphRunner:
    """Static buffers + CUDA graphs of the round's forwards for one model and one state pool (module docstring).

    buckets: the batch sizes graphs are kept for (the scheduler's, e.g. `graph_buckets(max_num_seqs)`);
    scratch: pool slots no session ever holds, at least `padding_rows(buckets)` of them. Row counts above the
    largest bucket, T above the pool's window, or another model / pool run eagerly."""

    def __init__(self, model: Qwen35ForCausalLM, pool: StatePool, buckets: list[int], scratch: list[int]):
        if len(scratch) < padding_rows(buckets):
            raise ValueError(f"buckets {buckets} need {padding_rows(buckets)} scratch slots, got {len(scratch)}")
        self.model, self.pool = model, pool
        self.buckets = sorted(buckets)
        self.scratch = list(scratch)
        self.device = model.lm_head.weight.device
        self.capture = self.device.type == "cuda"
        self.rope = _rope(model, pool)  # held: captured graphs read it
        V = model.config.vocab_size
        self.logits = torch.empty(self.buckets[-1] * pool.window, V, dtype=torch.float32, device=self.device)
        self._steps: dict[tuple[str, int, int], _Step] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def num_graphs(self) -> int:
        return sum(s.graph is not None for s in self._steps.values())

    def step_keys(self) -> list[tuple[str, int, int]]:
        """Every (kind, bucket, T) a round can run through this runner: verify at T = 1..window (plain decode and
        K + 1 = 2..window) and, when the pool has an MTP part, the draft at T = 1..window (depth 0 writes 1..K+1
        queued rows; chained depths have T = 1), for every bucket."""
        kinds = ("verify", "draft") if self.pool.mtp is not None else ("verify",)
        return [(k, B, T) for k in kinds for B in self.buckets for T in range(1, self.pool.window + 1)]

    @torch.inference_mode()
    def capture_all(self, on_each: Callable[[], object] | None = None) -> CaptureReport:
        """Capture the graph of every `step_keys()` key now (nothing on a CPU: no graphs there). Call it before
        any session holds a pool slot: each key's warm-up call writes K/V and GDN state rows of slots 0..B-1 at
        position 0. A failed capture leaves that key eager (logged); `on_each()` is called after each key."""
        t0 = time.monotonic()
        rep = CaptureReport()
        for kind, B, T in self.step_keys() if self.capture else []:
            st = self._step(kind, B, T)
            body = self._verify_body if kind == "verify" else self._draft_body
            if st.graph is None and st.failed is None:
                st.ix.zero_()
                st.ix[0] = torch.arange(B, device=self.device)  # distinct free slots, position 0, window slot 0
                body(st)  # compiles this key's kernels
                self._capture(st, body)
            name = _key(kind, B, T)
            if st.failed is not None:
                rep.eager[name] = st.failed
            elif st.graph is not None:
                rep.captured.append(name)
            if on_each is not None:
                on_each()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rep.seconds = time.monotonic() - t0
        return rep

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n rows (None: more rows than the largest bucket)."""
        return next((b for b in self.buckets if b >= n), None)

    def _ours(self, model: Qwen35ForCausalLM, pool: StatePool, n: int, T: int) -> int | None:
        if model is not self.model or pool is not self.pool or T > pool.window:
            return None
        return self.bucket(n)

    def verify(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, slots: list[int],
               pos0: list[int], cur: list[int], delta: list[int] | None = None) -> Verify:
        N, T = tokens.shape
        B = self._ours(model, pool, N, T)
        if B is None:
            return EAGER.verify(model, pool, tokens, slots, pos0, cur, delta)
        st = self._load("verify", B, tokens, None, slots, pos0, cur, [0] * N, delta)
        pre, post, logits = self._run(st, self._verify_body)
        return pre[:N].clone(), post[:N].clone(), logits[:N]

    def draft(self, model: Qwen35ForCausalLM, pool: StatePool, tokens: torch.Tensor, hidden: torch.Tensor,
              slots: list[int], pos0: list[int], last: list[int] | None, delta: list[int] | None = None) -> Draft:
        A, T = tokens.shape
        B = self._ours(model, pool, A, T)
        if B is None:
            return EAGER.draft(model, pool, tokens, hidden, slots, pos0, last, delta)
        st = self._load("draft", B, tokens, hidden, slots, pos0, [0] * A, last if last is not None else [0] * A,
                        delta)
        h, logits = self._run(st, self._draft_body)
        return h[:A], logits[:A]

    # ------------------------------------------------------------------ internals
    def _load(self, kind: str, B: int, tokens: torch.Tensor, hidden: torch.Tensor | None, slots: list[int],
              pos0: list[int], cur: list[int], last: list[int], delta: list[int] | None = None) -> _Step:
        """Copy a call's rows into the static buffers of (kind, B, T); the B - N padding rows get scratch slots,
        position 0, window slot 0, rope delta 0, token 0 (one host-to-device copy for the indices). delta: the
        rows' rope deltas (None: all 0)."""
        N, T = tokens.shape
        pad = B - N
        st = self._step(kind, B, T)
        st.tokens[:N].copy_(tokens)  # padding rows keep token 0
        if hidden is not None:
            assert st.hidden is not None
            st.hidden[:N].copy_(hidden)
        z = [0] * pad
        st.ix.copy_(_host_index(slots + self.scratch[:pad], pos0 + z, cur + z, last + z, (delta or [0] * N) + z,
                                device=self.device), non_blocking=True)
        return st

    def _step(self, kind: str, B: int, T: int) -> _Step:
        st = self._steps.get((kind, B, T))
        if st is None:
            dev, H = self.device, self.model.config.hidden_size
            hidden = torch.zeros(B, T, H, dtype=self.pool.dtype, device=dev) if kind == "draft" else None
            st = self._steps[(kind, B, T)] = _Step(torch.zeros(5, B, dtype=torch.long, device=dev),
                                                   torch.zeros(B, T, dtype=torch.long, device=dev), hidden)
        return st

    def _verify_body(self, st: _Step) -> tuple[torch.Tensor, ...]:
        B, T = st.tokens.shape
        m = self.model
        ctx = FwdCtx.from_tensors(st.ix[0], st.ix[1], st.ix[2], T, self.rope, st.ix[4])
        pre = m.forward_step(st.tokens, ctx, self.pool)  # [B, T, H]
        post = m.model.norm(pre)
        return pre, post, m.logits(post, out=self.logits[:B * T].view(B, T, -1))

    def _draft_body(self, st: _Step) -> tuple[torch.Tensor, ...]:
        B, T = st.tokens.shape
        m = self.model
        assert self.pool.mtp is not None and st.hidden is not None
        ctx = FwdCtx.from_tensors(st.ix[0], st.ix[1], st.ix[2], T, self.rope, st.ix[4])  # ix[2] == 0: no GDN
        hm = m.mtp_forward(st.tokens, st.hidden, ctx, self.pool.mtp)  # [B, T, H]
        h = hm[torch.arange(B, device=hm.device), st.ix[3]][:, None]  # [B, 1, H]
        return h, m.logits(h[:, 0], out=self.logits[:B])

    def _run(self, st: _Step, body: Callable[[_Step], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        if st.graph is not None:
            st.graph.replay()
            return st.out
        out = body(st)  # eagerly: a CPU, a key whose capture failed, or a key's first call (compiles its kernels)
        if self.capture and st.failed is None:
            self._capture(st, body)
        return out

    def _capture(self, st: _Step, body: Callable[[_Step], tuple[torch.Tensor, ...]]) -> None:
        """Record `body` on st's static buffers as st.graph; on failure keep st eager (st.failed) and log it."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                st.out = body(st)
        except Exception as e:  # noqa: BLE001 - serve this key eagerly rather than fail its requests
            st.failed = f"{type(e).__name__}: {e}".splitlines()[0]
            B, T = st.tokens.shape
            log.warning("CUDA graph capture of %s failed (%s); that step runs eagerly from now on",
                        _key("draft" if st.hidden is not None else "verify", B, T), st.failed)
            return
        st.graph = graph


def _key(kind: str, B: int, T: int) -> str:
    return f"{kind} B={B} T={T}"
