"""The C CPU kernels (engine/model/ops/cpu.py) never build or run for a model off the CPU: a CUDA model's torch path
(CUDA without triton, the host prefill chunks) asks the same decision functions as a CPU model, and each must say
no on the device before it would build the library. Meta tensors stand in for CUDA ones (no GPU here): any device
other than the CPU takes the same branch."""
from __future__ import annotations

import pytest
import torch

from engine.cache import StatePool
from engine.model.config import Qwen35Config
from engine.model.ops import cpu
from engine.model.qwen35 import FwdCtx, Qwen35ForCausalLM
from tests.tiny import hf_config


@pytest.fixture()
def builds(monkeypatch):
    """The list of build attempts from here on (a fresh, never-tried, enabled kernel whose build is recorded and
    fails, so the torch path runs)."""
    calls: list[int] = []
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_gemm", cpu._gemm)  # restored after the test (the failed build turns it off)
    monkeypatch.setattr(cpu, "_enabled", True)
    monkeypatch.setattr(cpu, "_build", lambda: calls.append(1))
    return calls


def test_every_decision_says_no_off_the_cpu_without_building(builds):
    x, w = torch.empty(4, 64, device="meta"), torch.empty(32, 64, device="meta")
    assert not cpu.available("cuda") and cpu.describe("cuda", torch.float32) is None
    assert not cpu.takes(x) and not cpu.usable(x, 4) and not cpu.gemm_takes(x, w)
    assert cpu.linear_or_none(x, w) is None
    assert cpu.mlp_or_none(x, torch.empty(64, 64, device="meta"), torch.empty(64, 32, device="meta")) is None
    assert cpu.argmax_or_none(torch.empty(2, 10, device="meta")) is None
    assert builds == []
    assert not cpu.gemm_takes(torch.empty(4, 64), torch.empty(32, 64)) and builds == [1]  # on the CPU it builds


def test_an_fp32_model_off_the_cpu_runs_step_and_prefill_forwards_without_building(builds):
    """A step forward (record) and a short prefill chunk, the forwards that take the C kernels on a CPU, of an fp32
    model whose weights and pool are not on the CPU: no build is attempted."""
    cfg = Qwen35Config.from_dict(hf_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    with torch.device("meta"):
        m = Qwen35ForCausalLM(cfg)
    m.eval()
    m.fuse()
    pool = StatePool(cfg, 2, 32, 4, device="meta", dtype=torch.float32)
    with torch.inference_mode():
        prefill = FwdCtx.make(cfg, "meta", torch.float32, [0], [0], [0], [0], 5, False)
        assert prefill.cpu_kernels
        m.forward_step(torch.zeros(1, 5, dtype=torch.long, device="meta"), prefill, pool)
        step = FwdCtx.make(cfg, "meta", torch.float32, [0, 1], [5, 3], [0, 0], [1, 1], 3, True)
        h = m.forward_step(torch.zeros(2, 3, dtype=torch.long, device="meta"), step, pool)
        assert m.logits(m.model.norm(h), ctx=step).shape == (2, 3, cfg.vocab_size)
    assert builds == []
