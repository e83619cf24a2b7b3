"""The startup self-check runs each kernel at the model's own shapes (engine/selfcheck.py): every GEMM shape, norm
width, MLP width and expert count the model's kernel path calls is one the check runs, so a pass proves the variants
Triton compiles for the real weights (it specialises on divisibility by 16 and on == 1).

The model's calls are recorded by running a tiny dense and a tiny MoE model (prefill, verify and drafts, K = 1)
through the kernel path under the interpreter, with the GEMM and norm wrappers replaced by recorders that compute
their twins (the other kernels run as they do); the check's calls are recorded the same way at the same config.
The LM head's N beyond MAX_CHECK_N runs at an N of the same compiled variant (`_variant_n`), checked here against
Qwen3.5's vocab on every device tier."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine import selfcheck
from engine.model.config import Qwen35Config
from engine.model.ops import act as _act
from engine.model.ops import dispatch as ops
from engine.model.ops import launch
from engine.model.ops import matmul as _mm
from engine.model.ops import norm as _norm
from engine.spec import generate_spec
from tests.ops_util import needs_triton
from tests.tiny import hf_config, random_model

SMALL = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=160,
             num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2)


@contextlib.contextmanager
def _record(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set]]:
    """Replace the GEMM, norm and SwiGLU wrappers by recorders that return their twins; yields what they saw."""
    seen: dict[str, set] = {"linear": set(), "grouped": set(), "norm": set(), "silu": set()}

    def matmul(x, w, out_dtype=None, split_k=None, out=None, phase="step"):
        seen["linear"].add((w.shape[0], w.shape[1], out_dtype))
        y = _mm.matmul_ref(x, w, out_dtype)
        return y if out is None else out.copy_(y)

    def grouped(x, w, offsets, rows=None, out_dtype=None, out=None):
        seen["grouped"].add(tuple(w.shape))
        return _mm.grouped_matmul_ref(x, w, offsets, rows, out_dtype)

    def norm(x, w, eps, out=None):
        seen["norm"].add(x.shape[-1])
        y = _norm.rms_norm_ref(x, w, eps)
        return y if out is None else out.copy_(y)

    def silu(gu, out=None):
        seen["silu"].add(gu.shape[-1] // 2)
        y = _act.silu_mul_ref(gu)
        return y if out is None else out.copy_(y)

    for mod, name, fn in ((_mm, "matmul", matmul), (_mm, "grouped_matmul", grouped), (_norm, "rms_norm", norm),
                          (_act, "silu_mul", silu)):
        monkeypatch.setattr(mod, name, fn)
    yield seen


@needs_triton
@pytest.mark.slow  # a model through Triton's interpreter
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_check_covers_every_shape_the_model_calls(moe, monkeypatch):
    cfg = Qwen35Config.from_dict(hf_config(moe=moe, **SMALL), dtype="bfloat16")
    m = random_model(cfg, 0)
    m.fuse()
    with _record(monkeypatch) as model_calls, ops.force_kernels():
        generate_spec(m, [5, 17, 33, 2, 9], 3, k=1)
    with _record(monkeypatch) as check_calls, ops.force_kernels():
        for name in ("matmul", "grouped_matmul", "rms_norm", "silu_mul"):
            if name in selfcheck.kernels_for(cfg):
                selfcheck.CHECKS[name](cfg, selfcheck._Rand(torch.device("cpu"), cfg.dtype))
    assert model_calls["linear"] and model_calls["norm"] and model_calls["silu"]
    for kind, calls in model_calls.items():
        assert calls <= check_calls[kind], f"{kind}: the model calls {sorted(calls - check_calls[kind], key=str)}, " \
                                           f"which the self-check never runs"
    shapes = {(N, K, odt) for _, N, K, odt in selfcheck.linear_shapes(cfg)}
    assert model_calls["linear"] <= shapes
    if moe:
        assert model_calls["grouped"] == {(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size),
                                          (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)}
    assert cfg.head_dim in check_calls["norm"]  # the q / k norm (BLOCK = head_dim)


@pytest.mark.parametrize("cc", [None, *launch.DEVICE_CLASSES.values()], ids=["interp", *launch.DEVICE_CLASSES])
@pytest.mark.parametrize("H", [1024, 2048, 4096, 5120])
def test_the_lm_head_is_checked_at_a_variant_of_its_own(cc, H):
    """Qwen3.5's vocab (248320) is over MAX_CHECK_N: the check's N' keeps N mod BN (and so N mod 16, the
    specialisation) and the K split of each tiling on each device tier; a short weight is checked at its own N."""
    V = 248320
    for phase in _mm.PHASES:
        cfg = launch.choose(f"matmul/{phase}", torch.bfloat16, cc)
        n = selfcheck._variant_n(V, H, cfg, phase, _mm.matmul_config)
        assert n <= 2 * selfcheck.MAX_CHECK_N and n % cfg["BN"] == V % cfg["BN"]
        if phase == "step":
            assert _mm.matmul_config(n, H, cfg) == _mm.matmul_config(V, H, cfg)
        odd = selfcheck._variant_n(V + 7, H, cfg, phase, _mm.matmul_config)
        assert odd % 16 == 7 and odd % cfg["BN"] == (V + 7) % cfg["BN"]
        assert selfcheck._variant_n(200, H, cfg, phase, _mm.matmul_config) == 200
