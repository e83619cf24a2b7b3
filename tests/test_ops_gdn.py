"""GDN over the state pool: recurrent update and causal conv update vs their twins (gdn.py semantics), the
pool contract (read rec[slot, cur] first, state after token t in slot t, other slots untouched) and the
invariance T=1 steps == one T=W launch, bitwise (TRITON_INTERPRET=1 on CPU)."""
import pytest
import torch

from engine.model.ops import gdn_update as gu
from engine.model.ops.gdn import UNFOLD_ROWS, causal_conv_window, gdn_chunked, gdn_recurrent, l2norm
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, nans, needs_triton, rand

S, W, NK, NV, DK, DV, C = 5, 4, 2, 4, 16, 32, 200  # GVA r = 2; DV spans one 32-wide block, C two 128 blocks
SLOT, CUR = [3, 0, 4], [1, 3, 0]  # cur == 3 is overwritten by token 3 of a T=4 launch: read first


def _gdn_inputs(dtype, l2, g):
    N, T = len(SLOT), W
    q, k = rand(N, T, NK, DK, gen=g), rand(N, T, NK, DK, gen=g)
    if not l2:
        q, k = l2norm(q) * DK ** -0.5, l2norm(k)
    v = rand(N, T, NV, DV, dtype=dtype, gen=g)
    gl = -torch.rand(N, T, NV, generator=g).to(DEVICE)
    beta = torch.rand(N, T, NV, generator=g).to(DEVICE)
    return q.to(dtype), k.to(dtype), v, gl, beta


def _pool(shape, dtype, g):
    """A pool whose slots 0..W-1 of the used sessions hold NaN except each row's live slot cur."""
    p = rand(*shape, dtype=dtype, gen=g, scale=0.3)
    for s, c in zip(SLOT, CUR):
        live = p[s, c].clone()
        p[s] = float("nan")
        p[s, c] = live
    return p


def _idx():
    return torch.tensor(SLOT, device=DEVICE), torch.tensor(CUR, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T", [(1, 1), (1, UNFOLD_ROWS), (UNFOLD_ROWS, 1), (2, UNFOLD_ROWS), (3, 37)])
def test_causal_conv_is_the_tap_by_tap_sum_for_every_shape(dtype, B, T, monkeypatch):
    """Both forms of `causal_conv_window` (unfolded taps up to UNFOLD_ROWS tokens, slices above) give bitwise the
    products summed tap by tap in order, for every token, in any launch or alone (T = 1); so a token's sum never
    depends on B or T. The SiLU after it is torch's, which is not position-free: its vector body and its scalar
    tail round some values differently (Sleef's exp vs libm's; with AVX-512's 16 lanes these 48 channels leave a
    tail), so it is checked over the whole output, in the same layout, and the sums token by token without it."""
    g = torch.Generator().manual_seed(B * 100 + T)
    Cc, kc = 48, 4
    x = torch.randn(B, Cc, T, generator=g, dtype=dtype)
    x[0, :5] = 0.0  # all-zero products from token 3 on: -0.0 each (w < 0), and their sum's sign must match too
    state = torch.randn(B, Cc, kc - 1, generator=g, dtype=dtype)
    w = torch.randn(Cc, kc, generator=g, dtype=dtype)
    w[:5] = -w[:5].abs()
    win = torch.cat([state, x], dim=-1)
    sums = []
    for t in range(T):
        acc = win[..., t] * w[:, 0]
        for j in range(1, kc):
            acc = acc + win[..., t + j] * w[:, j]
        sums.append(acc)  # [B, C]
    want = torch.stack(sums, dim=-1).contiguous()  # [B, C, T]
    y, window = causal_conv_window(x, state, w)
    assert y.is_contiguous()
    assert_bitwise(y, torch.nn.functional.silu(want), "SiLU of the tap-by-tap sums, same layout")
    assert_bitwise(window, win, "window")
    monkeypatch.setattr(torch.nn.functional, "silu", lambda a: a)  # the sums themselves, token by token
    s, _ = causal_conv_window(x, state, w)
    s3, _ = causal_conv_window(x, state, w[:, None, :])  # the conv module's own [C, 1, Kc] weight
    for t in range(T):
        assert_bitwise(s[..., t], want[..., t], f"token {t}")
        assert torch.equal(s[..., t].signbit(), want[..., t].signbit()), f"token {t}: the sign of a zero differs"
        assert_bitwise(s3[..., t], want[..., t], f"token {t} ([C, 1, Kc] weight)")
        one, _ = causal_conv_window(x[..., t:t + 1], win[..., t:t + kc - 1], w)  # the token alone (T = 1)
        assert_bitwise(one[..., 0], want[..., t], f"token {t} alone")


def test_twin_is_the_recurrence():
    """gdn_update_ref == gdn.gdn_recurrent on the gathered state, and it writes slot t of each row only."""
    g = torch.Generator().manual_seed(4)
    q, k, v, gl, beta = _gdn_inputs(torch.float32, False, g)
    rec = rand(S, W, NV, DK, DV, gen=g)
    before = rec.clone()
    slot, cur = _idx()
    o = gu.gdn_update_ref(q, k, v, gl, beta, rec, slot, cur)
    r = NV // NK
    want, _ = gdn_recurrent(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, gl, beta, before[slot, cur])
    assert_bitwise(o, want, "twin vs gdn_recurrent")
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[SLOT] = False
    assert_bitwise(rec[untouched.to(DEVICE)], before[untouched.to(DEVICE)], "slots of other sessions")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2", [False, True])
def test_gdn_update_matches_twin_and_steps_equal_window(dtype, l2):
    g = torch.Generator().manual_seed(5)
    q, k, v, gl, beta = _gdn_inputs(dtype, l2, g)
    rec = _pool((S, W, NV, DK, DV), torch.float32, g)
    rec_twin, rec_steps, before = rec.clone(), rec.clone(), rec.clone()
    slot, cur = _idx()
    o = gu.gdn_update(q, k, v, gl, beta, rec, slot, cur, qk_l2norm=l2, out=nans(3, W, NV, DV))
    assert_close(o, gu.gdn_update_ref(q, k, v, gl, beta, rec_twin, slot, cur, qk_l2norm=l2))
    assert_close(rec[slot], rec_twin[slot])
    others = torch.tensor([s not in SLOT for s in range(S)], device=DEVICE)
    assert_bitwise(rec[others], before[others], "slots of other sessions")
    c = cur
    for t in range(W):  # plain decode: T=1 reads the live slot and writes slot 0, then cur = 0
        sl = slice(t, t + 1)
        o1 = gu.gdn_update(q[:, sl], k[:, sl], v[:, sl], gl[:, sl], beta[:, sl], rec_steps, slot, c, qk_l2norm=l2)
        assert_bitwise(o1[:, 0], o[:, t], f"output of token {t}")
        assert_bitwise(rec_steps[slot, 0], rec[slot, t], f"state after token {t}")
        c = torch.zeros_like(cur)
    # a row alone == the same row in the batch
    alone_rec = before.clone()
    o_alone = gu.gdn_update(q[1:2], k[1:2], v[1:2], gl[1:2], beta[1:2], alone_rec, slot[1:2], cur[1:2], qk_l2norm=l2)
    assert_bitwise(o_alone[0], o[1], "row 1 alone vs batched")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_twin_and_steps_equal_window(dtype):
    g = torch.Generator().manual_seed(6)
    N = len(SLOT)
    x = rand(N, W, C, dtype=dtype, gen=g)
    wgt = rand(C, 4, dtype=dtype, gen=g)
    conv = _pool((S, W, C, 3), dtype, g)
    conv_twin, conv_steps, before = conv.clone(), conv.clone(), conv.clone()
    slot, cur = _idx()
    y = gu.conv_update(x, conv, wgt, slot, cur, out=nans(N, W, C, dtype=dtype))
    # kernel: taps summed in fp32, rounded once -> compare with the twin run in fp32
    y_twin = gu.conv_update_ref(x.float(), conv_twin.float().clone(), wgt.float(), slot, cur)
    assert_close(y, y_twin.to(dtype))
    gu.conv_update_ref(x, conv_twin, wgt, slot, cur)
    assert_bitwise(conv[slot], conv_twin[slot], "conv states (copies of raw inputs)")
    others = torch.tensor([s not in SLOT for s in range(S)], device=DEVICE)
    assert_bitwise(conv[others], before[others], "slots of other sessions")
    c = cur
    for t in range(W):
        y1 = gu.conv_update(x[:, t:t + 1], conv_steps, wgt, slot, c)
        assert_bitwise(y1[:, 0], y[:, t], f"output of token {t}")
        assert_bitwise(conv_steps[slot, 0], conv[slot, t], f"window after token {t}")
        c = torch.zeros_like(cur)


def test_gdn_prefill_torch_backend_is_the_chunked_form():
    g = torch.Generator().manual_seed(7)
    q, k = l2norm(rand(2, 70, NV, DK, gen=g)) * DK ** -0.5, l2norm(rand(2, 70, NV, DK, gen=g))
    v, gl, beta = rand(2, 70, NV, DV, gen=g), -torch.rand(2, 70, NV, generator=g), torch.rand(2, 70, NV, generator=g)
    gl, beta = gl.to(DEVICE), beta.to(DEVICE)
    s0 = rand(2, NV, DK, DV, gen=g, scale=0.1)
    o, s = gu.gdn_prefill(q, k, v, gl, beta, s0)
    o_want, s_want = gdn_chunked(q, k, v, gl, beta, s0)
    assert_bitwise(o, o_want, "prefill output")
    assert_bitwise(s, s_want, "prefill state")
    o_rec, s_rec = gdn_recurrent(q, k, v, gl, beta, s0)
    torch.testing.assert_close(o, o_rec, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="unknown GDN prefill backend"):
        gu.gdn_prefill(q, k, v, gl, beta, s0, backend="nope")
