"""Pool attention (1..W new queries per row over its cached K/V, GQA, fused gate) vs its twin, and its batch
invariance: query t of row i is bitwise the same at T = 1 (pos0 + t) as inside a T = W launch, with any other
rows (TRITON_INTERPRET=1 on CPU)."""
import pytest
import torch

from engine.model.ops import attention as at
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, nans, needs_triton, rand


S, L, NKV, HD, NH, W = 5, 448, 2, 16, 4, 4  # GQA r = 2


def _pool(dtype, slot, pos0, T, g):
    """K/V pool with real data below each row's pos0 + T and NaN above it (and in unused slots): the kernel
    must never read past a query's keys."""
    k, v = rand(S, L, NKV, HD, dtype=dtype, gen=g), rand(S, L, NKV, HD, dtype=dtype, gen=g)
    live = torch.zeros(S, L, dtype=torch.bool, device=DEVICE)
    for s, p in zip(slot.tolist(), pos0.tolist()):
        live[s, :p + T] = True
    k[~live], v[~live] = float("nan"), float("nan")
    return k, v


def test_write_kv_scatters_rows_at_their_positions():
    k_cache = torch.zeros(3, 8, 1, 2, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(8, dtype=torch.float32, device=DEVICE).view(2, 2, 1, 2)
    at.write_kv(k_cache, v_cache, k, -k, torch.tensor([2, 0], device=DEVICE), torch.tensor([5, 1], device=DEVICE))
    assert k_cache[2, 5:7].flatten().tolist() == [0, 1, 2, 3] and k_cache[0, 1:3].flatten().tolist() == [4, 5, 6, 7]
    assert v_cache[0, 2].flatten().tolist() == [-6, -7] and k_cache.count_nonzero() == 7  # one written value is 0


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated,nsplit,min_chunk", [(True, at.ATTN_SPLITS, at.ATTN_MIN_CHUNK), (False, 4, 64)])
def test_attention_matches_twin_and_is_batch_invariant(dtype, gated, nsplit, min_chunk):
    """Rows at short and long positions (the default config gives the long row 2 splits; the second one up
    to 4, queries of one row on different chunk sizes); every query also launched alone (T=1, pos0 + t)
    and at T=1 among other random rows."""
    g = torch.Generator().manual_seed(3)
    slot = torch.tensor([3, 0, 4], device=DEVICE)
    pos0 = torch.tensor([0, 380, 190], device=DEVICE)
    k_cache, v_cache = _pool(dtype, slot, pos0, W, g)
    q = rand(3, W, NH, HD, dtype=dtype, gen=g)
    gate = rand(3, W, NH, 2 * HD, dtype=dtype, gen=g)[..., HD:] if gated else None  # a strided view, as in the model
    kw = dict(gate=gate, nsplit=nsplit, min_chunk=min_chunk)
    o = at.attention(q, k_cache, v_cache, slot, pos0, HD ** -0.5, out=nans(3, W, NH, HD, dtype=dtype), **kw)
    assert_close(o, at.attention_ref(q, k_cache, v_cache, slot, pos0, HD ** -0.5, gate))
    for i in range(3):
        for t in range(W) if i == 1 else (0, W - 1):  # every query of the multi-split row
            gt = gate[i:i + 1, t:t + 1] if gated else None
            kw1 = dict(kw, gate=gt)
            alone = at.attention(q[i:i + 1, t:t + 1], k_cache, v_cache, slot[i:i + 1], pos0[i:i + 1] + t,
                                 HD ** -0.5, **kw1)
            assert_bitwise(alone[0, 0], o[i, t], f"row {i} query {t}: T=1 vs T={W}")
        # T=1 for query W-1 of row i, batched with the other rows' queries at other positions
        last = torch.stack([q[j, W - 1 if j == i else 0] for j in range(3)])[:, None]
        p = torch.where(torch.arange(3, device=DEVICE) == i, pos0 + W - 1, pos0)
        gl = torch.stack([gate[j, W - 1 if j == i else 0] for j in range(3)])[:, None] if gated else None
        mixed = at.attention(last, k_cache, v_cache, slot, p, HD ** -0.5, **dict(kw, gate=gl))
        assert_bitwise(mixed[i, 0], o[i, W - 1], f"row {i} query {W - 1}: batched T=1 vs T={W}")
