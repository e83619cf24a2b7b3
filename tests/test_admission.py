"""Admission (server/admission.py): requests that arrive together reach the worker together.

What must hold: a request alone is submitted at once (no wait, no extra turn of the event loop); a request that is
ready while others are being prepared is held until the last of them submits, then all go in ONE `submit_many`, in
order; a request that fails while being prepared releases the held ones at once; nothing is held longer than
`wait_s`; a refusal (queue full) answers its own request only; a request cancelled while held is never submitted,
one cancelled after its submit has its jobs cancelled. Against a real server (in-process worker and engine process):
requests that arrive together are one `submit_many` and one engine message, and their answers are right.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import server.app as app_module
from server.admission import Admission
from server.engine_proc import EngineProcess
from server.worker import QueueFull
from tests.server_fixtures import ServerThread


class _Job:
    def __init__(self, name: str) -> None:
        self.name, self.cancel_reason = name, None

    def cancel(self, reason: str) -> None:
        self.cancel_reason = reason

    def __repr__(self) -> str:
        return self.name


class _Worker:
    """Records each `submit_many` call's requests; refuses the requests whose first job is in `refuse`."""

    def __init__(self, refuse: Sequence[_Job] = ()) -> None:
        self.calls: list[list[list[_Job]]] = []
        self.refuse = list(refuse)

    def submit_many(self, requests: Sequence[Sequence[_Job]]) -> list[Exception | None]:
        self.calls.append([list(r) for r in requests])
        return [QueueFull("full") if r[0] in self.refuse else None for r in requests]


async def _request(adm: Admission, job: _Job, ready: asyncio.Event, fail: bool = False) -> None:
    """A request: prepared until `ready` is set, then it submits (or fails while being prepared)."""
    with adm.preparing():
        await ready.wait()
        if fail:
            raise ValueError("bad request")
        await adm.submit([job])


def test_a_request_alone_is_submitted_at_once():
    async def main() -> None:
        w = _Worker()
        adm = Admission(w, wait_s=30)
        a = _Job("a")
        with adm.preparing():
            coro = adm.submit([a])
            with pytest.raises(StopIteration):  # done on its first step: it never yields to the loop
                coro.send(None)
        assert w.calls == [[[a]]]
        b = _Job("b")
        await adm.submit([b])  # a caller outside any route (no preparing request): at once too
        assert w.calls[-1] == [[b]] and adm.preparing_count == 0

    asyncio.run(main())


def test_requests_prepared_together_are_one_submit_in_order():
    async def main() -> None:
        w = _Worker()
        adm = Admission(w, wait_s=30)
        jobs = [_Job(n) for n in "abc"]
        ready = [asyncio.Event() for _ in jobs]
        tasks = [asyncio.create_task(_request(adm, j, r)) for j, r in zip(jobs, ready)]
        await asyncio.sleep(0)
        assert adm.preparing_count == 3
        ready[1].set()
        ready[0].set()
        await asyncio.sleep(0.05)
        assert w.calls == [] and not any(t.done() for t in tasks)  # b and a are held: c is being prepared
        ready[2].set()
        await asyncio.gather(*tasks)
        assert w.calls == [[[jobs[1]], [jobs[0]], [jobs[2]]]]  # one call, in the order they were ready

    asyncio.run(main())


def test_a_request_that_fails_while_prepared_releases_the_held_at_once():
    async def main() -> None:
        w = _Worker()
        adm = Admission(w, wait_s=30)
        a, b = _Job("a"), _Job("b")
        ra, rb = asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(_request(adm, a, ra))
        tb = asyncio.create_task(_request(adm, b, rb, fail=True))
        await asyncio.sleep(0)
        ra.set()
        await asyncio.sleep(0.02)
        assert w.calls == []
        rb.set()
        await ta
        with pytest.raises(ValueError):
            await tb
        assert w.calls == [[[a]]] and adm.preparing_count == 0

    asyncio.run(main())


def test_nothing_is_held_longer_than_wait_s():
    async def main() -> None:
        w = _Worker()
        adm = Admission(w, wait_s=0.05)
        a, b = _Job("a"), _Job("b")
        ra, never = asyncio.Event(), asyncio.Event()
        tb = asyncio.create_task(_request(adm, b, never))  # stuck in preparation (a slow grammar, say)
        ta = asyncio.create_task(_request(adm, a, ra))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        ra.set()
        await ta
        held = time.monotonic() - t0
        assert w.calls == [[[a]]] and 0.04 <= held < 5
        tb.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tb
        assert adm.preparing_count == 0 and w.calls == [[[a]]]

    asyncio.run(main())


def test_a_refusal_answers_its_own_request_only():
    async def main() -> None:
        a, b = _Job("a"), _Job("b")
        w = _Worker(refuse=[a])
        adm = Admission(w, wait_s=30)
        ra, rb = asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(_request(adm, a, ra))
        tb = asyncio.create_task(_request(adm, b, rb))
        await asyncio.sleep(0)
        ra.set()
        await asyncio.sleep(0.01)
        rb.set()
        await tb
        with pytest.raises(QueueFull):
            await ta
        assert w.calls == [[[a], [b]]]

    asyncio.run(main())


def test_cancelled_while_held_is_never_submitted_and_after_its_submit_is_cancelled():
    async def main() -> None:
        w = _Worker()
        adm = Admission(w, wait_s=30)
        a, b, c = _Job("a"), _Job("b"), _Job("c")
        ra, rb, rc = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(_request(adm, j, r)) for j, r in ((a, ra), (b, rb), (c, rc))]
        await asyncio.sleep(0)
        ra.set()
        await asyncio.sleep(0.01)
        tasks[0].cancel()  # the client left while a was held
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        rb.set()
        await asyncio.sleep(0.01)
        assert w.calls == []  # b is held for c
        adm._flush()  # b is submitted...
        tasks[1].cancel()  # ...and its client leaves before b's request resumes
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert w.calls == [[[b]]] and b.cancel_reason == "abort" and a.cancel_reason is None
        rc.set()
        await tasks[2]
        assert w.calls[-1] == [[c]] and c.cancel_reason is None

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ a real server


def _gathered(srv: ServerThread, monkeypatch: pytest.MonkeyPatch, n: int) -> list[dict]:
    """n completions sent at once, each parse held at a barrier until all n are being prepared."""
    barrier = threading.Barrier(n)
    parse = app_module.parse_body

    def parse_together(model, body):
        req = parse(model, body)
        barrier.wait(30)
        return req

    monkeypatch.setattr(app_module, "parse_body", parse_together)
    srv.app.state.serving_completion.admission.wait_s = 60  # a slow CI box never splits them

    def post(i: int) -> dict:
        r = httpx.post(srv.base_url + "/completions", timeout=120, json={
            "model": srv.model, "prompt": [5 + i, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(post, range(n)))


@pytest.mark.parametrize("engine_process", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["in-process", "engine-process"])
def test_requests_that_arrive_together_reach_the_engine_together(monkeypatch, engine_process):
    n = 4  # under the event loop's default thread pool on a 2-core box (6 threads): every parse reaches the barrier
    # fixed K: with the K controller a row's drafts (in its usage) follow the batch it ran in
    with ServerThread(engine_process=engine_process, spec_adaptive=False) as srv:
        worker = srv.worker
        assert isinstance(worker, EngineProcess) == engine_process
        groups: list[int] = []
        messages: list[int] = []
        submit_many = worker.submit_many

        def recording(requests):
            groups.append(len(requests))
            return submit_many(requests)

        monkeypatch.setattr(worker, "submit_many", recording)
        if engine_process:
            send = worker._send

            def sending(msg):
                if msg[0] == "submit":
                    messages.append(len(msg[1]))
                send(msg)

            monkeypatch.setattr(worker, "_send", sending)
        together = _gathered(srv, monkeypatch, n)
        assert groups == [n] and messages == ([n] if engine_process else [])
        monkeypatch.undo()  # the barrier and the recorders
        alone = [httpx.post(srv.base_url + "/completions", timeout=120, json={
            "model": srv.model, "prompt": [5 + i, 6, 7], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}).json() for i in range(n)]
    assert [r["choices"][0]["text"] for r in together] == [r["choices"][0]["text"] for r in alone]
    assert [r["usage"] for r in together] == [r["usage"] for r in alone]


def test_engine_commands_keep_their_order_small_ones_written_without_the_sender_thread():
    """`EngineProcess._send`: a small command with nothing queued is written at once (no thread hop on a request's way
    to the engine); a large one goes to the sender thread, and every command after it waits behind it, so the engine
    reads them in the order they were sent (a cancel never overtakes its submit)."""
    import multiprocessing

    import types

    from server.engine_proc import DIRECT_SEND_BYTES, _maybe_small

    ep = EngineProcess(None, None, max_queue=1, max_num_seqs=1)  # type: ignore[arg-type] - never started
    r, w = multiprocessing.Pipe(duplex=False)
    ep._cmds = w
    ep._send(("cancel", 1, "abort"))
    assert r.poll(5) and r.recv() == ("cancel", 1, "abort")  # no sender thread runs yet
    big = ("cancel", 9, "x" * 2 * DIRECT_SEND_BYTES)  # pickled, then too large to write at once
    ep._send(big)
    ep._send(("cancel", 2, "abort"))  # small, but behind the queued one
    assert not r.poll(0.2)
    threading.Thread(target=ep._write, daemon=True).start()
    assert r.poll(5) and r.recv() == big
    assert r.poll(5) and r.recv() == ("cancel", 2, "abort")
    deadline = time.monotonic() + 5
    while ep._queued and time.monotonic() < deadline:
        time.sleep(0.01)
    ep._send(("cancel", 3, "abort"))
    assert r.poll(5) and r.recv() == ("cancel", 3, "abort")
    ep._send(("shutdown",))  # always the sender thread's (it ends there)
    assert r.poll(5) and r.recv() == ("shutdown",)
    # a long prompt or a picture is left to the sender thread unpickled
    spec = types.SimpleNamespace
    assert _maybe_small(("submit", [spec(images=(), prompt_ids=[7] * 1000)] * 3))
    assert not _maybe_small(("submit", [spec(images=(), prompt_ids=[7] * 4000)]))
    assert not _maybe_small(("submit", [spec(images=(object(),), prompt_ids=[7])]))
