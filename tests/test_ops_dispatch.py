"""engine.model.ops without triton and on CPU: everything imports, the dispatch runs the torch twins, and
the kernel entry points say what is missing."""
import subprocess
import sys
import textwrap

import torch

from engine.model.ops import dispatch as ops
from engine.model.ops import matmul as mm


def test_dispatch_runs_the_twins_on_cpu():
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g)
    assert not ops.use_triton(x)
    assert torch.equal(ops.linear(x, w), mm.matmul_ref(x.reshape(6, 8), w).view(2, 3, 5))
    lg = torch.randn(3, 40, generator=g)
    assert torch.equal(ops.argmax(lg), lg.argmax(-1))
    rec = torch.randn(2, 2, 2, 4, 4, generator=g)
    q = torch.randn(1, 1, 1, 4, generator=g)
    o = ops.gdn_update(q, q, torch.randn(1, 1, 2, 4, generator=g), -torch.rand(1, 1, 2), torch.rand(1, 1, 2), rec,
                       torch.tensor([1]), torch.tensor([1]), qk_l2norm=True)
    assert o.shape == (1, 1, 2, 4) and torch.isfinite(o).all()


def test_ops_import_and_fall_back_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        from engine.model.ops import dispatch, matmul, attention, gdn_update, norm, sample
        assert dispatch.HAS_TRITON is False
        x = torch.randn(3, 8)
        assert torch.equal(dispatch.rms_norm(x, torch.zeros(8), 1e-6), norm.rms_norm_ref(x, torch.zeros(8), 1e-6))
        try:
            matmul.matmul(x, torch.randn(4, 8))
        except RuntimeError as e:
            assert "triton is not installed" in str(e)
        else:
            raise AssertionError("matmul ran without triton")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
