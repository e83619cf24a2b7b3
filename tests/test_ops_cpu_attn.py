"""The CPU attention step and RMSNorm (engine/model/ops/cpu.py, cpu_attn.c) against their torch twins: the model's
GatedAttention torch path (norms, RoPE, K/V writes, SDPA, gate) and norm.rms_norm_ref."""
from __future__ import annotations

import pytest
import torch

from engine.cache import KVPool
from engine.model.ops import cpu
from engine.model.ops.norm import one_plus, rms_norm_ref
from engine.model.qwen35 import FwdCtx, GatedAttention, Qwen35ForCausalLM
from engine.model.config import Qwen35Config
from engine.spec import generate_spec
from tests.ops_util import assert_bitwise, cpu_kernel, spy
from tests.tiny import hf_config, make_checkpoint

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the CPU kernel is not built")

S, L = 5, 48  # pool slots, positions per slot


def _cfg(hd: int, rotary: float) -> Qwen35Config:
    raw = hf_config(vocab_size=64, hidden_size=48, num_hidden_layers=1, layer_types=["full_attention"], head_dim=hd)
    raw["rope_parameters"]["partial_rotary_factor"] = rotary
    return Qwen35Config.from_dict(raw)


def _layer(hd: int, rotary: float, seed: int, sharp: float = 1.0) -> tuple[GatedAttention, Qwen35Config]:
    cfg = _cfg(hd, rotary)
    torch.manual_seed(seed)
    att = GatedAttention(cfg)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        att.q_norm.weight.copy_(torch.randn(hd) * 0.5 * sharp)  # non-trivial 1 + w scales
        att.k_norm.weight.copy_(torch.randn(hd) * 0.5)
    att.fuse()
    att.requires_grad_(False)
    return att, cfg


def _pool(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    kv = KVPool.alloc(cfg, S, L, "cpu", torch.float32)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def _run(att, cfg, kv, x, slots, pos0, kernel):
    """The layer's forward over the pool, with the kernel on (it must run: counted) or off."""
    N, T, _ = x.shape
    ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, pos0, [0] * N, [0] * N, T, True)
    with cpu_kernel("attn_step", kernel):
        return att(x, ctx, kv)


# hd 16 (the vector path; RoPE on 4 dims), hd 12 (the scalar tails; RoPE on 6 dims)
@pytest.mark.parametrize("hd,rotary", [(16, 0.25), (12, 0.5)])
@pytest.mark.parametrize("N,T", [(1, 1), (1, 4), (3, 1), (3, 5)])
def test_attention_step_matches_torch_twin_and_writes_its_positions(hd, rotary, N, T):
    att, cfg = _layer(hd, rotary, seed=N * 10 + T)
    slots, pos0 = [3, 0, 4][:N], [9, 0, 30][:N]  # slots out of order; a row at position 0; rows of other lengths
    x = torch.randn(N, T, cfg.hidden_size, generator=torch.Generator().manual_seed(hd + N + T))
    kv_k, kv_t = _pool(cfg, 1), _pool(cfg, 1)
    before = (kv_k.k.clone(), kv_k.v.clone())
    for s, p in zip(slots, pos0):  # NaN-poison every position the step must write
        kv_k.k[s, p:p + T] = float("nan")
        kv_k.v[s, p:p + T] = float("nan")
    y_k = _run(att, cfg, kv_k, x, slots, pos0, True)
    y_t = _run(att, cfg, kv_t, x, slots, pos0, False)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)
    mine = torch.zeros(S, L, dtype=torch.bool)
    for s, p in zip(slots, pos0):
        mine[s, p:p + T] = True
    assert not kv_k.k[mine].isnan().any() and not kv_k.v[mine].isnan().any()
    torch.testing.assert_close(kv_k.k[mine], kv_t.k[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_k.v[mine], kv_t.v[mine], rtol=1e-5, atol=1e-5)  # the projection (C GEMM)
    assert_bitwise(kv_k.k[~mine], before[0][~mine], "K positions the step does not own")
    assert_bitwise(kv_k.v[~mine], before[1][~mine], "V positions the step does not own")


def test_attention_step_with_scores_spanning_hundreds_matches_twin():
    """Sharp attention (q scaled ~30x: scores spread over hundreds, most e^(s - max) far below fp32's range)."""
    att, cfg = _layer(16, 0.25, seed=12, sharp=60.0)
    x = torch.randn(3, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(12))
    y_k = _run(att, cfg, _pool(cfg, 4), x, [0, 2, 4], [7, 40, 0], True)
    y_t = _run(att, cfg, _pool(cfg, 4), x, [0, 2, 4], [7, 40, 0], False)
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)


def test_attention_step_is_batch_and_T_invariant_bitwise():
    """A row's outputs and cached K/V: the same bits alone or in a batch, and as one T-token verify or T
    single-token decodes -- what spec == plain greedy rests on (the kernel's own input and output)."""
    att, cfg = _layer(16, 0.25, seed=5)
    T = 4
    qkv = torch.randn(3, T, att._w_qkv.shape[0], generator=torch.Generator().manual_seed(7))
    cos, sin = FwdCtx.make(cfg, "cpu", torch.float32, [0, 2, 4], [5, 11, 20], [0] * 3, [0] * 3, T, True).rope
    args = (one_plus(att.q_norm.weight, torch.float32), one_plus(att.k_norm.weight, torch.float32), att.q_norm.eps)
    heads = (att.nh, att.nkv, att.hd, att.hd ** -0.5)
    kv_b, kv_a, kv_1 = _pool(cfg, 2), _pool(cfg, 2), _pool(cfg, 2)
    y_b = cpu.attn_step(qkv, *args, cos, sin, kv_b.k, kv_b.v, [0, 2, 4], [5, 11, 20], *heads)
    y_a = cpu.attn_step(qkv[1:2], *args, cos[1:2], sin[1:2], kv_a.k, kv_a.v, [2], [11], *heads)
    assert_bitwise(y_a[0], y_b[1], "row alone vs in the batch")
    assert_bitwise(kv_a.k[2], kv_b.k[2], "row's cached K alone vs in the batch")
    for t in range(T):  # plain decode: one token at a time
        y1 = cpu.attn_step(qkv[1:2, t:t + 1], *args, cos[1:2, t:t + 1], sin[1:2, t:t + 1], kv_1.k, kv_1.v, [2],
                           [11 + t], *heads)
        assert_bitwise(y1[0, 0], y_b[1, t], f"token {t}: one-token step vs the {T}-token forward")
    assert_bitwise(kv_1.k[2], kv_b.k[2], "K of single-token steps vs the T-token forward")
    # T = 1 rows as a "contiguous" [3, 1, P] whose size-1 dim has an arbitrary stride: rows are P apart
    odd = qkv[:, 0].clone()[None].transpose(0, 1)
    assert odd.is_contiguous() and odd.stride(1) == 3 * odd.shape[-1]
    kv_o, kv_c = _pool(cfg, 2), _pool(cfg, 2)
    assert_bitwise(cpu.attn_step(odd, *args, cos[:, :1], sin[:, :1], kv_o.k, kv_o.v, [0, 2, 4], [5, 11, 20], *heads),
                   cpu.attn_step(odd.clone(memory_format=torch.contiguous_format), *args, cos[:, :1], sin[:, :1],
                                 kv_c.k, kv_c.v, [0, 2, 4], [5, 11, 20], *heads), "size-1 dim")


@pytest.mark.parametrize("hd,rotary", [(16, 0.25), (12, 0.5)])
def test_the_blocked_prefill_path_has_the_step_paths_bits(hd, rotary):
    """A prefill block (T >= 16: K / V written first, then blocks of queries over chunks of keys) gives every token
    the bits of one-token steps (the row path), in a batch of rows at different positions, with GQA (4 query heads
    on 2 kv heads), keys past a 64-key chunk and a token count that is no multiple of the 16-token blocks; and its
    outputs match the torch twin."""
    att, cfg = _layer(hd, rotary, seed=3)
    T, L2 = 37, 160
    slots, pos0 = [1, 0], [90, 3]
    qkv = torch.randn(2, T, att._w_qkv.shape[0], generator=torch.Generator().manual_seed(8))
    cos, sin = FwdCtx.make(cfg, "cpu", torch.float32, slots, pos0, [0] * 2, [0] * 2, T, True).rope
    args = (one_plus(att.q_norm.weight, torch.float32), one_plus(att.k_norm.weight, torch.float32), att.q_norm.eps)
    heads = (att.nh, att.nkv, att.hd, att.hd ** -0.5)

    def pool():
        g = torch.Generator().manual_seed(4)
        kv = KVPool.alloc(cfg, 2, L2, "cpu", torch.float32)
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        return kv

    kv_b, kv_1 = pool(), pool()
    y_b = cpu.attn_step(qkv, *args, cos, sin, kv_b.k, kv_b.v, slots, pos0, *heads)
    for i in range(2):
        for t in range(T):
            y1 = cpu.attn_step(qkv[i:i + 1, t:t + 1], *args, cos[i:i + 1, t:t + 1], sin[i:i + 1, t:t + 1], kv_1.k,
                               kv_1.v, [slots[i]], [pos0[i] + t], *heads)
            assert_bitwise(y1[0, 0], y_b[i, t], f"row {i} token {t}: the blocked path vs a one-token step")
    assert_bitwise(kv_1.k, kv_b.k, "K")
    assert_bitwise(kv_1.v, kv_b.v, "V")
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, pos0, [0] * 2, [0] * 2, T, False)
    with torch.inference_mode():
        with cpu_kernel("attn_step", True):
            y_k = att(x, ctx, pool())
        with cpu_kernel("attn_step", False):
            y_t = att(x, ctx, pool())
    torch.testing.assert_close(y_k, y_t, rtol=1e-5, atol=1e-5)


def test_attention_step_reads_rope_rows_by_position_from_a_table_bitwise():
    """cos / sin as `rope_table`'s table (rows by position, what a step forward passes) give the bits of the same
    rows gathered per token; a position past the table raises instead of reading past it."""
    att, cfg = _layer(16, 0.25, seed=8)
    T, slots, pos0 = 3, [4, 1], [17, 2]
    qkv = torch.randn(2, T, att._w_qkv.shape[0], generator=torch.Generator().manual_seed(9))
    ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, pos0, [0, 0], [0, 0], T, True)
    args = (one_plus(att.q_norm.weight, torch.float32), one_plus(att.k_norm.weight, torch.float32), att.q_norm.eps)
    heads = (att.nh, att.nkv, att.hd, att.hd ** -0.5)
    kv_r, kv_t = _pool(cfg, 3), _pool(cfg, 3)
    y_r = cpu.attn_step(qkv, *args, *ctx.rope, kv_r.k, kv_r.v, slots, pos0, *heads)  # [N, T, R] per token
    cos, sin = ctx.rope_tab
    assert cos.dim() == 2 and cos.shape[0] >= max(pos0) + T
    y_t = cpu.attn_step(qkv, *args, cos, sin, kv_t.k, kv_t.v, slots, pos0, *heads)
    assert_bitwise(y_t, y_r, "RoPE rows from the table vs per token")
    assert_bitwise(kv_t.k, kv_r.k, "cached K")
    with pytest.raises(IndexError):  # the table ends before position 17 + 2
        cpu.attn_step(qkv, *args, cos[:18], sin[:18], _pool(cfg, 3).k, _pool(cfg, 3).v, slots, pos0, *heads)


def test_a_keys_score_has_the_same_bits_whichever_loop_computes_it():
    """The kernel scores keys eight at a time (one vector of trees), then four, then one by one; the same key
    must get the same score bits in each. Keys 0 (eight-key loop), 8 (four-key loop) and 12 (one by one) of a query
    at position 13 hold the same K; V is e_0, e_1, e_2 there and 0 elsewhere, the gate 0 (sigmoid: exactly 1/2), so
    output dims 0, 1, 2 are those three keys' softmax weights times 1/2, bit for bit."""
    att, cfg = _layer(16, 0.25, seed=11)
    kv = _pool(cfg, 6)
    slot, pos = 2, 13
    for p_ in (8, 12):
        kv.k[slot, p_] = kv.k[slot, 0]
    kv.v[slot] = 0.0
    for d, p_ in enumerate((0, 8, 12)):
        kv.v[slot, p_, :, d] = 1.0
    qkv = torch.randn(1, 1, att._w_qkv.shape[0], generator=torch.Generator().manual_seed(3))
    nq = 2 * att.nh * att.hd
    for h in range(att.nh):
        qkv[..., h * 2 * att.hd + att.hd:(h + 1) * 2 * att.hd] = 0.0  # the gate
    qkv[..., nq + att.nkv * att.hd:] = 0.0  # the new token's V
    cos, sin = FwdCtx.make(cfg, "cpu", torch.float32, [slot], [pos], [0], [0], 1, True).rope_tab
    w1 = one_plus(att.q_norm.weight, torch.float32)
    y = cpu.attn_step(qkv, w1, one_plus(att.k_norm.weight, torch.float32), att.q_norm.eps, cos, sin, kv.k, kv.v,
                      [slot], [pos], att.nh, att.nkv, att.hd, att.hd ** -0.5).view(att.nh, att.hd)
    assert (y[:, :3] > 0).all()
    for h in range(att.nh):
        assert y[h, 0].item() == y[h, 1].item() == y[h, 2].item(), (h, y[h, :3].tolist())


def test_a_step_forward_on_the_c_kernels_builds_no_index_tensors():
    """An N-row context's index tensors and gathered RoPE rows are built on first use, as they were eagerly
    (same values); a step forward whose layers all run the C kernels reads only host lists and the table."""
    att, cfg = _layer(16, 0.25, seed=10)
    slots, pos0, T = [3, 0, 4], [9, 0, 30], 2
    ctx = FwdCtx.make(cfg, "cpu", torch.float32, slots, pos0, [1, 0, 2], [2, 1, 0], T, True)
    x = torch.randn(3, T, cfg.hidden_size)
    with cpu_kernel("attn_step", True):
        att(x, ctx, _pool(cfg, 5))
    assert ctx._slot_t is None and ctx._rope is None  # nothing built
    positions = torch.tensor(pos0)[:, None] + torch.arange(T)
    cos, sin = ctx.rope_tab
    assert_bitwise(ctx.rope[0], cos[positions], "cos rows")
    assert_bitwise(ctx.rope[1], sin[positions], "sin rows")
    assert ctx.slot_t.tolist() == slots and ctx.read_t.tolist() == [1, 0, 2]
    assert ctx.write_t.tolist() == [[2, 3], [1, 2], [0, 1]]
    assert ctx.kv_slot.tolist() == [3, 3, 0, 0, 4, 4] and ctx.kv_pos.tolist() == [9, 10, 0, 1, 30, 31]
    one = FwdCtx.make(cfg, "cpu", torch.float32, [2], [5], [0], [0], T, True)
    assert one.slot_t is None and one.rope[0].shape == (1, T, cos.shape[1])  # one row: a slice, no index tensors
    pre = FwdCtx.make(cfg, "cpu", torch.float32, [0, 1], [0, 0], [0, 0], [0, 0], 4, False, lens=[4, 2])
    assert pre.lens == [4, 2] and pre.lens_t.tolist() == [4, 2] and pre.write_t.tolist() == [0, 0]


def test_attention_bad_indices_and_arguments_raise():
    att, cfg = _layer(16, 0.25, seed=6)
    kv = _pool(cfg, 3)
    x = torch.randn(1, 3, cfg.hidden_size)
    with pytest.raises(IndexError):  # positions 46..48: the last lands past the slot
        _run(att, cfg, kv, x, [1], [L - 2], True)
    with pytest.raises(IndexError):
        _run(att, cfg, kv, x[:, :1], [S], [0], True)
    qkv = torch.randn(2, 1, att._w_qkv.shape[0])
    cos, sin = FwdCtx.make(cfg, "cpu", torch.float32, [0, 1], [0, 0], [0, 0], [0, 0], 1, True).rope
    w1 = one_plus(att.q_norm.weight, torch.float32)
    with pytest.raises(ValueError):  # two rows on one pool slot
        cpu.attn_step(qkv, w1, w1, 1e-6, cos, sin, kv.k, kv.v, [1, 1], [0, 0], att.nh, att.nkv, att.hd, 0.25)
    with pytest.raises(ValueError):  # a projection of the wrong width
        cpu.attn_step(qkv[..., :-1], w1, w1, 1e-6, cos, sin, kv.k, kv.v, [0, 1], [0, 0], att.nh, att.nkv, att.hd,
                      0.25)
    with pytest.raises(ValueError):  # a norm weight of the wrong length
        cpu.attn_step(qkv, w1[:-1], w1, 1e-6, cos, sin, kv.k, kv.v, [0, 1], [0, 0], att.nh, att.nkv, att.hd, 0.25)


@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 5, 48), (2, 3, 4, 12), (7, 20)])
def test_rms_norm_matches_twin_rowwise_and_on_views(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    w1 = one_plus(w, torch.float32)
    y = cpu.rms_norm(x, w1, 1e-6)
    assert y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    rows = x.reshape(-1, shape[-1])
    for i in (0, rows.shape[0] - 1):  # a row's bits do not depend on the other rows
        assert_bitwise(cpu.rms_norm(rows[i:i + 1], w1, 1e-6)[0], y.reshape(-1, shape[-1])[i], f"row {i}")
    odd = torch.randn(1, 3, shape[-1], generator=g).transpose(0, 1)  # size-1 dim with an arbitrary stride
    assert_bitwise(cpu.rms_norm(odd, w1, 1e-6), cpu.rms_norm(odd.reshape(3, -1).clone(), w1, 1e-6)[:, None],
                   "size-1 dim")
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)  # a strided view (q inside q|gate)
    view = wide[..., :shape[-1]]
    torch.testing.assert_close(cpu.rms_norm(view, w1, 1e-6), rms_norm_ref(view, w, 1e-6), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        cpu.rms_norm(x, w1[:-1], 1e-6)


def test_rms_norm_module_takes_the_kernel_in_step_forwards_and_prefill_blocks():
    """RMSNorm runs the C kernel in a step forward (ctx.record) and a prefill block of any length of an fp32 CPU
    model; the cache-free forward (the transformers oracle's), fp64 and --no-cpu-kernel keep the torch twin,
    bitwise."""
    from engine.model.qwen35 import RMSNorm

    cfg = _cfg(16, 0.25)
    norm = RMSNorm(16, 1e-6)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(2, 3, 16, generator=g)
    long_T = 300
    xl = torch.randn(2, long_T, 16, generator=g)
    step = FwdCtx.make(cfg, "cpu", torch.float32, [0, 1], [0, 0], [0, 0], [0, 0], 3, True)
    prefill = FwdCtx.make(cfg, "cpu", torch.float32, [0, 1], [0, 0], [0, 0], [0, 0], 3, False)
    long_prefill = FwdCtx.make(cfg, "cpu", torch.float32, [0, 1], [0, 0], [0, 0], [0, 0], long_T, False)
    with torch.inference_mode():
        w1 = one_plus(norm.weight, torch.float32)
        with spy(cpu, "rms_norm") as calls:
            y, yp = norm(x, step), norm(x, prefill)
            assert len(calls) == 2, "the step forward or the short prefill chunk did not run the kernel"
            norm(xl, long_prefill)
            assert len(calls) == 3, "a long prefill block did not run the kernel"
            norm(x, None)
            assert len(calls) == 3, "the cache-free forward ran the kernel"
        assert_bitwise(y, cpu.rms_norm(x, w1, 1e-6), "step forward: the kernel")
        assert_bitwise(yp, y, "short prefill chunk: the kernel")
        assert_bitwise(norm(xl, long_prefill), cpu.rms_norm(xl, w1, 1e-6), "long prefill: the kernel")
        assert_bitwise(norm(x, None), rms_norm_ref(x, norm.weight, 1e-6), "no cache: the twin")
        xd = x.double()
        assert_bitwise(norm.double()(xd, step), rms_norm_ref(xd, norm.weight, 1e-6), "fp64: the twin")
        norm.float()
        prev = cpu.set_enabled(False)
        try:
            assert_bitwise(norm(x, step), rms_norm_ref(x, norm.weight, 1e-6), "--no-cpu-kernel: the twin")
        finally:
            cpu.set_enabled(prev)


def test_model_decode_runs_the_attention_kernel_and_matches_torch_ops(tmp_path):
    """The whole model (hybrid stack + MTP head): the same tokens with the C kernels and with torch ops, K = 0
    and 3, and the attention kernel ran in the trunk and in the MTP drafts."""
    ck = make_checkpoint(tmp_path / "m", seed=4, with_tokenizer=False)
    from engine.loader import load_model

    model: Qwen35ForCausalLM = load_model(ck)
    out, ts = {}, {}
    for on in (True, False):
        prev = cpu.set_enabled(on)
        try:
            with spy(cpu, "attn_step") as calls:
                for k in (0, 3):
                    out[on, k] = generate_spec(model, list(range(3, 40)), 24, k=k)[0]
        finally:
            cpu.set_enabled(prev)
        ts[on] = {a[0].shape[1] for a, _ in calls}  # tokens per row of each call
    assert {1, 4} <= ts[True], "decode (T = 1) and verify (T = 4) ran the kernel"
    assert not ts[False], "--no-cpu-kernel ran the kernel"
    assert out[True, 0] == out[True, 3] == out[False, 0] == out[False, 3]
