"""The speculation length controller (engine/kpolicy.py) and its wiring in the scheduler.

What each test proves: greedy output equals plain greedy bit for bit under adversarial per-row, per-round K
schedules (K changing every round, rows at 0 beside rows at K_max, a grammar row; through the graph runner's
bodies too, where the MTP backlog of plain rounds is written in chunks of captured widths) and with the
controller itself on; the controller's decisions are a function of the cost table and the history (zero
acceptance -> k = 0 but on probe rounds, which back off; high acceptance -> the deepest k the costs pay for; a
mixed batch -> a k per row); the K cap by batch size; the profiled cost table.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

import engine.scheduler as scheduler_module
from engine.graphs import GraphRunner
from engine.kpolicy import PROBE_EVERY, PROBE_MAX, KPolicy, KPolicySpec, profile_costs
from engine.loader import load_model
from engine.scheduler import Scheduler
from engine.spec import SpecSampling, SpecSession, generate_spec
from tests.test_spec import ParityConstraint
from tests.tiny import make_checkpoint

K = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("kp"), seed=41, with_tokenizer=False), dtype="float32")


def _prompts(V: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 19, 33, 8)]


def _drive(sched: Scheduler, sessions: list[SpecSession], choose=None) -> None:
    """Add every session, then step until all finish; `choose(step, i)` sets row i's k before each step."""
    for s in sessions:
        sched.add(s)
    step = 0
    while sched.num_sessions:
        if choose is not None:
            for i, s in enumerate(sessions):
                s.k_next = choose(step, i)
        sched.step()
        step += 1
        assert step < 1000


def _draft_shapes(sched: Scheduler, dim: int) -> list[int]:
    """From now on, each draft forward's tokens.shape[dim] is appended to the list returned."""
    got: list[int] = []
    draft = sched.runner.draft

    def spy(model, pool, tokens, *a, **kw):
        got.append(tokens.shape[dim])
        return draft(model, pool, tokens, *a, **kw)

    sched.runner.draft = spy
    return got


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-bodies"])
def test_adversarial_k_schedules_equal_plain_greedy(model, graphs):
    """Every row's k is redrawn every round (0..K_max, rows at 0 beside rows at K_max, long runs at 0 so the MTP
    backlog outgrows the graphs' width), a grammar row among them: each row emits plain greedy, bit for bit."""
    V = model.config.vocab_size
    ps = _prompts(V)
    banned = set(range(0, V, 7))
    plain = [generate_spec(model, p, 40, k=0)[0] for p in ps[:3]]
    cons_ref = SpecSession(model, ps[3], 40, k=0, constraint=ParityConstraint(V, banned)).run()
    rng = random.Random(7)
    sched = Scheduler(model, max_num_seqs=4, max_model_len=128, k=K, max_num_batched_tokens=64, step_graphs=graphs)
    assert isinstance(sched.runner, GraphRunner) == graphs
    mk = lambda i, **kw: SpecSession(model, ps[i], 40, k=K, pool=sched.pool, **kw)  # noqa: E731
    rows = [mk(0), mk(1), mk(2), mk(3, constraint=ParityConstraint(V, banned))]
    widths = _draft_shapes(sched, 1)
    # row 0: random every round; row 1: K_max; row 2: 0 for 12 rounds then K_max (backlog 12 > window 5);
    # row 3 (grammar): alternates 0 and K_max
    _drive(sched, rows, lambda step, i: (rng.randint(0, K), K, 0 if step < 12 else K, K * (step % 2))[i])
    assert [r.emitted for r in rows[:3]] == plain
    assert rows[3].emitted == cons_ref
    assert all(r.telem.drafted > 0 for r in rows)
    assert sched.pool.num_free == 4
    if graphs:  # the 12-row backlog went through forwards no wider than the captured window
        assert widths and max(widths) <= sched.pool.window and widths.count(sched.pool.window) >= 2


def test_rows_past_their_k_ride_the_draft_forwards(model):
    """A greedy row past its k stays in the round's chained draft forwards with its drafts cut (no gather of the
    rows still drafting); a sampled row and a grammar row past theirs leave them (no draw, no hook sees the ride).
    Every row emits what it emits alone at its k, bit for bit, and drafts no position past its k."""
    V = model.config.vocab_size
    ps = _prompts(V)
    banned = set(range(0, V, 7))
    seeded = SpecSampling(temperature=0.9, seed=4)
    plain = [generate_spec(model, p, 30, k=0)[0] for p in ps[:2]]
    alone = SpecSession(model, ps[2], 30, k=1, sampling=seeded).run()
    cons_ref = SpecSession(model, ps[3], 30, k=0, constraint=ParityConstraint(V, banned)).run()
    sched = Scheduler(model, max_num_seqs=4, max_model_len=128, k=K, max_num_batched_tokens=128)
    mk = lambda i, **kw: SpecSession(model, ps[i], 30, k=K, pool=sched.pool, **kw)  # noqa: E731
    rows = [mk(0), mk(1), mk(2, sampling=seeded), mk(3, constraint=ParityConstraint(V, banned))]
    widths = _draft_shapes(sched, 0)  # rows of each draft forward
    _drive(sched, rows, lambda step, i: (1, K, 1, 2)[i])  # greedy 1, greedy K, sampled 1, grammar 2
    assert [r.emitted for r in rows[:2]] == plain and rows[2].emitted == alone and rows[3].emitted == cons_ref
    # depths 0..3 of a full round: all 4; the sampled row left; the grammar row left; the greedy k=1 row rode on
    assert any(widths[i:i + 4] == [4, 3, 2, 2] for i in range(len(widths)))
    assert rows[0].telem.pos_drafted[1:] == [0] * (len(rows[0].telem.pos_drafted) - 1) and rows[0].telem.drafted
    assert rows[3].telem.pos_drafted[2] == 0 and rows[1].telem.pos_drafted[K - 1] > 0


def test_controller_on_equals_plain_greedy(model):
    """The controller (fixed cost table) choosing every round: greedy rows emit plain greedy; a seeded sampled row
    keeps its K (its text is the seed's, whatever the controller measures), as alone."""
    V = model.config.vocab_size
    ps = _prompts(V)
    plain = [generate_spec(model, p, 30, k=0)[0] for p in ps[:3]]
    sampled = SpecSampling(temperature=0.9, seed=4)
    alone = SpecSession(model, ps[3], 30, k=K, sampling=sampled).run()
    costs = {(b, t): 1.0 + 0.05 * (t - 1) for b in (1, 2, 4) for t in range(1, K + 2)}
    sched = Scheduler(model, max_num_seqs=4, max_model_len=128, k=K, max_num_batched_tokens=64,
                      spec_policy=KPolicySpec(K), spec_costs=costs)
    rows = [SpecSession(model, p, 30, k=K, pool=sched.pool) for p in ps[:3]]
    seeded = SpecSession(model, ps[3], 30, k=K, pool=sched.pool, sampling=sampled)
    assert sched.policy is not None
    plans, plan = [], sched.policy.plan
    sched.policy.plan = lambda rows, free=None, left=None: (  # type: ignore
        plans.append((free, plan(rows, free, left))) or plans[-1][1])
    _drive(sched, rows + [seeded])
    assert [r.emitted for r in rows] == plain and seeded.emitted == alone and seeded.k_next is None
    # the greedy rows are free (the seeded row is not planned): every round, each drafts the round's T - 1
    assert plans and all(free == [True] * len(ks) and len(set(ks)) == 1 for free, ks in plans)
    assert sched.spec_k_counts[0] > 0 and sched.spec_k_counts[K] > 0  # plain rows beside K_max rows
    assert sum(sched.spec_k_counts) > 0 and sched.policy is not None and not sched.policy.rows  # rows forgotten
    assert all(r.telem.k_rounds > 0 and 0 <= r.telem.k_sum <= K * r.telem.k_rounds for r in rows)


def test_a_rounds_time_runs_to_the_next_step(model, monkeypatch):
    """The controller's cost of a round is the time from its start to the next step's, the host's work between
    the two included (the server's relay of the tokens), while a row of it goes on, less the step's one-off work (a
    prefill, a finished row's last writes); a last round (no row of it left) counts the round alone."""
    costs = {(b, t): 1.0 for b in (1, 2, 4) for t in range(1, K + 2)}
    sched = Scheduler(model, max_num_seqs=4, max_model_len=128, k=K, max_num_batched_tokens=64,
                      spec_policy=KPolicySpec(K), spec_costs=costs)
    assert sched.policy is not None
    got: list[float] = []
    observe = sched.policy.observe_time
    sched.policy.observe_time = lambda n, T, sec: (got.append(sec), observe(n, T, sec))  # type: ignore
    prefill, forget = scheduler_module.prefill_rows, sched.policy.forget
    slow = {"prefill": 0, "finish": 0}

    def slow_prefill(*a, **kw):  # a dear prefill
        slow["prefill"] += 1
        time.sleep(0.5)
        return prefill(*a, **kw)

    def slow_forget(row):  # and dear work for a finished row
        slow["finish"] += 1
        time.sleep(0.5)
        forget(row)

    monkeypatch.setattr(scheduler_module, "prefill_rows", slow_prefill)
    sched.policy.forget = slow_forget  # type: ignore[method-assign]
    ps = _prompts(model.config.vocab_size)
    a = SpecSession(model, ps[0], 40, k=K, pool=sched.pool)
    b = SpecSession(model, ps[1], 6, k=K, pool=sched.pool)
    sched.add(a)
    step = 0
    while sched.num_sessions:
        if step == 3:
            sched.add(b)  # prefilled in step 3, after a's round
        sched.step()
        step += 1
        time.sleep(0.2)  # the host's work between steps
    sched.step()  # closes the last round
    assert slow["prefill"] == 2 and slow["finish"] == 2
    assert len(got) >= 4 and all(0.2 <= sec < 0.45 for sec in got[:-1]), got
    assert got[-1] < 0.2


def _policy(k: int = K, cost=lambda t: 1.0 + 0.1 * (t - 1), **kw) -> KPolicy:
    return KPolicy(KPolicySpec(k, **kw), {(b, t): cost(t) for b in (1, 2, 4, 8) for t in range(1, k + 2)},
                   [1, 2, 4, 8])


def _feed(pol: KPolicy, rows: list[str], rounds: int, n_acc) -> list[list[int]]:
    """Run `rounds` rounds: plan, then each row accepts n_acc(row, k) of its k drafts. Returns the plans."""
    out = []
    for _ in range(rounds):
        ks = pol.plan(rows)
        out.append(ks)
        for r, k in zip(rows, ks):
            pol.observe(r, k, n_acc(r, k))
        pol.observe_time(len(rows), max(ks) + 1, pol.cost[(pol.bucket(len(rows)), max(ks) + 1)])
    return out


def test_zero_acceptance_runs_plain_but_probes_with_backoff():
    pol = _policy()
    plans = _feed(pol, ["a", "b"], 600, lambda r, k: 0)
    late = plans[20:]
    probes = [i + 20 + 1 for i, ks in enumerate(late) if any(ks)]  # 1-based round numbers
    assert all(ks == [0, 0] for i, ks in enumerate(late) if i + 21 not in probes)
    assert all(ks == [1, 1] for i, ks in enumerate(late) if i + 21 in probes)  # probes: both rows, k = 1, together
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps[-1] == PROBE_MAX and len(probes) < 600 / PROBE_EVERY  # failed probes back off
    assert sum(map(sum, late)) < 0.02 * len(late) * 2 * K


def test_a_quiet_spell_owes_its_rows_their_decay():
    """Rows at zero acceptance planned in the same order round after round run a quiet spell (plain, planned in O(1));
    their estimates decay as if every round had been planned in full (rows planned in alternating order, which never
    forms a spell), and the spell ends on a probe round."""
    q, r = _policy(), _policy()
    plans: list[list[int]] = []
    for i in range(300):
        for pol, rows in ((q, ["a", "b"]), (r, ["a", "b"] if i % 2 else ["b", "a"])):
            ks = pol.plan(rows)
            plans.append(ks)
            for row, k in zip(rows, ks):
                pol.observe(row, k, 0)
            pol.observe_time(2, max(ks) + 1, pol.cost[(2, max(ks) + 1)])
        assert plans[-1] == plans[-2]
        if i in (30, 70, 150, 299):
            for row in "ab":
                assert q.accept(row) == pytest.approx(r.accept(row), rel=1e-12, abs=1e-15)
    late = plans[80:]
    assert all(ks in ([0, 0], [1, 1]) for ks in late) and 2 <= sum(ks == [1, 1] for ks in late) <= 10  # probes


def test_high_acceptance_drafts_deep_and_mixed_batch_differs_per_row():
    pol = _policy()
    plans = _feed(pol, ["a"], 30, lambda r, k: k)
    assert plans[-1] == [K]  # all accepted, drafts cheap: the deepest k
    pol = _policy(cost=lambda t: 1.0 + 0.6 * (t - 1))  # each draft costs 60% of a plain step
    plans = _feed(pol, ["a"], 40, lambda r, k: min(k, 1))  # only the first draft is ever accepted
    assert plans[-2] == [1] or plans[-1] == [1]
    pol = _policy()
    plans = _feed(pol, ["good", "bad"], 40, lambda r, k: k if r == "good" else 0)
    assert all(g == K and b <= 2 for g, b in plans[-20:])  # the bad row: a shallow draft now and then, in the
    assert sum(b == 0 for _, b in plans[-20:]) >= 5  # padded verify (the pooled estimate, good row's hits in it)
    acc = pol.accept("good")
    assert min(acc) > 0.9 and max(pol.accept("bad")[:1]) < 0.2


def test_a_row_whose_drafts_alone_would_not_pay_drafts_inside_a_batch_widened_by_another():
    """Each draft costs 30% of a plain step. A row that accepts its drafts one round in four (then all of them)
    is best plain alone (E(k) / c(k + 1) = (1 + k / 4) / (1 + 0.3 k) < 1). Beside a row that accepts everything
    the batch runs at T = K + 1, and the verify pads every row to T: the quarter row drafts K too (2 tokens a
    round instead of 1); by its own best k alone it would run plain."""
    def quarter(n=[0]):
        n[0] += 1
        return n[0] % 4 == 0
    cost = lambda t: 1.0 + 0.3 * (t - 1)  # noqa: E731
    plans = _feed(_policy(cost=cost), ["q"], 80, lambda r, k: k if quarter() else 0)
    assert sum(map(sum, plans[-40:])) <= 2 * K  # alone: plain (probe rounds aside)
    plans = _feed(_policy(cost=cost), ["good", "q"], 80, lambda r, k: k if r == "good" or quarter() else 0)
    assert all(ks == [K, K] for ks in plans[-40:])


def test_a_free_row_drafts_to_the_rounds_width():
    """A free row (a greedy one: once the round drafts, its drafts cost nothing) drafts T - 1, even with no useful
    draft of its own; a row that is not free drafts its useful depth; a batch of free rows with no useful draft runs
    plain (but on probe rounds)."""
    rows, free = ["good", "one", "one-free", "bad-free"], [True, False, True, True]
    n_acc = {"good": lambda k: k, "one": lambda k: min(k, 1), "one-free": lambda k: min(k, 1), "bad-free": lambda k: 0}
    pol, plans = _policy(), []
    for _ in range(60):
        ks = pol.plan(rows, free)
        plans.append(ks)
        for r, k in zip(rows, ks):
            pol.observe(r, k, n_acc[r](k))
        pol.observe_time(len(rows), max(ks) + 1, pol.cost[(pol.bucket(len(rows)), max(ks) + 1)])
    late = plans[-20:]
    assert all(ks[0] == ks[2] == ks[3] == K and 1 <= ks[1] <= 2 for ks in late)  # "one": 1 or 2 (a_1 ~ 0.1)
    assert 1 <= pol.plan(rows)[2] <= 2  # "one-free" as a row that is not free: its useful depth
    assert max(pol.accept("bad-free")) < 0.1
    pol, plans = _policy(), []
    for _ in range(60):
        ks = pol.plan(["bad-free", "bad-free-2"], [True, True])
        plans.append(ks)
        pol.observe("bad-free", ks[0], 0), pol.observe("bad-free-2", ks[1], 0)
        pol.observe_time(2, max(ks) + 1, pol.cost[(2, max(ks) + 1)])
    assert all(ks == [0, 0] for ks in plans[-20:])


def test_decisions_are_deterministic_from_costs_and_history():
    """Two controllers fed the same cost table and the same outcomes plan the same ks, round by round (and a
    history with different rows' acceptance leads to different ks per row)."""
    rng = random.Random(3)
    draws = [rng.choice((0, 1, 4)) for _ in range(600)]  # accepted-length caps, row by row, round by round

    def run():
        it = iter(draws)
        pol = _policy()
        return _feed(pol, ["x", "y", "z"], 200, lambda r, k: min(k, next(it) if r != "y" else 0)), pol.table()

    a, b = run(), run()
    assert a == b
    assert any(ks[0] != ks[1] for ks in a[0])


def test_fixed_policy_and_batch_size_schedule():
    spec = KPolicySpec(4, adaptive=False, schedule=((1, 4), (4, 2), (16, 1)))
    assert [spec.cap(n) for n in (1, 2, 4, 5, 16, 64)] == [4, 2, 2, 1, 1, 1]
    assert KPolicySpec(3).cap(100) == 3
    pol = KPolicy(spec, {}, [1, 2, 4, 8])
    assert pol.plan(["a"]) == [4] and pol.plan(["a", "b", "c"]) == [2, 2, 2]
    assert "fixed K" in spec.describe() and "<=4: 2" in spec.describe()


def test_profile_costs_interpolates_between_timed_buckets():
    t = [0.0]
    calls = []

    def run(n, T):
        calls.append((n, T))
        t[0] += n * 10 + T  # the fake clock advances by the "work"

    costs = profile_costs(run, [1, 2, 4, 8, 16], 3, points=2, reps=1, clock=lambda: t[0])
    assert {n for n, _ in calls} == {1, 16}
    assert costs[(1, 2)] == 12 and costs[(16, 3)] == 163
    assert costs[(8, 1)] == pytest.approx(11 + (7 / 15) * 150)


def test_profile_costs_time_the_widths_in_turn_and_keep_the_table_nondecreasing_in_t():
    """A slow spell of the host over three timings in a row costs no width its true time (each width is timed once
    in it at most); a width measured cheaper than a narrower one is pooled with it."""
    t, calls = [0.0], [0]
    work = {1: 10.0, 2: 14.0, 3: 12.0}  # T = 3 "measures" cheaper than T = 2

    def run(n, T):
        calls[0] += 1
        t[0] += work[T] + (100.0 if 6 <= calls[0] <= 8 else 0.0)

    costs = profile_costs(run, [8], 3, points=1, reps=3, clock=lambda: t[0])
    assert [costs[(8, T)] for T in (1, 2, 3)] == [10.0, 13.0, 13.0]
    assert calls[0] == 3 + 3 * 3  # one warm-up and three timings per width


def test_measured_round_times_refine_the_table_and_unmeasured_widths_carry_the_overhead():
    pol = _policy()
    pol.observe_time(1, 1, 2.0)  # profiled 1.0: the host adds 1.0 a round
    assert pol.seconds(1, 1) == 2.0 and pol.seconds(1, 4) == pytest.approx(1.3 + 1.0)
    assert pol.seconds(8, 4) == pytest.approx(1.3)  # another bucket: nothing measured there yet
    pol.observe_time(1, 1, 2.1)
    assert pol.seconds(1, 1) == pytest.approx(2.0 + 0.2 * 0.1)  # an EMA
    assert pol.table()["1"]["1"] == pytest.approx(2020.0)
    pol.observe_time(1, 1, 20.0)  # an outlier counts as SPIKE x the estimate
    assert pol.seconds(1, 1) == pytest.approx(2.02 + 0.2 * 0.1 * 2.02)


def test_a_width_not_run_for_a_while_returns_to_its_profile_plus_the_overhead():
    pol = _policy()
    pol.observe_time(1, 1, 5.0)  # one slow round at T = 1 (a busy host)
    assert pol.seconds(1, 1) == 5.0
    for _ in range(200):
        pol.observe_time(1, 4, 1.3 + 0.5)  # then T = 4 runs, the host adding 0.5 a round
    assert pol.seconds(1, 4) == pytest.approx(1.8)
    assert pol.seconds(1, 1) == pytest.approx(1.0 + 0.5, abs=0.01)  # its own measurement faded (STALE ** 200)
    pol.observe_time(1, 1, 1.5)
    assert pol.seconds(1, 1) == pytest.approx(1.5, abs=0.01)  # measured again: the EMA starts from the estimate


def test_one_slow_round_does_not_keep_the_batch_off_its_best_width():
    """A good row (accepts everything) beside a bad one (accepts nothing), drafts dear (each 60% of a plain step):
    the batch is best at T = 1 (2 tokens / 1.0 s, against 3 / 1.6 at T = 2). One slow T = 1 round makes T = 2 look
    better; T = 2 then runs and T = 1 is not measured again, but its estimate fades back to its profile and the
    batch returns to T = 1."""
    pol = _policy(cost=lambda t: 1.0 + 0.6 * (t - 1))
    pol.observe_time(2, 1, 2.0)
    plans = _feed(pol, ["good", "bad"], 300, lambda r, k: k if r == "good" else 0)
    assert sum(max(ks) == 1 for ks in plans[:40]) > 20  # T = 2 ran for a while (the old EMA kept it for good)
    assert plans[-1] == [0, 0] or plans[-2] == [0, 0]  # (one of two may be a probe round)


def test_deferred_mtp_rows_are_priced_by_the_slope_of_their_flushes():
    """A flush's fixed part is no row's: the price per deferred MTP row is the slope of flush time over rows (the
    time over the rows while every flush had one size)."""
    pol = _policy()
    assert pol.deferred() == 0.0
    pol.observe_deferred(4, 0.5 + 4 * 0.01)
    assert pol.deferred() == pytest.approx(0.54 / 4)
    pol.observe_deferred(100, 0.5 + 100 * 0.01)
    pol.observe_deferred(10, 0.5 + 10 * 0.01)
    assert pol.deferred() == pytest.approx(0.01)


def test_plain_rounds_pay_for_the_mtp_rows_they_defer():
    """The batch of `test_one_slow_round_...` is best plain on its forwards alone (2 tokens / 1.0 s against 3 / 1.6
    at T = 2), but each plain round leaves both rows' MTP rows for a later head forward, while at T = 2 only the bad
    row's (it neither drafts nor rides): at 0.1 s a row, T = 2 (3 / 1.7) beats T = 1 (2 / 1.2)."""
    cost = lambda t: 1.0 + 0.6 * (t - 1)  # noqa: E731
    plain = _feed(_policy(cost=cost), ["good", "bad"], 100, lambda r, k: k if r == "good" else 0)
    assert sum(max(ks) == 0 for ks in plain[-30:]) >= 28  # (one may be a probe round)
    pol = _policy(cost=cost)
    pol.observe_deferred(20, 2.0)
    plans = _feed(pol, ["good", "bad"], 100, lambda r, k: k if r == "good" else 0)
    assert sum(max(ks) == 1 for ks in plans[-30:]) >= 28


def test_a_finished_rows_deferred_mtp_rows_are_timed(model):
    """With the prefix cache on, a finished row's queued MTP rows are written in one head forward: its rows and
    time reach the controller (`observe_deferred`); a row that ran plain throughout queued all of its tokens'."""
    costs = {(b, t): 1.0 + 100.0 * (t > 1) for b in (1, 2, 4) for t in range(1, K + 2)}  # drafting looks ruinous
    sched = Scheduler(model, max_num_seqs=2, max_model_len=128, k=K, max_num_batched_tokens=64,
                      spec_policy=KPolicySpec(K), spec_costs=costs, prefix_cache_bytes=1 << 24)
    assert sched.policy is not None
    got: list[tuple[int, float]] = []
    observe = sched.policy.observe_deferred
    sched.policy.observe_deferred = lambda n, sec: (got.append((n, sec)), observe(n, sec))  # type: ignore
    s = SpecSession(model, _prompts(model.config.vocab_size)[0], 24, k=K, pool=sched.pool)
    sched.add(s)
    while sched.num_sessions:
        sched.step()
    assert s.telem.k_sum == 0  # plain throughout
    assert len(got) == 1 and got[0][0] >= 20 and got[0][1] > 0.0
    assert sched.policy.deferred() == pytest.approx(got[0][1] / got[0][0])


def _outcomes(rng: random.Random, rows: list[str], ks: list[int], acc: dict[str, float]) -> list[tuple[str, int, int]]:
    """Each row's (row, k, accepted): its k drafts accepted in turn with chance acc[row], up to the first miss."""
    out = []
    for r, k in zip(rows, ks):
        n = 0
        while n < k and rng.random() < acc[r]:
            n += 1
        out.append((r, k, n))
    return out


def test_observe_round_is_observe_for_each_row():
    """A round's outcomes in one call learn exactly what `observe` row by row learns (rows that drafted nothing, known
    or new, a quiet spell's included): the same plans and the same estimates."""
    rng = random.Random(5)
    a, b = _policy(), _policy()
    rows = ["r0", "r1", "r2", "r3"]
    acc = {"r0": 0.95, "r1": 0.0, "r2": 0.5, "r3": 0.0}
    for i in range(300):
        if i % 50 == 49:  # a row leaves, a new one joins
            gone = rows.pop(0)
            a.forget(gone)
            b.forget(gone)
            rows.append(f"n{i}")
            acc[rows[-1]] = rng.random()
        ks = a.plan(rows)
        assert b.plan(rows) == ks
        out = _outcomes(rng, rows, ks, acc)
        for r, k, n in out:
            a.observe(r, k, n)
        b.observe_round(out)
        for p in (a, b):
            p.observe_time(len(rows), max(ks) + 1, p.cost[(p.bucket(len(rows)), max(ks) + 1)])
    assert a.rows.keys() == b.rows.keys()
    assert all(a.accept(r) == b.accept(r) for r in rows)
    assert a.pooled() == b.pooled()


def test_a_plain_rounds_short_paths_learn_what_plan_and_observe_round_learn():
    """As the scheduler calls them: `resting` first (a quiet spell's round, O(1); `plan` when it says None) and
    `observe_plain` for a round in which no row drafted give the plans, widths, estimates and probe intervals that
    `plan` and `observe_round` alone give (zero-acceptance rows in quiet spells, joins and leaves, a row that drafts
    well now and then). `resting`'s own semantics: the quiet-spell tests above."""
    rng = random.Random(7)
    a, b = _policy(), _policy()
    rows = ["r0", "r1", "r2"]
    acc = {r: 0.0 for r in rows}
    rested = 0
    for i in range(1500):
        if i % 97 == 96:  # a row leaves, a new one joins (now and then one that drafts well)
            gone = rows.pop(0)
            a.forget(gone)
            b.forget(gone)
            rows.append(f"n{i}")
            acc[rows[-1]] = 0.9 if i % 3 == 0 else 0.0
        ks = a.plan(rows)
        kb = b.resting(rows)
        rested += kb is not None
        kb = b.plan(rows) if kb is None else kb
        assert kb == ks and b.last_t == a.last_t
        out = _outcomes(rng, rows, ks, acc)
        a.observe_round(out)
        b.observe_plain(rows) if max(ks) == 0 else b.observe_round(out)
        for p in (a, b):
            p.observe_time(len(rows), max(ks) + 1, p.cost[(p.bucket(len(rows)), max(ks) + 1)])
        assert a.probe_every == b.probe_every
        assert a.rows.keys() == b.rows.keys() and all(a.accept(r) == b.accept(r) for r in rows)
    assert a.pooled() == b.pooled()
    assert rested > 200  # the short path ran (227 rounds)


def test_a_rows_round_curve_is_its_decayed_estimates_curve():
    """`plan`'s one-pass `_Est.round_curve` keeps the round's decay in the counts and returns, bit for bit, the curve
    and useful depth of the estimate from the decayed counts (positions never reached, a cap below K included)."""
    from engine.kpolicy import DECAY, _Est

    rng = random.Random(7)
    for _ in range(200):
        n = [rng.choice((0.0, 0.3, rng.uniform(0, 9))) for _ in range(K)]
        hit = [x * rng.random() for x in n]
        pa = [rng.random() for _ in range(K)]
        cap = rng.randint(1, K)
        a, b = _Est(list(hit), list(n)), _Est(list(hit), list(n))
        got = a.round_curve(pa, cap)
        b.decay(DECAY)
        assert got == KPolicy.curve(b.estimate(pa), cap)
        assert (a.hit, a.n) == (b.hit, b.n)


def test_cost_rows_follow_every_measured_round_and_a_new_table():
    """`costs(B)`, the row `plan` and the drain read (kept between rounds), is `seconds(B, T)` for every T after any
    sequence of measured rounds on any bucket, and after the cost table is replaced (a profile after graph capture)."""
    pol = _policy()
    rng = random.Random(3)
    for i in range(300):
        for b in (1, 2, 4, 8):
            assert pol.costs(b) == [pol.seconds(b, t) for t in range(1, K + 2)]
        pol.observe_time(rng.choice((1, 2, 3, 5, 8)), rng.randint(1, K + 1), rng.uniform(0.5, 2.0))
        if i == 150:
            pol.cost = {key: 2 * v for key, v in pol.cost.items()}


def test_refill_counts_finished_rows_replaced_while_the_batch_ran():
    """`refill()`: 1 before any finish; a closed batch (rows finish, nobody joins until it empties) pulls it toward 0,
    a join into an empty batch replacing nobody; joins while the batch runs (steady load) pull it back toward 1."""
    pol = _policy()
    assert pol.refill() == 1.0
    for _ in range(3):  # closed batches of 8: 8 join (the first into an empty batch), 3 + 4 leave early, 1 last
        for i in range(8):
            pol.observe_flow(1 if i else 0, 0, i)
        pol.observe_flow(0, 3, 5)
        pol.observe_flow(0, 4, 1)
        pol.observe_flow(0, 1, 0)
    closed = pol.refill()
    assert closed < 0.15
    for _ in range(40):  # steady: each finished row replaced a step later
        pol.observe_flow(0, 1, 7)
        pol.observe_flow(1, 0, 7)
    assert pol.refill() > 0.95 and pol.refill() > closed


def test_a_batch_that_runs_down_is_planned_for_its_slowest_rows():
    """Four rows accept every draft, four none (free riders, as greedy rows are); smaller batches cost less. Refilled
    (steady load), the batch's best rate is the deepest width (the good rows' tokens); running down (closed batches:
    nobody replaces a finished row), the batch lasts as long as the bad rows' budgets whatever the width, and a wide
    round only makes those rounds dearer: it runs narrow. Without budgets (`left`), the rate alone."""
    import copy

    cost = {(b, t): (0.4 + 0.6 * b / 8) * (1 + 0.25 * (t - 1)) for b in (1, 2, 4, 8) for t in range(1, 5)}
    pol = KPolicy(KPolicySpec(3), cost, [1, 2, 4, 8])
    rows, free = [f"g{i}" for i in range(4)] + [f"b{i}" for i in range(4)], [True] * 8
    for _ in range(40):
        ks = pol.plan(rows, free)
        for r, k in zip(rows, ks):
            pol.observe(r, k, k if r[0] == "g" else 0)
    steady, closed = copy.deepcopy(pol), copy.deepcopy(pol)
    for _ in range(20):
        steady.observe_flow(0, 1, 7)
        steady.observe_flow(1, 0, 7)
        closed.observe_flow(0, 4, 4)
        closed.observe_flow(0, 4, 0)
    left = [100] * 8
    assert max(copy.deepcopy(steady).plan(rows, free, left)) == 3
    assert max(copy.deepcopy(pol).plan(rows, free)) == 3
    assert max(copy.deepcopy(closed).plan(rows, free)) == 3  # no budgets: the rate alone
    assert max(copy.deepcopy(closed).plan(rows, free, left)) == 0
    # the bad rows nearly done: the good rows set the batch's end, and their speed is the drain's too
    assert max(copy.deepcopy(closed).plan(rows, free, [40] * 4 + [1] * 4)) == 3


def test_the_scheduler_reports_rows_finishing_and_joining(model):
    """A short and a long request together: the short one finishes while the long one runs and nobody replaces it
    (refill drops); then, beside a long request, short ones each replaced by the next before the step after (refill
    recovers; the last one not yet counted)."""
    sched = Scheduler(model, max_num_seqs=4, max_model_len=256, k=K, max_num_batched_tokens=256,
                      spec_policy=KPolicySpec(K), spec_costs={})
    ps = _prompts(model.config.vocab_size)
    _drive(sched, [SpecSession(model, ps[0], 4, k=K, pool=sched.pool),
                   SpecSession(model, ps[1], 24, k=K, pool=sched.pool)])
    assert sched.policy is not None and sched.policy.refill() == pytest.approx(0.5)
    sched.add(SpecSession(model, ps[1], 40, k=K, pool=sched.pool))
    for _ in range(3):
        sched.add(s := SpecSession(model, ps[0], 4, k=K, pool=sched.pool))
        while s in sched.running or s in sched.joining:
            sched.step()
    assert sched.policy.refill() == pytest.approx((1 + 0.9 + 1) / (1 + 0.9 + 0.81 + 1))  # a miss, two hits
