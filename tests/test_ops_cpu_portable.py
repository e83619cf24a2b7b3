"""The C kernels' portable build (engine/model/ops/cpu_arch.h: -DNEXTN_PORTABLE, what a CPU that is not x86 compiles)
against the x86 build: every output bitwise the same (both libraries loaded in this process), the exactness and
batch-invariance tests green on it (a subprocess that forces it), and the sources compiling for aarch64 where a cross
compiler is installed."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model.ops import cpu
from tests.ops_util import assert_bitwise

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def libs() -> tuple[object, object]:
    """(the loaded x86 build, the portable build) for a comparison; skips where there is nothing to compare."""
    if not cpu.available():
        pytest.skip("no C compiler: the torch path runs")
    if cpu.portable():
        pytest.skip("this machine runs the portable build already: there is no x86 build to compare it with")
    port = cpu._build(True)
    if port is None:
        pytest.fail(f"the portable build failed where the x86 one builds: {cpu._why}")
    assert port.nextn_portable() == 1 and cpu._lib.nextn_portable() == 0
    return cpu._lib, port


@contextlib.contextmanager
def _using(lib) -> Iterator[None]:
    """The kernels' Python wrappers call `lib` inside (its GEMM when it has one)."""
    saved = cpu._lib, cpu._gemm
    cpu._lib, cpu._gemm = lib, bool(lib.nextn_linear_ok())
    try:
        yield
    finally:
        cpu._lib, cpu._gemm = saved


def _both(libs, fn) -> list:
    """fn() under each build."""
    out = []
    for lib in libs:
        with _using(lib):
            out.append(fn())
    return out


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise, NaNs included (torch.equal fails on NaN; the inputs hold none, so every NaN is the default one)."""
    assert_bitwise(a.view(torch.int32), b.view(torch.int32), what)


def _awkward(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal values with -0.0 and denormals sprinkled in, and in the first row a huge value and both infinities
    (never NaN; the other rows' sums stay finite, so a wrong rounding anywhere shows)."""
    x = torch.randn(*shape, generator=gen) * scale
    flat = x.view(-1)
    for value, step in ((-0.0, 7), (1e-40, 11), (-3e-42, 13)):
        flat[torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // step)]] = value
    first = x.view(-1, shape[-1])[0]
    first[torch.randperm(shape[-1], generator=gen)[:3]] = torch.tensor([3e38, float("inf"), float("-inf")])
    return x


@pytest.fixture
def gemm(libs):
    if not libs[1].nextn_linear_ok():
        pytest.skip("no hardware FMA here: the portable GEMM is off (torch's GEMM runs)")
    return libs


@pytest.mark.parametrize("N,K", [(13, 40), (50, 256), (7, 8), (392, 128)])
def test_gemm_has_the_x86_bits(gemm, N, K):
    g = torch.Generator().manual_seed(N * 7 + K)
    w = _awkward(N, K, gen=g)
    for M in range(1, 41):  # every tile and remainder shape, the L1 blocks of 8+ rows
        x = _awkward(M, 2 * K, gen=g)[:, :K] if M % 3 else torch.randn(M, K, generator=g)  # a pitch, or plain
        nat, port = _both(gemm, lambda: cpu.linear(x, w))
        _same(port, nat, f"M={M} N={N} K={K}")


def test_mlp_has_the_x86_bits(gemm):
    g = torch.Generator().manual_seed(3)
    for M, H, I in ((1, 48, 80), (5, 64, 24), (17, 32, 128)):
        x = torch.randn(M, H, generator=g) * 4  # gate values far out on both sides of silu
        wgu, wd = torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g)
        nat, port = _both(gemm, lambda: cpu.mlp_or_none(x, wgu, wd))
        _same(port, nat, f"mlp M={M} H={H} I={I}")


@pytest.mark.parametrize("T", [3, 20])  # a step (row by row), a prefill block (the blocked path)
def test_attention_step_has_the_x86_bits(libs, T):
    g = torch.Generator().manual_seed(T)
    nh, nkv, hd, R, S, L = 4, 2, 24, 12, 5, 64
    qkv = torch.randn(3, T, 2 * nh * hd + 2 * nkv * hd, generator=g) * 3
    w1 = 1 + 0.1 * torch.randn(2, hd, generator=g)
    cos, sin = torch.randn(2, L, R, generator=g)
    k0, v0 = torch.randn(2, S, L, nkv, hd, generator=g)
    slots, pos0 = [0, 3, 1], [0, 9, 30]

    def run():
        k, v = k0.clone(), v0.clone()
        return cpu.attn_step(qkv, w1[0], w1[1], 1e-6, cos, sin, k, v, slots, pos0, nh, nkv, hd, hd ** -0.5), k, v

    nat, port = _both(libs, run)
    for a, b, what in zip(port, nat, ("output", "cached K", "cached V")):
        _same(a, b, f"attention T={T}: {what}")


@pytest.mark.parametrize("record", [True, False])  # decode / verify (states by token), a prefill chunk with padding
def test_gdn_step_has_the_x86_bits(libs, record):
    g = torch.Generator().manual_seed(int(record))
    nk, dk, nv, dv, kc, S, T = 2, 16, 4, 12, 4, 4, 5
    C = 2 * nk * dk + nv * dv
    W = T + 2
    proj = torch.randn(3, T, C + nv * dv + 2 * nv, generator=g) * 2
    conv_w = torch.randn(C, kc, generator=g)
    conv0 = torch.randn(S, W, C, kc - 1, generator=g)
    rec0 = torch.randn(S, W, nv, dk, dv, generator=g)
    neg_a, dt_bias = -torch.rand(nv, generator=g) * 2, torch.randn(nv, generator=g)
    norm_w = 1 + 0.1 * torch.randn(dv, generator=g)
    slots, read, write0 = [2, 0, 3], [0, 1, 1], [1, 1, 2] if record else [1, 0, 2]
    lens = None if record else [T, 2, 0]

    def run():
        conv, rec = conv0.clone(), rec0.clone()
        y = cpu.gdn_step(proj, conv_w, conv, rec, slots, read, write0, neg_a, dt_bias, norm_w, 1e-6, nk, dk, nv, dv,
                         record=record, lens=lens)
        return y, conv, rec

    nat, port = _both(libs, run)
    for a, b, what in zip(port, nat, ("output", "conv states", "recurrent states")):
        _same(a, b, f"GDN record={record}: {what}")


def test_rms_norm_argmax_and_sigmoid_have_the_x86_bits(libs):
    g = torch.Generator().manual_seed(5)
    x = _awkward(9, 40, gen=g)
    x[x.isinf()] = 0.0  # rms of a row with an infinity is NaN throughout: kept out (NaN payloads aside)
    w1 = 1 + 0.1 * torch.randn(40, generator=g)
    nat, port = _both(libs, lambda: cpu.rms_norm(x, w1, 1e-6))
    _same(port, nat, "rms_norm")
    logits = torch.randn(6, 2112, generator=g)
    logits[1, 700] = logits[1, 1900] = 99.0  # a tie: the lower index
    logits[2, 5] = float("nan")  # the first NaN
    logits[3] = -0.0
    logits[3, 40] = 0.0  # -0.0 ties +0.0: index 0
    nat, port = _both(libs, lambda: cpu.argmax_or_none(logits))
    assert_bitwise(port, nat, "argmax")
    assert port.tolist()[1:4] == [700, 5, 0]
    z = _awkward(3, 37, gen=g) * 20
    nat, port = _both(libs, lambda: cpu.sigmoid(z))
    _same(port, nat, "sigmoid")
    assert torch.equal(nat, torch.cat([cpu.sigmoid(z.flatten()[i:i + 1]) for i in range(z.numel())]).view_as(z))


def test_the_build_is_chosen_by_the_cpu(monkeypatch):
    """x86 with AVX2: the x86 build (-mavx2); x86 with FMA but no AVX2: the portable build with -mfma; x86 with
    neither: the x86 build, whose GEMM stays off; any other CPU: the portable build."""
    monkeypatch.setattr(cpu, "_force_portable", False)
    for x86, feats, portable, extra in ((True, {"avx2", "fma"}, False, ("-mavx2",)), (True, {"fma"}, True, ("-mfma",)),
                                        (True, set(), False, ()), (False, set(), True, ())):
        monkeypatch.setattr(cpu, "X86", x86)
        monkeypatch.setattr(cpu, "_x86_features", lambda feats=feats: feats)
        assert (cpu._portable_reason() is not None) == portable, (x86, feats)
        flags = cpu._flags(portable)
        assert flags[:len(cpu.FLAGS)] == cpu.FLAGS
        assert flags[len(cpu.FLAGS):] == (("-DNEXTN_PORTABLE",) if portable else ()) + extra, (x86, feats)
    monkeypatch.setattr(cpu, "_force_portable", True)
    assert cpu._portable_reason() == "forced by use_portable_build"


def test_the_switch_refuses_once_the_other_build_is_loaded(monkeypatch):
    if not cpu.available():
        pytest.skip("no C compiler: the torch path runs")
    monkeypatch.setattr(cpu, "_force_portable", cpu._force_portable)  # restored after the test
    loaded = cpu.portable()
    cpu.use_portable_build(loaded)  # the kind already loaded: fine
    with pytest.raises(RuntimeError, match="other build"):
        cpu.use_portable_build(not loaded)
    assert cpu.portable() == loaded


# the exactness and batch-invariance tests that run the C kernels, in a few minutes of a 2-core box
_EXACTNESS = ("tests/test_ops_cpu.py", "tests/test_ops_cpu_linear.py", "tests/test_ops_cpu_attn.py",
              "tests/test_spec.py", "tests/test_batch.py", "tests/test_prefix.py")
_PICK = ("test_ops_cpu or (float32-dense and (spec_equals_plain_greedy_every_k or mixed_batch_equals or "
         "joining_prompts)) or (tiny and (packs_rows or every_k_from or tiny-257] or miss_bits[tiny-549]))")


@pytest.mark.slow
def test_exactness_tests_pass_on_the_forced_portable_build():
    if not cpu.available():
        pytest.skip("no C compiler: the torch path runs")
    if cpu.portable():
        pytest.skip("this machine runs the portable build already: the suite itself tests it")
    code = ("import sys, pytest\n"
            "from engine.model.ops import cpu\n"
            "cpu.use_portable_build()\n"
            "rc = pytest.main(sys.argv[1:])\n"
            "print('portable build:', cpu.portable(), 'GEMM:', cpu._gemm)\n"
            "sys.exit(rc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["TRITON_INTERPRET"] = "1"  # set before the kernels' modules load (tests/conftest.py comes too late here)
    r = subprocess.run([sys.executable, "-c", code, "-x", "-p", "no:cacheprovider", *_EXACTNESS, "-k", _PICK],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout[-4000:] + r.stderr[-4000:]
    assert r.returncode == 0, out
    assert " passed" in r.stdout and " failed" not in r.stdout, out
    want = "portable build: True GEMM: " + str(bool(cpu._build(True).nextn_linear_ok()))
    assert want in r.stdout, out


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="no aarch64 cross compiler (Debian: gcc-aarch64-linux-gnu)")
def test_the_sources_compile_for_aarch64(tmp_path):
    cc = shutil.which("aarch64-linux-gnu-gcc")
    for src in cpu.SOURCES:
        r = subprocess.run([cc, "-O1", "-Wall", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-fPIC",
                            "-c", str(src), "-o", str(tmp_path / f"{src.stem}.o")], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{src.name}: {r.stderr[-2000:]}"
