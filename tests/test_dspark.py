"""DSpark anchor records: top-k rule, anchor sampling, validator rules on an extracted corpus."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from research.dspark import extract_corpus, read_hidden_bf16, sample_anchors, sparse_softmax_topk, validate_corpus
from engine.loader import load_model
from tests.tiny import make_checkpoint


def test_topk_rule_ties_to_lower_id_and_full_vocab_softmax():
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0, 0.5, 3.0])
    ids, lg, p, tail = sparse_softmax_topk(logits, 3, 0.7)
    assert ids.tolist() == [1, 2, 5] and lg.tolist() == [3.0, 3.0, 3.0]
    full = torch.softmax(logits.double() / 0.7, -1)
    assert torch.allclose(p, full[[1, 2, 5]]) and abs(tail - float(full[[0, 3, 4]].sum())) < 1e-12
    for bad in [(torch.tensor([]), 1, 1.0), (logits, 0, 1.0), (logits, 7, 1.0), (logits, 2, 0.0),
                (torch.tensor([1.0, float("nan")]), 1, 1.0)]:
        with pytest.raises(ValueError):
            sparse_softmax_topk(*bad)


def test_anchor_sampling_is_stratified_deterministic_and_never_zero():
    a = sample_anchors(prompt_len=1, total_len=60, gamma=5, take=4, seed=20260811, pair_id=3)
    assert a == sample_anchors(1, 60, 5, 4, 20260811, 3) and a != sample_anchors(1, 60, 5, 4, 20260811, 4)
    assert a == sorted(set(a)) and len(a) == 4 and min(a) >= 1 and max(a) <= 60 - 5 - 1
    span = 60 - 5 - 1 - 1 + 1
    assert all(1 + i * span // 4 <= x <= 1 + (i + 1) * span // 4 - 1 for i, x in enumerate(a))
    assert sample_anchors(10, 14, 5, 4, 1, 0) == []


def test_extracted_corpus_passes_validator(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "m", seed=9, with_tokenizer=False))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 11, 3)]
    out = tmp_path / "corpus"
    n = extract_corpus(model, prompts, out, max_new_tokens=24, eos_ids=[], gamma=5, top_k=16, temperature=0.7,
                       anchors_per_pair=4)
    assert n >= 9
    assert validate_corpus(out, vocab_size=model.config.vocab_size) == []
    meta = json.loads((out / "extraction.meta.json").read_text())
    assert meta["records"] == n and meta["gamma"] == 5 and meta["top_k"] == 16
    toks = np.fromfile(out / "tokens.u32", dtype=np.uint32).reshape(n, 6)
    assert read_hidden_bf16(out, model.config.hidden_size).shape == (n, model.config.hidden_size)
    rows = (out / "index.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["record", "pair_id", "anchor_pos", "prompt_len", "split", "mode", "category"]
    assert int(rows[1].split("\t")[2]) >= 1 and toks.shape[0] == len(rows) - 1
    # the validator can fail: corrupt one tail value
    tail = np.fromfile(out / "tail_probs.f32", dtype=np.float32)
    tail[0] += 0.01
    tail.tofile(out / "tail_probs.f32")
    assert any("top + tail" in e for e in validate_corpus(out))
