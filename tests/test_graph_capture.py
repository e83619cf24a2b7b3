"""CUDA graphs captured at startup (engine/graphs.py `GraphRunner.capture_all`, called by engine/selfcheck.py
`startup`) on a CPU: the kernel path forced (`ops.force_kernels()`, TRITON_INTERPRET=1) and torch's CUDA graph API
replaced by a recording fake, so the runner's bookkeeping runs as it would on CUDA.

What each test proves: every (kind, bucket, T) the pool allows is captured at startup and later calls replay
it; a failed capture leaves that key alone eager (logged, correct results), the others replay; `startup` logs
the capture and its time, and `--kernels strict` makes a failed capture fatal; a CPU runner captures nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine import selfcheck
from engine.cache import StatePool
from engine.graphs import EAGER, GraphRunner
from engine.model.ops import dispatch as ops
from tests.ops_util import needs_triton, spy
from tests.test_kernel_path import V, _clone, _model

pytestmark = needs_triton


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays (the runner returns the outputs recorded at capture)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@contextlib.contextmanager
def fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch, fail_at: set[int] = frozenset()) -> Iterator[list[FakeGraph]]:
    """torch.cuda.CUDAGraph / torch.cuda.graph replaced: capture i (0-based, in call order) raises when i is in
    `fail_at`, else the body runs (a CPU cannot record) and its graph is kept. Yields the graphs made."""
    graphs: list[FakeGraph] = []
    n = [0]

    class Capture:
        def __init__(self, graph, **kw):
            self.i = n[0]
            n[0] += 1

        def __enter__(self):
            if self.i in fail_at:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    def make() -> FakeGraph:
        graphs.append(FakeGraph())
        return graphs[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", make)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    yield graphs


def _runner(window: int = 1) -> GraphRunner:
    """A runner over a fresh pool (3 slots, K = window - 1, an MTP part) with buckets 1 and 2, capture on."""
    m = _model(seed=11)
    pool = StatePool(m.config, 3, 32, window, dtype=m.config.dtype)
    runner = GraphRunner(m, pool, [1, 2], scratch=[pool.alloc()])
    runner.capture = True  # as on CUDA
    return runner


def test_every_key_is_captured_at_startup_and_replayed(monkeypatch):
    runner = _runner(window=2)
    keys = runner.step_keys()
    assert keys == [(k, B, T) for k in ("verify", "draft") for B in (1, 2) for T in (1, 2)]
    with fake_cuda_graphs(monkeypatch) as graphs, ops.force_kernels():
        rep = runner.capture_all()
        assert rep.captured == [f"{k} B={B} T={T}" for k, B, T in keys] and rep.eager == {}
        assert runner.num_graphs == len(keys) == len(graphs)
        tokens = torch.zeros(2, 2, dtype=torch.long)
        with spy(runner, "_verify_body") as bodies, torch.inference_mode():
            runner.verify(runner.model, runner.pool, tokens, [0, 1], [3, 3], [0, 0])
        assert not bodies and [g.replays for g in graphs] == [0, 0, 0, 1] + [0] * 4  # verify B=2 T=2 replayed


def test_a_failed_capture_leaves_that_key_alone_eager(monkeypatch, caplog):
    runner = _runner()
    bad = runner.step_keys().index(("verify", 2, 1))
    with fake_cuda_graphs(monkeypatch, fail_at={bad}) as graphs, ops.force_kernels(), \
            caplog.at_level("WARNING", logger="engine.graphs"):
        rep = runner.capture_all()
        assert list(rep.eager) == ["verify B=2 T=1"] and "operation not permitted" in rep.eager["verify B=2 T=1"]
        assert len(rep.captured) == runner.num_graphs == len(runner.step_keys()) - 1
        assert [r.getMessage() for r in caplog.records] == [
            "CUDA graph capture of verify B=2 T=1 failed (RuntimeError: CUDA error: operation not permitted when "
            "stream is capturing); that step runs eagerly from now on"]
        # that key runs eagerly with the right result; no second capture attempt
        ref = _clone(runner.pool)
        tokens = torch.randint(0, V, (2, 1), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want = EAGER.verify(runner.model, ref, tokens, [0, 1], [0, 0], [0, 0])[2]
            got = runner.verify(runner.model, runner.pool, tokens, [0, 1], [0, 0], [0, 0])[2]
        assert torch.equal(got, want) and len(graphs) == len(runner.step_keys())  # one attempt per key
        assert all(g.replays == 0 for g in graphs)


@pytest.mark.slow
def test_startup_logs_the_capture_and_strict_makes_a_failure_fatal(monkeypatch, caplog):
    runner = _runner()
    with fake_cuda_graphs(monkeypatch), ops.force_kernels(), caplog.at_level("INFO", logger="engine.selfcheck"):
        rep = selfcheck.startup(runner.model, runner, strict=True)
    assert rep.graphs is not None and len(rep.graphs.captured) == 4 and rep.seconds > 0
    lines = [r.getMessage() for r in caplog.records]
    assert any(x.startswith("CUDA graphs: 4 of 4 captured in ") for x in lines), lines
    assert lines[-1].startswith("startup on cpu: ") and "kernel self-check and CUDA graph capture" in lines[-1]
    runner = _runner()
    with fake_cuda_graphs(monkeypatch, fail_at={0}), ops.force_kernels():
        with pytest.raises(selfcheck.KernelCheckFailed, match=r"^--kernels strict: CUDA graph capture failed for "
                                                              r"verify B=1 T=1 \(RuntimeError"):
            selfcheck.startup(runner.model, runner, strict=True)


def test_a_cpu_runner_captures_nothing():
    runner = _runner()
    runner.capture = False  # what a CPU runner is
    with ops.force_kernels():
        rep = runner.capture_all()
    assert rep.captured == [] and rep.eager == {} and runner.num_graphs == 0
