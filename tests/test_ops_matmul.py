"""Batch-invariant matmul and its grouped-by-expert (MoE) form vs their torch twins (TRITON_INTERPRET=1 on CPU)."""
import pytest
import torch

from engine.model.ops import matmul as mm
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, nans, needs_triton, rand


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [None, 2])
def test_matmul_matches_twin_and_rows_are_batch_invariant(dtype, split_k):
    """Rows of an M=1 launch are bitwise the same rows inside M = 2..40 launches whatever the other rows;
    N spans two tiles with a remainder, K three blocks with a remainder; with and without a K split."""
    g = torch.Generator().manual_seed(0)
    K, N = 150, 80
    w = rand(N, K, dtype=dtype, gen=g)
    x = rand(40, K, dtype=dtype, gen=g)
    y = mm.matmul(x, w, split_k=split_k, out=nans(40, N, dtype=dtype))
    assert_close(y, mm.matmul_ref(x, w))
    for r in (0, 7, 39):
        alone = mm.matmul(x[r:r + 1], w, split_k=split_k)
        assert_bitwise(alone[0], y[r], f"row {r}, M=40 vs M=1")
        for M, at in ((2, 1), (9, 4), (33, 32)):
            other = rand(M, K, dtype=dtype, gen=g, scale=5.0)
            other[at] = x[r]
            assert_bitwise(mm.matmul(other, w, split_k=split_k)[at], alone[0], f"row {r} at {at} of M={M}")


@needs_triton
def test_matmul_lm_head_large_n_fp32_logits():
    """LM-head use: bf16 hidden, a vocab-sized N that is not a tile multiple, fp32 logits out."""
    g = torch.Generator().manual_seed(1)
    x = rand(3, 64, dtype=torch.bfloat16, gen=g)
    w = rand(1000, 64, dtype=torch.bfloat16, gen=g)
    y = mm.matmul(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_close(y, mm.matmul_ref(x, w, torch.float32))
    assert_bitwise(mm.matmul(x[2:], w, out_dtype=torch.float32)[0], y[2], "logits row 2, M=1 vs M=3")


def test_matmul_config_never_depends_on_m():
    assert mm.matmul_config(1024, 3584)[1] > 1  # few N tiles: a fixed K split
    k_per, split = mm.matmul_config(248320, 4096)
    assert split == 1 and k_per >= 4096


def test_group_by_expert_and_tiles():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3]], device=DEVICE)
    order, offsets = mm.group_by_expert(idx, 5)
    assert offsets.tolist() == [0, 2, 3, 3, 6, 6]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # expert 0: slots 1, 4; expert 1: slot 3; expert 3: 0, 2, 5
    te, tr, n = mm.expert_tiles(offsets, 6, block_m=2)
    live = te < 5
    assert te[live].tolist() == [0, 1, 3, 3] and tr[live].tolist() == [0, 2, 3, 5] and n == 8


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_matches_twin_and_is_batch_invariant(dtype):
    """MoE experts: tokens gathered and sorted by expert (some experts empty, one with > BLOCK_M rows);
    a token's rows are bitwise the same when it is routed alone."""
    g = torch.Generator().manual_seed(2)
    E, T, k, K, N = 6, 13, 2, 100, 48
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:k] for _ in range(T)]).to(DEVICE)  # experts 4, 5 unused
    idx[:9, 0] = 1  # expert 1 gets >= 17 rows: two tiles
    x = rand(T, K, dtype=dtype, gen=g)
    w = rand(E, N, K, dtype=dtype, gen=g)
    order, offsets = mm.group_by_expert(idx, E)
    rows = order // k
    y = mm.grouped_matmul(x, w, offsets, rows)
    assert_close(y, mm.grouped_matmul_ref(x, w, offsets, rows))
    pos = {int(s): m for m, s in enumerate(order.tolist())}  # flat routing slot -> sorted row
    for t in (0, 5, 12):
        o1, off1 = mm.group_by_expert(idx[t:t + 1], E)
        y1 = mm.grouped_matmul(x[t:t + 1], w, off1, o1 // k)
        for m1, s in enumerate(o1.tolist()):
            assert_bitwise(y1[m1], y[pos[t * k + s]], f"token {t} slot {s}")
    ys = mm.grouped_matmul(x[rows], w, offsets)  # pre-sorted input, no gather
    assert_bitwise(ys, y, "gathered vs pre-sorted rows")
