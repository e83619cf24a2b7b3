"""The device worker: one thread owns the model and the `Scheduler` that batches every `SpecSession`.

Requests reach it as `Job`s (one per choice) through a bounded admission queue. The loop admits waiting
jobs while the state pool has a free slot (a request waits in the queue until one frees), runs one scheduler
step (ONE batched speculative round over all running sessions, then prefill chunks of joining ones under
the token budget), and publishes each session's new tokens to its job's asyncio queue on the server's event
loop (one `loop.call_soon_threadsafe` hand-off per step for all of them, `_Outbox`). Telemetry is
stash-and-diff per emission: the delta goes to the job's own `telem`, and the step's deltas summed to the
Prometheus metrics, so the sum of the requests' `usage.spec` equals the counters' increase. A session that
raises fails its own job only; the loop goes on. Sessions that finish or whose job was cancelled leave the
batch and give their slot back at once. If the loop itself fails, every job gets an error event and /health
turns 503.

A device that fails for good (a sticky CUDA error: an illegal memory access, an uncorrectable ECC error) would
otherwise fail every request while /health stays 200. So a failure that looks like the device's (`device_error`)
makes the worker probe the device (`probe_device`); if the probe fails too, the device is lost (`DeviceLost`):
every job gets that error, /health and /ready answer 503 naming it, and the process exits with
`DEVICE_LOST_EXIT` once the failed requests' responses are out (`exit_process`), for its orchestrator to
replace it. A failure the probe does not confirm (e.g. a failed allocation) fails only the requests it hit.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.images import ImageInput
from engine.kpolicy import KPolicySpec
from engine.scheduler import ENCODER_CACHE_BYTES, Scheduler
from engine.selfcheck import startup
from engine.spec import SpecConstraint, SpecSampling, SpecSession, SpecTelemetry
from metrics.prometheus import ServingMetrics

log = logging.getLogger("nextn.worker")


#: exit status of a serving process whose device failed for good (sysexits' EX_IOERR): its orchestrator restarts it
DEVICE_LOST_EXIT = 74
#: after a device loss: the longest the process waits for its failed requests' responses to read their error ...
DEVICE_LOST_DRAIN_S = 10.0
#: ... and how long it then goes on answering /health 503 with the reason before it exits
DEVICE_LOST_LINGER_S = 1.0
#: what the message of a CUDA failure contains (torch's "CUDA error: ...", Triton's launcher, cuBLAS, cuDNN); an
#: error with one of these makes the worker probe the device
DEVICE_ERROR_MARKS = ("CUDA error", "Triton Error [CUDA]", "CUBLAS_STATUS", "cuDNN error", "CUDA driver",
                      "illegal memory access", "uncorrectable ECC error", "device-side assert",
                      "unspecified launch failure")
#: longest failure text /health and /ready show
MAX_FAILURE_CHARS = 300


class DeviceLost(RuntimeError):
    """The device failed for good: an error that looked like the device's, and a probe of the device that failed
    too. Every request in flight fails with it, /health and /ready answer 503 naming it, and the serving process
    exits with DEVICE_LOST_EXIT."""


def device_error(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) is one torch raises when the device failed rather than the
    request: `torch.AcceleratorError`, or a RuntimeError whose message is a CUDA error's (DEVICE_ERROR_MARKS).
    Running out of memory (`torch.OutOfMemoryError`) is not: only the request that asked for the memory fails."""
    e: BaseException | None = err
    for _ in range(8):  # a bounded walk down the cause chain
        if e is None or isinstance(e, torch.OutOfMemoryError):
            return False
        if isinstance(e, torch.AcceleratorError) or \
                (isinstance(e, RuntimeError) and any(m in str(e) for m in DEVICE_ERROR_MARKS)):
            return True
        e = e.__cause__ or e.__context__
    return False


def probe_device(device: torch.device | str) -> str | None:
    """None when `device` still computes, else why not. On CUDA: a tiny op, a synchronize and a check of its result
    (a sticky error, which leaves the CUDA context unusable, raises from each of them; a transient one does not).
    A CPU cannot be lost: None. (Tests stand in for a broken device by replacing this function.)"""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        x = torch.full((4,), 2.0, device=dev)
        got = float((x * x).sum().item())  # .item() synchronizes with the device
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - whatever the device says is the answer
        return f"{type(e).__name__}: {e}"
    return None if got == 16.0 else f"the device computed 4 x 2 x 2 = {got}"


def failure_text(err: BaseException) -> str:
    """One bounded line naming `err` (what /health shows)."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= MAX_FAILURE_CHARS else text[:MAX_FAILURE_CHARS - 3] + "..."


def exit_process(jobs: Sequence[Job], status: int = DEVICE_LOST_EXIT) -> None:
    """End this process with `status` once `jobs` (each given its error `done` event already) have been answered:
    their events delivered to their event loops and read by their responses (at most DEVICE_LOST_DRAIN_S), then
    DEVICE_LOST_LINGER_S in which /health goes on answering 503. Returns at once: a daemon thread waits, flushes the
    logs and calls `os._exit` (an interpreter shutdown could wait forever on a wedged device or a stuck thread)."""

    def wait_and_exit() -> None:
        deadline = time.monotonic() + DEVICE_LOST_DRAIN_S
        for loop in {job.loop for job in jobs}:  # the loop ran every hand-off scheduled before this marker
            delivered = threading.Event()
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(delivered.set)
                delivered.wait(max(0.0, deadline - time.monotonic()))
        while any(not job.events.empty() for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(DEVICE_LOST_LINGER_S)
        log.critical("exiting with status %d (device lost)", status)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    threading.Thread(target=wait_and_exit, name="nextn-exit", daemon=True).start()


class QueueFull(Exception):
    """The admission queue cannot take the job(s) now (HTTP 429)."""


class Unavailable(Exception):
    """The worker does not admit work: it is draining for shutdown, or stopped (HTTP 503)."""


@dataclass
class JobEvent:
    """What one step of a job produced. `done` marks the job's last event; then `finish_reason` is
    "stop"/"length" (or the cancel reason), `error` is set when the session raised, and `telem` is the
    job's final telemetry."""

    index: int
    token_ids: list[int]
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None  # with the job's first tokens, when it asked for them
    cached_tokens: int | None = None  # with the job's first tokens: its prompt tokens the prefix cache held
    done: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None
    telem: SpecTelemetry | None = None

    def then(self, later: JobEvent) -> JobEvent | None:
        """This event and the same job's next one as ONE event (tokens and logprobs joined, the later one's
        end), or None when they must stay apart (this one is final; the later one is an error or an abort)."""
        if self.done or later.index != self.index or later.error is not None or later.finish_reason == "abort":
            return None
        lps = None if self.logprobs is None and later.logprobs is None else \
            list(self.logprobs or []) + list(later.logprobs or [])
        plps = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        cached = self.cached_tokens if self.cached_tokens is not None else later.cached_tokens
        return JobEvent(self.index, self.token_ids + later.token_ids, lps, prompt_logprobs=plps, cached_tokens=cached,
                        done=later.done, finish_reason=later.finish_reason, telem=later.telem)


@dataclass(eq=False)
class Job:
    """One session's worth of work (a request with n choices submits n jobs).

    Created on the event loop; the worker reads the inputs and hands its events over through its `_Outbox`
    (`publish`, a direct hand-off, is kept for the failure path only); `cancel` may be called
    from the event loop at any time (the worker drops the session before its next step).
    """

    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SpecSampling
    eos_ids: Sequence[int]
    logprobs: int | tuple[int, ...] | None  # None, n alternatives, or these ids' logprobs (SpecSession's `logprobs`)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[JobEvent]
    constraint: SpecConstraint | None = None  # this choice's grammar (one per choice: it holds matcher state)
    prompt_logprobs: int | None = None  # compute the prompt tokens' logprobs (+ this many alternatives)
    images: tuple[ImageInput, ...] = ()  # the prompt's images in order (`prompt_ids` holds their expanded pads)
    arrival: float = field(default_factory=time.monotonic)
    telem: SpecTelemetry = field(default_factory=SpecTelemetry)
    cancel_reason: str | None = None
    done: bool = False  # the final event was published
    on_cancel: Callable[[Job], None] | None = None  # set by a worker that must be told (the engine process)

    def cancel(self, reason: str = "abort") -> None:
        """Ask the worker to drop this job; `reason` ("stop" for a stop string, "abort" for a client that
        left) is what metrics record. The job still gets a final `done` event."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            if self.on_cancel is not None:
                self.on_cancel(self)

    def end(self, reason: str, error: BaseException | None = None) -> JobEvent:
        """Mark the job done and return its final event (no tokens; `reason`, `error`, its telemetry)."""
        self.done = True
        return JobEvent(self.index, [], done=True, finish_reason=reason, error=error, telem=self.telem)

    def publish(self, event: JobEvent) -> None:
        """Hand `event` to the event loop now (thread-safe), bypassing the worker's `_Outbox`: the outer guard
        uses it so that failing every job depends on nothing else; dropped when the loop has already closed."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _Outbox:
    """The worker's hand-off to the event loop(s): events of many jobs and steps, one wake-up at a time.

    `send` queues (job, event) pairs (worker thread); the first pair queued for a loop schedules one `_drain` on
    it (`call_soon_threadsafe`: a self-pipe write and a wake-up), later pairs join the same delivery until it has
    run. `_drain` puts every queued event into its job's queue in order, so a consumer that reads all ready
    events at once streams them as one chunk. Events of one job keep their order; a closed loop drops its events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[asyncio.AbstractEventLoop, list[tuple[Job, JobEvent]]] = {}

    def send(self, pairs: Sequence[tuple[Job, JobEvent]]) -> None:
        wake: list[asyncio.AbstractEventLoop] = []
        with self._lock:
            for job, ev in pairs:
                box = self._boxes.get(job.loop)
                if box is None:
                    box = self._boxes[job.loop] = []
                    wake.append(job.loop)
                box.append((job, ev))
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._drain, loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                with self._lock:
                    self._boxes.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            pairs = self._boxes.pop(loop, [])
        for job, ev in pairs:
            job.events.put_nowait(ev)

    def flush(self) -> None:
        """End of a worker iteration (nothing to do here: `send` already scheduled the delivery; the engine
        process's relay sends its buffered message now)."""


@dataclass(eq=False)
class _Active:
    job: Job
    sess: SpecSession
    last_emit: float | None = None
    seen: SpecTelemetry = field(default_factory=SpecTelemetry)  # the session's telemetry at the last publish


SessionFactory = Callable[..., SpecSession]


class Drainable:
    """What both workers (`Worker`, `server.engine_proc.EngineProcess`) share: the drain switch (`_cv` guards it)
    and `submit`, one request through their `submit_many`."""

    _cv: threading.Condition
    _draining: bool
    _failure: str | None = None

    def submit_many(self, requests: Sequence[Sequence[Job]]) -> list[Exception | None]:
        raise NotImplementedError

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue all of `jobs` or none. Raises `Unavailable` or `QueueFull`."""
        err = self.submit_many([jobs])[0]
        if err is not None:
            raise err

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def failure(self) -> str | None:
        """Why the worker stopped serving (a lost device, a failed loop, a dead engine process); None while it
        serves."""
        return self._failure

    def begin_drain(self) -> None:
        """Stop admitting new submissions; queued and active jobs still run to completion."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()


class Worker(Drainable):
    """Owns the model; `submit` from the event loop, everything else happens on the worker thread.

    `session_factory` builds a session with `SpecSession`'s signature (tests subclass it to inject failures); a
    job with images passes them as `images=` (only then, so factories without the argument serve text).
    `kernels` ("auto" | "strict"): the startup self-check's mode (`engine.selfcheck.startup`); strict raises
    `KernelCheckFailed` from here. `on_device_lost(err, jobs)` runs on the worker thread once the device is lost
    and every job has its error event (`jobs`: those it failed); None: `exit_process(jobs)`, the serving
    contract (the engine process passes its own, which tells the server first). `encoder_cache_bytes`: the
    scheduler's image-embedding cache.
    """

    def __init__(self, model: Any, metrics: ServingMetrics, *, k: int, p_min: float, capmax: int,
                 max_num_seqs: int, max_queue: int, max_model_len: int, max_num_batched_tokens: int,
                 prefix_cache_bytes: int | None = 0, session_factory: SessionFactory = SpecSession,
                 outbox: Any = None, kernels: str = "auto",
                 on_device_lost: Callable[[DeviceLost, list[Job]], Any] | None = None,
                 encoder_cache_bytes: int = ENCODER_CACHE_BYTES, spec_policy: KPolicySpec | None = None) -> None:
        self.model = model
        self.metrics = metrics
        self.k, self.p_min, self.capmax = k, p_min, capmax
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.session_factory = session_factory
        self.scheduler = Scheduler(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, k=k,
                                   max_num_batched_tokens=max_num_batched_tokens, prefix_cache_bytes=prefix_cache_bytes,
                                   encoder_cache_bytes=encoder_cache_bytes, spec_policy=spec_policy)
        log.info("%s", self.scheduler.describe())
        self._pc_seen = self.scheduler.prefix_stats()
        if self._pc_seen is not None:
            metrics.set_prefix_cache(self._pc_seen)  # the budget, before the first request
        self._vs_seen = self._vision_stats()
        if self._vs_seen is not None:
            metrics.set_vision(self._vs_seen)  # the image counters exist at 0 before the first image
        #: the model has a vision tower (the loader's `model.vision`; None: no tower, or --language-model-only)
        self.vision = getattr(model, "vision", None) is not None
        # the kernels meet the device and the CUDA graphs are captured before the first request
        # (engine/selfcheck.py; --kernels strict: any failure is fatal)
        self.startup = startup(model, self.scheduler.runner, strict=kernels == "strict", progress=True)
        self.kernel_info = self.startup.kernel_info()  # kernel -> "triton" | "torch" ({} on the torch path)
        pol = self.scheduler.policy
        if pol is not None and pol.spec.adaptive and not pol.cost:  # graphs captured: the round's costs now
            self.scheduler.profile_speculation()
        elif pol is not None and not pol.spec.adaptive:
            log.info("%s", pol.spec.describe())
        self._k_seen = self.scheduler.spec_k_stats()
        if pol is not None:
            metrics.set_spec_k(self._k_seen)  # the cost table on /health before the first request
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[SpecSession, _Active] = {}
        self._draining = False
        self._stopping = False
        self._busy = False  # the worker holds jobs outside the two queues (admitting or stepping)
        self._limbo: list[Job] = []  # jobs taken off the queues and not yet placed (failed with the loop)
        self._failed = False  # the loop died: /health and /ready report it, submit refuses
        self._on_device_lost = on_device_lost
        # a step's events reach the event loop in one hand-off (the engine process passes its pipe relay)
        self._outbox = _Outbox() if outbox is None else outbox
        self._thread = threading.Thread(target=self._run, name="nextn-worker", daemon=True)

    # -- event-loop side -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit_many(self, requests: Sequence[Sequence[Job]]) -> list[Exception | None]:
        """Queue several requests' jobs at once, in order, each request's all or none: the worker admits them
        together. Returns each request's refusal (`Unavailable`, `QueueFull`) or None."""
        out: list[Exception | None] = []
        with self._cv:
            for jobs in requests:
                if self._draining or self._stopping:
                    out.append(Unavailable("the server is draining for shutdown"))
                elif self._failed or not self._thread.is_alive():
                    out.append(Unavailable("the worker is not running"))
                elif len(self._waiting) + len(jobs) > self.max_queue:
                    out.append(QueueFull(f"the admission queue is full ({self.max_queue} waiting)"))
                else:
                    self._waiting.extend(jobs)
                    out.append(None)
            self.metrics.set_waiting(len(self._waiting))
            self._cv.notify()
        return out

    @property
    def num_active(self) -> int:
        """Sessions that hold caches now."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        """The loop is running (False once it died or stopped)."""
        return self._thread.is_alive() and not self._failed

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop's thread to end (it ends on `shutdown` or when the loop itself failed)."""
        self._thread.join(timeout)

    def wake(self) -> None:
        """Make an idle loop look at its jobs again (a cancel of a queued job from another thread)."""
        with self._cv:
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or active; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._waiting or self._active or self._busy), timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread; jobs still queued or active get an "abort" `done` event."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except DeviceLost as e:
            log.critical("%s; failing every request, then exiting", e, exc_info=True)
            jobs = self._fail_all(e)
            if self._on_device_lost is not None:
                self._on_device_lost(e, jobs)
            else:
                exit_process(jobs)
        except BaseException as e:  # noqa: BLE001 - the loop itself failed: nobody may be left waiting
            log.critical("the worker loop failed; failing every request", exc_info=True)
            self._fail_all(e)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._waiting or self._active)
                if self._stopping:
                    break
                # a stop string or a client that left: drop the job now (queued) or free its slot (active)
                gone_waiting = [j for j in self._waiting if j.cancel_reason is not None]
                gone_active = [a for a in self._active.values() if a.job.cancel_reason is not None]
                for j in gone_waiting:
                    self._waiting.remove(j)
                for a in gone_active:
                    del self._active[a.sess]
                room = self.scheduler.pool.num_free + len(gone_active)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._limbo = admitted + gone_waiting + [a.job for a in gone_active]
                self._busy = True
            for j in gone_waiting:
                self._finish(j, j.cancel_reason or "abort")
            for a in gone_active:
                self.scheduler.remove(a.sess)
                self._finish(a.job, a.job.cancel_reason or "abort")
            sessions = [a for a in map(self._admit, admitted) if a is not None]
            with self._cv:
                self._active.update((a.sess, a) for a in sessions)
                self._limbo = []
            if self._active:
                self._step()
            with self._cv:
                self._busy = False
                self.metrics.set_running(len(self._active))
                self.metrics.set_waiting(len(self._waiting))
                # slots held by sessions (the pool's other slots, graph-padding scratch, are held for good)
                self.metrics.set_pool_usage(self.max_num_seqs - self.scheduler.pool.num_free, self.max_num_seqs)
                self._cv.notify_all()  # wait_idle
            self._outbox.flush()
        for a in list(self._active.values()):
            self.scheduler.remove(a.sess)
            self._finish(a.job, "abort")
        self._active.clear()
        while self._waiting:
            self._finish(self._waiting.popleft(), "abort")
        self._outbox.flush()

    def _fail_all(self, err: BaseException) -> list[Job]:
        """The loop died: refuse new work and give every job it held or queued an error `done` event (a lost device's
        `DeviceLost` itself, else a RuntimeError naming the failure); returns the jobs it failed."""
        with self._cv:
            self._failed = True
            self._failure = failure_text(err) if isinstance(err, DeviceLost) else \
                f"the worker loop failed: {failure_text(err)}"
            jobs = [a.job for a in self._active.values()] + list(self._limbo) + list(self._waiting)
            sessions = [a.sess for a in self._active.values()]
            self._active.clear()
            self._waiting.clear()
            self._limbo = []
            self._busy = False
            self._cv.notify_all()
        for sess in sessions:
            with contextlib.suppress(Exception):
                sess.close()
        failure = err if isinstance(err, DeviceLost) else RuntimeError(f"the worker failed: {type(err).__name__}")
        failed = [job for job in jobs if not job.done]
        for job in failed:  # the event first: metrics may be what failed
            job.publish(job.end("error", failure))
        with contextlib.suppress(Exception):
            self.metrics.set_running(0)
            self.metrics.set_waiting(0)
            self.metrics.set_pool_usage(0, self.max_num_seqs)
        return failed

    def _check_device(self, errors: Iterable[BaseException]) -> None:
        """After failures: when one looks like the device's (`device_error`), probe the device (`probe_device`); raise
        `DeviceLost` when the probe fails too (the loop's guard then fails every job and ends the process)."""
        suspect = next((e for e in errors if device_error(e)), None)
        if suspect is None:
            return
        why = probe_device(self.scheduler.pool.device)
        if why is None:
            log.warning("a device error (%s) did not persist: the device passes its probe; only the requests it hit "
                        "failed", failure_text(suspect))
            return
        after = failure_text(suspect)
        raise DeviceLost(f"the device failed: {why}" + ("" if why == after else f" (after {after})")) from suspect

    def _admit(self, job: Job) -> _Active | None:
        """Start a session for `job` on a free pool slot and add it to the batch (its prefix-cache lookup and resume);
        None when either failed: the job is then finished with that error, the session's slot and reservations
        released, and every other job goes on."""
        self.metrics.observe_queue_time(time.monotonic() - job.arrival)
        sess: SpecSession | None = None
        images = {"images": job.images} if job.images else {}
        try:
            sess = self.session_factory(self.model, job.prompt_ids, job.max_new_tokens, k=self.k,
                                        sampling=job.sampling, constraint=job.constraint, eos_ids=list(job.eos_ids),
                                        p_min=self.p_min, capmax=self.capmax, logprobs=job.logprobs,
                                        pool=self.scheduler.pool, prompt_logprobs=job.prompt_logprobs, **images)
            self.scheduler.add(sess)
        except Exception as e:  # noqa: BLE001 - a bad session fails its own request only
            log.exception("creating a session failed" if sess is None else "a session could not join the batch")
            if sess is not None:
                self._release(sess)
            self._check_device([e])
            self._finish(job, "error", error=e)
            return None
        return _Active(job, sess)

    def _release(self, sess: SpecSession) -> None:
        """Take a session that failed to join out of the scheduler: its prefix-cache reservations and its slot."""
        try:
            self.scheduler.remove(sess)
        except Exception:  # noqa: BLE001 - at least give the slot back
            log.exception("removing a session that failed to join failed")
            with contextlib.suppress(Exception):
                sess.close()

    def _step(self) -> None:
        """One scheduler step; publish every session's new tokens (one emission = one inter-token-latency
        sample, vLLM's per-step semantics) and retire the sessions that left."""
        t0 = time.monotonic()
        try:
            res = self.scheduler.step()
        except Exception as e:
            self._check_device([e])  # DeviceLost, or the step's own failure: both end the loop
            raise
        t1 = time.monotonic()
        out: list[tuple[Job, JobEvent]] = []  # this step's events, handed to the event loop at once
        step_telem = SpecTelemetry()  # the step's deltas, summed: one metrics update per step
        for sess, new_ids in res.emitted:
            a = self._active.get(sess)
            if a is None:
                continue
            job = a.job
            if sess.telem.k_rounds != a.seen.k_rounds:  # telemetry moves with rounds only
                delta = sess.telem.delta_since(a.seen)
                a.seen = sess.telem.copy()
                step_telem.merge(delta)
                job.telem.merge(delta)
            first = a.last_emit is None
            if first:
                if job.index == 0:  # one TTFT sample per request: its first choice's first token
                    self.metrics.observe_ttft(t1 - job.arrival)
            else:
                self.metrics.observe_itl(t1 - a.last_emit)
            a.last_emit = t1
            lps = list(sess.logprobs[len(sess.emitted) - len(new_ids):]) if job.logprobs is not None else None
            plps = list(sess.prompt_logprobs) if first and job.prompt_logprobs is not None else None
            out.append((job, JobEvent(job.index, list(new_ids), lps, prompt_logprobs=plps,
                                      cached_tokens=sess.cached_tokens if first else None)))
        if step_telem.rounds:
            self.metrics.add_spec(step_telem)
        ks = self.scheduler.spec_k_stats()
        if ks != self._k_seen:
            self._k_seen = ks
            self.metrics.set_spec_k(ks)
        pc = self.scheduler.prefix_stats()
        if pc is not None and pc != self._pc_seen:
            self._pc_seen = pc
            self.metrics.set_prefix_cache(pc)
        vs = self._vision_stats()
        if vs is not None and vs != self._vs_seen:
            self._vs_seen = vs
            self.metrics.set_vision(vs)
        errors = [s.error for s in res.finished if s.error is not None and s in self._active]
        if any(map(device_error, errors)):
            self._outbox.send(out)  # the tokens the step did emit, before any error event
            out = []
            self._check_device(errors)  # a lost device raises: every job, these too, fails with DeviceLost
        for sess in res.finished:
            a = self._active.get(sess)
            if a is None:
                continue
            with self._cv:
                del self._active[sess]
            if sess.error is not None:
                log.error("session failed: %s: %s", type(sess.error).__name__, sess.error,
                          exc_info=(type(sess.error), sess.error, sess.error.__traceback__))
                self._finish(a.job, "error", error=sess.error, out=out)
            else:
                self._finish(a.job, sess.finish_reason or "stop", out=out)
        self._outbox.send(out)
        log.debug("step: %d session(s), %.1f ms", len(self._active), (t1 - t0) * 1e3)

    def _vision_stats(self) -> Any:
        """A copy of the scheduler's image counters now (None: the model has no vision tower)."""
        vs = self.scheduler.vision_stats()
        return None if vs is None else dataclasses.replace(vs)

    def _finish(self, job: Job, reason: str, error: BaseException | None = None,
                out: list[tuple[Job, JobEvent]] | None = None) -> None:
        """The job's final event (request-level metrics are the serving layer's: one request, n jobs); appended
        to `out` when given (the step's batch, published after its token events), else handed over now."""
        ev = job.end(reason, error)
        if out is None:
            self._outbox.send([(job, ev)])
        else:
            out.append((job, ev))
