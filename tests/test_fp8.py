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

from engine.graphs import GraphRunner
from engine.loader import CheckpointError, load_config, load_model
from engine.model.ops import dispatch as ops
from engine.model.ops import matmul as mm
from engine.model.ops import matmul_fp8 as f8
from engine.scheduler import Scheduler
from engine.spec import SpecSession, generate_spec
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
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.model.ops import launch
from engine.model.ops import matmul_fp8 as f8
out = []
for cap, native in ((80, False), (90, True)):
    for family in ("step", "prefill", "grouped"):
        grouped = family == "grouped"
        cfg = launch.choose(f"matmul_fp8/{family}", torch.bfloat16, divmod(cap, 10))
        types = {n: "i32" for n in f8._matmul_fp8_kernel.arg_names}
        types.update(x="*bf16", q="*fp8e4nv" if native else "*u8", s="*fp32", srows="*i32", y="*bf16", part="*fp32",
                     rows="*i64", tile_expert="*i32", tile_row0="*i32", offsets="*i32")
        consts = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUPED=grouped, GATHER=grouped, SPLIT=True,
                      ROWMAP=grouped, NATIVE=native, IEEE=False)
        types.update({c: "constexpr" for c in consts})
        k = triton.compile(ASTSource(f8._matmul_fp8_kernel, types, consts), target=GPUTarget("cuda", cap, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        est = launch.smem_bytes(f"matmul_fp8/{family}", cfg, torch.bfloat16)
        out.append([cap, family, k.metadata.shared, est, launch.smem_limit(divmod(cap, 10))])
print(json.dumps(out))
"""


@needs_triton
def test_the_kernel_compiles_for_cuda_targets_within_shared_memory():
    """Compiled for real (PTX, no GPU needed; not the interpreter) at the launch table's configs: sm_80 decodes the
    FP8 bits with integer ops (its triton has no float8e4nv), sm_90 natively; the step, prefill and grouped (row
    map) families; bf16 shared memory under the device's limit and under the table's static estimate."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=Path(__file__).resolve().parents[1], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not installed")
    assert r.returncode == 0, r.stderr[-3000:]
    for cap, family, shared, est, limit in json.loads(r.stdout.strip().splitlines()[-1]):
        assert 0 < shared <= min(est, limit), (cap, family, shared, est, limit)


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


# ---- checkpoints ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpts(request, tmp_path_factory):
    """(bf16 source, FP8, dequantized reference) checkpoint dirs; the MoE one in the per-expert layout."""
    d = tmp_path_factory.mktemp(f"fp8-{request.param}")
    moe = request.param == "moe"
    src = make_checkpoint(d / "bf16", seed=11 if moe else 10, moe=moe, per_expert=moe, with_tokenizer=False, **DIMS)
    q = quantize_checkpoint(src, d / "fp8", scale_dtype=torch.bfloat16 if moe else torch.float32)
    return src, q, dequantize_checkpoint(q, d / "deq")


def test_the_fp8_checkpoint_has_the_release_layout(ckpts):
    src, q, _ = ckpts
    sd = load_file(str(q / "model.safetensors"))
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    lay = "model.layers.{}."
    w = sd[lay.format(1) + "self_attn.k_proj.weight"]  # [64, 160]: one partial block of each
    assert w.dtype == torch.float8_e4m3fn and sd[lay.format(1) + "self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    for kept in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.conv1d.weight",
                 "input_layernorm.weight"):
        assert sd[lay.format(0) + kept].dtype == torch.bfloat16, kept
    assert sd["lm_head.weight"].dtype == sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sd["mtp.fc.weight"].dtype == torch.bfloat16
    if "model.layers.0.mlp.experts.0.gate_proj.weight" in sd:
        assert sd["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
        assert sd["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


def test_loaded_weights_equal_the_dequantized_reference_bitwise(ckpts, caplog):
    """CPU: every weight of the FP8 checkpoint loads as its blocks multiplied out (in bf16, and in fp32 against an
    fp32 reference); the unquantized tensors load unchanged; the scales are consumed, not reported unused."""
    src, q, deq = ckpts
    with caplog.at_level("INFO", logger="nextn.loader"):
        a = load_model(q)
    assert "dequantized to bfloat16 at load" in caplog.text and "ignored" not in caplog.text
    b = load_model(deq)
    sa, sb, s0 = a.state_dict(), b.state_dict(), load_model(src).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == torch.bfloat16 and torch.equal(sa[k], sb[k]), k
    kept, converted = "model.layers.0.linear_attn.in_proj_a.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(sa[kept], s0[kept]) and not torch.equal(sa[converted], s0[converted])
    s32 = load_model(q, dtype="float32").state_dict()
    ref32 = load_model(dequantize_checkpoint(q, q.parent / "deq32", torch.float32), dtype="float32").state_dict()
    assert all(torch.equal(s32[k], ref32[k]) for k in s32)


def test_greedy_and_spec_on_the_fp8_checkpoint_equal_the_dequantized_model(ckpts):
    """CPU: the FP8 checkpoint's logits are bitwise the dequantized checkpoint's; greedy tokens equal, and greedy
    speculative decoding equals plain greedy on it for K = 1..3."""
    _, q, deq = ckpts
    a, b = load_model(q), load_model(deq)
    ids = torch.tensor([PROMPT])
    assert torch.equal(a(ids), b(ids))
    ref, _ = generate_spec(b, PROMPT, 16, k=0)
    plain, _ = generate_spec(a, PROMPT, 16, k=0)
    assert plain == ref and len(plain) == 16
    for k in (1, 2, 3):
        out, tel = generate_spec(a, PROMPT, 16, k=k)
        assert out == plain and tel.rounds > 0, f"K={k}"


def _served(model, k: int, n: int) -> list[list[int]]:
    """Greedy tokens of two sessions batched through the scheduler's GraphRunner (the serving step path)."""
    sched = Scheduler(model, max_num_seqs=2, max_model_len=32, k=k, max_num_batched_tokens=64, step_graphs=True)
    assert isinstance(sched.runner, GraphRunner)
    sessions = [SpecSession(model, p, n, k=k, pool=sched.pool) for p in (PROMPT, PROMPT[3:])]
    for s in sessions:
        sched.add(s)
    while sched.num_sessions:
        sched.step()
    return [s.emitted for s in sessions]


@pytest.mark.slow
@needs_triton
def test_kernel_path_keeps_fp8_and_gives_the_dequantized_models_greedy_tokens(ckpts):
    """Where the kernel path runs (forced on CPU), the linears and experts stay FP8 with their scales (q|k|v fused
    with a scale row map; the GDN input projections unfused, since their a / b parts are bf16) and the W8A16 kernel
    serves them: two sessions batched through the scheduler's step graphs give the dequantized bf16 model's greedy
    tokens (its kernel path, and its CPU path), and speculative decoding (K = 2) gives the same."""
    _, q, deq = ckpts
    n = 4
    with ops.force_kernels():
        a = load_model(q)
        attn, gdn = a.model.layers[1].self_attn, a.model.layers[0].linear_attn
        assert attn._w_qkv.dtype == torch.float8_e4m3fn and f8.scales(attn._w_qkv)[1] is not None
        assert gdn._w_in is None and gdn.in_proj_qkv.weight.dtype == torch.float8_e4m3fn
        assert gdn.in_proj_a.weight.dtype == torch.bfloat16
        experts = getattr(a.model.layers[0].mlp, "experts", None)
        if experts is not None:
            assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and f8.scales(experts.gate_up_proj)[1] is not None
        assert a.lm_head.weight.dtype == torch.bfloat16
        with spy(f8, "grouped_matmul_fp8" if experts is not None else "matmul_fp8") as calls:
            got = _served(a, 0, n)
        assert calls
        assert got == _served(load_model(deq), 0, n)
        if experts is None:
            assert _served(a, 2, n) == got
    assert got == [generate_spec(load_model(deq), p, n, k=0)[0] for p in (PROMPT, PROMPT[3:])]


# ---- refusals -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plain"), seed=0, with_tokenizer=False)


def _with_config(src, dst, **kv):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw.update(kv)
    (dst / "config.json").write_text(json.dumps(raw))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


FP8_OK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quant_method 'compressed-tensors'"),
    ({**FP8_OK, "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({**FP8_OK, "weight_block_size": None}, "weight_block_size None"),
    ({**FP8_OK, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8_OK, "fmt": "e5m2"}, "fmt 'e5m2'"),
])
def test_other_quantizations_fail_with_one_line_naming_them(plain_dir, tmp_path, qc, named):
    d = _with_config(plain_dir, tmp_path / "q", quantization_config=qc)
    for fn in (load_config, load_model):
        with pytest.raises(CheckpointError) as e:
            fn(d)
        assert named in str(e.value) and "\n" not in str(e.value)


def test_nextn_serve_stops_at_startup_on_an_unsupported_quantization(plain_dir, tmp_path, capsys):
    from server.cli import main

    d = _with_config(plain_dir, tmp_path / "awq", quantization_config={"quant_method": "awq"})
    assert main(["serve", str(d), "--device", "cpu", "--port", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nextn serve: error: cannot load {d}") and "'awq'" in err[0]


def test_inconsistent_fp8_checkpoints_name_the_tensor(ckpts, tmp_path):
    _, q, _ = ckpts
    sd = load_file(str(q / "model.safetensors"))
    key = "model.layers.1.self_attn.o_proj.weight"

    def variant(name, edit, **config):
        d = tmp_path / name
        d.mkdir()
        raw = json.loads((q / "config.json").read_text())
        raw.update(config)
        (d / "config.json").write_text(json.dumps(raw))
        s = dict(sd)
        edit(s)
        save_file(s, str(d / "model.safetensors"))
        return d

    cases = [
        (variant("noscale", lambda s: s.pop(key + "_scale_inv")), f"{key!r} is float8_e4m3fn but has no"),
        (variant("badscale", lambda s: s.update({key + "_scale_inv": torch.ones(3, 3)})), "want (2, 1)"),
        (variant("noconfig", lambda s: None, quantization_config=None), "has no quantization_config"),
        (variant("int", lambda s: s.update({key: torch.zeros(160, 128, dtype=torch.int32)})), "is torch.int32"),
    ]
    for d, msg in cases:
        with pytest.raises(CheckpointError, match=None) as e:
            load_model(d)
        assert msg in str(e.value), (d.name, str(e.value))
