"""The CPU GEMM and SwiGLU MLP (engine/model/ops/cpu.py, cpu_linear.c) against their torch twins (F.linear, the
MLP's torch path), and the property exactness leans on: a row's bits do not depend on the other rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.config import Qwen35Config
from engine.model.moe import MLP
from engine.model.ops import cpu
from engine.model.qwen35 import FwdCtx, linear
from tests.ops_util import assert_bitwise, spy
from tests.tiny import hf_config

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu._gemm),
                                reason="no C compiler, or a CPU without AVX2 + FMA: the torch GEMM runs")


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double()).float()


@pytest.mark.parametrize("N,K", [(8, 8), (3, 16), (13, 40), (392, 128), (2112, 128), (50, 256)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 33])
def test_linear_matches_fp64_and_every_row_is_batch_invariant(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    y = cpu.linear(x, w)
    assert y.shape == (M, N)
    torch.testing.assert_close(y, _ref(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)
    for i in {0, M // 2, M - 1}:  # alone, and inside other launch shapes (tiles, remainders)
        assert_bitwise(cpu.linear(x[i:i + 1], w)[0], y[i], f"row {i} alone vs in {M} rows")
        assert_bitwise(cpu.linear(x[:i + 1], w)[i], y[i], f"row {i} in {i + 1} rows vs in {M}")


@pytest.fixture
def wide_tiles():
    """The GEMM's 16-lane tiles on (skip on a CPU without AVX-512); the setting is restored after the test."""
    if not cpu.set_wide(True):
        pytest.skip("this CPU has no AVX-512: the 8-lane tiles are the only ones")
    yield
    cpu.set_wide(True)


@pytest.mark.parametrize("N,K", [(8, 8), (3, 16), (4, 24), (13, 40), (768, 128), (128, 384), (50, 256)])
def test_wide_tiles_give_the_8_lane_tiles_bits(wide_tiles, N, K):
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    for M in (2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 32, 33, 70):  # every pair count, odd rows, L1 blocks of 8+ rows
        x = torch.randn(M, 2 * K, generator=g)[:, :K]  # rows 2K apart: the packing reads a pitch
        assert cpu.set_wide(True)
        y16 = cpu.linear(x, w)
        cpu.set_wide(False)
        y8 = cpu.linear(x, w)
        torch.testing.assert_close(y16, _ref(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)
        assert_bitwise(y16, y8, f"16-lane vs 8-lane tiles, M={M} N={N} K={K}")
    wgu, wd = torch.randn(2 * K, K, generator=g), torch.randn(K, K, generator=g)
    x = torch.randn(9, K, generator=g)
    assert cpu.set_wide(True)
    m16 = cpu.mlp_or_none(x, wgu, wd)
    cpu.set_wide(False)
    assert_bitwise(m16, cpu.mlp_or_none(x, wgu, wd), f"mlp, 16-lane vs 8-lane tiles, H=I={K}")


def test_linear_on_views_and_leading_dims():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 3, 64, generator=g)
    x = wide[..., :32]  # rows 64 floats apart
    w = torch.randn(24, 32, generator=g)
    y = cpu.linear(x, w)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, _ref(x, w), rtol=1e-5, atol=1e-5)
    assert_bitwise(y, cpu.linear(x.contiguous(), w), "a strided view vs its contiguous copy")
    # "contiguous" with an arbitrary stride on a size-1 dim ([3, 1, K] strides (K, 3K, 1)): rows are K apart
    odd = torch.randn(1, 3, 32, generator=g).transpose(0, 1)
    assert odd.is_contiguous() and odd.stride(1) == 96
    assert_bitwise(cpu.linear(odd, w), cpu.linear(odd.clone(memory_format=torch.contiguous_format), w), "size-1 dim")
    mlp_w = torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g)
    assert_bitwise(cpu.mlp_or_none(odd, *mlp_w), cpu.mlp_or_none(odd.reshape(3, 32).clone()[:, None], *mlp_w),
                   "mlp, size-1 dim")


def test_gemm_takes_only_what_it_can_compute_and_bad_arguments_raise():
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    assert cpu.gemm_takes(x, w)
    assert not cpu.gemm_takes(x[:, :12], torch.randn(4, 12))  # K not a multiple of 8: torch's GEMM
    assert not cpu.gemm_takes(x.double(), w.double())
    assert not cpu.gemm_takes(x.requires_grad_(), w)
    assert not cpu.gemm_takes(x.detach(), torch.randn(16, 4).t())  # a transposed (non-contiguous) weight
    with pytest.raises(ValueError):
        cpu.linear(torch.randn(2, 16), torch.randn(4, 24))
    with pytest.raises(ValueError):
        cpu.linear(torch.randn(2, 12), torch.randn(4, 12))


@pytest.mark.parametrize("M", [1, 4, 7])
def test_mlp_matches_torch_path_and_is_batch_invariant(M):
    torch.manual_seed(M)
    mlp = MLP(48, 80)
    mlp.fuse()
    mlp.requires_grad_(False)
    x = torch.randn(1, M, 48)
    cfg = Qwen35Config.from_dict(hf_config(hidden_size=48, num_hidden_layers=1, layer_types=["full_attention"]))
    step = FwdCtx.make(cfg, "cpu", torch.float32, [0], [0], [0], [0], M, True)
    with spy(cpu, "mlp_or_none") as calls, torch.inference_mode():
        y = mlp(x, step)
        y_t = mlp(x)  # no context: the torch path
    assert [r is not None for _, r in calls] == [True], "the step forward did not run the C MLP"
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-5)
    for i in range(M):
        assert_bitwise(cpu.mlp_or_none(x[:, i:i + 1], mlp._w_gu, mlp.down_proj.weight)[0, 0], y[0, i],
                       f"row {i} alone")
    assert cpu.mlp_or_none(x, mlp._w_gu[:-8], mlp.down_proj.weight) is None  # shapes that do not fit: not taken


def test_model_linear_takes_the_gemm_in_step_forwards_and_prefill_blocks():
    cfg = Qwen35Config.from_dict(hf_config(hidden_size=48, num_hidden_layers=1, layer_types=["full_attention"]))
    x, w = torch.randn(1, 2, 48), torch.randn(16, 48)
    long_T = 300  # a prefill block of any length takes the kernels (row by row: the same bits as alone)
    xl = torch.randn(1, long_T, 48)
    step = FwdCtx.make(cfg, "cpu", torch.float32, [0], [0], [0], [0], 2, True)
    prefill = FwdCtx.make(cfg, "cpu", torch.float32, [0], [0], [0], [0], 2, False)
    long_prefill = FwdCtx.make(cfg, "cpu", torch.float32, [0], [0], [0], [0], long_T, False)
    with torch.inference_mode():
        for ctx in (step, prefill):
            assert_bitwise(linear(x, w, ctx), cpu.linear(x, w), "step forward / short prefill: the C GEMM")
        yl = linear(xl, w, long_prefill)
        assert_bitwise(yl, cpu.linear(xl, w), "long prefill: the C GEMM")
        assert_bitwise(yl[:, :2], cpu.linear(xl[:, :2], w), "a long block's rows are the rows alone")
        assert_bitwise(linear(x, w, None), F.linear(x, w), "no cache: torch's GEMM")
        prev = cpu.set_enabled(False)
        try:
            assert_bitwise(linear(x, w, step), F.linear(x, w), "--no-cpu-kernel: torch's GEMM")
        finally:
            cpu.set_enabled(prev)
