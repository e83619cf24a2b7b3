"""Fused row-wise pieces of the step forward (engine/model/ops/act.py) vs their torch twins (TRITON_INTERPRET=1
on CPU): SwiGLU, the GDN gates, the MoE combine; each row's result bitwise the same alone or among other rows;
the twins vs the model's own torch ops."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.ops import act
from engine.model.ops.matmul import group_by_expert
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, needs_triton, rand


def test_twins_are_the_model_ops():
    g = torch.Generator().manual_seed(1)
    gu = rand(5, 2, 48, gen=g)
    assert_bitwise(act.silu_mul_ref(gu), F.silu(gu[..., :24]) * gu[..., 24:], "silu_mul_ref vs the MLP")
    a, b = rand(3, 4, 6, gen=g, scale=4.0), rand(3, 4, 6, gen=g)
    a_log, dt_bias = rand(6, gen=g).abs(), rand(6, gen=g)
    g_ref, beta_ref = act.gdn_gates_ref(a, b, -a_log.exp(), dt_bias)
    assert_bitwise(g_ref, -a_log.exp() * F.softplus(a + dt_bias), "g: -exp(A_log) * softplus(a + dt_bias)")
    assert_bitwise(beta_ref, torch.sigmoid(b), "beta: sigmoid(b)")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_gdn_gates_match_twins_rows_invariant(dtype):
    g = torch.Generator().manual_seed(2)
    gu = rand(7, 2 * 1100, dtype=dtype, gen=g, scale=3.0)  # I = 1100: two column blocks with a remainder
    y = act.silu_mul(gu)
    assert_close(y, act.silu_mul_ref(gu))
    assert_bitwise(act.silu_mul(gu[4:5])[0], y[4], "silu_mul row 4 alone vs in 7 rows")
    fused = rand(2, 3, 40, dtype=dtype, gen=g, scale=4.0)  # a, b as views of a fused projection output
    a, b = fused[..., 30:35], fused[..., 35:40]
    a[0, 0, 0] = 30.0  # softplus above its threshold: x itself
    a[0, 0, 1] = -30.0  # exp(x) tiny: log1p, not log(1 + x)
    neg_a, dt_bias = -rand(5, gen=g).abs().exp(), rand(5, gen=g)
    gk, bk = act.gdn_gates(a, b, neg_a, dt_bias)
    gr, br = act.gdn_gates_ref(a, b, neg_a, dt_bias)
    assert gk.dtype == bk.dtype == torch.float32
    torch.testing.assert_close(gk, gr, rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(bk, br, rtol=2e-6, atol=0)
    g1, b1 = act.gdn_gates(a[1:, 2:], b[1:, 2:], neg_a, dt_bias)
    assert_bitwise(g1[0, 0], gk[1, 2], "gates row alone vs batched")
    assert_bitwise(b1[0, 0], bk[1, 2], "beta row alone vs batched")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_combine_matches_twin_and_token_invariant(dtype):
    g = torch.Generator().manual_seed(3)
    N, k, E, H = 6, 3, 5, 1300
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(DEVICE)
    order, _ = group_by_expert(idx, E)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(N * k, device=DEVICE)
    y = rand(N * k, H, dtype=dtype, gen=g)  # expert outputs in sorted order
    w = torch.softmax(rand(N, k, gen=g), -1).to(dtype)
    shared, sg = rand(N, H, dtype=dtype, gen=g), rand(N, 1, dtype=dtype, gen=g)
    out = act.moe_combine(y, inv, w, shared, sg)
    assert_close(out, act.moe_combine_ref(y, inv, w, shared, sg))
    # token 4 alone: its k expert rows at positions 0..k-1 of a fresh sorted order
    rows = inv.view(N, k)[4]
    one = act.moe_combine(y[rows], torch.arange(k, device=DEVICE), w[4:5], shared[4:5], sg[4:5])
    assert_bitwise(one[0], out[4], "token 4 alone vs among 6 tokens")
