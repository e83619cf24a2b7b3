"""The C greedy pick (engine/model/ops/cpu.py `argmax_or_none`, cpu_sample.c) picks exactly what its twin,
torch.argmax(dim=-1), picks: random rows, ties, NaNs, infinities, signed zeros, every length around the 8-lane
chunks, a row pitch; and dispatch.argmax runs it on fp32 CPU logits."""
from __future__ import annotations

import pytest
import torch

from engine.model.ops import cpu, dispatch
from engine.model.ops.sample import argmax_ref

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the CPU kernel is not built")


def _check(x: torch.Tensor) -> None:
    got = cpu.argmax_or_none(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, argmax_ref(x)), (x, got, argmax_ref(x))


@pytest.mark.parametrize("V", [1, 2, 7, 8, 9, 15, 16, 17, 31, 64, 2112, 2119])
def test_random_rows_pick_as_torch(V):
    g = torch.Generator().manual_seed(V)
    _check(torch.randn(33, V, generator=g))
    # few distinct values: many ties, across lanes, chunks and the tail; the lowest index must win
    _check(torch.randint(-2, 3, (64, V), generator=g).float())
    _check(torch.zeros(3, V))  # one value everywhere: index 0


@pytest.mark.parametrize("V", [1, 5, 8, 13, 40, 2112])
def test_specials_pick_as_torch(V):
    g = torch.Generator().manual_seed(100 + V)
    rows = []
    for _ in range(200):
        x = torch.randint(-3, 4, (V,), generator=g).float()
        for val in (float("nan"), float("inf"), float("-inf"), -0.0, 0.0):
            n = int(torch.randint(0, 3, (1,), generator=g))
            x[torch.randint(0, V, (n,), generator=g)] = val
        rows.append(x)
    rows.append(torch.full((V,), float("-inf")))  # all -inf: index 0
    rows.append(torch.full((V,), float("nan")))
    _check(torch.stack(rows))


def test_a_row_pitch_and_a_view():
    base = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    _check(base[:, 3:35])  # rows 40 floats apart
    _check(base[::2])
    _check(base.t().contiguous().t())  # a column-major view (copied)


def test_what_it_does_not_take():
    assert cpu.argmax_or_none(torch.randn(3, 5, dtype=torch.float64)) is None
    assert cpu.argmax_or_none(torch.randn(3, 5).to(torch.bfloat16)) is None
    assert cpu.argmax_or_none(torch.randn(3, 4, 5)) is None
    assert cpu.argmax_or_none(torch.randn(3, 0)) is None
    assert cpu.argmax_or_none(torch.randn(0, 5)).shape == (0,)


def test_dispatch_argmax_runs_the_c_pick(monkeypatch):
    x = torch.randn(4, 100)
    seen = []
    real = cpu.argmax_or_none
    monkeypatch.setattr(cpu, "argmax_or_none", lambda t: seen.append(t.shape) or real(t))
    assert torch.equal(dispatch.argmax(x), x.argmax(-1)) and seen == [(4, 100)]
    assert torch.equal(dispatch.argmax(x.double()), x.double().argmax(-1))  # the torch twin
