"""The prefill kernels wired into the model (engine/model/qwen35.py `FwdCtx.prefill_kernels`): a host prefill forward
on the kernel path writes K/V with ops.write_kv, attends through ops.attention_prefill and runs the GDN recurrence
through ops.gdn_prefill. On a CPU under TRITON_INTERPRET=1 (`ops.force_kernels`), at tiny shapes:

  * the wired prefill's logits and what it writes in the pool (K/V, the GDN recurrent and conv states) match the
    torch path's prefill within the kernels' twin tolerance (fp32), padded rows and a read slot != write slot too;
  * grid invariance: a prompt of several grid blocks and a tail, prefilled in one forward or one forward per grid
    block (engine.prefill.prefill), gives bitwise the same logits and states; a block's bits are also the same alone
    or packed with another row (right-padded);
  * greedy spec == plain greedy, token for token, with the prefill on the kernels (K = 1, 3);
  * the model really calls the two kernels (and neither SDPA nor the torch chunked GDN) on that path, and not on
    the CPU's own path.
The grid here is 64 tokens (a divisor of engine.cache.PREFILL_GRID and a multiple of the GDN chunk and of the
attention kernel's key block) so the interpreter stays quick; the slow test runs the real grid."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.prefill as prefill_mod
from engine.cache import PREFILL_GRID, KVPool, ModelCache, StatePool
from engine.model import qwen35
from engine.model.ops import attention_prefill as ap
from engine.model.ops import dispatch as ops
from engine.model.ops import gdn_prefill as gp
from engine.model.ops import launch
from engine.model.qwen35 import FwdCtx
from tests.ops_util import needs_triton
from tests.test_kernel_path import SMALL, V, _clone, _model, _rel, run_greedy

pytestmark = needs_triton

G = 64  # the tests' grid


def _kv_block_aligned() -> None:
    """The grid the invariance relies on: blocks start at multiples of the GDN chunk and of the attention key block."""
    bn = launch.choose("attention_prefill", torch.float32, None, hd=16)["BLOCK_N"]
    assert G % gp.CHUNK == 0 and G % bn == 0 and PREFILL_GRID % G == 0


@torch.inference_mode()
def _forward(m, pool, ids, slots, pos0, read, write0, lens=None, kernels=True):
    """One host prefill forward (record=False) of rows ids [N, T] -> fp32 logits [N, T, V]."""
    N, T = ids.shape
    ctx = FwdCtx.make(m.config, "cpu", pool.dtype, slots, pos0, read, write0, T, False, lens=lens)
    if kernels:
        with ops.force_kernels():
            return m.logits(m.model.norm(m.forward_step(ids, ctx, pool)))
    return m.logits(m.model.norm(m.forward_step(ids, ctx, pool)))


def _pool_with_history(m, g):
    """Slots 0 and 2 hold a 64-token prefix (torch path; GDN state in window slot 0), slot 1 is empty."""
    pool = StatePool(m.config, 3, 256, 4, dtype=m.config.dtype)
    for s in (0, 2):
        _forward(m, pool, torch.randint(0, V, (1, G), generator=g), [s], [0], [0], [0], kernels=False)
    return pool


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_wired_prefill_matches_torch_path(moe):
    """Two rows in one forward: slot 1 from empty, 150 tokens (two GDN chunks and a tail of 22); slot 0 after its
    64-token prefix, 37 real tokens right-padded to 150, reading window slot 0 and writing window slot 2."""
    assert SMALL["num_attention_heads"] > SMALL["num_key_value_heads"]  # GQA, and value heads sharing a key head
    assert SMALL["linear_num_value_heads"] > SMALL["linear_num_key_heads"]
    m = _model(moe, "float32", seed=11)
    g = torch.Generator().manual_seed(1)
    pool = _pool_with_history(m, g)
    kpool = _clone(pool)
    ids = torch.randint(0, V, (2, 150), generator=g)
    slots, pos0, read, write0, lens = [1, 0], [0, G], [0, 0], [0, 2], [150, 37]
    got = _forward(m, kpool, ids, slots, pos0, read, write0, lens, kernels=True)
    want = _forward(m, pool, ids, slots, pos0, read, write0, lens, kernels=False)
    for i, n in enumerate(lens):
        assert _rel(got[i, :n], want[i, :n]) <= 2e-5, f"row {i} logits: {_rel(got[i, :n], want[i, :n]):.2e}"
    for a, b in zip(kpool.layers, pool.layers):
        if isinstance(a, KVPool):
            for s, p, n in zip(slots, pos0, lens):
                assert _rel(a.k[s, p:p + n], b.k[s, p:p + n]) <= 2e-5 and _rel(a.v[s, p:p + n], b.v[s, p:p + n]) <= 2e-5
        else:
            for s, w in zip(slots, write0):
                assert _rel(a.rec[s, w], b.rec[s, w]) <= 2e-5, f"GDN recurrent state of slot {s}"
                assert _rel(a.conv[s, w], b.conv[s, w]) <= 2e-5, f"GDN conv state of slot {s}"
            assert torch.equal(a.rec[2], b.rec[2]) and torch.equal(a.rec[0, 0], b.rec[0, 0]), "a state not written"


def _prefill_states(cache: ModelCache) -> list[torch.Tensor]:
    """What a prefill left in the cache's slot: K/V rows 0..length-1, the live GDN window slot's states."""
    s, n, out = cache.slot, cache.length, []
    for c in cache.layers:
        out += [c.k[s, :n], c.v[s, :n]] if isinstance(c, KVPool) else [c.rec[s, cache.cur], c.conv[s, cache.cur]]
    return out


@torch.inference_mode()
def _one_forward_vs_grid_blocks(m, ids: list[int], grid: int, monkeypatch) -> None:
    """ids prefilled in ONE forward vs one forward per grid block (engine.prefill.prefill): bitwise the same logits of
    every position and the same states."""
    monkeypatch.setattr(prefill_mod, "PREFILL_GRID", grid)
    one, blocks = ModelCache(m.config, 1024, dtype=m.config.dtype), ModelCache(m.config, 1024, dtype=m.config.dtype)
    with ops.force_kernels():
        h = m.forward_hidden(torch.tensor([ids]), 0, one)[0]  # [T, H]
        one.length = len(ids)
        want = m.logits(m.model.norm(h))  # [T, V]
        last, post, _ = prefill_mod.prefill(m, ids, blocks, want_hidden=True)
        got = m.logits(post)
    assert torch.equal(last, want[-1]) and torch.equal(got, want), "logits: one forward vs grid blocks"
    for a, b in zip(_prefill_states(one), _prefill_states(blocks)):
        assert torch.equal(a, b), "pool state: one forward vs grid blocks"


@pytest.mark.slow
@pytest.mark.parametrize("tail,dtype", [(19, "float32"), (1, "float32"), (30, "bfloat16")])
def test_grid_invariance_one_forward_vs_grid_blocks(tail, dtype, monkeypatch):
    """Two grid blocks and a tail (one token too: a one-token block runs the same kernels)."""
    _kv_block_aligned()
    m = _model(False, dtype, seed=12)
    ids = torch.randint(0, V, (2 * G + tail,), generator=torch.Generator().manual_seed(2)).tolist()
    _one_forward_vs_grid_blocks(m, ids, G, monkeypatch)


@pytest.mark.slow
def test_grid_invariance_at_the_serving_grid(monkeypatch):
    """As above at engine.cache.PREFILL_GRID: two blocks of 256 and a tail."""
    m = _model(False, "float32", seed=13)
    ids = torch.randint(0, V, (2 * PREFILL_GRID + 5,), generator=torch.Generator().manual_seed(3)).tolist()
    _one_forward_vs_grid_blocks(m, ids, PREFILL_GRID, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_bits_alone_or_packed(dtype):
    """A grid block's logits and states are bitwise the same in a forward of its own or packed with another row
    (longer, so this one is right-padded): the wired prefill is row-wise on the kernel path."""
    m = _model(True, dtype, seed=14)
    g = torch.Generator().manual_seed(4)
    base = _pool_with_history(m, g)
    ids = torch.randint(0, V, (2, G), generator=g)
    alone, packed = _clone(base), _clone(base)
    la = _forward(m, alone, ids[:1, :41], [0], [G], [0], [1])  # [1, 41, V]
    lp = _forward(m, packed, ids, [0, 1], [G, 0], [0, 0], [1, 0], lens=[41, G])  # [2, G, V]
    assert torch.equal(la[0], lp[0, :41]), "logits: alone vs packed"
    for a, b in zip(alone.layers, packed.layers):
        if isinstance(a, KVPool):
            assert torch.equal(a.k[0, G:G + 41], b.k[0, G:G + 41]) and torch.equal(a.v[0, G:G + 41], b.v[0, G:G + 41])
        else:
            assert torch.equal(a.rec[0, 1], b.rec[0, 1]) and torch.equal(a.conv[0, 1], b.conv[0, 1]), "GDN state"


@pytest.mark.slow
def test_greedy_spec_equals_plain_with_wired_prefill():
    """Greedy spec (forced drafts, K = 1, 3) == plain greedy through the scheduler on the kernel path, prompts that
    span two GDN chunks (one of them a grid block and a tail at a 64-token grid)."""
    m = _model(False, "float32", seed=15)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (150, 23)]
    n_new = 6

    def run(k, refs=None):
        out, ss, _ = run_greedy(m, prompts, n_new, k, refs, max_num_seqs=2, max_model_len=192,
                                max_num_batched_tokens=256)
        return out, ss

    with ops.force_kernels():
        plain, _ = run(0)
        assert all(len(p) == n_new for p in plain)
        for k in (1, 3):
            out, ss = run(k, plain)
            assert out == plain, f"K={k}"
            assert sum(s.telem.accepted for s in ss) > 0


class _Calls:
    """Counts the calls of a function it wraps; `refuse` makes any call fail instead."""

    def __init__(self, fn=None, refuse: str | None = None):
        self.fn, self.refuse, self.n = fn, refuse, 0

    def __call__(self, *a, **kw):
        if self.refuse:
            raise AssertionError(self.refuse)
        self.n += 1
        return self.fn(*a, **kw)


def test_model_calls_the_prefill_kernels(monkeypatch):
    """On the kernel path a prefill forward runs the Triton kernels through ops.attention_prefill / ops.gdn_prefill
    once per layer (and the MTP head's prefill rows the attention kernel), never SDPA or the torch chunked GDN; the
    CPU's own path calls neither kernel."""
    m = _model(False, "float32", seed=16)
    n_gdn = sum(t == "linear_attention" for t in m.config.layer_types)
    n_attn = len(m.config.layer_types) - n_gdn
    calls = {name: _Calls(getattr(mod, name)) for mod, name in ((ops, "attention_prefill"), (ops, "gdn_prefill"),
                                                                (ops, "write_kv"))}
    kern = {"prefill_attention": _Calls(ap.prefill_attention), "chunked_gdn": _Calls(gp.chunked_gdn)}
    for name, c in calls.items():
        monkeypatch.setattr(ops, name, c)
    monkeypatch.setattr(ap, "prefill_attention", kern["prefill_attention"])
    monkeypatch.setattr(gp, "chunked_gdn", kern["chunked_gdn"])
    g = torch.Generator().manual_seed(6)
    pool = StatePool(m.config, 2, 128, 4, dtype=m.config.dtype)
    with monkeypatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", _Calls(refuse="SDPA on the wired prefill"))
        mp.setattr(qwen35, "gdn_chunked", _Calls(refuse="torch chunked GDN on the wired prefill"))
        _forward(m, pool, torch.randint(0, V, (1, 70), generator=g), [0], [0], [0], [0])
        assert (calls["attention_prefill"].n, calls["gdn_prefill"].n) == (n_attn, n_gdn)
        assert (kern["prefill_attention"].n, kern["chunked_gdn"].n) == (n_attn, n_gdn), "the Triton kernels ran"
        assert calls["write_kv"].n == n_attn
        hid = torch.randn(1, 69, m.config.hidden_size, generator=g)
        with ops.force_kernels(), torch.inference_mode():  # the MTP head's prefill rows
            m.mtp_forward(torch.randint(0, V, (1, 69), generator=g), hid,
                          FwdCtx.make(m.config, "cpu", m.config.dtype, [0], [0], [0], [0], 69, False), pool.mtp)
        assert kern["prefill_attention"].n == n_attn + 1
    before = {k: c.n for k, c in {**calls, **kern}.items()}
    _forward(m, pool, torch.randint(0, V, (1, 12), generator=g), [1], [0], [0], [0], kernels=False)
    assert {k: c.n for k, c in {**calls, **kern}.items()} == before, "the CPU path called a prefill kernel"


def test_a_fallen_back_prefill_kernel_leaves_its_layers_on_the_host_path(monkeypatch):
    """After the startup self-check hands `gdn_prefill` / `attention_prefill` to their twins, the host forward runs
    that layer as before the wiring (the torch path's own math), not the twin through the wired code."""
    m = _model(False, "float32", seed=17)
    pool = StatePool(m.config, 1, 128, 4, dtype=m.config.dtype)
    spy = {name: _Calls(getattr(ops, name)) for name in ("attention_prefill", "gdn_prefill")}
    for name, c in spy.items():
        monkeypatch.setattr(ops, name, c)
    try:
        ops.fall_back("gdn_prefill", "test")
        ops.fall_back("attention_prefill", "test")
        _forward(m, pool, torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(7)), [0], [0], [0], [0])
    finally:
        ops.reset_fallbacks()
    assert spy["attention_prefill"].n == spy["gdn_prefill"].n == 0
