"""Admission: requests that arrive together are submitted together.

Eight clients that send at once (an SDK's `batch`, a load test, an agent's fan-out) reach the worker one by one,
each after its own parse and preparation (two thread hops). Submitted as they come, the first starts alone: its
prompt is prefilled in a forward of its own and its rounds run a forward ahead of the others' for the rest of the
run, and the seven others are prefilled a step later. Held until the last of them is prepared, they join the
worker in one submit (one message to the engine process), are prefilled in one forward and decode in lockstep.

The rule, on the event loop: a request is *preparing* from the moment its body has been read until it submits its
jobs or fails (`preparing`). A request that is ready to submit while others are preparing is held, and every held
request is submitted, in arrival order, when the last preparing one is done or `wait_s` after the first was held,
whichever comes first. A request alone (nobody else preparing) is submitted at once: a lone client never waits.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Protocol

from server.worker import Job

#: The longest a prepared request waits for others that arrived with it (seconds). Preparing a request takes about
#: a millisecond on the CPU box (parse, checks, tokenization: bench/RESULTS.md), so eight that arrive at once are all
#: prepared well within it; a request that takes longer (a long prompt to tokenize, a grammar to compile) lets the
#: others go when it runs out.
ARRIVAL_WAIT_S = 0.005


class Submits(Protocol):
    """`server.worker.Worker` or `server.engine_proc.EngineProcess`."""

    def submit_many(self, requests: Sequence[Sequence[Job]]) -> list[Exception | None]: ...


class _Ticket:
    """One request's preparation (open until the request submits or fails)."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = True


#: The preparing request of the current task (and of the tasks it starts), if its route opened one.
_current: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("nextn_admission", default=None)


class Admission:
    """Submits jobs to `worker`, holding requests that arrive together until all of them are prepared (module
    docstring). Event-loop only; one per server, shared by every endpoint."""

    def __init__(self, worker: Submits, wait_s: float = ARRIVAL_WAIT_S) -> None:
        self.worker, self.wait_s = worker, wait_s
        self._preparing = 0
        self._held: list[tuple[Sequence[Job], asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def preparing_count(self) -> int:
        return self._preparing

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Around a request from its read body to its submit (or its error): while it is open, requests that are
        ready wait for this one (at most `wait_s`). Leaving it without submitting (an error) releases them."""
        ticket = _Ticket()
        self._preparing += 1
        token = _current.set(ticket)
        try:
            yield
        finally:
            _current.reset(token)
            self._close(ticket)
            if not self._preparing:  # it was the last being prepared (and failed): the held go now
                self._flush()

    def _close(self, ticket: _Ticket) -> None:
        if ticket.open:
            ticket.open = False
            self._preparing -= 1

    async def submit(self, jobs: Sequence[Job]) -> None:
        """Queue `jobs` (one request's, all or none) on the worker, now or with the requests that arrived with it.
        Raises what the worker's `submit` raises (`QueueFull`, `Unavailable`). Cancelled while held: nothing was
        submitted; cancelled after its submit: its jobs are cancelled."""
        ticket = _current.get()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._held.append((jobs, done))
        if ticket is not None:
            self._close(ticket)
        if not self._preparing:  # nobody else is being prepared: this request and any held go now, together
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.wait_s, self._flush)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            if done.done() and not done.cancelled() and done.exception() is None:
                for job in jobs:  # submitted, and nobody will read them
                    job.cancel("abort")
            else:
                done.cancel()  # still held: `_flush` skips it
            raise

    def _flush(self) -> None:
        """Submit every held request, in the order they were held, in one `submit_many` (the worker admits them in
        one step)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held = [(jobs, done) for jobs, done in self._held if not done.done()]  # (done: cancelled while held)
        self._held = []
        if not held:
            return
        for (_, done), err in zip(held, self.worker.submit_many([jobs for jobs, _ in held]), strict=True):
            if err is None:
                done.set_result(None)
            else:
                done.set_exception(err)
