"""The batched round (engine/scheduler.py): every running session in one forward, sessions joining and leaving
between rounds, chunked prefill under a token budget, the state pool. Batched output == the same session alone
== plain greedy, token for token, for mixed batches (greedy, sampled and constrained rows), K = 1..8, fp32/fp64."""
from __future__ import annotations

import pytest
import torch

from engine.cache import PREFILL_GRID, PoolFull
from engine.loader import load_model
from engine.prefill import packs_rows
from engine.scheduler import PoolTooLarge, Scheduler
from engine.spec import SpecSampling, SpecSession, generate_spec
from tests.test_spec import ParityConstraint
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("b" + request.param), seed=41 if request.param == "dense" else 42,
                           moe=request.param == "moe", with_tokenizer=False)


@pytest.fixture(scope="module", params=["float32", pytest.param("float64", marks=pytest.mark.slow)])  # fp64: CI
def model(request, ckpt):
    return load_model(ckpt, dtype=request.param)


def _prompts(V: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 17, 70, 6, 41)]


def _run(sched: Scheduler, joins: dict[int, list[SpecSession]]) -> int:
    """Step until every session is done; `joins[step]` sessions are added at that step. Returns the steps run."""
    step = 0
    while True:
        for s in joins.pop(step, []):
            sched.add(s)
        if not joins and not sched.num_sessions:
            return step
        sched.step()
        step += 1
        assert step < 2000


def test_mixed_batch_equals_alone_and_plain_greedy(model):
    V = model.config.vocab_size
    ps = _prompts(V)
    banned = set(range(0, V, 7))
    sampled = SpecSampling(temperature=0.8, top_p=0.95, seed=11)
    plain = [generate_spec(model, ps[i], n, k=0)[0] for i, n in ((0, 40), (1, 25), (2, 33))]
    cons_ref = SpecSession(model, ps[3], 30, k=0, constraint=ParityConstraint(V, banned)).run()
    for K in range(1, 9):
        sampled_alone = SpecSession(model, ps[4], 20, k=K, capmax=8, sampling=sampled).run()
        # a budget of 24 tokens forces the 70-token prompt through several prefill chunks between rounds
        sched = Scheduler(model, max_num_seqs=5, max_model_len=160, k=K, max_num_batched_tokens=24)
        mk = lambda i, n, **kw: SpecSession(model, ps[i], n, k=K, capmax=8, pool=sched.pool, **kw)  # noqa: E731
        g0, g1 = mk(0, 40), mk(1, 25)
        g2 = mk(2, 33)  # joins mid-decode
        c = mk(3, 30, constraint=ParityConstraint(V, banned))
        s = mk(4, 20, sampling=sampled)
        _run(sched, {0: [g0, g1, c], 3: [s], 6: [g2]})
        assert [g0.emitted, g1.emitted, g2.emitted] == plain, f"K={K}"
        assert c.emitted == cons_ref, f"K={K} constrained"
        assert s.emitted == sampled_alone, f"K={K} sampled"
        assert all(x.finish_reason == "length" for x in (g0, g1, g2, c, s))
        assert g0.telem.rounds > 0 and g0.telem.drafted > 0
        assert sched.pool.num_free == 5 and not sched.running and not sched.joining


def test_p_min_cuts_each_row_as_alone_in_a_mixed_batch(model):
    """Rows with p_min 0 (the round then skips the top-probability test), 0.3 and 1.01 (every chained draft cut)
    in one batch: each drafts exactly what it drafts alone, and all emit plain greedy."""
    V = model.config.vocab_size
    ps = _prompts(V)
    p_mins = (0.0, 1.01, 0.3)
    alone = [SpecSession(model, ps[i], 30, k=4, p_min=p) for i, p in enumerate(p_mins)]
    for a in alone:
        a.run()
    sched = Scheduler(model, max_num_seqs=3, max_model_len=160, k=4, max_num_batched_tokens=128)
    rows = [SpecSession(model, ps[i], 30, k=4, p_min=p, pool=sched.pool) for i, p in enumerate(p_mins)]
    _run(sched, {0: rows})
    for i, (r, a) in enumerate(zip(rows, alone)):
        assert r.emitted == a.emitted == generate_spec(model, ps[i], 30, k=0)[0], f"row {i}"
        assert (r.telem.pos_drafted, r.len_hist) == (a.telem.pos_drafted, a.len_hist), f"row {i}"
    assert rows[1].telem.pos_drafted[1:] == [0] * (len(rows[1].telem.pos_drafted) - 1)  # only d0, ever
    assert rows[0].telem.pos_drafted[1] > 0


def test_pool_admission_and_slot_reuse(ckpt):
    model = load_model(ckpt)
    V = model.config.vocab_size
    ps = _prompts(V)
    sched = Scheduler(model, max_num_seqs=2, max_model_len=128, k=3, max_num_batched_tokens=512)
    a = SpecSession(model, ps[0], 30, k=3, pool=sched.pool)
    b = SpecSession(model, ps[1], 30, k=3, pool=sched.pool)
    assert not sched.has_room
    with pytest.raises(PoolFull):
        SpecSession(model, ps[2], 30, k=3, pool=sched.pool)
    sched.add(a)
    sched.add(b)
    sched.step()
    sched.step()
    sched.remove(a)  # cancelled mid-decode: the slot is free at once
    assert sched.has_room and sched.running == [b]
    c = SpecSession(model, ps[2], 30, k=3, pool=sched.pool)  # reuses a's slot, starting from an empty state
    assert c.slot == a.slot
    _run(sched, {0: [c]})
    assert c.emitted == generate_spec(model, ps[2], 30, k=0)[0]
    assert b.emitted == generate_spec(model, ps[1], 30, k=0)[0]


def test_prefill_runs_one_grid_block_per_step_next_to_a_running_stream(ckpt):
    """A long prompt joining a running stream under a small budget prefills one grid block per step (a block never
    splits, whatever the budget leaves), and the stream advances in every one of those steps."""
    model = load_model(ckpt)
    V = model.config.vocab_size
    ps = _prompts(V)
    sched = Scheduler(model, max_num_seqs=2, max_model_len=1024, k=2, max_num_batched_tokens=16)
    run = SpecSession(model, ps[0], 200, k=2, pool=sched.pool)
    sched.add(run)
    sched.step()  # prefill of the short prompt + first token
    g = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(0, V, (3 * PREFILL_GRID + 70,), generator=g).tolist()
    long = SpecSession(model, long_prompt, 5, k=2, pool=sched.pool)
    sched.add(long)
    ends = []
    while long.prefilling:
        before = len(run.emitted)
        sched.step()
        assert len(run.emitted) > before
        ends.append(long.cache.length)
    assert ends == [PREFILL_GRID, 2 * PREFILL_GRID, 3 * PREFILL_GRID, len(long_prompt)]
    _run(sched, {})
    assert long.emitted == generate_spec(model, long_prompt, 5, k=0)[0]


def _live_state(sess: SpecSession) -> list[torch.Tensor]:
    """The session's live trunk state: every layer's K/V rows [:length], GDN recurrent and conv state."""
    out = []
    for st in sess.pool.layers:
        if hasattr(st, "rec"):
            out += [st.rec[sess.slot, sess.cache.cur], st.conv[sess.slot, sess.cache.cur]]
        else:
            out += [st.k[sess.slot, :sess.cache.length], st.v[sess.slot, :sess.cache.length]]
    return out


def test_joining_prompts_prefill_in_one_forward(model):
    """Sessions that join together prefill in ONE trunk forward (rows right-padded to the longest chunk); the
    padding changes no row's state (its GDN tokens keep the state, its K/V land past the row), so each row's live
    state matches its prefill alone and greedy output equals plain greedy."""
    V = model.config.vocab_size
    ps = _prompts(V)
    which = (0, 1, 3, 4)  # 3, 17, 6 and 41 tokens
    sched = Scheduler(model, max_num_seqs=4, max_model_len=160, k=3, max_num_batched_tokens=512)
    rows = [SpecSession(model, ps[i], 12, k=3, pool=sched.pool) for i in which]
    shapes = []
    orig = model.forward_step
    model.forward_step = lambda ids, ctx, pool: shapes.append(tuple(ids.shape)) or orig(ids, ctx, pool)
    try:
        for r in rows:
            sched.add(r)
        sched.step()
    finally:
        del model.forward_step
    # one forward on the C kernels (every op row-wise); elsewhere (fp64, MoE routing) one forward per prompt
    assert shapes == ([(4, 41)] if packs_rows(model) else [(1, len(ps[i])) for i in which])
    tol = 1e-12 if model.config.dtype == torch.float64 else 2e-5
    for r, i in zip(rows, which):
        alone = SpecSession(model, ps[i], 12, k=3)
        alone.step()  # its prefill, alone, and the first token
        assert r.emitted == alone.emitted and r.cache.length == alone.cache.length == len(ps[i])
        for a, b in zip(_live_state(r), _live_state(alone)):
            assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), f"prompt {i}"
    _run(sched, {})
    assert [r.emitted for r in rows] == [generate_spec(model, ps[i], 12, k=0)[0] for i in which]


def test_padding_never_makes_a_prefill_forward_larger_than_the_token_budget(ckpt):
    """A 60-token chunk and short ones joining together: padding the short ones to 60 would put 4 x 60 tokens
    through one forward under a 64-token budget, so the long chunk runs alone and the short ones share a forward."""
    model = load_model(ckpt)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (60, 2, 1, 1)]
    sched = Scheduler(model, max_num_seqs=4, max_model_len=96, k=2, max_num_batched_tokens=64)
    rows = [SpecSession(model, p, 6, k=2, pool=sched.pool) for p in ps]
    shapes = []
    orig = model.forward_step
    model.forward_step = lambda ids, ctx, pool: shapes.append(tuple(ids.shape)) or orig(ids, ctx, pool)
    try:
        _run(sched, {0: rows})
    finally:
        del model.forward_step
    if packs_rows(model):  # the first step: the prompts' forwards (then rounds: verify forwards)
        assert shapes[:2] == [(1, 60), (3, 2)], shapes
    else:  # one row per forward (MoE routing on a CPU is not row-wise)
        assert shapes[:4] == [(1, 60), (1, 2), (1, 1), (1, 1)], shapes
    assert [r.emitted for r in rows] == [generate_spec(model, p, 6, k=0)[0] for p in ps]


def test_a_row_failing_in_a_batched_prefill_fails_alone(ckpt):
    model = load_model(ckpt)
    ps = _prompts(model.config.vocab_size)

    class Failing(SpecSession):
        def prefilled(self, *args, **kwargs):
            raise RuntimeError("injected")

    class TooLong(SpecSession):
        def next_chunk(self):
            raise ValueError("does not fit")

    sched = Scheduler(model, max_num_seqs=4, max_model_len=128, k=2, max_num_batched_tokens=512)
    good = [SpecSession(model, ps[i], 10, k=2, pool=sched.pool) for i in (0, 3)]
    bad = Failing(model, ps[1], 10, k=2, pool=sched.pool)
    long = TooLong(model, ps[4], 10, k=2, pool=sched.pool)
    for s in (good[0], bad, long, good[1]):
        sched.add(s)
    res = sched.step()
    assert res.finished == [bad, long] and sched.pool.num_free == 2
    assert isinstance(bad.error, RuntimeError) and isinstance(long.error, ValueError)
    _run(sched, {})
    assert [s.emitted for s in good] == [generate_spec(model, ps[i], 10, k=0)[0] for i in (0, 3)]


def test_a_batched_prefill_whose_padding_would_pass_a_slot_runs_row_by_row(ckpt):
    """A row near its slot's end (one grid block of 272 positions used, 6 prompt tokens left) meets a 30-token
    prompt in one wave: padding it to 30 would write past the slot, so that wave prefills row by row instead."""
    model = load_model(ckpt)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    long, short = (torch.randint(0, V, (n,), generator=g).tolist() for n in (PREFILL_GRID + 6, 30))
    sched = Scheduler(model, max_num_seqs=2, max_model_len=PREFILL_GRID + 10, k=3, max_num_batched_tokens=260)
    assert sched.pool.capacity == 272
    a = SpecSession(model, long, 3, k=3, capmax=3, pool=sched.pool)
    sched.add(a)
    sched.step()
    assert a.cache.length == PREFILL_GRID
    b = SpecSession(model, short, 3, k=3, capmax=3, pool=sched.pool)
    shapes = []
    orig = model.forward_step
    model.forward_step = lambda ids, ctx, pool: shapes.append(tuple(ids.shape)) or orig(ids, ctx, pool)
    try:
        sched.add(b)
        sched.step()
    finally:
        del model.forward_step
    assert shapes == [(1, 6), (1, 30)]
    _run(sched, {})
    assert a.error is None and b.error is None
    assert [a.emitted, b.emitted] == [generate_spec(model, p, 3, k=0)[0] for p in (long, short)]


def test_a_long_mtp_backlog_drafts_beside_a_row_near_its_slots_end(ckpt):
    """Row a runs plain (k = 0) for 40 rounds, so 40 MTP rows queue up; then it drafts beside row b, whose context is
    within 40 positions of its slot's end. Padded to a's backlog, b's head rows would be written past its slot (the
    round failed both rows); the backlog is written first, and both answer as plain greedy does."""
    model = load_model(ckpt)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(11)
    pa, pb = (torch.randint(0, V, (n,), generator=g).tolist() for n in (10, 80))
    sched = Scheduler(model, max_num_seqs=2, max_model_len=128, k=3, max_num_batched_tokens=256)
    assert sched.pool.capacity == 144
    a = SpecSession(model, pa, 100, k=3, pool=sched.pool)
    b = SpecSession(model, pb, 45, k=3, pool=sched.pool)
    sched.add(a)
    sched.add(b)
    rounds, most = 0, 0
    while sched.num_sessions:
        a.k_next, b.k_next = (0 if rounds < 40 else 3), 3
        most = max(most, len(a._mtp_tokens))  # noqa: SLF001 - the backlog this test builds
        sched.step()
        rounds += 1
    assert most >= 40 and b.cache.length + most > sched.pool.capacity  # the padding would have passed b's slot
    assert a.error is None and b.error is None
    assert [a.emitted, b.emitted] == [generate_spec(model, p, n, k=0)[0] for p, n in ((pa, 100), (pb, 45))]


def test_too_large_pool_is_refused_with_the_setting_to_lower(ckpt):
    model = load_model(ckpt)
    with pytest.raises(PoolTooLarge, match="lower --max-num-seqs or --max-model-len"):
        Scheduler(model, max_num_seqs=10**7, max_model_len=4096, k=3, max_num_batched_tokens=512)


@pytest.mark.slow
def test_nextn_serve_refuses_a_pool_that_does_not_fit_in_one_line():
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.server_fixtures import free_port

    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    exe = Path(sys.executable).with_name("nextn")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTN_")}
    r = subprocess.run([str(exe), "serve", str(demo), "--port", str(free_port()), "--max-num-seqs", "100000000"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("nextn serve: error: the state pool") and "lower --max-num-seqs or --max-model-len" in last
