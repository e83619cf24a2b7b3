"""Constrained speculation is exact: with a GuidanceConstraint, spec decode (K = 1..8) emits exactly the tokens
of constrained plain greedy, for json_schema, regex, lark and choice grammars, on random tiny models and on
the demo model, including when `</think>` is accepted inside a draft window. Drafts the grammar forbids are
never verified (the engine's verify-side truncation never fires)."""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.loader import load_model
from engine.spec import DraftedSession, SpecSession
from engine.tokenizer import Tokenizer
from grammar.compile import GrammarCompiler, GuidanceTokenizer, source_from_request
from grammar.constraint import GuidanceConstraint
from grammar.parsers import prompt_opens_reasoning, split_reasoning
from tests.tiny import make_checkpoint

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"

SOURCES = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "rec", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "n": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "maxItems": 3},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "n", "ok"], "additionalProperties": False}}}},
    "regex": {"structured_outputs": {"regex": r"[a-z]{2,6}( [a-z]{2,6}){2,5}\."}},
    "lark": {"structured_outputs": {"grammar": 'start: item (", " item){5,12}\nitem: NUM | WORD\nNUM: /[0-9]{1,3}/\n'
                                               'WORD: /[a-z]{1,5}/'}},
    "choice": {"structured_outputs": {"choice": ["the quick brown fox jumps", "hello world, numbers 0 1 2",
                                                 "speculative decoding drafts tokens"]}},
}


class SpyConstraint(GuidanceConstraint):
    """Records each draft window (token, allowed) and which drafts the verify walk accepted."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.windows: list[list[tuple[int, bool]]] = []
        self.accepted: list[tuple[int, int]] = []  # (window, draft position)

    def draft_begin(self):
        super().draft_begin()
        self.windows.append([])

    def draft_allowed(self, tok):
        ok = super().draft_allowed(tok)
        self.windows[-1].append((tok, ok))
        return ok

    def consume(self, tok):
        if self._cursor < len(self._drafts) and self._drafts[self._cursor][0] == tok:
            self.accepted.append((len(self.windows) - 1, self._cursor))
        super().consume(tok)

    def think_windows(self, think: int) -> int:
        """Windows where `</think>` was accepted at draft position j0 and a later draft of the same window
        was accepted too (so it was grammar-checked after the phase switch)."""
        n = 0
        for w, drafts in enumerate(self.windows):
            acc = {j for ww, j in self.accepted if ww == w}
            j0 = next((j for j, (t, ok) in enumerate(drafts) if t == think and ok), None)
            n += j0 is not None and j0 in acc and any(j > j0 for j in acc)
        return n


def noisy_drafter(ref: list[int], plen: int, V: int, seed: int, wrong: float = 0.25):
    """A `DraftedSession` drafter: the reference token, except at hashed positions a random (often illegal) one."""
    def override(pos, j, d):
        i = pos - plen
        if i >= len(ref):
            return d
        h = zlib.crc32(f"{seed}:{pos}:{j}".encode()) % 1000
        return (ref[i] * 7 + h) % V if h < wrong * 1000 else ref[i]
    return override


def check_exact(model, compiler, src, prompt, eos, n_new, *, reasoning=False, forced=True, ks=range(1, 9)):
    """Constrained plain greedy, then spec for every k: MTP drafts and forced noisy drafts (`forced`); all
    identical. Returns (ref, [(k, forced, session, spy)])."""
    grammar = compiler.compile(src).grammar
    V = model.config.vocab_size
    ref = SpecSession(model, prompt, n_new, k=0, constraint=GuidanceConstraint(grammar, reasoning=reasoning),
                      eos_ids=eos).run()
    runs = []
    for k in ks:
        drafter = noisy_drafter(ref, len(prompt), V, k)
        for override in [None] + ([drafter] if forced else []):
            spy = SpyConstraint(grammar, reasoning=reasoning)
            kw = dict(k=k, capmax=8, constraint=spy, eos_ids=eos)
            s = (SpecSession(model, prompt, n_new, **kw) if override is None
                 else DraftedSession(model, prompt, n_new, drafter=override, **kw))
            assert s.run() == ref, (src.kind, k, override is not None)
            assert s.constraint_cuts == 0  # every verified draft had passed the grammar
            runs.append((k, override is not None, s, spy))
    return ref, runs


# ----------------------------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module", params=[31])
def tiny(request, tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp(f"g{request.param}"), seed=request.param, with_tokenizer=True)
    model = load_model(ckpt, dtype="float32")
    tok = Tokenizer.from_dir(ckpt)
    comp = GrammarCompiler(GuidanceTokenizer.from_tokenizer(tok, n_vocab=model.config.vocab_size))
    return model, tok, comp


@pytest.mark.parametrize("kind", list(SOURCES))
def test_tiny_constrained_spec_equals_constrained_plain(tiny, kind):
    model, tok, comp = tiny
    src = source_from_request(**SOURCES[kind])
    prompt = tok.encode("Hello world! The quick brown fox")
    ref, runs = check_exact(model, comp, src, prompt, tok.eos_token_ids, 40)
    assert len(ref) > 3
    assert any(not ok for *_, spy in runs for w in spy.windows for _, ok in w), "no draft was ever refused"
    # verify columns are masked by the grammar (engine hook): forced grammar-legal drafts are accepted
    assert sum(s.telem.accepted for _, forced, s, _ in runs if forced) > 0
    text = tok.decode(ref, skip_special_tokens=True)
    if kind == "choice":
        assert text in SOURCES[kind]["structured_outputs"]["choice"]
    elif kind == "regex" and ref[-1] in tok.eos_token_ids:
        assert re.fullmatch(SOURCES[kind]["structured_outputs"]["regex"], text), text


def test_tiny_think_end_inside_draft_windows(tiny):
    """The target emits `</think>` mid-output (its lm_head row is made a scaled copy of a token it emits early);
    forced drafts put `</think>` at every draft position; the grammar must switch on inside the window."""
    model, tok, comp = tiny
    think = comp.tokenizer.think_end_id
    src = source_from_request(structured_outputs={"regex": r"[a-z]{1,4}( [a-z]{1,4}){3,8}"})
    prompt = tok.encode("def add(a, b):")
    eos = tok.eos_token_ids
    base = SpecSession(model, prompt, 16, k=0).run()
    W = model.lm_head.weight
    saved = W[think].detach().clone()
    try:
        for i_star in range(3, 10):
            t = base[i_star]
            if t in base[:i_star] or t in eos:
                continue
            with torch.no_grad():
                W[think] = W[t] * 1.05
            ref = SpecSession(model, prompt, 40, k=0, constraint=GuidanceConstraint(comp.compile(src).grammar,
                                                                                   reasoning=True), eos_ids=eos).run()
            if think in ref[2:]:
                break
        else:
            pytest.fail("could not make the tiny model emit </think> mid-output")
        ref2, runs = check_exact(model, comp, src, prompt, eos, 40, reasoning=True)
        assert ref2 == ref
        assert sum(spy.think_windows(think) for *_, spy in runs) >= 3
        refused_after = [w for *_, spy in runs for w in spy.windows
                         if any(t == think and ok for t, ok in w[:-1]) and not w[-1][1] and w[-1][0] != think]
        assert refused_after, "no draft after a drafted </think> was ever refused by the grammar"
        at = {next(j for j, (tk, ok) in enumerate(w) if tk == think) for *_, spy in runs for w in spy.windows
              if any(tk == think for tk, _ in w)}
        assert len(at) >= 3, f"</think> drafted only at positions {at}"
        after = tok.decode(ref[ref.index(think) + 1:], skip_special_tokens=True).lstrip("\n")
        assert ref[-1] in eos and re.fullmatch(r"[a-z]{1,4}( [a-z]{1,4}){3,8}", after), after
    finally:
        with torch.no_grad():
            W[think] = saved


# ----------------------------------------------------------------------------------------------- demo model
@pytest.fixture(scope="module")
def demo():
    model = load_model(DEMO)
    tok = Tokenizer.from_dir(DEMO)
    return model, tok, GrammarCompiler(GuidanceTokenizer.from_tokenizer(tok, n_vocab=model.config.vocab_size))


def _chat(tok, text, thinking=False):
    p = tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=False if thinking is False else None)
    return tok.encode(p), prompt_opens_reasoning(p)


DEMO_PROMPTS = {"json_schema": "Give me a JSON object for a person named Alice who is 30 years old.",
                "regex": "What is the for statement in Python?", "lark": "List 3 Python keywords as a JSON array.",
                "choice": "Is for a Python keyword? Answer in JSON."}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_demo_constrained_spec_equals_constrained_plain(demo, kind):
    model, tok, comp = demo
    prompt, reasoning = _chat(tok, DEMO_PROMPTS[kind])
    assert not reasoning
    ref, runs = check_exact(model, comp, source_from_request(**SOURCES[kind]), prompt, tok.eos_token_ids, 32,
                            forced=False)
    assert ref and sum(s.telem.accepted for _, _, s, _ in runs) > 0


def test_demo_think_end_accepted_inside_draft_window(demo):
    """Thinking on: the demo writes `\\n</think>\\n\\n` then the answer; `</think>` and grammar-checked drafts
    after it are verified in one window, and the answer obeys the schema."""
    model, tok, comp = demo
    prompt, reasoning = _chat(tok, DEMO_PROMPTS["json_schema"], thinking=None)
    assert reasoning
    src = source_from_request(**SOURCES["json_schema"])
    ref, runs = check_exact(model, comp, src, prompt, tok.eos_token_ids, 48, reasoning=True, forced=False)
    think = comp.tokenizer.think_end_id
    assert think in ref and sum(spy.think_windows(think) for *_, spy in runs) >= 4
    reasoning_text, content = split_reasoning(tok.decode(ref, skip_special_tokens=True))
    schema = SOURCES["json_schema"]["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(content), schema)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]}},
     "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}}, "required": ["name", "age"],
        "additionalProperties": False}}, "required": ["person"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"squares": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 100}, "maxItems": 5}},
     "required": ["squares"], "additionalProperties": False},
    {"type": "object", "properties": {"keyword": {"type": "boolean"}, "word": {"type": "string",
                                                                               "pattern": "^[a-z]{2,8}$"}},
     "required": ["word", "keyword"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"module": {"type": "string", "maxLength": 20},
                                      "purpose": {"type": "string", "maxLength": 40}},
     "required": ["module", "purpose"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "x": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["n", "x"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3},
                                      "level": {"enum": [1, 2, 3]}},
     "required": ["tags", "level"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
                "additionalProperties": False},
               {"type": "object", "properties": {"error": {"type": "string", "maxLength": 12}}, "required": ["error"],
                "additionalProperties": False}]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "$ref": "#/$defs/Item"}}}, "required": ["items"], "additionalProperties": False,
     "$defs": {"Item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                                         "label": {"type": "string", "maxLength": 8}},
                        "required": ["id", "label"], "additionalProperties": False}}},
]


def test_demo_json_schema_outputs_validate(demo):
    """A dozen schemas (enums, nested objects, arrays, bounded integers, patterns, $defs): every output that
    finishes ("stop") parses and validates with jsonschema."""
    model, tok, comp = demo
    prompts = ["Give me a JSON object for a person named Bob who is 41 years old.", "What is the capital of Italy? "
               "Answer in JSON.", "Give the first 4 square numbers as JSON.", "Describe the json module in JSON."]
    stopped = 0
    for i, schema in enumerate(SCHEMAS):
        prompt, _ = _chat(tok, prompts[i % len(prompts)])
        src = source_from_request(response_format={"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                          "schema": schema}})
        s = SpecSession(model, prompt, 64, k=3, constraint=comp.constraint(comp.compile(src).grammar),
                        eos_ids=tok.eos_token_ids)
        out = s.run()
        if s.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(tok.decode(out, skip_special_tokens=True)), schema)
    assert stopped >= 10, stopped
