"""The C kernels on two threads (engine/model/ops/cpu_par.c): the same bits as on one, the helper really computes
items, and a forked child never waits on a helper it does not have."""
from __future__ import annotations

import ctypes
import multiprocessing as mp

import pytest
import torch

from engine.model.ops import cpu
from tests.ops_util import assert_bitwise
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch path runs")


def _var(name: str) -> ctypes.c_int64:
    return ctypes.c_int64.in_dll(cpu._get(), name)


@pytest.fixture
def threads2():
    """Two kernel threads, every job split (no minimum size), restored afterwards."""
    min_work = _var("nextn_par_min_work")
    prev_min, prev = min_work.value, cpu.set_threads(2)
    min_work.value = 0
    try:
        yield
    finally:
        min_work.value = prev_min
        cpu.set_threads(prev)


def _helper_items() -> int:
    return _var("nextn_par_helper_items").value


def test_set_threads_caps_at_two_and_is_reported():
    prev = cpu.set_threads(5)
    try:
        assert cpu.threads() == cpu.MAX_THREADS == 2
        assert "on 2 threads" in cpu.describe("cpu", torch.float32)
        cpu.set_threads(0)
        assert cpu.threads() == 1 and "on 1 thread" in cpu.describe("cpu", torch.float32)
    finally:
        cpu.set_threads(prev)


@pytest.mark.skipif(not cpu._gemm, reason="a CPU without AVX2 + FMA: the torch GEMM runs")
def test_gemm_and_mlp_on_two_threads_are_bitwise_one_thread(threads2):
    g = torch.Generator().manual_seed(11)
    before = _helper_items()
    for M, N, K in ((1, 2112, 128), (4, 100, 64), (33, 392, 128), (64, 4096, 256)):
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        two = cpu.linear(x, w)
        cpu.set_threads(1)
        one = cpu.linear(x, w)
        cpu.set_threads(2)
        assert_bitwise(two, one, f"linear {M}x{N}x{K}")
        wgu, wd = torch.randn(2 * 96, K, generator=g), torch.randn(K, 96, generator=g)
        two = cpu.mlp_or_none(x, wgu, wd)
        cpu.set_threads(1)
        one = cpu.mlp_or_none(x, wgu, wd)
        cpu.set_threads(2)
        assert_bitwise(two, one, f"mlp {M}x{K}")
    x, w = torch.randn(64, 512, generator=g), torch.randn(8192, 512, generator=g)
    for _ in range(50):  # a job of milliseconds: the helper wakes and takes items (it may be slow to, once)
        cpu.linear(x, w)
        if _helper_items() > before:
            break
    assert _helper_items() > before, "the helper never computed an item"


@pytest.mark.skipif(not cpu._gemm, reason="a CPU without AVX2 + FMA: the torch GEMM runs")
def test_the_helper_computes_under_the_callers_denormal_mode(threads2):
    """Flush-to-zero / denormals-are-zero set on the calling thread (torch.set_flush_denormal) after the helper
    started: the helper's column blocks flush exactly as the caller's do."""
    x, w = torch.full((64, 256), 1e-20), torch.full((4096, 256), 1e-20)  # products 1e-40: denormal
    cpu.linear(x, w)  # the helper exists, started under the default mode
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        for _ in range(20):
            before = _helper_items()
            y = cpu.linear(x, w)
            assert not y.any(), "a thread computed denormals under the caller's flush-to-zero mode"
            if _helper_items() > before:
                break
    finally:
        torch.set_flush_denormal(False)
    assert cpu.linear(x, w).all(), "without flush-to-zero the sums are denormal, not zero"


def _greedy_rounds(model, prompts: list[list[int]], k: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    from engine.scheduler import Scheduler
    from engine.spec import SpecSession

    sched = Scheduler(model, max_num_seqs=len(prompts), max_model_len=256, k=k, max_num_batched_tokens=512)
    ss = [SpecSession(model, p, 24 + 5 * i, k=k, pool=sched.pool) for i, p in enumerate(prompts)]
    for s in ss:
        sched.add(s)
    for _ in range(6):  # mid-decode: the pool still holds every row's state
        sched.step()
    pool = sched.pool
    state = [t.clone() for c in pool.layers for t in ((c.k, c.v) if hasattr(c, "k") else (c.conv, c.rec))]
    state += [pool.mtp.k.clone(), pool.mtp.v.clone()] if pool.mtp is not None else []
    while sched.num_sessions:
        sched.step()
    return [s.emitted for s in ss], state


def test_batched_spec_rounds_on_two_threads_are_bitwise_one_thread(tmp_path, threads2):
    """Every kernel of a step forward (GEMMs, MLP, GDN and attention rows) split over two threads: the same tokens
    and the same pool bits (GDN states, conv windows, K/V) as one thread, for a batch of rows of different lengths."""
    from engine.loader import load_model

    model = load_model(make_checkpoint(tmp_path / "m", seed=8, with_tokenizer=False))
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30)]
    before = _helper_items()
    two = _greedy_rounds(model, prompts, 3)
    cpu.set_threads(1)
    one = _greedy_rounds(model, prompts, 3)
    assert two[0] == one[0]
    assert len(two[1]) == len(one[1]) > 0
    for i, (a, b) in enumerate(zip(two[1], one[1])):
        assert_bitwise(a, b, f"pool tensor {i}")
    assert _helper_items() >= before  # (whether it woke in time is the box's business; the bits are ours)


def _raw(t: torch.Tensor) -> bytes:
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


_FORK_INPUTS: tuple[torch.Tensor, torch.Tensor] | None = None


def _child(q, want: bytes) -> None:
    """In the forked child: a two-thread job, its bytes compared without torch ops (the parent's OpenMP pool, if
    any, is not fork-safe; ours must be)."""
    assert _FORK_INPUTS is not None
    q.put(_raw(cpu.linear(*_FORK_INPUTS)) == want)


@pytest.mark.skipif(not cpu._gemm, reason="a CPU without AVX2 + FMA: the torch GEMM runs")
def test_a_forked_child_runs_threaded_jobs_without_the_parents_helper(threads2):
    global _FORK_INPUTS
    _FORK_INPUTS = x, w = torch.randn(64, 256), torch.randn(2048, 256)
    want = _raw(cpu.linear(x, w))  # the parent's helper exists now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, want))
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive and p.exitcode == 0, "the forked child hung or failed in a two-thread job"
    assert q.get(timeout=5) is True
