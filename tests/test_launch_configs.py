"""The launch table (engine/model/ops/launch.py): every Triton kernel takes its config from it, and every config's
static shared-memory estimate fits each device class at Qwen3.5's shapes, bf16 and fp32. CPU only, no triton
needed for the table checks."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.model.ops import launch
from engine.model.ops._triton import cdiv

OPS = Path(launch.__file__).parent

#: text_config values (shared/reference/qwen35-architecture.md section 1.3; 2B and 4B from third-party copies of
#: the official config.json): hidden, value heads of the GDN, head_dim, dk, dv, vocab
QWEN35 = {
    "0.8B": dict(H=1024, nv=16), "2B": dict(H=2048, nv=16), "4B": dict(H=2560, nv=32),
    "9B": dict(H=4096, nv=32), "27B": dict(H=5120, nv=48), "35B-A3B": dict(H=2048, nv=32),
}
COMMON = dict(hd=256, dk=128, dv=128, nch=cdiv(248320, launch.RACE_CHUNK))


@pytest.mark.parametrize("model", list(QWEN35))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", list(launch.DEVICE_CLASSES))
def test_every_config_fits_the_device(model, dtype, device):
    cc = launch.DEVICE_CLASSES[device]
    over = launch.over_limit(cc, dtype, **QWEN35[model], **COMMON)
    assert not over, [f"{k}: {est / 1024:.0f} KB > {lim / 1024:.0f} KB" for k, est, lim in over]


def test_device_limits_and_tiers():
    assert [launch.smem_limit(launch.DEVICE_CLASSES[d]) // 1024 for d in ("sm90", "sm80", "sm89", "sm120")] == \
        [227, 163, 99, 99]
    assert [launch.tier(launch.DEVICE_CLASSES[d]) for d in ("sm90", "sm80", "sm89", "sm120")] == \
        ["large", "medium", "small", "small"]
    assert launch.tier((11, 3)) == "small" and launch.smem_limit((11, 3)) == 99 * 1024  # unknown: the safe tier
    assert launch.tier(None) == "interp" and launch.smem_limit(None) is None


def test_the_estimate_catches_the_default_attention_config():
    """Triton's defaults (3 stages) with 64-key tiles at head_dim 256: fits an H200, not an A100 nor an L4 (the
    risk the table exists for); the table's own choice fits all three."""
    default = launch.L(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_D=256)
    est = launch.smem_bytes("attention", default, torch.bfloat16, hd=256)
    assert est <= launch.smem_limit((9, 0)) and est > launch.smem_limit((8, 0)) > launch.smem_limit((8, 9))
    for cc in launch.DEVICE_CLASSES.values():
        cfg = launch.choose("attention", torch.bfloat16, cc, hd=256)
        assert launch.smem_bytes("attention", cfg, torch.bfloat16, hd=256) <= launch.smem_limit(cc)


def test_step_and_prefill_matmul_families():
    """Two matmul tilings where one cannot serve both; neither depends on M (it is not an argument), and the
    K block of each family is the same on every device (the rounding of a row inside a family)."""
    for cc in launch.DEVICE_CLASSES.values():
        step = launch.choose("matmul/step", torch.bfloat16, cc)
        pre = launch.choose("matmul/prefill", torch.bfloat16, cc)
        assert step["BM"] <= 64 < pre["BM"] and step["BK"] == pre["BK"] == 64
    with pytest.raises(KeyError):
        launch.choose("attention", torch.bfloat16, (9, 0))  # head size missing: never a silent default


def _jit_kernels() -> set[str]:
    """module._name of every `@triton.jit` function named `_*_kernel` in engine/model/ops (by source, so this
    runs without triton)."""
    out = set()
    for path in OPS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and node.name.endswith("_kernel") \
                    and any("jit" in ast.unparse(d) for d in node.decorator_list):
                out.add(f"{path.stem}.{node.name}")
    return out


def test_every_kernel_has_a_table_entry():
    listed = {k for e in launch.TABLE.values() for k in e.kernels}
    found = _jit_kernels()
    assert found - listed == set(), f"kernels without a launch-table entry: {sorted(found - listed)}"
    assert listed - found == set(), f"table entries for kernels that do not exist: {sorted(listed - found)}"


def test_every_launch_takes_its_config_from_the_table():
    """Each `_x_kernel[grid](...)` call passes `**<launch config>.kwargs()` and sets no num_warps / num_stages /
    block size of its own."""
    bad = []
    for path in OPS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and ast.unparse(node.func.value).endswith("_kernel")):
                continue
            splat = [k for k in node.keywords if k.arg is None and ast.unparse(k.value).endswith(".kwargs()")]
            own = [k.arg for k in node.keywords if k.arg in ("num_warps", "num_stages")
                   or (k.arg or "").startswith("BLOCK") or k.arg in ("BM", "BN", "BK", "BV", "BC", "CHUNK")]
            if not splat or own:
                bad.append(f"{path.name}:{node.lineno} {ast.unparse(node.func.value)}")
    assert not bad, bad



def test_the_gdn_prefill_dots_are_ieee_fp32_for_every_model_dtype():
    """The chunked GDN prefill's dots take fp32 operands and feed the fp32 recurrent state: never TF32 (10-bit
    mantissas), whatever the model's dtype, on every tier; a bf16 model's self-check compares those states at the
    fp32 accumulation bound (tests/test_tolerance.py shows TF32 fails it)."""
    for cc in [None, *launch.DEVICE_CLASSES.values()]:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            assert launch.choose("gdn_prefill", dt, cc, dk=128, dv=128)["IEEE"] == 1, (cc, dt)
