"""`nextn generate` and `nextn bench spec` end to end (in-process through server.cli.main)."""
from __future__ import annotations

import json

import pytest

from engine.loader import load_model
from engine.spec import generate_spec
from server.cli import main
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cli"), seed=41)


def test_generate_json_plain_and_spec(ckpt, capsys):
    ref, _ = generate_spec(load_model(ckpt), [5, 6, 7, 8], 20, k=0)
    assert main(["generate", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-tokens", "20", "--ignore-eos", "--json",
                 "--num-speculative-tokens", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["prompt_token_ids"] == [5, 6, 7, 8] and plain["token_ids"] == ref and "spec" not in plain
    assert isinstance(plain["text"], str)
    assert main(["generate", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-tokens", "20", "--ignore-eos", "--json",
                 "--num-speculative-tokens", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == ref
    s = spec["spec"]
    assert s["rounds"] > 0 and s["drafted"] == sum(s["pos_drafted"]) and len(s["pos_drafted"]) == 4


def test_generate_text_prompt_defaults_to_spec_when_mtp(ckpt, capsys):
    assert main(["generate", str(ckpt), "--prompt", "Hello world", "--max-tokens", "8", "--json", "--chat"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["rounds"] >= 1 and len(out["spec"]["pos_drafted"]) == 3  # default K = 3


def test_bench_spec_gate_passes(ckpt, capsys):
    assert main(["bench", "spec", str(ckpt), "--k", "1..3", "--max-tokens", "16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["pass"] and [r["k"] for r in res["rows"]] == [1, 2, 3] and all(r["identical"] for r in res["rows"])
