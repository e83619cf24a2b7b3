"""The bundled demo checkpoint (models/demo): a generic HF vision-language checkpoint with a trained MTP head that
answers chats and says what its generated pictures show.

Built by `tools/train_demo.py` and `tools/train_demo_vision.py` (see models/demo/README.md). Nothing here is
special-cased: the model loads through `engine.loader.load_model` and the tokenizer through
`engine.tokenizer.Tokenizer.from_dir`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.spec import generate_spec
from engine.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
MAX_NEW = 48


@pytest.fixture(scope="module")
def model():
    return load_model(DEMO)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO)


def _prompt(tok: Tokenizer, text: str, thinking: bool | None = False) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                              enable_thinking=False if thinking is False else None))


def _answer(model, tok, text: str, thinking: bool | None = False, max_new: int = MAX_NEW) -> str:
    out, _ = generate_spec(model, _prompt(tok, text, thinking), max_new, k=3, eos_ids=tok.eos_token_ids)
    return tok.decode(out, skip_special_tokens=True)


def test_files_tokenizer_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (DEMO / name).is_file(), name
    tcfg = json.loads((DEMO / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"
    tok = Tokenizer.from_dir(DEMO)
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total < 20 * 2**20, f"models/demo is {total} bytes"


def test_config_declares_a_qwen35_model_with_mtp(model, tok):
    vl = json.loads((DEMO / "config.json").read_text())
    assert vl["model_type"] == "qwen3_5" and vl["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert vl["vision_config"]["out_hidden_size"] == vl["text_config"]["hidden_size"]
    assert (DEMO / "preprocessor_config.json").is_file() and model.vision is not None
    cfg = vl["text_config"]
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["mtp_num_hidden_layers"] == 1
    types = cfg["layer_types"]
    assert types.count("linear_attention") == 3 * types.count("full_attention") > 0
    assert cfg["vocab_size"] >= tok.vocab_size and cfg["vocab_size"] % 64 == 0
    assert model.config.has_mtp and model.mtp is not None
    assert any(k.startswith("mtp.") for k in model.state_dict())


@pytest.mark.parametrize("text,thinking", [("What is the for statement in Python?", False),
                                           ("Tell me about the json module.", None)])
def test_speculative_equals_plain_greedy(model, tok, text, thinking):
    ids = _prompt(tok, text, thinking)
    plain, _ = generate_spec(model, ids, MAX_NEW, k=0, eos_ids=tok.eos_token_ids)
    for k in (1, 3):
        spec, tel = generate_spec(model, ids, MAX_NEW, k=k, eos_ids=tok.eos_token_ids)
        assert spec == plain, k
        assert tel.rounds > 0


def test_mtp_head_is_trained(model, tok):
    # A broken head would still be exact; a trained one gets several tokens per verify round.
    _, tel = generate_spec(model, _prompt(tok, "Explain the with statement."), 64, k=3, eos_ids=tok.eos_token_ids)
    assert tel.tokens_per_round > 1.5, tel.to_dict()


def test_chat_answers_are_on_topic(model, tok):
    ans = _answer(model, tok, "What is the for statement in Python?")
    assert "iterat" in ans.lower() or "loop" in ans.lower(), ans
    ans = _answer(model, tok, "What does the json module do?", thinking=None)
    assert "json" in ans.lower(), ans
    ans = _answer(model, tok, "Hello!")
    assert any(w in ans.lower() for w in ("hello", "python")), ans


def test_json_answer_parses(model, tok):
    ans = _answer(model, tok, "Give me a JSON object for a person named Alice who is 30 years old and lives in Paris.")
    obj = json.loads(ans)  # valid JSON of the requested kind (the tiny model does not copy the values reliably)
    assert isinstance(obj, dict) and "name" in obj and "age" in obj, obj


def test_transformers_loads_the_checkpoint(model, tok):
    pytest.importorskip("transformers")
    sys.modules.setdefault("fla", None)  # fla-core + triton on a CPU box breaks transformers' Qwen3.5
    from tests.hf_oracle import load_hf

    hf = load_hf(DEMO)
    ids = _prompt(tok, "What is a lambda?")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
        got = model(torch.tensor([ids]))[0]
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), (got - want).abs().max()


def test_the_demo_says_what_a_picture_shows(model, tok):
    """Held-out generated pictures (tools/demo_pictures.py), the image first as the server renders it: at least 11
    of 12 answered exactly ("two red circles."), through the engine at K = 3, equal to plain greedy."""
    from engine import images
    from tools import demo_pictures as pics

    text = tok.apply_chat_template([{"role": "user", "content": "\ue000What is in this picture?"}],
                                   add_generation_prompt=True)
    right = 0
    for seed in pics.split("heldout", 12):
        p = pics.picture(seed)
        inp = images.prepare_input(p.image, model.image_config)
        ids = images.expand_image_pads(tok.encode(text.replace("\ue000", "<|vision_start|><|image_pad|><|vision_end|>")),
                                       [inp.n_tokens], model.image_config.image_token_id)
        out, _ = generate_spec(model, ids, 16, k=3, eos_ids=tok.eos_token_ids, images=[inp])
        plain, _ = generate_spec(model, ids, 16, k=0, eos_ids=tok.eos_token_ids, images=[inp])
        assert out == plain, seed
        right += tok.decode(out).split("</think>")[-1].replace("<|im_end|>", "").strip() == p.answer
    assert right >= 11, right
