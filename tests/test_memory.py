"""Peak memory of a long prompt at a large vocabulary stays bounded: logits are computed only for rows that
are used (the last prefill row, the last MTP row), never [prompt_len, vocab]."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tiny import make_checkpoint

pytestmark = pytest.mark.slow  # a subprocess at the real vocabulary

VOCAB = 248320  # the real Qwen3.5 vocabulary
PROMPT_LEN = 3000

_PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    from engine.loader import load_model
    from engine.spec import SpecSession
    torch.set_num_threads(1)
    model = load_model(sys.argv[1])
    V, n = model.config.vocab_size, int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    SpecSession(model, torch.randint(0, V, (64,), generator=g).tolist(), 8, k=3).run()  # warm every path
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = SpecSession(model, torch.randint(0, V, (n,), generator=g).tolist(), 8, k=3).run()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (after - before) / 1024, "tokens": len(out)}))
""")


def test_long_prompt_peak_memory_is_bounded_at_large_vocab(tmp_path: Path):
    ckpt = make_checkpoint(tmp_path / "bigvocab", seed=3, with_tokenizer=False, vocab_size=VOCAB,
                           hidden_size=64, num_hidden_layers=4, max_position_embeddings=8192)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(ckpt), str(PROMPT_LEN)], capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tokens"] == 8
    # one [prompt_len, vocab] fp32 logits tensor alone would be 3000 * 248320 * 4 B = 2.8 GiB
    full_logits_mb = PROMPT_LEN * VOCAB * 4 / 2**20
    assert res["growth_mb"] < 256, f"peak RSS grew {res['growth_mb']:.0f} MB (full logits: {full_logits_mb:.0f} MB)"
