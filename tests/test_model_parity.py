"""Our Qwen3.5 forward + greedy decode against transformers 5.x on random tiny checkpoints."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.spec import generate_spec
from tests.hf_oracle import load_hf
from tests.tiny import make_checkpoint

CASES = {
    # name: make_checkpoint kwargs
    "dense-gqa2-untied": dict(seed=1),
    "dense-tied-vlm-layout": dict(seed=2, tie=True, layout="vlm", num_key_value_heads=1),
    "dense-sharded-mha-nv8": dict(seed=3, sharded=True, num_attention_heads=4, num_key_value_heads=4,
                                  linear_num_key_heads=2, linear_num_value_heads=8),
    "moe-per-expert": dict(seed=4, moe=True, per_expert=True),
    "moe-fused-vlm-sharded": dict(seed=5, moe=True, layout="vlm", sharded=True, num_hidden_layers=8),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp(request.param), with_tokenizer=False, **CASES[request.param])
    return load_model(d), load_hf(d)


def test_prefill_logits_match_transformers(pair):
    ours, hf = pair
    g = torch.Generator().manual_seed(0)
    for T in (1, 7, 70, 130):  # 130 spans more than two GDN chunks
        ids = torch.randint(0, ours.config.vocab_size, (2, T), generator=g)
        with torch.no_grad():
            ref = hf(ids).logits.float()
            got = ours(ids)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, f"T={T}: max relative error {rel:.2e}"


def test_greedy_64_tokens_match_transformers(pair):
    ours, hf = pair
    g = torch.Generator().manual_seed(1)
    for plen in (3, 17, 40):
        prompt = torch.randint(0, ours.config.vocab_size, (1, plen), generator=g)
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, plen:].tolist()
        got, _ = generate_spec(ours, prompt[0].tolist(), 64, k=0)
        assert got == ref
