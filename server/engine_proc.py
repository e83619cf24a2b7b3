"""The engine in its own process (`--engine-process`, the default of `nextn serve`), as vLLM's engine core.

Why: torch releases the GIL around every op and takes it back after, so in one process the HTTP event loop's
per-chunk Python (detokenizing, building and sending each SSE chunk) runs between the worker's ops and the
worker waits for it: each streamed chunk lengthens the round. In a child process the engine has a GIL of its own.

The child (`_engine_main`) loads the model and runs the same `Worker` (thread) as the in-process server, with
two differences: its jobs' events go to a pipe instead of an event loop (`_Relay`, ONE message per worker
iteration: the events and the metrics calls of that iteration), and its metrics calls are replayed by the
parent on the served `ServingMetrics`. Grammar-constrained jobs travel as their grammar source; the child
compiles them again with its own compiler (cached) and builds the constraint there.

The parent (`EngineProcess`) has `Worker`'s interface for the serving layer: `submit` sends job specs, a
`Job.cancel` sends a cancel (written at once when small and nothing is queued, else queued to a sender thread, in
order, so the event loop never blocks on a full pipe),
a reader thread turns the child's messages into each job's events on its event
loop (the same `_Outbox` hand-off). If the child exits (a crash, the OOM killer), every job it held gets an
error `done` event, /health turns 503 and `submit` refuses: no client waits on a dead engine. If the child's
worker finds its device lost (`server.worker.DeviceLost`), the child fails its jobs, tells the parent ("lost") and
exits with DEVICE_LOST_EXIT; the parent reports the reason on /health from the first such error it relays, fails
what is left, and exits with the same status once those requests are answered (`exit_process`): an orchestrator
restarts the replica.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.kpolicy import KPolicySpec
from engine.scheduler import ENCODER_CACHE_BYTES
from server.worker import (
    DEVICE_LOST_EXIT,
    DeviceLost,
    Drainable,
    Job,
    JobEvent,
    QueueFull,
    Unavailable,
    _Outbox,
    exit_process,
    failure_text,
)

log = logging.getLogger("nextn.engine")

#: the largest command `EngineProcess._send` writes from its caller's thread (a pipe holds 64 KiB: one this size is
#: taken at once unless the engine has fallen far behind reading), larger ones go through the sender thread
DIRECT_SEND_BYTES = 16 << 10


def _maybe_small(msg: tuple) -> bool:
    """Whether a command may fit DIRECT_SEND_BYTES, judged without pickling it (a long prompt or a picture is
    pickled by the sender thread, off the event loop); "shutdown" always goes through the sender thread (it ends
    there)."""
    if msg[0] == "submit":  # a token id pickles to at most 5 bytes
        return all(not spec.images for spec in msg[1]) and \
            sum(len(spec.prompt_ids) for spec in msg[1]) <= DIRECT_SEND_BYTES // 5
    return msg[0] != "shutdown"


#: grammar compiles the engine runs at once (off its command loop, which must keep taking submits and cancels)
GRAMMAR_THREADS = 2


class EngineStartError(RuntimeError):
    """The engine process could not start; `str(err)` is one line (PoolTooLarge's message when the pool does
    not fit)."""


@dataclass(frozen=True)
class EngineSetup:
    """Everything the child needs to build the same worker the in-process server would (picklable)."""

    model_dir: Path
    device: str
    dtype: str | None  # None: the checkpoint's / the device's default
    cpu_threads: int | None
    cpu_kernel: bool
    cpu_kernel_threads: int | None
    log_level: str
    k: int
    p_min: float
    capmax: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    prefix_cache_bytes: int | None
    grammar_max_bytes: int
    grammar_timeout_s: float
    grammar_cache_size: int
    kernels: str = "auto"  # the startup self-check's mode (Worker)
    language_model_only: bool = False  # load no vision tower
    encoder_cache_bytes: int = ENCODER_CACHE_BYTES  # the scheduler's image-embedding cache
    session_factory: Callable[..., Any] | None = None  # tests inject failures (a module-level callable)
    spec_policy: KPolicySpec | None = None  # the speculation controller's policy (None: fixed K)


@dataclass(frozen=True)
class _JobSpec:
    """A parent `Job`'s inputs, as the child rebuilds it."""

    key: int
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Any
    eos_ids: list[int]
    logprobs: int | tuple[int, ...] | None
    prompt_logprobs: int | None
    grammar: Any  # GrammarSource, or None
    reasoning: bool
    arrival: float  # the parent's time.monotonic() at the job's creation (CLOCK_MONOTONIC: one clock for both)
    images: tuple = ()  # the job's `ImageInput`s (their numpy pictures pickle as they are)


# -- child ----------------------------------------------------------------------------------------------


class _RelayMetrics:
    """The child's stand-in for `ServingMetrics`: records the worker's calls for the parent to replay."""

    _CALLS = ("observe_queue_time", "observe_ttft", "observe_itl", "add_spec", "set_running", "set_waiting",
              "set_prefix_cache", "set_vision", "set_pool_usage", "set_spec_k")

    def __init__(self, relay: _Relay) -> None:
        for name in self._CALLS:
            setattr(self, name, (lambda n: lambda *a: relay.metric(n, a))(name))


class _Relay:
    """The child's outbox: the worker's events and metrics calls, buffered and sent as one pipe message per
    worker iteration (`flush`). Thread-safe (the worker thread and the command thread both send)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._events: list[tuple[int, JobEvent]] = []
        self._ops: list[tuple[str, tuple]] = []
        self.metrics = _RelayMetrics(self)

    def metric(self, name: str, args: tuple) -> None:
        with self._lock:
            self._ops.append((name, args))

    def send(self, pairs: Sequence[tuple[Job, JobEvent]]) -> None:
        with self._lock:
            self._events.extend((job.key, _portable(ev)) for job, ev in pairs)  # type: ignore[attr-defined]

    def flush(self) -> None:
        with self._lock:
            if not (self._events or self._ops):
                return
            msg = pickle.dumps(("out", self._events, self._ops), protocol=pickle.HIGHEST_PROTOCOL)
            self._events, self._ops = [], []
            with contextlib.suppress(OSError):  # the parent is gone: nobody is listening any more
                self._conn.send_bytes(msg)  # plain pickle: half the cost of Connection.send's ForkingPickler

    def device_lost(self, err: DeviceLost, _jobs: list[Job]) -> None:
        """The worker's `on_device_lost` in the engine process: what is buffered, then ("lost", reason) to the
        parent; then this process exits with DEVICE_LOST_EXIT (the parent ends the server)."""
        self.flush()
        with self._lock, contextlib.suppress(OSError):
            self._conn.send_bytes(pickle.dumps(("lost", str(err)), protocol=pickle.HIGHEST_PROTOCOL))
        logging.shutdown()
        os._exit(DEVICE_LOST_EXIT)


def _portable(ev: JobEvent) -> JobEvent:
    """`ev` with an error the parent can unpickle (else a RuntimeError naming it)."""
    if ev.error is None:
        return ev
    try:
        pickle.loads(pickle.dumps(ev.error))
        return ev
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        ev.error = RuntimeError(f"{type(ev.error).__name__}: {ev.error}")
        return ev


class _ChildJob(Job):
    """A job inside the engine process: `key` names it to the parent; its events go to the relay."""

    key: int
    relay: _Relay

    def publish(self, event: JobEvent) -> None:  # the worker's failure path: hand it over now
        self.relay.send([(self, event)])
        self.relay.flush()


class _ChildGrammar:
    """The child's grammar compiler: the served tokenizer's `StructuredOutputs`, its llguidance tokenizer built in
    the background from the start."""

    def __init__(self, setup: EngineSetup, n_vocab: int) -> None:
        from engine.tokenizer import Tokenizer
        from server.structured import StructuredOutputs

        self._so = StructuredOutputs(Tokenizer.from_dir(setup.model_dir), n_vocab=n_vocab, metrics=None,
                                     max_bytes=setup.grammar_max_bytes, timeout_s=setup.grammar_timeout_s,
                                     cache_size=setup.grammar_cache_size)
        self._so.start()

    def constraint(self, source: Any, reasoning: bool) -> Any:
        """A fresh constraint for `source` (compiled, or from the cache); raises what compiling raised."""
        compiler = self._so.compiler_blocking()
        return compiler.constraint(compiler.compile(source).grammar, reasoning=reasoning)


def _submit(worker: Any, jobs: list[_ChildJob]) -> None:
    """Queue `jobs` on the engine's worker; if it refuses (it died), each gets its error `done` event."""
    try:
        worker.submit(jobs)
    except (QueueFull, Unavailable) as e:
        for job in jobs:
            job.publish(job.end("error", e))


def _constrain_and_submit(job: _ChildJob, spec: _JobSpec, grammar: _ChildGrammar, worker: Any) -> None:
    """A compile thread: build the job's constraint from its grammar source, then queue it (a failure fails this
    job alone; a job cancelled meanwhile is dropped by the worker with an "abort")."""
    try:
        job.constraint = grammar.constraint(spec.grammar, spec.reasoning)
    except Exception as e:  # noqa: BLE001 - this job fails alone
        job.publish(job.end("error", e))
        return
    _submit(worker, [job])


def _engine_main(setup: EngineSetup, cmds: Connection, out: Connection) -> None:
    """The engine process: build the worker, report "ready" (or one "fatal" line), then serve commands until
    "shutdown" or until the parent goes away. It ignores SIGINT and SIGTERM: a Ctrl-C (sent to the whole process
    group) or a group-wide SIGTERM is for `nextn serve`, which drains and then stops its engine."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=setup.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")

    from engine.loader import CheckpointError, load_model
    from engine.model.config import ConfigError
    from engine.scheduler import PoolTooLarge
    from engine.selfcheck import KernelCheckFailed
    from engine.spec import SpecSession
    from server.worker import Worker

    from engine.model.ops import cpu

    on_cpu = setup.device == "cpu"
    cpu.configure(torch_threads=setup.cpu_threads if on_cpu else None,
                  kernel_threads=setup.cpu_kernel_threads if on_cpu else None, enabled=setup.cpu_kernel)
    try:
        model = load_model(setup.model_dir, device=setup.device, dtype=setup.dtype, progress=True,
                           language_model_only=setup.language_model_only)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:  # as `nextn serve` words a failed load
        out.send(("fatal", f"cannot load {setup.model_dir}: {e}"))
        return
    except BaseException as e:  # noqa: BLE001 - e.g. a corrupt safetensors file
        out.send(("fatal", f"cannot load {setup.model_dir}: {type(e).__name__}: {e}"))
        return
    try:
        relay = _Relay(out)
        worker = Worker(model, relay.metrics, k=setup.k, p_min=setup.p_min, capmax=setup.capmax,
                        max_num_seqs=setup.max_num_seqs, max_queue=1 << 30,  # the parent bounds the queue
                        max_model_len=setup.max_model_len, max_num_batched_tokens=setup.max_num_batched_tokens,
                        prefix_cache_bytes=setup.prefix_cache_bytes, encoder_cache_bytes=setup.encoder_cache_bytes,
                        session_factory=setup.session_factory or SpecSession, outbox=relay, kernels=setup.kernels,
                        on_device_lost=relay.device_lost, spec_policy=setup.spec_policy)
    except (PoolTooLarge, KernelCheckFailed) as e:
        out.send(("fatal", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - one line for the parent to print
        out.send(("fatal", f"the engine could not start: {type(e).__name__}: {e}"))
        return
    grammar = _ChildGrammar(setup, model.config.vocab_size)
    compiles = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="nextn-engine-compile")
    worker.start()
    stopping = threading.Event()

    def watch() -> None:  # the loop died by itself (it has failed its jobs): exit, so the server reports it
        worker.join()
        if not stopping.is_set():
            log.critical("the engine's worker loop died; the engine process exits")
            relay.flush()
            os._exit(70)

    threading.Thread(target=watch, name="nextn-engine-watch", daemon=True).start()
    out.send(("ready", str(model.config.dtype).removeprefix("torch."), worker.kernel_info, worker.vision))
    jobs: dict[int, _ChildJob] = {}
    while True:
        try:
            msg = cmds.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        for key in [k for k, j in jobs.items() if j.done]:  # jobs whose final event went out
            del jobs[key]
        if msg[0] == "submit":
            batch = []
            for spec in msg[1]:
                job = _ChildJob(spec.index, spec.prompt_ids, spec.max_new_tokens, spec.sampling, spec.eos_ids,
                                spec.logprobs, None, None, prompt_logprobs=spec.prompt_logprobs,  # type: ignore[arg-type]
                                arrival=spec.arrival, images=spec.images)
                job.key, job.relay = spec.key, relay
                jobs[spec.key] = job
                if spec.grammar is None:
                    batch.append(job)
                else:  # compiled off this loop; the job joins the queue when its constraint is built
                    compiles.submit(_constrain_and_submit, job, spec, grammar, worker)
            _submit(worker, batch)
        elif msg[0] == "cancel":
            job = jobs.get(msg[1])
            if job is not None:
                job.cancel(msg[2])
                worker.wake()
        elif msg[0] == "shutdown":
            break
    stopping.set()
    compiles.shutdown(wait=False, cancel_futures=True)
    worker.shutdown(timeout=60)
    relay.flush()


# -- parent ---------------------------------------------------------------------------------------------


def _end(jobs: list[Job], reason: str, err: BaseException | None) -> None:
    """Publish the final event of each job that has none yet."""
    for job in jobs:
        if not job.done:
            job.publish(job.end(reason, err))


class EngineProcess(Drainable):
    """`Worker`'s interface over an engine process. `start()` spawns it and waits until its model is loaded
    and its state pool reserved (raises `EngineStartError` with the child's one-line reason)."""

    def __init__(self, setup: EngineSetup, metrics: Any, *, max_queue: int, max_num_seqs: int) -> None:
        self.setup, self.metrics = setup, metrics
        self.max_queue, self.max_num_seqs = max_queue, max_num_seqs
        self.dtype = "?"
        self.kernel_info: dict[str, str] = {}  # the child's startup self-check: kernel -> "triton" | "torch"
        self.vision = False  # the child's model has a vision tower
        self._cv = threading.Condition()
        self._jobs: dict[int, Job] = {}  # sent, no `done` event yet
        self._keys = itertools.count()
        self._running = 0  # the child's last report
        self._draining = False
        self._stopping = False
        self._failed = False
        self._lost: list[Job] | None = None  # the jobs in flight when the engine reported its device lost
        self._lost_reason = ""
        self._outbox = _Outbox()
        self._outq: queue.SimpleQueue[tuple[tuple, bytes | None]] = queue.SimpleQueue()  # for the sender thread
        self._wlock = threading.Lock()  # held while a command is written to the pipe
        self._qlock = threading.Lock()
        self._queued = 0  # commands handed to the sender thread and not written yet (under _qlock)
        self._proc: Any = None
        self._cmds: Connection | None = None
        self._out: Connection | None = None
        self._reader: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads, CUDA-safe
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_engine_main, args=(self.setup, cmd_r, out_w), name="nextn-engine",
                                 daemon=True)
        self._proc.start()
        atexit.register(self._kill)  # before multiprocessing's own exit hook, which would wait for it forever
        cmd_r.close()
        out_w.close()
        self._cmds, self._out = cmd_w, out_r
        try:  # as long as loading takes (a large checkpoint on slow storage), unless the child exits
            while not out_r.poll(1.0) and self._proc.is_alive():
                pass
            msg = out_r.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise EngineStartError(f"the engine process exited while starting (exit code {self._proc.exitcode})") \
                from None
        except BaseException:  # e.g. Ctrl-C while the model loads: the child ignores SIGINT, so stop it here
            self._kill()
            raise
        if msg[0] != "ready":
            self._proc.join(30)
            raise EngineStartError(msg[1])
        self.dtype, self.kernel_info, self.vision = msg[1], msg[2], msg[3]
        log.info("engine process started (pid %d)", self._proc.pid)
        self._reader = threading.Thread(target=self._read, name="nextn-engine-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._write, name="nextn-engine-sender", daemon=True).start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; jobs still queued or active get an "abort" `done` event."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._proc is None:
            return
        self._send(("shutdown",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._kill()
        if self._reader is not None:
            self._reader.join(10)
        self._fail_all("abort", None)  # whatever the child did not finish itself
        atexit.unregister(self._kill)

    def _kill(self) -> None:
        """SIGKILL the engine process if it still runs (a failed start, an unreadable stream, interpreter exit)."""
        with contextlib.suppress(Exception):
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)

    # -- event-loop side ------------------------------------------------------------------------------

    def submit_many(self, requests: Sequence[Sequence[Job]]) -> list[Exception | None]:
        """Queue several requests' jobs, in order, each request's all or none, in ONE message: the engine's worker
        admits them together. Returns each request's refusal (`Unavailable`, `QueueFull`, a job the engine process
        cannot take) or None."""
        out: list[Exception | None] = []
        sent: list[Job] = []
        specs: list[_JobSpec] = []
        with self._cv:
            for jobs in requests:
                if self._draining or self._stopping:
                    out.append(Unavailable("the server is draining for shutdown"))
                    continue
                if not self.alive:
                    out.append(Unavailable("the engine is not running"))
                    continue
                waiting = max(0, len(self._jobs) - self._running)  # sent and not yet running (an upper bound)
                if waiting + len(jobs) > self.max_queue:
                    out.append(QueueFull(f"the admission queue is full ({self.max_queue} waiting)"))
                    continue
                try:
                    mine = [self._spec(job) for job in jobs]
                except Exception as e:  # noqa: BLE001 - this request's answer
                    out.append(e)
                    continue
                for job, spec in zip(jobs, mine, strict=True):
                    self._jobs[spec.key] = job
                    job.key = spec.key  # type: ignore[attr-defined]
                    job.on_cancel = self._cancel
                specs += mine
                sent += jobs
                out.append(None)
            if specs:
                self.metrics.set_waiting(max(0, len(self._jobs) - self._running))
        if specs:
            self._send(("submit", specs))
        for job in sent:  # cancelled before they were sent
            if job.cancel_reason is not None:
                self._cancel(job)
        return out

    def _spec(self, job: Job) -> _JobSpec:
        grammar, reasoning = None, False
        if job.constraint is not None:
            src = getattr(getattr(job.constraint, "grammar", None), "source", None)
            if src is None:
                raise ValueError("the engine process serves grammar constraints only (GuidanceConstraint)")
            grammar, reasoning = src, bool(getattr(job.constraint, "reasoning", False))
        return _JobSpec(next(self._keys), job.index, list(job.prompt_ids), job.max_new_tokens, job.sampling,
                        list(job.eos_ids), job.logprobs, job.prompt_logprobs, grammar, reasoning, job.arrival,
                        tuple(job.images))

    def _cancel(self, job: Job) -> None:
        key = getattr(job, "key", None)
        if key is not None:
            self._send(("cancel", key, job.cancel_reason or "abort"))

    def _send(self, msg: tuple) -> None:
        """Send a command, in order with the earlier ones: written at once when nothing waits for the sender thread,
        the pipe is free and the message is small (no thread hop on a request's way to the engine), else queued for
        the sender thread (never blocks the event loop on a full pipe: a large prompt fills it while the engine is
        busy)."""
        data: bytes | None = None
        if _maybe_small(msg) and self._wlock.acquire(blocking=False):
            try:
                if not self._queued:
                    data = self._pickle(msg)
                    if data is None:
                        return
                    if len(data) <= DIRECT_SEND_BYTES:
                        self._write_one(msg, data)
                        return
            finally:
                self._wlock.release()
        with self._qlock:
            self._queued += 1
        self._outq.put((msg, data))

    def _pickle(self, msg: tuple) -> bytes | None:
        """The command's bytes; None when it cannot be pickled (its jobs failed: `_failed_send`)."""
        try:
            return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a message that cannot be sent: its jobs fail, the rest goes on
            self._failed_send(msg, e)
            return None

    def _write_one(self, msg: tuple, data: bytes) -> None:
        """Write one command's bytes (the caller holds _wlock)."""
        assert self._cmds is not None
        try:
            self._cmds.send_bytes(data)
        except (OSError, ValueError):  # a dead child: the reader fails its jobs
            pass
        except Exception as e:  # noqa: BLE001 - as `_pickle`
            self._failed_send(msg, e)

    def _failed_send(self, msg: tuple, err: BaseException) -> None:
        log.error("could not send %r to the engine process", msg[0], exc_info=err)
        if msg[0] == "submit":
            self._fail_jobs([spec.key for spec in msg[1]], err)

    def _write(self) -> None:
        """The sender thread: queued commands to the engine in order, until shutdown."""
        while True:
            msg, data = self._outq.get()
            data = data if data is not None else self._pickle(msg)
            with self._wlock:
                if data is not None:
                    self._write_one(msg, data)
                with self._qlock:
                    self._queued -= 1
            if msg[0] == "shutdown":
                return

    @property
    def num_active(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._jobs) - self._running)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not self._failed

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is in flight; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs, timeout)

    # -- reader thread --------------------------------------------------------------------------------

    def _read(self) -> None:
        assert self._out is not None
        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable message: the stream is lost, so is the engine
                log.critical("unreadable message from the engine process; stopping it", exc_info=True)
                self._kill()
                break
            if msg[0] == "lost":
                self._device_lost(msg[1])
                continue
            if msg[0] != "out":
                continue
            _, events, ops = msg
            lost = next((ev.error for _, ev in events if isinstance(ev.error, DeviceLost)), None)
            if lost is not None:  # /health says so before the first client hears of it
                self._device_lost(str(lost))
            for name, args in ops:
                with contextlib.suppress(Exception):
                    if name == "set_running":
                        self._running = args[0]
                    getattr(self.metrics, name)(*args)
            pairs = []
            with self._cv:
                for key, ev in events:
                    job = self._jobs.get(key)
                    if job is None:
                        continue
                    if ev.done:
                        job.done = True
                        del self._jobs[key]
                    pairs.append((job, ev))
                if not self._jobs:
                    self._cv.notify_all()
            self._outbox.send(pairs)
        if self._stopping:  # shutdown: what the engine did not finish itself ends as an abort
            self._fail_all("abort", None)
            return
        self._proc.join(1)
        code = self._proc.exitcode
        if code == DEVICE_LOST_EXIT and self._lost is None:  # it died before it could say why
            self._device_lost(f"the engine process exited (exit code {code}: device lost)")
        if self._lost is not None:
            log.critical("the engine's device is lost (%s); failing every request, then exiting", self._failure)
            self._fail_all("error", DeviceLost(self._lost_reason))
            exit_process(self._lost)
            return
        log.critical("the engine process exited (exit code %s); failing every request", code)
        self._fail_all("error", RuntimeError(f"the engine process exited (exit code {code})"))

    def _device_lost(self, reason: str) -> None:
        """The engine reported its device lost: /health and /ready say why, `submit` refuses; the jobs in flight now
        are those the exit waits for."""
        with self._cv:
            if self._lost is None:
                self._lost = list(self._jobs.values())
                self._lost_reason = reason
                self._failure = failure_text(DeviceLost(reason))
            self._failed = True

    def _fail_jobs(self, keys: list[int], err: BaseException) -> None:
        """Give these jobs (never sent) their error `done` event."""
        with self._cv:
            jobs = [self._jobs.pop(k) for k in keys if k in self._jobs]
            self._cv.notify_all()
        _end(jobs, "error", err)

    def _fail_all(self, reason: str, err: BaseException | None) -> None:
        with self._cv:
            if reason == "error":
                self._failed = True
                if self._failure is None:
                    self._failure = failure_text(err) if err is not None else "the engine stopped"
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._running = 0
            self._cv.notify_all()
        _end(jobs, reason, err)
        with contextlib.suppress(Exception):
            self.metrics.set_running(0)
            self.metrics.set_waiting(0)
            self.metrics.set_pool_usage(0, self.max_num_seqs)
