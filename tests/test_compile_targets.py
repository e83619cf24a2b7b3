"""Every Triton kernel the model calls compiles for real CUDA targets, without a GPU (bench/compile_targets.py: PTX and
cubins from the ptxas that ships with triton, not the interpreter): at the 35B-A3B shape in bf16 (its launches reach
every kernel and every launch-table entry: dense GEMMs in both tilings, the experts, the FP8 matmul, the MoE combine,
attention, GDN, norms, sampling), for sm_80, sm_89 and sm_90 (one per shared-memory tier of the launch table), each
target's launch-table config, Triton's own specialisation of each launch (== 1, constexprs, argument types), one
binary per kernel config and argument types (launches that differ only in which integers divide by 16 share one;
the tool compiles every specialisation). Every binary's shared memory is within the device's limit and within the table's
static estimate. The whole matrix (0.8B / 9B / 27B / 35B-A3B, bf16 and fp32, sm_80 to sm_120) is the tool's, with
its table in bench/RESULTS.md.

Slow: cold, 108 binaries in 75 s of CPU over two compile processes (3 min 10 s of wall time on a 2-core box shared
with other jobs); Triton's on-disk cache makes a rerun a few seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.ops import launch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("sm80", "sm89", "sm90")


@pytest.mark.slow
def test_every_kernel_compiles_for_every_target_within_shared_memory(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "bench/compile_targets.py", "--models", "35B-A3B", "--dtypes", "bf16",
                        "--targets", ",".join(TARGETS), "--jobs", "2", "--per-config", "--quiet", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not installed")
    got = json.loads(out.read_text()) if out.exists() else None
    assert got is not None, r.stderr[-3000:]
    rows = got["rows"]
    every = {k for e in launch.TABLE.values() for k in e.kernels}
    for t in TARGETS:
        assert {x["kernel"] for x in rows if x["target"] == t} == every, t
        for entry in launch.TABLE:  # each entry's config of this target's tier was compiled
            assert any(x["entry"] == entry for x in rows if x["target"] == t), (t, entry)
    bad = [x for x in rows if not (0 <= x["smem"] <= min(x["limit"], x["estimate"]))]
    assert not bad, [(x["kernel"], x["target"], x["config"], x["smem"], x["estimate"], x["limit"]) for x in bad]
    assert all(x["regs"] > 0 for x in rows)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    print(r.stdout.strip().splitlines()[-1])  # the summary line: binaries, registers, spills, headroom, seconds
