"""Qwen's block-128 FP8 checkpoints: the W8A16 kernel vs its twin (TRITON_INTERPRET=1 on CPU), the loader (weights
dequantized at load on CPU, kept FP8 on the kernel path), greedy and speculative exactness against the dequantized
checkpoint, and the refusal of every other quantization.

The FP8 checkpoints are made here from tiny bf16 ones by tools/quantize_fp8.py (the format's definition, not the
loader's code), with dims that give full and partial 128-blocks: hidden 160 (128 + 32), q_proj 256 rows, k / v
64, MLP 288 (128 + 128 + 32), GDN qkv 192, experts 96. The dequantized reference is written block by block by
the same tool, as an ordinary bf16 checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import CheckpointError, load_config, load_model
from engine.model.ops import dispatch as ops
from engine.model.ops import matmul as mm
from engine.model.ops import matmul_fp8 as f8
from engine.spec import generate_spec
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, nans, needs_triton, rand, spy
from tests.tiny import make_checkpoint
from tools.quantize_fp8 import dequantize_block_by_block, dequantize_checkpoint, quantize, quantize_checkpoint

DIMS = dict(vocab_size=256, hidden_size=160, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_key_head_dim=32,
            linear_num_value_heads=2, linear_value_head_dim=64, intermediate_size=288, num_experts=4,
            moe_intermediate_size=96, shared_expert_intermediate_size=128, dtype="bfloat16")
PROMPT = [5, 17, 33, 2, 9]


def _fp8_weight(N: int, K: int, gen: torch.Generator, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight [N, K] (q on DEVICE, fp32 scales) from the tool's quantizer."""
    q, s = quantize(torch.randn(N, K, generator=gen) * 0.1, scale_dtype)
    return q.to(DEVICE), s.float().to(DEVICE)


# ---- the kernel and its twin ----------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [None, 2])
def test_matmul_fp8_matches_twin_and_rows_are_batch_invariant(dtype, split_k):
    """N = 200 (a full and a partial 128-row block, over four 64-column tiles), K = 300 (two full K blocks and one
    of 44): vs the twin into a NaN-poisoned buffer; a row of an M = 1 launch is bitwise that row in M = 2..40."""
    g = torch.Generator().manual_seed(0)
    N, K = 200, 300
    q, s = _fp8_weight(N, K, g)
    x = rand(40, K, dtype=dtype, gen=g)
    y = f8.matmul_fp8(x, q, s, split_k=split_k, out=nans(40, N, dtype=dtype))
    assert_close(y, f8.matmul_fp8_ref(x, q, s))
    for r in (0, 17, 39):
        alone = f8.matmul_fp8(x[r:r + 1], q, s, split_k=split_k)
        assert_bitwise(alone[0], y[r], f"row {r}, M=40 vs M=1")
        for M, at in ((2, 1), (19, 16)):
            other = rand(M, K, dtype=dtype, gen=g, scale=5.0)
            other[at] = x[r]
            assert_bitwise(f8.matmul_fp8(other, q, s, split_k=split_k)[at], alone[0], f"row {r} at {at} of M={M}")


@needs_triton
def test_fp8_logits_out_dtype_and_config_never_depends_on_m():
    g = torch.Generator().manual_seed(1)
    q, s = _fp8_weight(300, 160, g)
    x = rand(3, 160, dtype=torch.bfloat16, gen=g)
    y = f8.matmul_fp8(x, q, s, out_dtype=torch.float32, out=nans(3, 300))
    assert y.dtype == torch.float32
    assert_close(y, f8.matmul_fp8_ref(x, q, s, out_dtype=torch.float32))
    k_per, split = f8.fp8_config(1024, 3584)
    assert split > 1 and k_per % f8.BLOCK == 0  # a K split starts on a scale block
    assert f8.fp8_config(248320, 4096) == (4096, 1)


@needs_triton
def test_both_fp8_decodes_give_every_e4m3_value_exactly(monkeypatch):
    """Every non-NaN e4m3fn code, decoded by the kernel natively (compute capability >= 8.9) and from its bits
    (older GPUs), times a unit scale: exactly torch's float value."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(f8.FP8)[:, None].to(DEVICE)  # [254, 1]
    s = torch.ones(2, 1, device=DEVICE)
    x = torch.ones(1, 1, device=DEVICE)
    for native in (True, False):
        monkeypatch.setattr(f8, "_native", lambda q, native=native: native)
        y = f8.matmul_fp8(x, q, s, out=nans(1, 254))
        assert_bitwise(y[0], q[:, 0].float(), f"native={native}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_pieces_keep_their_own_scale_blocks(dtype):
    """q|k|v-style fusion of pieces of 96, 200 and 64 rows (none on a 128-row boundary): one launch over the fused
    weight equals each piece's own matmul (twin), and the fused weight dequantizes to the pieces' weights."""
    g = torch.Generator().manual_seed(2)
    K = 150
    pieces = [f8.mark(*_fp8_weight(n, K, g)) for n in (96, 200, 64)]
    w, views = f8.fuse(pieces)
    scale, rows = f8.scales(w)
    assert rows is not None and rows.dtype == torch.int32 and scale.shape == (1 + 2 + 1, 2)
    want = torch.cat([f8.dequantize(p, *f8.scales(p), dtype=torch.float32) for p in pieces])
    assert torch.equal(f8.dequantize(w, scale, rows, torch.float32), want)
    for v, p in zip(views, pieces):
        assert torch.equal(v.view(torch.uint8), p.view(torch.uint8)) and f8.scales(v)[0] is f8.scales(p)[0]
    x = rand(5, K, dtype=dtype, gen=g)
    y = f8.matmul_fp8(x, w, scale, rows, out=nans(5, 360, dtype=dtype))
    assert_close(y, torch.cat([f8.matmul_fp8_ref(x, p, *f8.scales(p)) for p in pieces], dim=1))
    aligned, _ = f8.fuse([f8.mark(*_fp8_weight(n, K, g)) for n in (128, 40)])
    assert f8.scales(aligned)[1] is None  # pieces on block boundaries need no row map


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_fp8_matches_twin_and_is_batch_invariant(dtype):
    """MoE experts with a gate|up row map (two 80-row halves): tokens sorted by expert, some experts empty, one with
    more than BLOCK_M rows; a token's rows are bitwise the same routed alone."""
    g = torch.Generator().manual_seed(3)
    E, T, k, K, Im = 5, 13, 2, 200, 80
    gu = [f8.fuse([f8.mark(*_fp8_weight(Im, K, g)), f8.mark(*_fp8_weight(Im, K, g))])[0] for _ in range(E)]
    q = torch.stack(gu)  # [E, 2Im, K]
    scale = torch.stack([f8.scales(w)[0] for w in gu])  # [E, 2, 2]
    srows = f8.scales(gu[0])[1]
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)]).to(DEVICE)  # expert 4 unused
    idx[:9, 0] = 1
    x = rand(T, K, dtype=dtype, gen=g)
    order, offsets = mm.group_by_expert(idx, E)
    rows = order // k
    y = f8.grouped_matmul_fp8(x, q, scale, offsets, rows, srows)
    assert not y.isnan().any()
    assert_close(y, f8.grouped_matmul_fp8_ref(x, q, scale, offsets, rows, srows))
    pos = {int(s): m for m, s in enumerate(order.tolist())}
    for t in (0, 6, 12):
        o1, off1 = mm.group_by_expert(idx[t:t + 1], E)
        y1 = f8.grouped_matmul_fp8(x[t:t + 1], q, scale, off1, o1 // k, srows)
        for m1, s in enumerate(o1.tolist()):
            assert_bitwise(y1[m1], y[pos[t * k + s]], f"token {t} slot {s}")


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.model.ops import matmul_fp8 as f8
out = []
for cap, native in ((80, False), (90, True)):
    for grouped in (False, True):
        types = {n: "i32" for n in f8._matmul_fp8_kernel.arg_names}
        types.update(x="*bf16", q="*fp8e4nv" if native else "*u8", s="*fp32", srows="*i32", y="*bf16", part="*fp32",
                     rows="*i64", tile_expert="*i32", tile_row0="*i32", offsets="*i32")
        consts = dict(BM=f8.BLOCK_M, BN=f8.BLOCK_N, BK=f8.BLOCK_K, GROUPED=grouped, GATHER=grouped, SPLIT=True,
                      ROWMAP=grouped, NATIVE=native, IEEE=False)
        types.update({c: "constexpr" for c in consts})
        k = triton.compile(ASTSource(f8._matmul_fp8_kernel, types, consts), target=GPUTarget("cuda", cap, 32),
                           options=dict(num_warps=f8.NUM_WARPS, num_stages=f8.NUM_STAGES))
        out.append([cap, grouped, k.metadata.shared])
print(json.dumps(out))
"""


@needs_triton
def test_the_kernel_compiles_for_cuda_targets_within_shared_memory():
    """Compiled for real (PTX, no GPU needed; not the interpreter): sm_80 decodes the FP8 bits with integer ops
    (its triton has no float8e4nv), sm_90 natively; dense and grouped with a row map; bf16 shared memory at the
    launch parameters stays under 99 KB (L4 / RTX 4090, the smallest limit nextn targets)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=Path(__file__).resolve().parents[1], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not installed")
    assert r.returncode == 0, r.stderr[-3000:]
    for cap, grouped, shared in json.loads(r.stdout.strip().splitlines()[-1]):
        assert 0 < shared <= 99 * 1024, (cap, grouped, shared)


def test_dequantize_is_the_format_block_by_block():
    """matmul_fp8.dequantize (the loader's) equals the tool's block-by-block reference bitwise: 2-D and stacked
    experts, fp32 and bf16 scales, partial blocks in both dims, into bf16 and fp32."""
    g = torch.Generator().manual_seed(4)
    for shape in ((200, 300), (3, 130, 90)):
        for sdt in (torch.float32, torch.bfloat16):
            q, s = quantize(torch.randn(*shape, generator=g), sdt)
            assert s.shape == f8.scale_shape(shape) and s.dtype == sdt
            for dt in (torch.bfloat16, torch.float32):
                assert torch.equal(f8.dequantize(q, s, dtype=dt), dequantize_block_by_block(q, s, dt))
    w = torch.randn(200, 300, generator=g)
    q, s = quantize(w)
    err = (dequantize_block_by_block(q, s, torch.float32) - w).abs().max() / w.abs().max()
    assert 0 < err < 0.07  # e4m3 keeps 3 mantissa bits: each element within 1/16 of its block's largest


def test_dispatch_runs_fp8_weights_through_the_twin_off_the_kernel_path():
    """Outside the kernel path (a CPU tensor) ops.linear / ops.grouped_linear of an FP8 weight is the twin, out=."""
    g = torch.Generator().manual_seed(5)
    w = f8.mark(*quantize(torch.randn(40, 150, generator=g)))
    x = torch.randn(2, 3, 150, generator=g).to(torch.bfloat16)
    out = torch.empty(2, 3, 40, dtype=torch.float32)
    y = ops.linear(x, w, out_dtype=torch.float32, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(y.view(6, 40), f8.matmul_fp8_ref(x.view(6, 150), w, *f8.scales(w), torch.float32))
    we = torch.stack([w, w])
    f8.mark(we, torch.stack([f8.scales(w)[0]] * 2))
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert torch.equal(ops.grouped_linear(x.view(6, 150), we, offsets),
                       mm.grouped_matmul_ref(x.view(6, 150), f8.dequantize(we, *f8.scales(we)), offsets))
