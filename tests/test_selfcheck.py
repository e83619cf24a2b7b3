"""The startup self-check (engine/selfcheck.py) on a CPU: the check forced onto CPU tensors under TRITON_INTERPRET=1
(`ops.force_kernels()`), failures injected by replacing a kernel wrapper in its module (the test-only seam: the
check and the model look wrappers up at call time; nothing in the serving path reaches it).

What each test proves:
  * every kernel of a dense and a MoE model, fp32 and bf16, passes against its twin (the check's own soundness);
  * a kernel that raises, returns wrong numbers or leaves its output unwritten is caught, named in one log line,
    and that op alone runs its twin from then on, through the model's kernel path;
  * `--kernels strict` turns any failure into one fatal line (the check, and `nextn serve`'s exit status 1);
  * the verdicts reach /health's detail and the `nextn_kernel_info{kernel,impl}` gauge of a real server.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
import torch

from config.settings import load_settings
from engine import selfcheck
from engine.model.config import Qwen35Config
from engine.model.ops import act as _act
from engine.model.ops import attention as _attn
from engine.model.ops import dispatch as ops
from engine.model.ops import matmul_fp8 as f8
from engine.model.ops import norm as _norm
from engine.model.ops import sample as _sample
from tests.ops_util import needs_triton, spy
from tests.tiny import hf_config, random_model
from tools.quantize_fp8 import quantize

pytestmark = needs_triton
OOM = "out of resource: shared memory, Required: 233472, Hardware limit: 101376"


@pytest.fixture(autouse=True)
def _fresh_fallbacks() -> Iterator[None]:
    ops.reset_fallbacks()
    yield
    ops.reset_fallbacks()


def _model(moe: bool = False, dtype: str = "float32"):
    m = random_model(Qwen35Config.from_dict(hf_config(moe=moe), dtype=dtype), 1)
    m.fuse()
    return m


@contextlib.contextmanager
def fault(monkeypatch: pytest.MonkeyPatch, module, name: str, kind: str) -> Iterator[list[int]]:
    """Replace `module.name` (a kernel wrapper): "raise" (a compile failure), "wrong" (1% off, or the next token
    id), "unwritten" (returns its NaN-poisoned `out` untouched). Yields a list that counts the calls."""
    real, calls = getattr(module, name), []

    def broken(*a, **k):
        calls.append(1)
        if kind == "raise":
            raise RuntimeError(OOM)
        if kind == "unwritten":
            return k["out"]
        y = real(*a, **k)
        return y + 1 if not y.is_floating_point() else y * 1.01

    monkeypatch.setattr(module, name, broken)
    yield calls


@pytest.mark.parametrize("moe,dtype", [(False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")])
def test_every_kernel_matches_its_twin(moe, dtype):
    m = _model(moe, dtype)
    with ops.force_kernels():
        rep = selfcheck.startup(m, strict=True)
    want = set(ops.KERNELS) - {"matmul_fp8"} - (set() if moe else {"grouped_matmul", "moe_combine"})
    assert {c.kernel for c in rep.kernels} == want
    assert [c for c in rep.kernels if not c.ok] == []
    assert set(rep.kernel_info().values()) == {"triton"} and ops.kernel_impls() == dict.fromkeys(ops.KERNELS, "triton")


def _fp8_model(moe: bool):
    """A bf16 model whose MLP / expert weights are FP8 (quantized by the tool from the format's definition), as the
    loader leaves them on the kernel path."""
    m = _model(moe, "bfloat16")
    n = 0
    for name, p in list(m.named_parameters()):
        if "mlp" in name and name.endswith("weight") and p.dim() >= 2:
            owner = m.get_submodule(name.rsplit(".", 1)[0])
            q, s = quantize(p.detach())
            setattr(owner, name.rsplit(".", 1)[1], torch.nn.Parameter(f8.mark(q, s), requires_grad=False))
            n += 1
    assert n
    return m


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_an_fp8_model_checks_the_w8a16_matmul(moe):
    with ops.force_kernels():
        rep = selfcheck.startup(_fp8_model(moe), strict=True)
    assert "matmul_fp8" in rep.kernel_info() and [c for c in rep.kernels if not c.ok] == []


def test_a_wrong_fp8_matmul_runs_its_twin(monkeypatch):
    with fault(monkeypatch, f8, "matmul_fp8", "wrong"), ops.force_kernels():
        rep = selfcheck.startup(_fp8_model(False))
        bad = [c for c in rep.kernels if not c.ok]
        assert [c.kernel for c in bad] == ["matmul_fp8"] and "off the twin" in bad[0].detail, bad
        assert ops.kernel_impls()["matmul_fp8"] == "torch"
        g = torch.Generator().manual_seed(0)
        w = f8.mark(*quantize(torch.randn(96, 160, generator=g) * 0.1))
        with spy(f8, "matmul_fp8_ref") as twin:
            ops.linear(torch.randn(2, 160, generator=g, dtype=torch.bfloat16), w)
        assert twin, "an FP8 linear ran the kernel after its fallback"


def test_the_torch_path_checks_nothing():
    rep = selfcheck.startup(_model())  # a CPU model outside force_kernels(): the torch path
    assert rep.kernels == [] and rep.kernel_info() == {}


def test_a_kernel_that_raises_runs_its_twin_from_then_on(monkeypatch, caplog):
    from tests.test_kernel_path import _clone, _model as kp_model, _prefilled, _verify

    m = kp_model()
    pool, cur = _prefilled(m, [7, 4])
    kpool = _clone(pool)
    with fault(monkeypatch, _attn, "attention", "raise") as calls, ops.force_kernels(), \
            caplog.at_level("WARNING", logger="engine.selfcheck"):
        rep = selfcheck.startup(m)
        assert rep.kernel_info()["attention"] == "torch"
        assert {k for k, v in rep.kernel_info().items() if v == "torch"} == {"attention"}
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "kernel attention failed its startup check" in lines[0] and OOM in lines[0]
        assert ops.kernel_impls()["attention"] == "torch"
        n = len(calls)
        tokens = torch.randint(0, m.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))
        with spy(_attn, "attention_ref") as twin:
            got = _verify(m, kpool, tokens, [0, 1], [7, 4], cur, True)  # the model's kernel path
        assert twin and len(calls) == n, "the step ran the kernel, not its twin"
    want = _verify(m, pool, tokens, [0, 1], [7, 4], cur, False)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("module,name,kind,needle", [
    (_norm, "rms_norm", "wrong", "off the twin"),
    (_act, "silu_mul", "unwritten", "NaN"),
    (_sample, "argmax", "wrong", "differ from the twin"),
], ids=["wrong-numbers", "unwritten-output", "wrong-tokens"])
def test_wrong_results_are_caught(monkeypatch, module, name, kind, needle):
    with fault(monkeypatch, module, name, kind), ops.force_kernels():
        rep = selfcheck.startup(_model())
    bad = [c for c in rep.kernels if not c.ok]
    assert [c.kernel for c in bad] == [name] and needle in bad[0].detail, bad
    assert ops.kernel_impls()[name] == "torch"


def test_strict_makes_any_failure_fatal_in_one_line(monkeypatch):
    with fault(monkeypatch, _norm, "gated_rms_norm", "raise"), ops.force_kernels():
        with pytest.raises(selfcheck.KernelCheckFailed) as e:
            selfcheck.startup(_model(), strict=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--kernels strict: kernel gated_rms_norm failed") and OOM in msg


def test_serve_exits_1_with_one_line_when_strict_fails(monkeypatch, capsys):
    from server import cli
    from tests.server_fixtures import tiny_checkpoint

    def failing(settings, model, tokenizer, **kw):
        assert settings.kernels == "strict"
        raise selfcheck.KernelCheckFailed("--kernels strict: kernel attention failed its startup check (boom)")

    monkeypatch.setattr(cli, "run_server", failing)
    rc = cli.main(["serve", str(tiny_checkpoint()), "--device", "cpu", "--no-engine-process", "--kernels", "STRICT"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1] == "nextn serve: error: --kernels strict: kernel attention failed its startup " \
                                  "check (boom)"
    assert load_settings({}, environ={}).kernels == "auto"


def test_health_and_metrics_name_each_kernels_impl(monkeypatch):
    from tests.server_fixtures import ServerThread

    with fault(monkeypatch, _attn, "attention", "raise"), ops.force_kernels():
        srv = ServerThread(max_num_seqs=1, num_speculative_tokens=1)  # the worker runs the check as it starts
    with srv:
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "ok" and health["kernels"]["attention"] == "torch"
        assert health["kernels"]["matmul"] == "triton" and set(health["kernels"]) == set(srv.worker.kernel_info)
        assert srv.metric("nextn_kernel_info", kernel="attention", impl="torch") == 1.0
        assert srv.metric("nextn_kernel_info", kernel="matmul", impl="triton") == 1.0
        assert srv.metric("nextn_kernel_info", kernel="attention", impl="triton") == 0.0
