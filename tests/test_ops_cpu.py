"""The CPU kernel (engine/model/ops/cpu.py, cpu_gdn.c) against its torch twin, the model's GDN torch path."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.cache import StatePool
from engine.model.ops import cpu
from engine.model.qwen35 import FwdCtx
from tests.ops_util import assert_bitwise, cpu_kernel
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the CPU kernel is not built")

S, W = 5, 8  # pool slots, GDN window slots


@pytest.fixture(scope="module", params=[8, 44], ids=["dv8", "dv44"])
def layer_and_cfg(tmp_path_factory, request):
    # two key heads serving four value heads (q, k repeated), Kc = 4; dv = 44: the state's columns run as one block
    # of four 8-column groups, one group alone and a 4-column tail (cpu_gdn.c)
    ck = make_checkpoint(tmp_path_factory.mktemp("cpu"), seed=11, mtp=False, with_tokenizer=False,
                         hidden_size=64, num_hidden_layers=2, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=request.param)
    model = load_model(ck)
    idx = model.config.layer_types.index("linear_attention")
    gdn = model.model.layers[idx].linear_attn
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every constant non-trivial: the norm weight, the decay's A_log and dt_bias
        gdn.norm.weight.copy_(torch.randn(gdn.dv, generator=g))
        gdn.A_log.copy_(torch.randn(gdn.nv, generator=g))
        gdn.dt_bias.copy_(torch.randn(gdn.nv, generator=g))
    gdn._decay = None
    gdn._decay = gdn._decay_consts()
    return gdn, model.config, idx


def _pool(cfg, idx, seed):
    pool = StatePool(cfg, S, 64, W, mtp=False)
    st = pool.layers[idx]
    g = torch.Generator().manual_seed(seed)
    st.conv.copy_(torch.randn(st.conv.shape, generator=g))
    st.rec.copy_(torch.randn(st.rec.shape, generator=g) * 0.3)
    return st


def _run(gdn, cfg, st, x, slots, read, write0, record, kernel):
    """The layer's forward over the pool, with the kernel on (it must run: counted) or off."""
    N, T, _ = x.shape
    ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, [10] * N, read, write0, T, record)
    with cpu_kernel("gdn_step", kernel):
        return gdn(x, ctx, st)


@pytest.mark.parametrize("N,T", [(1, 1), (1, 4), (3, 1), (3, 5)])
def test_kernel_matches_torch_twin_and_writes_every_state(layer_and_cfg, N, T):
    gdn, cfg, idx = layer_and_cfg
    slots, read, write0 = [3, 0, 4][:N], [7, 1, 0][:N], [0, 2, 1][:N]  # slots out of order; read outside writes
    x = torch.randn(N, T, cfg.hidden_size, generator=torch.Generator().manual_seed(N * 10 + T))
    st_k, st_t = _pool(cfg, idx, 1), _pool(cfg, idx, 1)
    before = (st_k.conv.clone(), st_k.rec.clone())
    for s, w in zip(slots, write0):  # NaN-poison every window slot the kernel must write
        st_k.conv[s, w:w + T] = float("nan")
        st_k.rec[s, w:w + T] = float("nan")
    y_k = _run(gdn, cfg, st_k, x, slots, read, write0, True, True)
    y_t = _run(gdn, cfg, st_t, x, slots, read, write0, True, False)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)
    for s, w in zip(slots, write0):
        assert not st_k.conv[s, w:w + T].isnan().any() and not st_k.rec[s, w:w + T].isnan().any()
        torch.testing.assert_close(st_k.rec[s, w:w + T], st_t.rec[s, w:w + T], rtol=1e-5, atol=1e-5)
        # conv windows are copies of the input projection, which the C GEMM rounds (cpu_linear.c) in a step
        torch.testing.assert_close(st_k.conv[s, w:w + T], st_t.conv[s, w:w + T], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(S, W, dtype=torch.bool)
    for s, w in zip(slots, write0):
        untouched[s, w:w + T] = False
    assert_bitwise(st_k.conv[untouched], before[0][untouched], "window slots the step does not own")
    assert_bitwise(st_k.rec[untouched], before[1][untouched], "window slots the step does not own")


def test_verify_reading_a_slot_it_writes_matches_twin(layer_and_cfg):
    """A verify's live slot can lie inside the window slots it writes (read 2, write 0..3): read first."""
    gdn, cfg, idx = layer_and_cfg
    x = torch.randn(1, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    st_k, st_t = _pool(cfg, idx, 3), _pool(cfg, idx, 3)
    y_k = _run(gdn, cfg, st_k, x, [2], [2], [0], True, True)
    y_t = _run(gdn, cfg, st_t, x, [2], [2], [0], True, False)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_k.rec, st_t.rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_k.conv, st_t.conv, rtol=1e-5, atol=1e-5)


def _step(gdn, st, proj, slots, read, write0):
    return cpu.gdn_step(proj, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, slots, read, write0,
                        *gdn._decay_consts(), gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv)


def test_kernel_is_batch_and_T_invariant_bitwise(layer_and_cfg):
    """A row's outputs and states: the same bits alone or in a batch, and as one T-token verify or T single-token
    decodes (each reading the previous token's slot) -- what spec == plain greedy rests on. (The kernel's own
    input and output: the projections around it are torch GEMMs, whose bits may depend on the row count.)"""
    gdn, cfg, idx = layer_and_cfg
    T = 4
    proj = torch.randn(3, T, gdn._w_in.shape[0], generator=torch.Generator().manual_seed(7))
    st_b, st_a, st_1 = _pool(cfg, idx, 2), _pool(cfg, idx, 2), _pool(cfg, idx, 2)
    y_b = _step(gdn, st_b, proj, [0, 2, 4], [3, 3, 5], [0, 0, 0])
    y_a = _step(gdn, st_a, proj[1:2], [2], [3], [0])
    assert_bitwise(y_a[0], y_b[1], "row alone vs in the batch")
    assert_bitwise(st_a.rec[2, :T], st_b.rec[2, :T], "row's states alone vs in the batch")
    read = 3
    for t in range(T):  # plain decode: one token reads the live slot and writes the next
        y1 = _step(gdn, st_1, proj[1:2, t:t + 1], [2], [read], [t])
        assert_bitwise(y1[0, 0], y_b[1, t], f"token {t}: one-token step vs the {T}-token forward")
        read = t
    assert_bitwise(st_1.rec[2, :T], st_b.rec[2, :T], "states of single-token steps vs the T-token forward")
    assert_bitwise(st_1.conv[2, :T], st_b.conv[2, :T], "conv windows of single-token steps vs the T-token forward")


def test_non_recording_step_updates_the_live_slot_in_place(layer_and_cfg):
    gdn, cfg, idx = layer_and_cfg
    x = torch.randn(2, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    st_k, st_t = _pool(cfg, idx, 4), _pool(cfg, idx, 4)
    y_k = _run(gdn, cfg, st_k, x, [1, 3], [2, 4], [2, 4], False, True)  # read == write: in place
    y_t = _run(gdn, cfg, st_t, x, [1, 3], [2, 4], [2, 4], False, False)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_k.rec, st_t.rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_k.conv, st_t.conv, rtol=1e-6, atol=1e-6)  # the projection: the C GEMM vs MKL


def test_prefill_chunk_with_padding_matches_twin_and_is_chunking_invariant(layer_and_cfg):
    """A batched prefill chunk (record=False, rows right-padded, `lens`): each row's real outputs and its final
    state (in window slot write0, updated in place) match the torch path's chunked form; the padding leaves the
    state alone and outputs zeros. And the kernel's state is the same bits whether a row's tokens come as one chunk,
    two chunks or one token at a time (the recurrence runs token by token)."""
    gdn, cfg, idx = layer_and_cfg
    N, T, lens = 3, 9, [9, 4, 6]
    slots, cur = [4, 1, 2], [2, 0, 5]
    x = torch.randn(N, T, cfg.hidden_size, generator=torch.Generator().manual_seed(21))
    out = {}
    for kernel in (True, False):
        st = _pool(cfg, idx, 6)
        ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, [0] * N, cur, cur, T, False, lens=lens)
        with cpu_kernel("gdn_step", kernel):
            out[kernel] = gdn(x, ctx, st), st
    (y_k, st_k), (y_t, st_t) = out[True], out[False]
    for i, n in enumerate(lens):
        torch.testing.assert_close(y_k[i, :n], y_t[i, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st_k.rec[slots[i], cur[i]], st_t.rec[slots[i], cur[i]], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st_k.conv[slots[i], cur[i]], st_t.conv[slots[i], cur[i]], rtol=1e-5, atol=1e-5)
    ref = _pool(cfg, idx, 6)
    mask = torch.ones(S, W, dtype=torch.bool)
    mask[slots, cur] = False
    assert_bitwise(st_k.rec[mask], ref.rec[mask], "window slots the prefill does not own")
    # chunking: row 0's 9 tokens as 9, as 5 + 4 and one at a time, straight through the kernel
    proj = torch.randn(1, T, gdn._w_in.shape[0], generator=torch.Generator().manual_seed(22))
    states, outs = [], []
    for cuts in ([0, 9], [0, 5, 9], list(range(10))):
        st = _pool(cfg, idx, 7)
        ys = [cpu.gdn_step(proj[:, a:b], gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1], [3], [3],
                           *gdn._decay_consts(), gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv,
                           record=False) for a, b in zip(cuts, cuts[1:])]
        states.append((st.rec[1, 3].clone(), st.conv[1, 3].clone()))
        outs.append(torch.cat(ys, dim=1))
    for (rec, conv), y in zip(states[1:], outs[1:]):
        assert_bitwise(rec, states[0][0], "final state: one chunk vs split")
        assert_bitwise(conv, states[0][1], "conv window: one chunk vs split")
        assert_bitwise(y, outs[0], "outputs: one chunk vs split")
    padded = torch.cat([proj, torch.randn(1, 3, proj.shape[-1])], dim=1)  # 3 padding tokens
    st = _pool(cfg, idx, 7)
    y = cpu.gdn_step(padded, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1], [3], [3], *gdn._decay_consts(),
                     gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv, record=False, lens=[T])
    assert_bitwise(st.rec[1, 3], states[0][0], "padding left the state alone")
    assert_bitwise(y[:, :T], outs[0], "real tokens' outputs with padding after them")
    assert not y[:, T:].any(), "padding outputs zeros"
    with pytest.raises(ValueError):
        cpu.gdn_step(padded, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1], [3], [3], *gdn._decay_consts(),
                     gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv, record=False, lens=[T + 4])
    # a row with no real token (all padding) reading one window slot and writing another: the state moves as is
    st = _pool(cfg, idx, 7)
    y = cpu.gdn_step(padded, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1], [3], [5], *gdn._decay_consts(),
                     gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv, record=False, lens=[0])
    assert_bitwise(st.rec[1, 5], st.rec[1, 3], "no token: the state copied to write0")
    assert_bitwise(st.conv[1, 5], st.conv[1, 3], "no token: the conv window copied to write0")
    assert not y.any()


def test_a_rows_blocks_in_one_call_equal_one_call_per_block_bitwise(layer_and_cfg):
    """seg / keep (a prefill row that carries several blocks): one call gives the outputs, the inner boundaries'
    states (each in its kept window slot) and the final state of one call per block, bit for bit, beside a row of
    one block and padding; a kept slot that is the read or write slot, or two blocks on one slot, raises."""
    gdn, cfg, idx = layer_and_cfg
    P = gdn._w_in.shape[0]
    proj = torch.randn(2, 9, P, generator=torch.Generator().manual_seed(31))
    seg, keep = [[4, 3, 2], [6]], [[5, 1], []]
    ref = _pool(cfg, idx, 9)
    ys = []
    for a, b, r, w in ((0, 4, 3, 5), (4, 7, 5, 1), (7, 9, 1, 3)):  # row 0 block by block: read 3 ... write0 3
        ys.append(cpu.gdn_step(proj[:1, a:b], gdn.conv1d.weight[:, 0, :], ref.conv, ref.rec, [1], [r], [w],
                               *gdn._decay_consts(), gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv,
                               record=False))
    y1 = cpu.gdn_step(proj[1:, :6], gdn.conv1d.weight[:, 0, :], ref.conv, ref.rec, [0], [2], [2],
                      *gdn._decay_consts(), gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv, record=False)
    st = _pool(cfg, idx, 9)
    y = cpu.gdn_step(proj, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1, 0], [3, 2], [3, 2], *gdn._decay_consts(),
                     gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv, record=False, lens=[9, 6],
                     seg=seg, keep=keep)
    assert_bitwise(y[:1], torch.cat(ys, dim=1), "row 0's outputs: one call vs one per block")
    assert_bitwise(y[1:, :6], y1, "row 1's outputs")
    assert not y[1:, 6:].any(), "padding outputs zeros"
    for slot, w in ((1, 5), (1, 1), (1, 3), (0, 2)):
        assert_bitwise(st.rec[slot, w], ref.rec[slot, w], f"state in slot {slot}, window slot {w}")
        assert_bitwise(st.conv[slot, w], ref.conv[slot, w], f"conv window in slot {slot}, window slot {w}")
    for bad in ([[5, 3], []], [[5, 5], []], [[5], []]):  # the read/write slot; one slot twice; a boundary unkept
        with pytest.raises(ValueError):
            cpu.gdn_step(proj, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [1, 0], [3, 2], [3, 2],
                         *gdn._decay_consts(), gdn.norm.weight, gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv,
                         record=False, lens=[9, 6], seg=seg, keep=bad)


def test_bad_pool_indices_raise_instead_of_writing_past_the_pool(layer_and_cfg):
    gdn, cfg, idx = layer_and_cfg
    st = _pool(cfg, idx, 5)
    x = torch.randn(1, 3, cfg.hidden_size)
    with pytest.raises(IndexError):
        _run(gdn, cfg, st, x, [1], [0], [W - 2], True, True)  # tokens 1, 2 would land past the window
    with pytest.raises(IndexError):
        _run(gdn, cfg, st, x[:, :1], [S], [0], [0], True, True)


def test_inconsistent_arguments_raise(layer_and_cfg):
    gdn, cfg, idx = layer_and_cfg
    st = _pool(cfg, idx, 5)
    proj = torch.randn(2, 1, gdn._w_in.shape[0])
    with pytest.raises(ValueError):  # two rows on one pool slot
        _step(gdn, st, proj, [1, 1], [0, 0], [1, 1])
    with pytest.raises(ValueError):  # a norm weight of the wrong length
        cpu.gdn_step(proj, gdn.conv1d.weight[:, 0, :], st.conv, st.rec, [0, 1], [0, 0], [1, 1],
                     *gdn._decay_consts(), gdn.norm.weight[:-1], gdn.norm.eps, gdn.nk, gdn.dk, gdn.nv, gdn.dv)
    with pytest.raises(ValueError):  # a projection of the wrong width
        _step(gdn, st, proj[..., :-1], [0, 1], [0, 0], [1, 1])


def test_no_writable_directory_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_gemm", cpu._gemm)  # restored after the test

    def read_only():
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cpu, "_cache_dir", read_only)
    assert not cpu.available() and cpu._tried and "Read-only" in cpu._why
    assert "C kernels unavailable" in cpu.describe("cpu", torch.float32)


def test_without_a_compiler_the_torch_path_runs(layer_and_cfg, monkeypatch):
    gdn, cfg, idx = layer_and_cfg
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_gemm", cpu._gemm)  # restored after the test
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert not cpu.available()
    x = torch.randn(1, 2, cfg.hidden_size)
    with pytest.raises(AssertionError, match="the kernel did not run"):  # enabled, but nothing to run
        _run(gdn, cfg, _pool(cfg, idx, 6), x, [0], [0], [1], True, True)
    y = _run(gdn, cfg, _pool(cfg, idx, 6), x, [0], [0], [1], True, False)
    assert y.shape == x.shape and not y.isnan().any()
