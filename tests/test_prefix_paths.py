"""The prefix cache's promise on every path, and its failures contained to one request (engine/scheduler.py,
engine/session.py).

  * hit == miss bit for bit, drafts included: seeded sampling at K = 3 over 64 tokens gives the same tokens, logit
    rows and acceptance counters with the cache off and on a hit, on the torch path (the C kernels off) and on the C
    path. The MTP head's prompt rows are written block by block in forwards that cover exactly a cached block's
    rows (bG-1 .. B-2), so a hit at B runs the forward a miss runs (row B-1 with the next block's rows);
  * an exception inside one of the scheduler's prefix-cache paths (`_resume`, `_write_prefilled`, `_capture_decoded`,
    `_finish_pending`, and the tails' `_capture_tail`, `_write_tails`; injected by monkeypatching the cache's methods
    for one session's slot) fails that request only: the others in the batch finish with the tokens of a run without the
    fault, every pool slot and reserved block comes back, and a later request with the same prefix still resumes from
    the cache with a cold run's bits.
"""
from __future__ import annotations

import pytest
import torch

from engine.cache import PREFILL_GRID as G
from engine.cache import TAIL_MARGIN
from engine.cache import PrefixCache
from engine.loader import load_model
from engine.model.ops import cpu
from engine.sampling import SpecSampling
from engine.scheduler import Scheduler
from engine.spec import SpecSession
from tests.test_prefix import MB, Rows, _prompt, _run, _same
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("paths"), seed=7, with_tokenizer=False,
                                      max_position_embeddings=4096))


def _sched(model, cache_mb: int, seqs: int = 4, budget: int = 512) -> Scheduler:
    return Scheduler(model, max_num_seqs=seqs, max_model_len=1200, k=3, max_num_batched_tokens=budget,
                     prefix_cache_bytes=cache_mb * MB)


@pytest.mark.parametrize("path", ["torch", "c"])
def test_seeded_sampling_hit_equals_miss(model, path):
    """A sampled request (temperature 0.9, seed 5, K = 3, 64 tokens) resumed from a 2-block hit (and the C path's
    tail) emits the tokens, the logit rows and the acceptance counters (so the drafts) of the same request with the
    cache off."""
    prev = cpu.set_enabled(path == "c")
    try:
        prompt = _prompt(model.config.vocab_size, 2 * G + 45, 3)
        samp = SpecSampling(temperature=0.9, seed=5)
        off = _sched(model, 0)
        miss = Rows(model, prompt, 64, k=3, sampling=samp, pool=off.pool)
        _run(off, {0: [miss]})
        on = _sched(model, 64)
        _run(on, {0: [SpecSession(model, prompt, 2, k=3, sampling=SpecSampling(temperature=0.9, seed=1),
                                  pool=on.pool)]})
        hit = Rows(model, prompt, 64, k=3, sampling=samp, pool=on.pool)
        _run(on, {0: [hit]})
        # the C path resumes at the prompt's tail (a forward that stops anywhere has the bits of one that runs on)
        assert hit.cached_tokens == (2 * G if path == "torch" else len(prompt) - TAIL_MARGIN)
        assert miss.cached_tokens == 0
        assert len(miss.emitted) == 64 and miss.telem.drafted > 0
        assert hit.emitted == miss.emitted, f"{path} path: sampled tokens differ between a hit and a miss"
        _same(hit.rows, miss.rows, f"{path} path, hit vs miss")
        assert hit.telem == miss.telem, f"{path} path: the drafts differ between a hit and a miss"
    finally:
        cpu.set_enabled(prev)


@pytest.mark.parametrize("path", ["torch", "c"])
def test_a_hit_runs_the_head_forwards_of_a_miss(model, path, monkeypatch):
    """The MTP head's prefill forwards (positions, rows) from the resume point on are the same on a hit as on a
    miss: the forwards whose shapes the torch path's rounding follows."""
    prev = cpu.set_enabled(path == "c")
    calls: list[tuple[int, int]] = []
    real = model.mtp_forward

    def spy(ids, hidden, ctx, kv=None):
        if not ctx.record:  # prefill rows (the round's drafts record)
            calls.append((ctx.pos0[0], ids.shape[1]))
        return real(ids, hidden, ctx, kv)

    monkeypatch.setattr(model, "mtp_forward", spy)
    try:
        prompt = _prompt(model.config.vocab_size, 3 * G + 45, 4)
        sched = _sched(model, 64)
        miss = SpecSession(model, prompt, 2, k=3, pool=sched.pool)
        _run(sched, {0: [miss]})
        want = [c for c in calls if c[0] >= 2 * G - 1]
        assert want[0] == (2 * G - 1, G), "a prompt block's head forward covers the cached block's rows"
        sched = _sched(model, 64)  # a cache holding the first two blocks only
        _run(sched, {0: [SpecSession(model, prompt[:2 * G + 1], 2, k=3, pool=sched.pool)]})
        calls.clear()
        hit = SpecSession(model, prompt, 2, k=3, pool=sched.pool)
        _run(sched, {0: [hit]})
        assert hit.cached_tokens == 2 * G
        assert calls == want
    finally:
        cpu.set_enabled(prev)


class Injected(RuntimeError):
    """The fault a test injects into one session's prefix-cache path."""


#: path -> (the PrefixCache method that raises for the target session's slot, prompt length, tokens to generate)
FAULTS = {
    "_resume": ("restore", 2 * G + 10, 12),
    "_write_prefilled": ("insert", 2 * G + 10, 12),
    "_capture_decoded": ("capture_state", G - 20, 40),
    "_finish_pending": ("insert", G - 20, 40),
    "_capture_tail": ("capture_state", 2 * G + 100, 4),  # the prompt's tail, in block 2
    "_write_tails": ("insert_tail", 2 * G + 100, 4),
}


def _inject(monkeypatch, name: str, path: str, slot: int) -> None:
    """PrefixCache.name raises `Injected` when called for pool slot `slot` (insert: from `path` only)."""
    real = getattr(PrefixCache, name)

    def faulty(self, *a, **kw):
        at = a[1 if name in ("restore", "capture_state") else 4 if name == "insert_tail" else 3]
        bid = kw.get("bid")
        if at == slot and (name != "insert" or (bid is None) == (path == "_write_prefilled")):
            raise Injected(f"{name} for slot {slot}")
        return real(self, *a, **kw)

    monkeypatch.setattr(PrefixCache, name, faulty)


def _ledger(monkeypatch) -> set[int]:
    """The reserved block ids not yet released nor inserted (tracks PrefixCache.reserve / release / insert)."""
    held: set[int] = set()
    reserve, release, insert, insert_tail = PrefixCache.reserve, PrefixCache.release, PrefixCache.insert, \
        PrefixCache.insert_tail

    def rsv(self):
        bid = reserve(self)
        if bid is not None:
            held.add(bid)
        return bid

    def rel(self, bid):
        held.discard(bid)
        return release(self, bid)

    def ins(self, *a, bid=None, **kw):
        ok = insert(self, *a, bid=bid, **kw)
        if ok and bid is not None:
            held.discard(bid)
        return ok

    def ins_tail(self, *a, **kw):
        ok = insert_tail(self, *a, **kw)
        if ok:
            held.discard(a[6])
        return ok

    monkeypatch.setattr(PrefixCache, "insert_tail", ins_tail)
    monkeypatch.setattr(PrefixCache, "reserve", rsv)
    monkeypatch.setattr(PrefixCache, "release", rel)
    monkeypatch.setattr(PrefixCache, "insert", ins)
    return held


def _batch(model, path: str, monkeypatch=None):
    """Three greedy K = 3 sessions sharing their first grid block, joining together on a cache that holds that block;
    with monkeypatch, the middle one's `path` raises. Returns (scheduler, sessions, the reserved ids ledger)."""
    name, n, n_new = FAULTS[path]
    V = model.config.vocab_size
    shared = _prompt(V, G, 20)
    prompts = [(shared + _prompt(V, n, 21 + i))[:n] if n > G else _prompt(V, n, 21 + i) for i in range(3)]
    sched = _sched(model, 64)
    _run(sched, {0: [SpecSession(model, shared + _prompt(V, 5, 29), 2, k=3, pool=sched.pool)]})
    held = _ledger(monkeypatch) if monkeypatch is not None else set()
    ss = [Rows(model, p, n_new, k=3, pool=sched.pool) for p in prompts]
    if monkeypatch is not None:
        _inject(monkeypatch, name, path, ss[1].slot)
    _run(sched, {0: ss})
    return sched, ss, held


@pytest.mark.parametrize("path", list(FAULTS))
def test_a_raise_in_a_prefix_cache_path_fails_one_request(model, path, monkeypatch):
    _, ref, _ = _batch(model, path)
    assert all(s.error is None for s in ref)
    sched, ss, held = _batch(model, path, monkeypatch)
    assert isinstance(ss[1].error, Injected) and ss[1].finish_reason == "error", f"{path}: the fault did not fire"
    for s, r in zip((ss[0], ss[2]), (ref[0], ref[2])):
        assert s.error is None and s.emitted == r.emitted, f"{path}: another request's output changed"
        _same(s.rows, r.rows, f"{path}: another request")
    assert sched.num_sessions == 0 and sched.pool.num_free == sched.pool.slots, "a slot was not freed"
    assert not held, f"{path}: reserved blocks {held} were never released"
    monkeypatch.undo()
    # the cache still serves exact hits: the failed request's prompt again, and (decoded blocks) a next turn
    a = ss[0]
    later = [Rows(model, ss[1].prompt_ids, 6, k=3, pool=sched.pool),
             Rows(model, a.prompt_ids + a.emitted + _prompt(model.config.vocab_size, 7, 30), 6, k=3, pool=sched.pool)]
    _run(sched, {0: later[:1]})
    _run(sched, {0: later[1:]})
    # whole blocks the others left (ss[1]'s own tail too, where its fault came after writing it)
    n1 = len(ss[1].prompt_ids)
    assert later[0].cached_tokens in {b * G for b in range(n1 // G + 1)} | {n1 - TAIL_MARGIN}
    n0 = len(a.prompt_ids) + len(a.emitted) - 1  # a's sequence in the cache: its last block, or the answer's tail
    assert later[1].cached_tokens in (n0 // G * G, n0)
    for s in later:
        assert s.error is None
        _same(s.rows, _alone_rows(model, s.prompt_ids), f"{path}: a later hit")


def _alone_rows(model, prompt):
    s = Rows(model, prompt, 6, k=3)
    s.run()
    return s.rows
