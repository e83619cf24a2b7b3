"""The prefill kernels (engine/model/ops/gdn_prefill.py, attention_prefill.py) vs their twins and the recurrent step,
under TRITON_INTERPRET=1 on a CPU, at small shapes: chunk tails, short rows, GQA (a non-power-of-two group),
NaN-poisoned outputs, and the grid's invariance (a row's bits do not depend on the other rows, on T, on where a
chunk starts, or on how a prompt is split at multiples of 64)."""
from __future__ import annotations

import pytest
import torch

from engine.model.ops import attention_prefill as ap
from engine.model.ops import gdn_prefill as gp
from engine.model.ops.gdn import gdn_recurrent, l2norm
from tests.ops_util import DEVICE, assert_bitwise, assert_close, nans, needs_triton, rand

pytestmark = needs_triton

NK, NV, DK, DV = 1, 2, 16, 32  # value heads share a key head (r = 2)
LENS = [150, 64, 5]  # three chunks (the last a tail of 22), exactly one chunk, a tail alone
SLOT, CUR, DST = [3, 0, 1], [1, 0, 1], [0, 1, 1]  # row 2 writes its state in place (dst == cur)


def _gdn_inputs(dtype, T, g, n=3):
    q, k = rand(n, T, NK, DK, dtype=dtype, gen=g), rand(n, T, NK, DK, dtype=dtype, gen=g)
    v = rand(n, T, NV, DV, dtype=dtype, gen=g)
    gl = (-torch.rand(n, T, NV, generator=g) * 0.3).to(DEVICE)
    beta = torch.rand(n, T, NV, generator=g).to(DEVICE)
    return q, k, v, gl, beta


def _ix(*cols):
    return [torch.tensor(c, device=DEVICE) for c in cols]


def _pool(g):
    """rec [5, 2, NV, DK, DV] fp32: random states, NaN in every destination slot that is not also read first."""
    rec = rand(5, 2, NV, DK, DV, gen=g, scale=0.3)
    for s, c, d in zip(SLOT, CUR, DST):
        if (s, d) != (s, c):
            rec[s, d] = float("nan")
    return rec


@pytest.mark.parametrize("dtype,l2", [(torch.float32, False), (torch.bfloat16, True)])
def test_chunked_gdn_matches_twin_and_recurrence(dtype, l2):
    g = torch.Generator().manual_seed(0)
    T = max(LENS)
    q, k, v, gl, beta = _gdn_inputs(dtype, T, g)
    if not l2:  # the caller normalised q and k
        q, k = (l2norm(q.float()) * DK ** -0.5).to(dtype), l2norm(k.float()).to(dtype)
    rec = _pool(g)
    rec_t, before = rec.clone(), rec.clone()
    slot, cur, dst, lens = _ix(SLOT, CUR, DST, LENS)
    o = gp.chunked_gdn(q, k, v, gl, beta, rec, slot, cur, dst, lens, qk_l2norm=l2, out=nans(3, T, NV, DV))
    o_t = gp.chunked_gdn_ref(q, k, v, gl, beta, rec_t, slot, cur, dst, lens, qk_l2norm=l2)
    for i, n in enumerate(LENS):
        assert_close(o[i, :n], o_t[i, :n])
        assert o[i, n:].isnan().all(), f"row {i}: a padding column was written"
    assert_close(rec[slot, dst], rec_t[slot, dst])
    others = torch.tensor([s not in SLOT for s in range(5)], device=DEVICE)
    assert_bitwise(rec[others], before[others], "slots of other rows")
    # against the token-by-token step (gdn.py), row 0: every chunk and the tail
    r = NV // NK
    qe, ke = q.float().repeat_interleave(r, 2), k.float().repeat_interleave(r, 2)
    if l2:
        qe, ke = l2norm(qe) * DK ** -0.5, l2norm(ke)
    o_r, s_r = gdn_recurrent(qe[:1], ke[:1], v[:1].float(), gl[:1], beta[:1], before[SLOT[0], CUR[0]][None])
    torch.testing.assert_close(o[0].float(), o_r[0], rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-4)
    torch.testing.assert_close(rec[SLOT[0], DST[0]], s_r[0], rtol=1e-4, atol=1e-5)


def test_chunked_gdn_is_the_same_split_at_multiples_of_64_and_batched():
    """One call over 150 tokens == the same prompt in calls split at 64 or 128 (the state carried through the
    pool) == the row alone; bitwise, outputs and final state."""
    g = torch.Generator().manual_seed(1)
    q, k, v, gl, beta = _gdn_inputs(torch.bfloat16, 150, g)
    rec = rand(5, 2, NV, DK, DV, gen=g, scale=0.3)
    slot, cur, dst, lens = _ix(SLOT, CUR, DST, LENS)
    whole = rec.clone()
    o = gp.chunked_gdn(q, k, v, gl, beta, whole, slot, cur, dst, lens, qk_l2norm=True)
    for cut in (64, 128):
        part = rec.clone()
        s1, c1, d1 = _ix([3], [1], [0])
        o1 = gp.chunked_gdn(q[:1, :cut], k[:1, :cut], v[:1, :cut], gl[:1, :cut], beta[:1, :cut], part, s1, c1, d1,
                            qk_l2norm=True)
        o2 = gp.chunked_gdn(q[:1, cut:], k[:1, cut:], v[:1, cut:], gl[:1, cut:], beta[:1, cut:], part, s1, d1, d1,
                            qk_l2norm=True)  # resumes from the state the first call left in window slot 0
        assert_bitwise(torch.cat([o1, o2], 1)[0], o[0], f"outputs, split at {cut}")
        assert_bitwise(part[3, 0], whole[3, 0], f"final state, split at {cut}")
    alone = rec.clone()
    o_a = gp.chunked_gdn(q[2:], k[2:], v[2:], gl[2:], beta[2:], alone, slot[2:], cur[2:], dst[2:], lens[2:],
                         qk_l2norm=True)
    assert_bitwise(o_a[0, :5], o[2, :5], "row 2 alone vs batched")
    assert_bitwise(alone[1, 1], whole[1, 1], "row 2's state alone vs batched")



def test_chunked_gdn_with_block_bounds_is_each_block_alone_and_matches_twin():
    """Rows carrying several blocks (bounds at offsets off the 64 grid: 40 and 110 in a 150-token row, 3 in a 5-token
    row, none in the third): bitwise each block in a call of its own (its chunks restart at the block's start), the
    states at the boundaries kept in the window slots named (NaN-poisoned before), and the twin agrees."""
    g = torch.Generator().manual_seed(4)
    q, k, v, gl, beta = _gdn_inputs(torch.bfloat16, 150, g)
    lens = [150, 5, 64]
    B = gp.NO_BOUND
    bounds = torch.tensor([[40, 110, B], [3, B, B], [B, B, B]], dtype=torch.int32, device=DEVICE)
    keep = torch.tensor([[2, 3, -1], [-1, -1, -1], [-1, -1, -1]], dtype=torch.int32, device=DEVICE)
    rec = rand(3, 4, NV, DK, DV, gen=g, scale=0.3)
    rec[0, 2:] = float("nan")
    slot, cur, dst, ln = _ix([0, 1, 2], [0, 1, 0], [1, 1, 0], lens)
    packed, twin = rec.clone(), rec.clone()
    o = gp.chunked_gdn(q, k, v, gl, beta, packed, slot, cur, dst, ln, qk_l2norm=True, out=nans(3, 150, NV, DV),
                       bounds=bounds, keep=keep)
    o_t = gp.chunked_gdn_ref(q, k, v, gl, beta, twin, slot, cur, dst, ln, qk_l2norm=True, bounds=bounds, keep=keep)
    for i, n in enumerate(lens):
        assert o[i, n:].isnan().all(), f"row {i}: a padding column was written"
        assert_close(o[i, :n], o_t[i, :n])
    assert_close(packed, twin)
    assert not packed[0, 2:].isnan().any(), "a kept boundary state was not written"
    # each block alone, one call per block, the state carried through the pool's window slots
    for i, cuts in enumerate([[0, 40, 110, 150], [0, 3, 5], [0, 64]]):
        alone = rec.clone()
        s1 = _ix([i])[0]
        read = cur[i:i + 1]
        for a, e in zip(cuts, cuts[1:]):
            w = _ix([1 if e == cuts[-1] and i == 0 else dst[i].item()])[0]
            oa = gp.chunked_gdn(q[i:i + 1, a:e], k[i:i + 1, a:e], v[i:i + 1, a:e], gl[i:i + 1, a:e],
                                beta[i:i + 1, a:e], alone, s1, read, w, qk_l2norm=True)
            assert_bitwise(oa[0], o[i, a:e], f"row {i}: block {a}..{e} alone vs packed")
            if e < cuts[-1] and keep[i, cuts.index(e) - 1] >= 0:
                assert_bitwise(alone[i, w.item()], packed[i, keep[i, cuts.index(e) - 1].item()],
                               f"row {i}: the state kept at {e}")
            read = w
        assert_bitwise(alone[i, dst[i].item()], packed[i, dst[i].item()], f"row {i}: final state")

NH, NKV, HD, L = 6, 2, 16, 160  # a group of 3 query heads per KV head


def _attn_inputs(dtype, g, N=2, T=70):
    kc, vc = rand(3, L, NKV, HD, dtype=dtype, gen=g), rand(3, L, NKV, HD, dtype=dtype, gen=g)
    q, gate = rand(N, T, NH, HD, dtype=dtype, gen=g), rand(N, T, NH, HD, dtype=dtype, gen=g)
    return kc, vc, q, gate


@pytest.mark.parametrize("dtype,gated", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_prefill_attention_matches_twin(dtype, gated):
    g = torch.Generator().manual_seed(2)
    kc, vc, q, gate = _attn_inputs(dtype, g)
    gate = gate if gated else None
    slot, pos0 = _ix([2, 0], [64, 13])  # a chunk on the grid, and one anywhere
    o = ap.prefill_attention(q, kc, vc, slot, pos0, HD ** -0.5, gate, out=nans(2, 70, NH, HD, dtype=dtype))
    assert_close(o, ap.prefill_attention_ref(q, kc, vc, slot, pos0, HD ** -0.5, gate))


def test_prefill_attention_rows_do_not_depend_on_t_start_or_other_rows():
    g = torch.Generator().manual_seed(3)
    kc, vc, q, gate = _attn_inputs(torch.bfloat16, g)
    slot, pos0 = _ix([2, 0], [64, 13])
    sc = HD ** -0.5
    o = ap.prefill_attention(q, kc, vc, slot, pos0, sc, gate)
    for a, b in ((0, 20), (20, 70), (37, 38)):  # chunks starting anywhere (pos0 84 and 101: off BLOCK_N), T = 1
        part = ap.prefill_attention(q[:, a:b], kc, vc, slot, pos0 + a, sc, gate[:, a:b])
        assert_bitwise(part, o[:, a:b], f"queries {a}..{b} as their own chunk")
    alone = ap.prefill_attention(q[1:], kc, vc, slot[1:], pos0[1:], sc, gate[1:])
    assert_bitwise(alone[0], o[1], "row 1 alone vs batched")
