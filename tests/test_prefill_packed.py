"""Prompt prefill on the kernel path (CUDA with triton; here the Triton interpreter under `ops.force_kernels`, the C
kernels off so that every op is the kernel path's): the matmul's "prefill" tiling and packed prefill.

  * every GEMM of a prefill forward (a packed, right-padded grid block forward, its prompt row's logits, the MTP
    head's prompt rows; dense and MoE) runs the "prefill" tiling, every GEMM of a step forward (verify, drafts) the
    "step" one: the tiling follows the forward's kind (`FwdCtx.phase`), never its rows;
  * the scheduler packs the next blocks of several sessions into one forward on the kernel path (`packs_rows`; a
    session's blocks in one row), and what each session's prefill leaves (its first token's
    logits, K/V rows, GDN states, MTP head rows and queued row) is bitwise what one block per forward leaves; decode
    steps there are not taken to reach a prefill's states (`steps_match_prefill` False), and a prefill kernel that
    fell back to its twin ends the packing. Greedy spec == plain with packed prefill: tests/test_prefill_wired.py.
"""
from __future__ import annotations

import pytest
import torch

import engine.scheduler as sched_mod
import engine.session as session_mod
from engine.cache import PREFILL_GRID, KVPool, StatePool
from engine.model.ops import cpu
from engine.model.ops import dispatch as ops
from engine.model.ops import matmul as mm
from engine.model.qwen35 import FwdCtx
from engine.prefill import packs_rows, prefill_rows, steps_match_prefill
from engine.scheduler import Scheduler
from tests.ops_util import needs_triton
from tests.test_kernel_path import V, _kctx, _model
from tests.test_prefix import Rows

pytestmark = needs_triton

G = 16  # the packing test's grid, a divisor of PREFILL_GRID, so the interpreter stays quick: packed or not, a block
# starts at the same position, so the kernels' chunks and key blocks line up the same either way


@pytest.fixture
def kernel_path():
    """The kernel path on a CPU: Triton kernels under the interpreter, ops/cpu.py's C kernels off."""
    prev = cpu.set_enabled(False)
    try:
        with ops.force_kernels():
            yield
    finally:
        cpu.set_enabled(prev)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_prefill_forwards_run_the_prefill_tiling(moe, kernel_path, monkeypatch):
    m = _model(moe, "float32", seed=31)
    cfg = m.config
    phases: list[str] = []
    real = mm.matmul

    def spy(*a, phase="step", **kw):
        phases.append(phase)
        return real(*a, phase=phase, **kw)

    monkeypatch.setattr(mm, "matmul", spy)
    g = torch.Generator().manual_seed(1)
    pool = StatePool(cfg, 2, 64, 4, dtype=cfg.dtype)
    ids = torch.randint(0, V, (2, 9), generator=g)
    with torch.inference_mode():
        ctx = FwdCtx.make(cfg, "cpu", cfg.dtype, [0, 1], [0, 0], [0, 0], [0, 0], 9, False, lens=[9, 5])
        post = m.model.norm(m.forward_step(ids, ctx, pool), ctx)  # [2, 9, H]: a packed, padded block forward
        m.logits(post[0, -1], ctx=ctx)  # the prompt's last row
        m.mtp_forward(ids, post, FwdCtx.make(cfg, "cpu", cfg.dtype, [0, 1], [0, 0], [0, 0], [0, 0], 9, False),
                      pool.mtp)  # the MTP head's prompt rows
        prefill, phases[:] = list(phases), []
        kctx = _kctx(m, pool, [0, 1], [9, 5], [0, 0], 3)
        m.logits(m.model.norm(m.forward_step(ids[:, :3], kctx, pool)))  # a verify step
        m.logits(m.mtp_forward(ids[:, :1], post[:, :1], _kctx(m, pool, [0, 1], [9, 5], [0, 0], 1), pool.mtp))
    n_layers = len(cfg.layer_types)
    assert len(prefill) >= 2 * n_layers + 3, prefill  # every layer's projections, the LM head, the head's fc
    assert set(prefill) == {"prefill"}, f"a prefill forward ran the step tiling: {prefill}"
    assert phases and set(phases) == {"step"}, f"a step forward ran the prefill tiling: {phases}"


def _prefill(m, prompts: list[list[int]], k: int, packed: bool, monkeypatch) -> tuple[list[Rows], list[int]]:
    """Every prompt joins one scheduler at once (greedy, K = k; the grid G) and prefills (one step: the budget takes
    every block); packed=False: one block per forward. Returns the sessions (each has chosen its first token) and
    the rows of each prefill forward."""
    assert PREFILL_GRID % G == 0
    monkeypatch.setattr(session_mod, "PREFILL_GRID", G)
    monkeypatch.setattr(sched_mod, "PREFILL_GRID", G)
    sched = Scheduler(m, max_num_seqs=len(prompts), max_model_len=2 * G + 16, k=k, max_num_batched_tokens=4 * G,
                      step_graphs=False)
    assert sched.packs
    sched.packs = packed
    sizes: list[int] = []

    def spy(model, rows, *a, **kw):
        sizes.append(len(rows))
        return prefill_rows(model, rows, *a, **kw)

    monkeypatch.setattr(sched_mod, "prefill_rows", spy)
    ss = [Rows(m, p, 4, k=k, pool=sched.pool) for p in prompts]
    for s in ss:
        sched.add(s)
    sched.step()
    sched.settle()  # the prompts' MTP rows wait behind their first tokens
    assert not sched.joining and all(s.error is None and len(s.emitted) == 1 for s in ss)
    return ss, sizes


def _state(s: Rows) -> list[torch.Tensor]:
    """What the prefill left for session s: its K/V rows, live GDN states, MTP head rows and the queued MTP row."""
    out = []
    for c in s.pool.layers:
        if isinstance(c, KVPool):
            out += [c.k[s.slot, :s.cache.length], c.v[s.slot, :s.cache.length]]
        else:
            out += [c.conv[s.slot, s.cache.cur], c.rec[s.slot, s.cache.cur]]
    if s.scratch is not None:
        n = s.scratch.length
        out += [s.pool.mtp.k[s.slot, :n], s.pool.mtp.v[s.slot, :n], s._mtp_hidden]
    return [t.clone() for t in out]


@pytest.mark.slow
def test_packed_prefill_equals_one_block_per_forward(kernel_path, monkeypatch):
    """A dense model (a MoE block's rows alone vs packed: tests/test_prefill_wired.py
    `test_block_bits_alone_or_packed`)."""
    m = _model(False, "float32", seed=32)
    assert packs_rows(m) and not steps_match_prefill(m)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (G + 7, 5, G + 3)]
    one, sizes1 = _prefill(m, prompts, 3, False, monkeypatch)
    one = [(s.emitted, s.rows, _state(s)) for s in one]
    packed, sizes = _prefill(m, prompts, 3, True, monkeypatch)
    # packed: a session's blocks in one row (tests/test_prefill_multiblock.py), rows padded to 23 tokens, so the
    # third row (3 x 23 > the budget of 64) takes a second forward
    assert sizes1 == [1] * 5 and sizes == [2, 1], (sizes1, sizes)
    for i, (s, (emitted, rows, state)) in enumerate(zip(packed, one)):
        assert s.emitted == emitted and torch.equal(s.rows[0], rows[0]), f"prompt {i}: first token's logits"
        got = _state(s)
        assert len(got) == len(state)
        for j, (x, y) in enumerate(zip(got, state)):
            assert torch.equal(x, y), f"prompt {i}: state tensor {j} differs packed vs one block per forward"


def test_a_fallen_back_prefill_kernel_ends_the_packing(kernel_path, monkeypatch):
    """Also in a scheduler built before the fallback (the startup self-check runs after the scheduler is built)."""
    m = _model(False, "float32", seed=33)
    assert packs_rows(m)
    sizes: list[int] = []
    monkeypatch.setattr(sched_mod, "prefill_rows", lambda model, rows, *a, **kw: sizes.append(len(rows)))  # forwards' rows only
    sched = Scheduler(m, max_num_seqs=3, max_model_len=64, k=3, max_num_batched_tokens=64, step_graphs=False)
    g = torch.Generator().manual_seed(3)
    for n in (5, 7, 3):
        sched.add(Rows(m, torch.randint(0, V, (n,), generator=g).tolist(), 2, k=3, pool=sched.pool))
    try:
        ops.fall_back("gdn_prefill", "test")
        assert not packs_rows(m)
        sched.step()
    finally:
        ops.reset_fallbacks()
    assert sched.packs and sizes == [1, 1, 1]
    sched.step()
    assert sizes[3:] == [3], "packing again once every prefill kernel runs"
