"""The model's kernel path (engine/model/qwen35.py, moe.py through engine/model/ops, engine/graphs.py) on a CPU:
`ops.force_kernels()` runs the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py), at tiny shapes.

What each test proves (the issue #11 contract, without a GPU):
  * the whole step forward through the kernels (trunk verify and the MTP head; dense and MoE; fp32 and bf16)
    equals the torch path within tolerance, logits and every state it writes;
  * a session's logits (and the GDN states it records) are bitwise the same alone or batched with other
    sessions, and at T = 1 (token by token) or inside one T = K + 1 verify;
  * greedy spec decoding == plain greedy decoding through the kernels, K = 1..4, batched through the
    scheduler's `GraphRunner` (static buffers, a padded bucket with a scratch slot), fp32 and bf16;
  * the bodies a CUDA graph would capture read no host value (no .item / bool / tolist / torch.tensor) and the
    runner's padding rows touch only their scratch slot.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cache import GdnPool, KVPool, StatePool
from engine.graphs import EAGER, GraphRunner, graph_buckets, padding_rows
from engine.model.config import Qwen35Config
from engine.model.ops import dispatch as ops
from engine.model.qwen35 import FwdCtx, Qwen35ForCausalLM, rope_table
from engine.scheduler import Scheduler
from engine.spec import DraftedSession, SpecSession
from tests.ops_util import needs_triton
from tests.test_spec import forced_drafter
from tests.tiny import hf_config, random_model

pytestmark = needs_triton

V = 160
W = 5  # K + 1 for K = 4
SMALL = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=V,
             num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2)


def _model(moe: bool = False, dtype: str = "float32", seed: int = 3):
    cfg = Qwen35Config.from_dict(hf_config(moe=moe, **SMALL), dtype=dtype)
    m = random_model(cfg, seed)
    m.fuse()
    return m


def _clone(pool: StatePool) -> StatePool:
    """A deep copy of the pool's tensors (same slots, same free list)."""
    p = copy.copy(pool)
    p.layers = [KVPool(c.k.clone(), c.v.clone()) if isinstance(c, KVPool) else GdnPool(c.conv.clone(), c.rec.clone())
                for c in pool.layers]
    p.mtp = KVPool(pool.mtp.k.clone(), pool.mtp.v.clone()) if pool.mtp is not None else None
    return p


def _prefilled(m, lens: list[int], seed: int = 0) -> tuple[StatePool, list[int]]:
    """A pool whose slot i holds a random prompt of lens[i] tokens (torch-path prefill); the live GDN window slot
    of slot i is i % 2 (so verify reads a nonzero `cur` too). Returns (pool, cur)."""
    cfg = m.config
    pool = StatePool(cfg, len(lens) + 1, 64, W, dtype=cfg.dtype)
    g = torch.Generator().manual_seed(seed)
    cur = [i % 2 for i in range(len(lens))]
    with torch.inference_mode():
        for s, n in enumerate(lens):
            ids = torch.randint(0, V, (1, n), generator=g)
            m.forward_step(ids, FwdCtx.make(cfg, "cpu", cfg.dtype, [s], [0], [0], [cur[s]], n, False), pool)
            toks = torch.randint(0, V, (1, n), generator=g)
            hid = torch.randn(1, n, cfg.hidden_size, generator=g).to(cfg.dtype)
            m.mtp_forward(toks, hid, FwdCtx.make(cfg, "cpu", cfg.dtype, [s], [0], [0], [0], n, False), pool.mtp)
    return pool, cur


def _kctx(m, pool, slots, pos0, cur, T) -> FwdCtx:
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return FwdCtx.from_tensors(t(slots), t(pos0), t(cur), T, rope_table(m.config, pool.capacity, "cpu", pool.dtype))


@torch.inference_mode()
def _verify(m, pool, tokens, slots, pos0, cur, kernels: bool):
    """Logits [N, T, V] of one recording step (kernel or torch path)."""
    N, T = tokens.shape
    if kernels:
        with ops.force_kernels():
            h = m.forward_step(tokens, _kctx(m, pool, slots, pos0, cur, T), pool)
            return m.logits(m.model.norm(h))
    ctx = FwdCtx.make(m.config, "cpu", pool.dtype, slots, pos0, cur, [0] * N, T, True)
    return m.logits(m.model.norm(m.forward_step(tokens, ctx, pool)))


@torch.inference_mode()
def _mtp(m, pool, tokens, hidden, slots, pos0, kernels: bool):
    N, T = tokens.shape
    if kernels:
        with ops.force_kernels():
            return m.logits(m.mtp_forward(tokens, hidden, _kctx(m, pool, slots, pos0, [0] * N, T), pool.mtp))
    ctx = FwdCtx.make(m.config, "cpu", pool.dtype, slots, pos0, [0] * N, [0] * N, T, False)
    return m.logits(m.mtp_forward(tokens, hidden, ctx, pool.mtp))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1.0)).item()


def _upcast(m):
    """The same weights in an fp32 model (the reference the bf16 paths are measured against)."""
    m32 = Qwen35ForCausalLM(m.config.replace(dtype=torch.float32))
    m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    m32.eval()
    m32.fuse()
    return m32


@pytest.mark.parametrize("moe,dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16"),
                                       (True, "bfloat16")])
def test_kernel_step_forward_matches_torch_path(moe, dtype):
    """fp32: kernel path == torch path to 2e-5 (logits, K/V rows and per-position GDN states written, MTP head).
    bf16: both paths are measured against the same weights in fp32; the kernel path (fp32 accumulation, one
    rounding per fused op) must be at least about as close as the torch path (1.5x + 5e-3)."""
    m = _model(moe, dtype)
    pool, cur = _prefilled(m, [7, 12, 3])
    kpool = _clone(pool)
    g = torch.Generator().manual_seed(1)
    slots, pos0, T = [2, 0], [3, 7], 4
    cur = [cur[s] for s in slots]
    tokens = torch.randint(0, V, (2, T), generator=g)
    hid = torch.randn(2, T, m.config.hidden_size, generator=g).to(m.config.dtype)
    got = [_verify(m, kpool, tokens, slots, pos0, cur, True), _mtp(m, kpool, tokens, hid, slots, pos0, True)]
    ref_path = [_verify(m, pool, tokens, slots, pos0, cur, False), _mtp(m, pool, tokens, hid, slots, pos0, False)]
    if dtype == "bfloat16":
        m32 = _upcast(m)
        pool32, _ = _prefilled(m32, [7, 12, 3])
        ref = [_verify(m32, pool32, tokens, slots, pos0, cur, False),
               _mtp(m32, pool32, tokens, hid.float(), slots, pos0, False)]
        for what, a, b, r in zip(("verify logits", "MTP logits"), got, ref_path, ref):
            assert _rel(a, r) <= 1.5 * _rel(b, r) + 5e-3, \
                f"{what}: kernel path {_rel(a, r):.2e} from fp32, torch path {_rel(b, r):.2e}"
        return
    for what, a, b in zip(("verify logits", "MTP logits"), got, ref_path):
        assert _rel(a, b) <= 2e-5, f"{what}: {_rel(a, b):.2e}"
    for a, b in zip(kpool.layers, pool.layers):  # what the step wrote: K/V rows, per-position GDN states
        if isinstance(a, KVPool):
            for s, p in zip(slots, pos0):
                assert _rel(a.k[s, p:p + T], b.k[s, p:p + T]) <= 2e-5 and _rel(a.v[s, p:p + T], b.v[s, p:p + T]) <= 2e-5
        else:
            assert _rel(a.rec[slots, :T], b.rec[slots, :T]) <= 2e-5, "GDN recurrent states"
            assert _rel(a.conv[slots, :T], b.conv[slots, :T]) <= 2e-5, "GDN conv states"


@pytest.mark.slow
@pytest.mark.parametrize("moe,dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_logits_bitwise_alone_or_batched_and_t1_or_verify(moe, dtype):
    m = _model(moe, dtype, seed=4)
    base, cur = _prefilled(m, [9, 4, 15], seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (3, W), generator=g)
    slots, pos0 = [1, 0, 2], [4, 9, 15]
    cur = [cur[s] for s in slots]
    batched = _clone(base)
    lb = _verify(m, batched, tokens, slots, pos0, cur, True)  # [3, W, V]: row 1 = session in slot 0
    alone = _clone(base)
    la = _verify(m, alone, tokens[1:2], slots[1:2], pos0[1:2], cur[1:2], True)
    assert torch.equal(la[0], lb[1]), "session's verify logits: alone vs in a batch of 3"
    steps = _clone(base)
    c = list(cur)
    for t in range(W):  # token by token, batched with a different companion (slot 2) each step
        order = [2, 0] if t % 2 else [0, 2]
        i = {s: slots.index(s) for s in order}
        lt = _verify(m, steps, tokens[[i[s] for s in order], t:t + 1], order, [pos0[i[s]] + t for s in order],
                     [c[i[s]] for s in order], True)
        assert torch.equal(lt[order.index(0), 0], lb[1, t]), f"T=1 step {t} vs column {t} of the T={W} verify"
        c = [0, 0, 0]  # a T = 1 step leaves the state in window slot 0
    for a, b in zip(steps.layers, batched.layers):
        if isinstance(a, GdnPool):  # the state after the last token: slot 0 (T=1) == slot W-1 (verify)
            assert torch.equal(a.rec[0, 0], b.rec[0, W - 1]) and torch.equal(a.conv[0, 0], b.conv[0, W - 1])
    hid = torch.randn(3, 2, m.config.hidden_size, generator=g).to(m.config.dtype)
    mb = _mtp(m, _clone(base), tokens[:, :2], hid, slots, pos0, True)
    ma = _mtp(m, _clone(base), tokens[1:2, :2], hid[1:2], slots[1:2], pos0[1:2], True)
    assert torch.equal(ma[0], mb[1]), "MTP draft logits: alone vs batched"


def run_greedy(m, prompts: list[list[int]], n_new: int, k: int, refs: list[list[int]] | None = None,
               **sched_kw) -> tuple[list[list[int]], list[SpecSession], Scheduler]:
    """Greedy sessions of `prompts` through one Scheduler (K = k) until done: (tokens each emitted, the sessions, the
    scheduler). refs: plain greedy's tokens, which forced drafts (`forced_drafter`) follow except at hashed
    positions (every n_acc path)."""
    sched = Scheduler(m, k=k, **sched_kw)
    ss = [SpecSession(m, p, n_new, k=k, pool=sched.pool) if refs is None
          else DraftedSession(m, p, n_new, k=k, pool=sched.pool, drafter=forced_drafter(refs[i], len(p), V, k, 0.35))
          for i, p in enumerate(prompts)]
    for s in ss:
        sched.add(s)
    while sched.num_sessions:
        sched.step()
    return [s.emitted for s in ss], ss, sched


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_spec_equals_plain_through_kernels_and_graph_runner(dtype):
    """Three sessions batched through the scheduler's GraphRunner (bucket 4: one padding row on its scratch slot):
    plain greedy (K = 0) and greedy spec with forced drafts (every n_acc path) give the same tokens, K = 1..4 in
    float32, K = 1 and 3 in bfloat16 (each K costs a run under the interpreter; the torch-path tests cover 1..8)."""
    m = _model(False, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 2)]
    n_new = 10

    def run(k, refs=None):
        out, ss, sched = run_greedy(m, prompts, n_new, k, refs, max_num_seqs=4, max_model_len=40,
                                    max_num_batched_tokens=64, step_graphs=True)
        assert isinstance(sched.runner, GraphRunner) and sched.buckets == [1, 2, 4] and sched.pool.slots == 5
        return out, ss

    with ops.force_kernels():
        plain, _ = run(0)
        assert all(len(p) == n_new for p in plain)
        for k in (range(1, 5) if dtype == "float32" else (1, 3)):
            out, ss = run(k, plain)
            assert out == plain, f"K={k}"
            assert sum(s.telem.accepted for s in ss) > 0 and sum(s.telem.rounds for s in ss) > 0


class _NoHostReads(TorchDispatchMode):
    """Fails on any op that reads a tensor value on the host or bakes host data into the step."""

    BANNED = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.lift_fresh", "aten.masked_select")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.BANNED):
            raise AssertionError(f"host read inside a captured step: {func}")
        return func(*args, **(kwargs or {}))


@contextmanager
def _no_host_reads():
    def refuse(*a, **k):
        raise AssertionError("host read inside a captured step: Tensor.tolist")

    orig, torch.Tensor.tolist = torch.Tensor.tolist, refuse
    try:
        with _NoHostReads():
            yield
    finally:
        torch.Tensor.tolist = orig


@pytest.mark.parametrize("moe", [False, True])
def test_graph_bodies_read_no_host_values_and_padding_stays_in_scratch(moe):
    m = _model(moe, "float32", seed=7)
    base, cur = _prefilled(m, [6, 10, 3, 1], seed=4)  # slot 4 is free: the scratch slot
    runner = GraphRunner(m, base, [1, 2, 4], scratch=[4])
    ref = _clone(base)
    g = torch.Generator().manual_seed(8)
    slots, pos0, c = [2, 0, 1], [3, 6, 10], [cur[2], cur[0], cur[1]]
    tokens = torch.randint(0, V, (3, 3), generator=g)
    with ops.force_kernels(), torch.inference_mode():
        want = EAGER.verify(m, ref, tokens, slots, pos0, c)[2]
        # what a replay does: the host fills the static buffers, then the captured body runs
        st = runner._load("verify", 4, tokens, None, slots, pos0, c, [0, 0, 0])
        with _no_host_reads():
            got = runner._verify_body(st)[2]
        assert torch.equal(got[:3], want), "bucket-padded static-buffer verify vs the eager kernel path"
        hid = torch.randn(3, 3, m.config.hidden_size, generator=g)
        h_want, l_want = EAGER.draft(m, ref, tokens, hid, slots, pos0, [2, 0, 1])
        st = runner._load("draft", 4, tokens, hid, slots, pos0, [0, 0, 0], [2, 0, 1])
        with _no_host_reads():
            h_got, l_got = runner._draft_body(st)
        assert torch.equal(l_got[:3], l_want) and torch.equal(h_got[:3], h_want), "draft depth 0"
    pairs = [(x, y) for a, b in zip(base.layers + [base.mtp], ref.layers + [ref.mtp])
             for x, y in (((a.k, b.k), (a.v, b.v)) if isinstance(a, KVPool) else ((a.conv, b.conv), (a.rec, b.rec)))]
    for x, y in pairs:  # the padding row wrote only its scratch slot
        assert torch.equal(x[:4], y[:4]), "a session slot differs after the padded run"
        assert not torch.equal(x[4], y[4]), "the padding row did not run on its scratch slot"


def test_buckets_and_scheduler_defaults_on_cpu(tmp_path):
    assert graph_buckets(1) == [1] and graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20] and padding_rows(graph_buckets(20)) == 7
    assert padding_rows([1, 2, 4, 8]) == 3 and padding_rows([1]) == 0
    m = _model()
    sched = Scheduler(m, max_num_seqs=3, max_model_len=32, k=2, max_num_batched_tokens=64)
    assert sched.runner is EAGER and sched.buckets == [] and sched.pool.slots == 3  # the torch path: unchanged
    with pytest.raises(ValueError, match="scratch"):
        GraphRunner(m, sched.pool, [1, 4], scratch=[])


def test_a_failed_capture_serves_that_key_eagerly_from_then_on(monkeypatch, caplog):
    """GraphRunner._run as on CUDA (capture on) with a capture that fails: the call still returns its eager
    result, nothing is kept as a graph, the failure is logged with its key, and later calls of that key run
    eagerly without a second attempt; capture stays on for the other keys (tests/test_graph_capture.py)."""
    m = _model(seed=9)
    base, cur = _prefilled(m, [5, 7], seed=6)
    runner = GraphRunner(m, base, [1, 2], scratch=[2])
    ref = _clone(base)
    calls = []

    class FailingCapture:
        def __init__(self, *a, **kw):
            calls.append(kw)

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    runner.capture = True
    tokens = torch.randint(0, V, (2, 2), generator=torch.Generator().manual_seed(2))
    with ops.force_kernels(), torch.inference_mode(), caplog.at_level("WARNING", logger="engine.graphs"):
        want = EAGER.verify(m, ref, tokens, [0, 1], [5, 7], cur)[2]
        got = runner.verify(m, base, tokens, [0, 1], [5, 7], cur)[2]
        assert torch.equal(got, want) and len(calls) == 1
        assert runner.capture and runner.num_graphs == 0
        assert "capture of verify B=2 T=2 failed (RuntimeError" in caplog.text
        want = EAGER.verify(m, ref, tokens, [0, 1], [5, 7], cur)[2]  # both pools took the same first step
        again = runner.verify(m, base, tokens, [0, 1], [5, 7], cur)[2]  # eager: no second capture attempt
        assert torch.equal(again, want) and len(calls) == 1 and runner.num_graphs == 0
