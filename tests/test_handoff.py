"""The worker -> event loop hand-off: one wake-up delivers every queued event in order, and a choice's events
that are ready together stream as one delta (the same tokens, text and finish as one event at a time)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from engine.spec import SpecSampling, SpecTelemetry
from engine.tokenizer import Tokenizer
from metrics.prometheus import ServingMetrics
from server.serving import ChoiceState, Generation
from server.worker import Job, JobEvent, _Outbox

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def _job(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[JobEvent], index: int = 0) -> Job:
    return Job(index, [1, 2], 8, SpecSampling(), (), None, loop, events)


def test_then_joins_token_events_and_keeps_finals_apart():
    a, b = JobEvent(0, [5, 6]), JobEvent(0, [7], done=True, finish_reason="length", telem=SpecTelemetry(rounds=2))
    j = a.then(b)
    assert j is not None and j.token_ids == [5, 6, 7] and j.done and j.finish_reason == "length"
    assert j.telem is b.telem and j.logprobs is None
    assert b.then(JobEvent(0, [8])) is None  # nothing follows a final event
    assert a.then(JobEvent(1, [8])) is None  # another choice
    assert a.then(JobEvent(0, [], done=True, finish_reason="abort")) is None
    assert a.then(JobEvent(0, [], done=True, finish_reason="error", error=RuntimeError("x"))) is None
    # the first event's prompt logprobs (sent with a job's first tokens) survive the join
    first = JobEvent(0, [5], ["lp5"], prompt_logprobs=[None, "p1"])
    j = first.then(JobEvent(0, [6], ["lp6"], done=True, finish_reason="stop"))
    assert (j.prompt_logprobs, j.logprobs, j.done, j.finish_reason) == ([None, "p1"], ["lp5", "lp6"], True, "stop")


def test_outbox_one_wakeup_for_many_sends_in_order():
    async def main() -> list[JobEvent]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[JobEvent] = asyncio.Queue()
        job, box = _job(loop, q), _Outbox()
        scheduled = []
        real = loop.call_soon_threadsafe

        def spy(cb, *args):  # type: ignore[no-untyped-def]
            scheduled.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
        for t in range(3):  # three steps before the loop runs: one delivery
            box.send([(job, JobEvent(0, [t]))])
        box.send([(job, JobEvent(0, [], done=True, finish_reason="stop"))])
        assert len(scheduled) == 1 and q.empty()
        await asyncio.sleep(0)
        got = [q.get_nowait() for _ in range(q.qsize())]
        box.send([(job, JobEvent(0, [9]))])  # after a delivery the next send wakes the loop again
        assert len(scheduled) == 2
        return got

    got = asyncio.run(main())
    assert [e.token_ids for e in got] == [[0], [1], [2], []] and got[-1].done


def test_ready_events_stream_as_one_delta_with_the_same_text():
    tok = Tokenizer.from_dir(DEMO)
    ids = tok.encode("Hello world, this is a streamed answer.")

    def run(batched: bool) -> list[tuple[str, list[int], str | None]]:
        async def main() -> list[tuple[str, list[int], str | None]]:
            loop = asyncio.get_running_loop()
            q: asyncio.Queue[JobEvent] = asyncio.Queue()
            gen = Generation([_job(loop, q)], [ChoiceState(0, tok, [1], ["never-there"])], q,
                             ServingMetrics("m", 3), 1)
            evs = [JobEvent(0, [t]) for t in ids] + [JobEvent(0, [], done=True, finish_reason="length")]
            out = []
            if batched:
                for ev in evs:
                    q.put_nowait(ev)
                out = [(d.text, d.token_ids, d.finish_reason) async for d in gen.deltas()]
            else:
                it = gen.deltas()
                for ev in evs:
                    q.put_nowait(ev)
                    try:
                        d = await it.__anext__()
                    except StopAsyncIteration:
                        break
                    out.append((d.text, d.token_ids, d.finish_reason))
            return out
        return asyncio.run(main())

    one_by_one, together = run(False), run(True)
    assert len(together) == 1 and len(one_by_one) > 1
    assert together[0][0] == "".join(d[0] for d in one_by_one) == tok.decode(ids)
    assert together[0][1] == ids and together[0][2] == one_by_one[-1][2] == "length"
