"""OPTIPIPE research door (research/optipipe.py): inert by default, the forced harness's invariants, the controller
never changes a token, refusals, and the server door -- armed only at process start, never by a request."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import signal
import subprocess

import httpx
import pytest
import torch

import research.optipipe as op
import engine.spec as spec
from config.settings import REPO_ROOT
from engine.loader import load_model
from research.optipipe import (
    OptiForkGateMode,
    OptiForkGateStats,
    gate_invariants,
    optipipe_gate_mode,
    optipipe_gate_stats,
    reset_optipipe_gate_stats,
    run_gate,
    set_optipipe_controller_threshold,
    set_optipipe_gate_mode,
)
from engine.scheduler import Scheduler
from engine.spec import SpecSampling, SpecSession, generate_spec
from tests.server_fixtures import (
    ServerThread,
    free_port,
    http_ready,
    tiny_checkpoint,
    tiny_model_and_tokenizer,
    wait_until,
)
from tests.test_server_config import NEXTN, run_nextn
from tests.test_spec import ParityConstraint
from tests.tiny import make_checkpoint

MODES = ["off", "hit", "miss", "alternate", "abort", "controller"]


@pytest.fixture(autouse=True)
def gate_off():
    """Every test starts and ends with the gate disarmed and the counters zero (the state is process-wide)."""
    set_optipipe_gate_mode(OptiForkGateMode.DISABLED)
    reset_optipipe_gate_stats()
    yield
    op._rearm(OptiForkGateMode.DISABLED, 0.0)
    reset_optipipe_gate_stats()


def _model(kind: str, tmp_path_factory) -> torch.nn.Module:
    path = make_checkpoint(tmp_path_factory.mktemp("o" + kind), seed=61 if kind == "dense" else 62, moe=kind == "moe",
                           with_tokenizer=False)
    return load_model(path)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _model("dense", tmp_path_factory)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, dense, tmp_path_factory):
    return dense if request.param == "dense" else _model("moe", tmp_path_factory)


def _prompts(V: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(13)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 23, 11)]


# ------------------------------------------------------------------------------------------ engine


def test_api_validation_and_mode_mapping():
    assert optipipe_gate_mode() == (OptiForkGateMode.DISABLED, 0.0)
    assert spec.ROUND_HOOK is None  # disarmed: the round's one door is closed
    for bad in (math.nan, math.inf, -0.1, 1.5, -math.inf):
        with pytest.raises(ValueError, match="finite number in"):
            set_optipipe_controller_threshold(bad)
        assert optipipe_gate_mode()[0] is OptiForkGateMode.DISABLED  # a refused q arms nothing
        assert spec.ROUND_HOOK is None
    for q in (0.0, 0.7, 1.0):
        set_optipipe_controller_threshold(q)
        assert optipipe_gate_mode() == (OptiForkGateMode.CONTROLLER, q)
        assert spec.ROUND_HOOK is op.optipipe_round
    set_optipipe_gate_mode(OptiForkGateMode.DISABLED)
    assert spec.ROUND_HOOK is None
    parse = OptiForkGateMode.parse
    assert [parse(n) for n in ("off", "hit", "ring", "stream", "miss", "alternate", "abort", "controller")] == [
        OptiForkGateMode.DISABLED, *[OptiForkGateMode.HIT] * 3, OptiForkGateMode.MISS, OptiForkGateMode.ALTERNATE,
        OptiForkGateMode.ABORT, OptiForkGateMode.CONTROLLER]
    with pytest.raises(ValueError):
        parse("sometimes")
    s = optipipe_gate_stats()
    assert s == OptiForkGateStats() and s.to_dict() == dict.fromkeys(s.to_dict(), 0) and len(s.to_dict()) == 12
    with pytest.raises(AttributeError):
        s.hits = 1  # type: ignore[misc]  # a copy, frozen


@pytest.mark.parametrize("mode", MODES)
def test_forced_harness_passes_each_mode(dense, mode):
    """`nextn optipipe-gate`'s checks: mode invariants, per-round state identity, whole pools, tokens."""
    m = OptiForkGateMode.parse(mode)
    report = run_gate(dense, m, _prompts(dense.config.vocab_size)[:2], max_new_tokens=40, threshold=0.0)
    assert report.passed, "\n".join(report.lines())
    s = report.stats
    if m is OptiForkGateMode.DISABLED:
        assert s == OptiForkGateStats()
    else:
        assert s.refusals > 0 and s.gate_checks > 0
        assert report.identity_first is not None and report.identity_first.trunk_kv_bytes > 0
    assert optipipe_gate_mode()[0] is OptiForkGateMode.DISABLED  # the harness restores the previous mode


def test_harness_catches_a_fork_that_touches_committed_state(dense, monkeypatch):
    """A shadow head step one row too early overwrites a committed MTP row the fork did not save: the harness
    must see it (if it could not, its PASS would prove nothing)."""
    real = op._head_step
    monkeypatch.setattr(op, "_head_step", lambda m, kv, slots, pos, tok, hid: real(m, kv, slots, [p - 1 for p in pos],
                                                                                      tok, hid))
    report = run_gate(dense, OptiForkGateMode.MISS, _prompts(dense.config.vocab_size)[:2], max_new_tokens=24)
    assert not report.passed
    failed = [text for text, ok in report.checks if not ok]
    assert any("state equals the serial run's" in t and "scratch_kv" in t for t in failed), failed


def test_invariants_reject_inconsistent_counters():
    good = OptiForkGateStats(attempts=4, hits=3, misses=1, gate_checks=5, gate_admits=4, gate_rejects=1,
                             reconciles=1, wasted_draft_tokens=3, shadow_draft_tokens=9, refusals=2)
    assert all(ok for _, ok in gate_invariants(good, OptiForkGateMode.CONTROLLER))
    for bad in (dict(reconciles=0), dict(gate_rejects=0), dict(hits=2), dict(wasted_draft_tokens=2),
                dict(shadow_draft_tokens=8)):
        s = OptiForkGateStats(**{**good.to_dict(), **bad})
        assert not all(ok for _, ok in gate_invariants(s, OptiForkGateMode.CONTROLLER)), bad
    assert not all(ok for _, ok in gate_invariants(good, OptiForkGateMode.HIT))  # a miss under forced hit
    assert not all(ok for _, ok in gate_invariants(good, OptiForkGateMode.DISABLED))  # off: all default


def _run_batch(model, q: float | None, *, k: int = 1) -> tuple[list[list[int]], OptiForkGateStats, list]:
    """A mixed batch through the scheduler (greedy K = k rows, one joining late; a sampled and a constrained row)
    with the controller armed at q (None: off). Returns (tokens per session, the counters, the sessions)."""
    V = model.config.vocab_size
    ps = _prompts(V)
    reset_optipipe_gate_stats()
    if q is None:
        set_optipipe_gate_mode(OptiForkGateMode.DISABLED)
    else:
        set_optipipe_controller_threshold(q)
    sched = Scheduler(model, max_num_seqs=5, max_model_len=128, k=k, max_num_batched_tokens=64)
    mk = lambda i, n, **kw: SpecSession(model, ps[i], n, k=k, pool=sched.pool, **kw)  # noqa: E731
    sess = [mk(0, 32), mk(1, 28), mk(2, 24, sampling=SpecSampling(temperature=0.9, seed=3)),
            mk(1, 16, constraint=ParityConstraint(V, {3, 4}))]
    late = mk(2, 30)
    for s in sess:
        sched.add(s)
    steps = 0
    while sched.num_sessions or late is not None:
        if steps == 4 and late is not None:
            sched.add(late)
            sess.append(late)
            late = None
        sched.step()
        steps += 1
    stats = optipipe_gate_stats()
    set_optipipe_gate_mode(OptiForkGateMode.DISABLED)
    return [s.emitted for s in sess], stats, sess


def test_controller_never_changes_a_token(model):
    """q = 0 (the unconditional arm), a tiny q (nearly every check admitted; this random drafter mostly misses,
    so sessions trip their breaker and stop paying the shadow draft) and q = 1 (nothing admitted)."""
    ref, off, _ = _run_batch(model, None)
    assert off == OptiForkGateStats()
    ps = _prompts(model.config.vocab_size)
    assert ref[0] == generate_spec(model, ps[0], 32, k=0)[0] and ref[4] == generate_spec(model, ps[2], 30, k=0)[0]
    runs = {}
    for q in (0.0, 1e-12, 1.0):
        out, s, sess = _run_batch(model, q)
        runs[q] = s
        assert out == ref, f"q={q}"
        assert all(ok for _, ok in gate_invariants(s, OptiForkGateMode.CONTROLLER)), (q, s)
        assert s.gate_checks > 0 and s.refusals > 0
        tripped = [x for x in sess if op._sessions[x].closed]
        assert len(tripped) == s.breaker_trips
    s0, s1, s2 = runs[0.0], runs[1e-12], runs[1.0]
    assert s0.gate_rejects == 0 and s0.attempts == s0.gate_checks and s0.breaker_trips == 0  # no breaker at q = 0
    assert s0.misses >= op.BREAKER_MISSES
    assert s1.breaker_trips >= 1 and s1.gate_checks < s0.gate_checks
    assert s2.attempts == 0 and s2.gate_rejects == s2.gate_checks  # p(d1) * p(d2) < 1 on this model


def test_controller_fails_closed(dense, monkeypatch, caplog):
    """A failure inside the bookkeeping disarms the controller (one error line); the tokens still go out."""
    ref, _, _ = _run_batch(dense, None)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(op, "_head_step", boom)
    with caplog.at_level(logging.ERROR, logger="nextn.optipipe"):
        out, s, _ = _run_batch(dense, 0.0)
    assert out == ref and s.gate_checks == s.attempts == 0
    assert len([r for r in caplog.records if "OPTIPIPE controller failed; disarmed" in r.getMessage()]) == 1


def test_k_other_than_one_is_refused_and_counted(dense):
    ref, _, _ = _run_batch(dense, None, k=3)
    out, s, sess = _run_batch(dense, 0.0, k=3)
    assert out == ref
    assert s.gate_checks == s.attempts == s.shadow_draft_tokens == 0 and s.refusals > 0
    assert s.refusals == sum(op._sessions[x].refusals for x in sess)


def test_disabled_path_does_no_extra_work(dense, monkeypatch):
    """Off (the default): the same tokens and the same head/trunk forwards as with the hooks removed."""
    calls = {"mtp": 0, "trunk": 0}
    real_mtp, real_fwd = dense.mtp_forward, dense.forward_step

    def count(key, fn):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(dense, "mtp_forward", count("mtp", real_mtp))
    monkeypatch.setattr(dense, "forward_step", count("trunk", real_fwd))
    assert spec.ROUND_HOOK is None  # off: the round does not call the research door at all
    out, stats, _ = _run_batch(dense, None)
    with_hooks = dict(calls)
    calls.update(mtp=0, trunk=0)
    monkeypatch.setattr(spec, "ROUND_HOOK", None)  # a build without the research door
    bare, _, _ = _run_batch(dense, None)
    assert with_hooks["mtp"] > 0 and with_hooks["trunk"] > 0
    assert out == bare and calls == with_hooks and stats == OptiForkGateStats()


# ------------------------------------------------------------------------------------------ server

PROMPTS = [[11, 12, 13, 14, 15], [40, 2, 77, 5, 9, 31, 8], [100, 101]]


def _workload(srv: ServerThread) -> list[list[int]]:
    """Three concurrent greedy completions (token prompts, EOS ignored) -> their token ids."""
    def one(p: list[int]) -> list[int]:
        body = {"model": srv.model, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(one, PROMPTS))


def _series(srv: ServerThread) -> set[str]:
    """The /metrics series (name + labels, no values)."""
    text = httpx.get(srv.url + "/metrics").text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _plain(p: list[int]) -> list[int]:
    model, _ = tiny_model_and_tokenizer()
    return generate_spec(model, p, 24, k=0)[0]


def test_absent_door_equals_a_build_without_hooks(monkeypatch, caplog):
    """Two server runs (K = 1, where a live door would fork every row): without the hooks, and as shipped with
    the door absent. Same tokens (== plain greedy), same /metrics series set, counters zero, no startup line."""
    with monkeypatch.context() as m:
        m.setattr(spec, "ROUND_HOOK", None)
        with ServerThread(num_speculative_tokens=1) as srv:
            bare_tokens, bare_series = _workload(srv), _series(srv)
    with caplog.at_level(logging.INFO, logger="nextn"):
        with ServerThread(num_speculative_tokens=1) as srv:
            tokens, series = _workload(srv), _series(srv)
    assert tokens == bare_tokens == [_plain(p) for p in PROMPTS]
    assert series == bare_series and not any("optipipe" in s for s in series)
    assert optipipe_gate_stats() == OptiForkGateStats()
    assert optipipe_gate_mode()[0] is OptiForkGateMode.DISABLED
    assert not any("research door" in r.getMessage() for r in caplog.records)


def _optipipe_values(srv: ServerThread) -> dict[str, float]:
    return {f.name: srv.metric(f"nextn_optipipe_{f.name}_total") for f in dataclasses.fields(OptiForkGateStats)}


def test_armed_door_same_tokens_metrics_block_and_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="nextn"):
        with ServerThread(num_speculative_tokens=1, research_opti_controller_q=0.0) as srv:
            tokens = _workload(srv)
            values = _optipipe_values(srv)
            stats = optipipe_gate_stats()
            series = _series(srv)
    armed = [r.getMessage() for r in caplog.records if "research door" in r.getMessage()]
    assert len(armed) == 1 and "q=0" in armed[0] and "NO-GO" in armed[0]
    assert tokens == [_plain(p) for p in PROMPTS]  # armed output == unarmed output, token for token
    assert len([s for s in series if s.startswith("nextn_optipipe_")]) == 12
    assert values == {k: float(v) for k, v in stats.to_dict().items()}
    assert values["attempts"] > 0 and values["attempts"] == values["gate_checks"]  # q = 0 admits every check
    assert all(ok for _, ok in gate_invariants(stats, OptiForkGateMode.CONTROLLER))


FORGED_BODY = {"research_opti_controller_q": 0.0, "opti_controller_q": 0.0, "optipipe": {"mode": "hit", "q": 0.0},
               "optipipe_gate_mode": "hit", "nextn_research_opti_controller_q": "0.0"}
FORGED_HEADERS = {"X-Research-Opti-Controller-Q": "0.0", "X-Nextn-Research-Opti-Controller-Q": "0.0",
                  "X-Optipipe-Mode": "hit", "NEXTN_RESEARCH_OPTI_CONTROLLER_Q": "0.0"}
FORGED_QUERY = {"research_opti_controller_q": "0.0", "optipipe": "hit", "q": "0.0"}


def _try_to_arm(srv: ServerThread) -> list[list[int]]:
    """Every request-side way in: body fields, query parameters, headers, made-up routes."""
    outs = []
    for path, body in (("/completions", {"prompt": PROMPTS[0], "ignore_eos": True, "return_token_ids": True}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "return_token_ids": True})):
        r = httpx.post(srv.base_url + path, params=FORGED_QUERY, headers=FORGED_HEADERS, timeout=60,
                       json={"model": srv.model, "max_tokens": 24, "temperature": 0, **body, **FORGED_BODY})
        assert r.status_code == 200, r.text  # unknown fields are ignored (and logged), as any other
        outs.append(r.json()["choices"][0]["token_ids"])
    for route in ("/optipipe", "/v1/optipipe", "/research", "/v1/research/opti-controller", "/admin/optipipe"):
        for method in ("GET", "POST", "PUT"):
            r = httpx.request(method, srv.url + route, json={"q": 0.0, "mode": "hit"}, headers=FORGED_HEADERS)
            assert r.status_code in (404, 405), (method, route, r.status_code)
    paths = httpx.get(srv.url + "/openapi.json").json()["paths"]
    assert "/v1/completions" in paths and not [p for p in paths if "opti" in p.lower() or "research" in p.lower()]
    return outs


def test_no_request_arms_the_door_or_changes_q(monkeypatch):
    with ServerThread(num_speculative_tokens=1) as srv:
        monkeypatch.setenv("NEXTN_RESEARCH_OPTI_CONTROLLER_Q", "0.0")  # the environment after start: no effect
        outs = _try_to_arm(srv)
        assert optipipe_gate_mode()[0] is OptiForkGateMode.DISABLED
        assert optipipe_gate_stats() == OptiForkGateStats()
        assert not any("optipipe" in s for s in _series(srv))
    monkeypatch.delenv("NEXTN_RESEARCH_OPTI_CONTROLLER_Q")
    with ServerThread(num_speculative_tokens=1, research_opti_controller_q=0.9) as srv:
        monkeypatch.setenv("NEXTN_RESEARCH_OPTI_CONTROLLER_Q", "0.0")
        assert _try_to_arm(srv) == outs  # and the forged fields changed nothing in the output either
        assert optipipe_gate_mode() == (OptiForkGateMode.CONTROLLER, 0.9)
    assert outs[0] == _plain(PROMPTS[0])


@pytest.mark.parametrize("argv,env,needle", [
    (["--research-opti-controller-q", "nan"], {}, "--research-opti-controller-q"),
    (["--research-opti-controller-q", "1.5"], {}, "--research-opti-controller-q"),
    ([], {"NEXTN_RESEARCH_OPTI_CONTROLLER_Q": "-0.1"}, "NEXTN_RESEARCH_OPTI_CONTROLLER_Q"),
    ([], {"NEXTN_RESEARCH_OPTI_CONTROLLER_Q": "inf"}, "NEXTN_RESEARCH_OPTI_CONTROLLER_Q"),
], ids=["flag-nan", "flag-above-1", "env-negative", "env-inf"])
@pytest.mark.slow
def test_bad_q_fails_startup_with_one_line(argv, env, needle):
    r = run_nextn("serve", str(tiny_checkpoint()), *argv, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.slow
def test_env_arms_a_real_process_once():
    """`nextn serve` with NEXTN_RESEARCH_OPTI_CONTROLLER_Q: one startup line and the /metrics block."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NEXTN_RESEARCH_OPTI_CONTROLLER_Q": "0.7"}
    proc = subprocess.Popen(NEXTN + ["serve", str(tiny_checkpoint()), "--port", str(port), "--num-speculative-tokens",
                                     "1"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: http_ready(base), timeout=60), "server did not become ready"
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == _plain(PROMPTS[1])[:16]
        text = httpx.get(base + "/metrics").text
        assert "nextn_optipipe_gate_checks_total" in text and "nextn_optipipe_breaker_trips_total" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    armed = [line for line in stderr.splitlines() if "research door armed" in line]
    assert len(armed) == 1 and "q=0.7" in armed[0], stderr
