"""The self-check's tolerance (engine/model/ops/dispatch.py `bounds`, `mismatch`): it follows the output dtype, the
reduction length and the accumulation mode, so a correct kernel never fails against its twin on a GPU, while real
defects are caught.

The GPU's noise is simulated honestly on the CPU, at the LM head's shape class (fp32 output, K = the hidden sizes of
Qwen3.5: 1024, 2048, 4096, 5120; 3 rows x 1024 columns) over 60 seeds, with the self-check's inputs (bf16
x ~ N(0, 1), w ~ N(0, 1/K)):
the twin is torch's fp32 GEMM (MKL here, cuBLAS there: products of bf16 values are exact in fp32, only the order of
the fp32 sums differs); the "kernel" sums the same products in another legitimate order: the MMA's (a partial per
64-wide K tile, the tiles accumulated in order), a K split's (partials summed in order), and (one seed in five) a
plain sequential FMA loop over a random permutation of K (the worst order a correct kernel could take). A TF32 kernel
(fp32 operands rounded to 10-bit mantissas, what `tl.dot` does by default) passes the TF32 tolerance and fails the
fp32 one (why the chunked GDN prefill's dots run IEEE, launch.py). Defects that must be caught on every seed: one ulp added to every
element of a bf16 output, an fp32 output (or its partial sums) rounded through bf16, one wrong element, an N tile
read off by one tile, a dropped K tile.

What the bound cannot see, by construction: a defect below the accumulation noise, e.g. one fp32 ulp per element of
an fp32 output (2^-23 relative, where two correct fp32 orders already differ by about 2^-24 sqrt(K)).
"""
from __future__ import annotations

import pytest
import torch

from engine.model.ops import dispatch as ops
from engine.model.ops.dispatch import U_BF16, U_TF32, Accumulation

SEEDS = range(60)
HIDDEN = (1024, 2048, 4096, 5120)  # Qwen3.5 0.8B, 35B-A3B, 9B, 27B
BK = 64


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (10 stored mantissa bits), rounding to nearest even, kept in fp32."""
    b = t.contiguous().view(torch.int32)
    return ((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF).view(torch.float32)


def _bf16_ulp_up(y: torch.Tensor) -> torch.Tensor:
    """Every element of a bf16 tensor moved one ulp away from zero (its next representable magnitude)."""
    b = y.view(torch.int16)
    return (b + 1).view(torch.bfloat16)


def _case(seed: int, N: int):
    g = torch.Generator().manual_seed(seed)
    K = HIDDEN[seed % len(HIDDEN)]
    x = torch.randn(3, K, generator=g).bfloat16().float()  # [3, K] bf16 values
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16().float()  # [N, K]
    return g, K, x, w, x @ w.T  # the twin: an fp32 GEMM of exact products


def _mma(x: torch.Tensor, w: torch.Tensor, split: int = 1) -> torch.Tensor:
    """A partial per BK tile (the MMA), tiles accumulated in order; `split` K ranges summed in order after."""
    M, K = x.shape
    tiles = torch.einsum("mtk,ntk->tmn", x.view(M, -1, BK), w.view(w.shape[0], -1, BK))  # [K/BK, M, N]
    per = -(-tiles.shape[0] // split)
    out = torch.zeros(M, w.shape[0])
    for s in range(0, tiles.shape[0], per):
        acc = torch.zeros_like(out)
        for t in tiles[s:s + per]:
            acc = acc + t
        out = out + acc
    return out


def _sequential(x: torch.Tensor, w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One fp32 FMA per product, over a random permutation of K."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in torch.randperm(x.shape[1], generator=g).tolist():
        acc.addcmul_(x[:, k:k + 1], w[None, :, k])
    return acc


def test_no_false_failure_of_a_correct_gemm_over_60_seeds():
    """fp32 (LM head) and bf16 outputs, three legitimate summation orders, TF32 under the TF32 tolerance: every seed
    passes, with margin (the worst error stays under half of each bound)."""
    worst: dict[str, float] = {}
    for seed in SEEDS:
        g, K, x, w, ref = _case(seed, 1024)
        acc = Accumulation(K)
        b32 = ops.bounds(torch.float32, torch.float32, acc)
        rms = ref.square().mean().sqrt()
        orders = [("mma", _mma(x, w), ref), ("split4", _mma(x, w, 4), ref)]
        if seed % 5 == 0:  # one seed in five (every K): the Python loop costs K steps
            orders.append(("sequential", _sequential(x, w[:128], g), ref[:, :128]))
        for name, got, want in orders:
            assert ops.mismatch(got, want, acc) is None, (seed, name, ops.mismatch(got, want, acc))
            assert ops.mismatch(got.bfloat16(), want.bfloat16(), acc) is None, (seed, name, "bf16 output")
            err = (got - want).abs()
            worst[name] = max(worst.get(name, 0.0), (err.max() / (b32.elem * rms)).item(),
                              (err.norm() / want.norm() / b32.norm).item())
        xt, wt = torch.randn(3, K, generator=g), torch.randn(256, K, generator=g) * K ** -0.5  # an fp32 model
        twin, tf = xt @ wt.T, _tf32(xt) @ _tf32(wt).T
        assert ops.mismatch(tf, twin, Accumulation(K, U_TF32)) is None, (seed, "tf32")
        assert ops.mismatch(tf, twin, Accumulation(K)) is not None, (seed, "tf32 under the fp32 bound")
    assert max(worst.values()) < 0.5, worst


def test_real_defects_are_caught_on_every_seed():
    for seed in SEEDS:
        g, K, x, w, ref = _case(seed, 512)
        acc = Accumulation(K)
        good = _mma(x, w)
        assert ops.mismatch(good, ref, acc) is None
        defects = {
            "1 bf16 ulp per element": (_bf16_ulp_up(good.bfloat16()), ref.bfloat16()),
            "fp32 output through bf16": (good.bfloat16().float(), ref),
            "bf16 partial sums": (sum(p.bfloat16().float() for p in
                                      (_mma(x[:, :K // 2], w[:, :K // 2]), _mma(x[:, K // 2:], w[:, K // 2:]))), ref),
            "a dropped K tile": (_mma(x[:, :-BK], w[:, :-BK]), ref),
            "an N tile off by one": (torch.cat([good[:, 64:128], good[:, 64:]], 1), ref),
        }
        wrong = good.clone()
        r, c = seed % 3, (seed * 37) % 512
        wrong[r, c] = good[(r + 1) % 3, c]
        defects["one wrong element"] = (wrong, ref)
        for name, (got, want) in defects.items():
            assert ops.mismatch(got, want, acc) is not None, (seed, K, name)


def test_bounds_follow_dtype_reduction_and_mode():
    f32, bf = torch.float32, torch.bfloat16
    short, long_ = ops.bounds(f32, f32, Accumulation(128)), ops.bounds(f32, f32, Accumulation(128 * 64))
    assert long_.elem == pytest.approx(8 * short.elem)  # sqrt(K)
    assert ops.bounds(f32, f32, Accumulation(128, U_TF32)).elem > 100 * short.elem
    assert ops.bounds(f32, f32).norm == ops.TOL_FP32[0] and ops.bounds(bf, f32).norm == 2.0 ** -9
    assert ops.bounds(bf, bf, Accumulation(64, U_BF16)).norm == pytest.approx(ops.C_NORM * (U_BF16 + 2.0 ** -21))
    assert ops.tolerance(f32, f32) == ops.TOL_FP32 and ops.tolerance(bf, f32) == ops.TOL_16BIT
