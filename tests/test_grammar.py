"""grammar/: request sources, compile (errors, bounds, cache), the tool-call grammar, and GuidanceConstraint's
contract (mask == is_allowed, EOS rules, draft consume/rollback, reasoning phases) on the demo tokenizer."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.tokenizer import Tokenizer
from grammar.compile import (GrammarCompiler, GrammarSource, GuidanceTokenizer, grammar_text, source_from_request)
from grammar.constraint import SEPARATOR_MAX, ConstraintError, GuidanceConstraint
from grammar.errors import GrammarError
from grammar.parsers import parse_tool_calls
from grammar.tools import convert_param_value, parse_tools, value_type

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
N_VOCAB = 2112  # the demo model's logit width (tokenizer: 2081)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "opts": {"$ref": "#/$defs/Opts"}},
    "required": ["query"],
    "$defs": {"Opts": {"type": "object", "properties": {"limit": {"type": "integer"}}, "required": ["limit"],
                       "additionalProperties": False}}}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


@pytest.fixture(scope="module")
def gtok(tok) -> GuidanceTokenizer:
    return GuidanceTokenizer.from_tokenizer(tok, n_vocab=N_VOCAB)


@pytest.fixture()
def compiler(gtok) -> GrammarCompiler:
    return GrammarCompiler(gtok)


def _constraint(compiler, src, reasoning=False) -> GuidanceConstraint:
    return compiler.constraint(compiler.compile(src).grammar, reasoning=reasoning)


def _accepts(compiler, tok, src, text: str) -> bool:
    """Does the grammar take `text` (tokenized as the model would write it) and then allow EOS?"""
    c = _constraint(compiler, src)
    for t in tok.encode(text):
        if not c.is_allowed(t):
            return False
        c.consume(t)
    return c.is_allowed(tok.eos_token_ids[0])


# ----------------------------------------------------------------------------------------------- sources
def test_sources_from_request_fields():
    rf = source_from_request(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                                     "strict": True}})
    assert rf.kind == "json_schema" and json.loads(rf.text) == PERSON and rf.param == "response_format.json_schema.schema"
    assert source_from_request(response_format={"type": "json_object"}).kind == "json_object"
    assert source_from_request(response_format={"type": "text"}) is None
    assert source_from_request() is None
    so = source_from_request(structured_outputs={"json": json.dumps(PERSON), "disable_any_whitespace": True})
    assert so.kind == "json_schema" and dict(so.json_options)["item_separator"] == ","
    assert source_from_request(structured_outputs={"regex": "a+"}).kind == "regex"
    assert source_from_request(structured_outputs={"grammar": 'start: "x"'}).kind == "lark"
    assert source_from_request(structured_outputs={"choice": ["a", "b"]}).kind == "choice"
    assert source_from_request(structured_outputs={"json_object": True}).kind == "json_object"
    # auto / none: no grammar (the tools are still validated)
    assert source_from_request(tools=[WEATHER], tool_choice="auto") is None
    assert source_from_request(tools=[WEATHER]) is None
    forced = source_from_request(tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False,
                                 response_format={"type": "json_object"})
    assert forced.kind == "tool_calls" and not forced.parallel and len(json.loads(forced.text)) == 2
    named = source_from_request(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}})
    assert [t["name"] for t in json.loads(named.text)] == ["search"] and named.parallel

    class Model:  # pydantic-style request parts are model_dump()ed
        def model_dump(self):
            return {"type": "json_schema", "json_schema": {"name": "p", "schema_": PERSON}}

    assert json.loads(source_from_request(response_format=Model()).text) == PERSON


@pytest.mark.parametrize("kwargs,param,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     ["'nope'", "get_weather"]),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", ["required"]),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ["sometimes"]),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", ["name"]),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", ["duplicate"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     ["schema"]),
    ({"response_format": {"type": "yaml"}}, "response_format", ["yaml"]),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", ["not valid JSON"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty"]),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ["not supported"]),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     ["not both"]),
])
def test_bad_request_fields_name_the_problem(kwargs, param, words):
    with pytest.raises(GrammarError) as ei:
        source_from_request(**kwargs)
    assert ei.value.param == param
    assert all(w in ei.value.message for w in words), ei.value.message


@pytest.mark.parametrize("so,words", [
    ({"regex": "(abc"}, ["structured_outputs.regex", "unclosed group"]),
    ({"regex": "a{3,1}"}, ["structured_outputs.regex", "repetition"]),
    ({"grammar": "start: foo"}, ["structured_outputs.grammar", 'unknown name: "foo"']),
    ({"grammar": 'start: "a" +?'}, ["structured_outputs.grammar", "Expected"]),
    ({"grammar": "root ::= ("}, ["structured_outputs.grammar", "GBNF"]),
    ({"json": {"type": "foo"}}, ["structured_outputs.json", "Invalid type: foo"]),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, ["structured_outputs.json", "minimum"]),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}, ["unclosed group"]),
    ({"json": {"$ref": "#/$defs/nope"}}, ["/$defs/nope"]),
    ({"json": {"type": "array", "uniqueItems": True}}, ["uniqueItems"]),
])
def test_bad_grammar_is_grammar_error_with_llguidance_message(compiler, so, words, monkeypatch):
    src = source_from_request(structured_outputs=so)
    with pytest.raises(GrammarError) as ei:
        compiler.compile(src)
    assert ei.value.param == src.param
    assert all(w in ei.value.message for w in words), ei.value.message
    monkeypatch.setattr("grammar.compile.grammar_text", lambda src: pytest.fail("recompiled a cached failure"))
    with pytest.raises(GrammarError) as again:  # failures are cached: same error, no recompile
        compiler.compile(src)
    assert (again.value.message, again.value.param) == (ei.value.message, ei.value.param)


def test_bad_tool_parameter_schema_is_grammar_error(compiler):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 9, "maximum": 1}}}}}
    with pytest.raises(GrammarError) as ei:
        compiler.compile(source_from_request(tools=[bad], tool_choice="required"))
    assert ei.value.param == "tools" and "minimum" in ei.value.message


def test_openai_sdk_parse_schema_compiles_and_accepts_instances(compiler, tok):
    """`client.chat.completions.parse(response_format=Model)` sends the SDK's strict schema ($defs, enums,
    nullable anyOf, titles, descriptions); it compiles and takes a model_dump of a valid instance."""
    enum = pytest.importorskip("enum")
    pydantic = pytest.importorskip("pydantic")
    to_strict = pytest.importorskip("openai.lib._pydantic").to_strict_json_schema

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Addr(pydantic.BaseModel):
        street: str
        zip: str | None = None

    class Person(pydantic.BaseModel):
        """A person."""
        name: str = pydantic.Field(description="full name")
        age: int = pydantic.Field(ge=0, le=150)
        color: Color
        tags: list[str]
        addr: Addr
        score: float | None

    schema = to_strict(Person)
    src = source_from_request(response_format={"type": "json_schema",
                                               "json_schema": {"name": "Person", "schema": schema, "strict": True}})
    good = Person(name="Ann", age=3, color="red", tags=["x"], addr=Addr(street="Main St"), score=None)
    assert _accepts(compiler, tok, src, json.dumps(good.model_dump(mode="json")))
    assert not _accepts(compiler, tok, src, json.dumps({**good.model_dump(mode="json"), "age": 151}))


def test_bounds_and_cache(gtok):
    small = GrammarCompiler(gtok, max_bytes=64)
    with pytest.raises(GrammarError, match="over the 64-byte grammar limit"):
        small.compile(source_from_request(structured_outputs={"regex": "a" * 65}))
    slow = GrammarCompiler(gtok, timeout_s=0.0)
    with pytest.raises(GrammarError, match="compile took"):
        slow.compile(source_from_request(response_format={"type": "json_object"}))
    comp = GrammarCompiler(gtok, cache_size=2)
    src = source_from_request(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    first = comp.compile(src)
    assert not first.cache_hit and first.seconds > 0 and first.grammar.compile_s == first.seconds
    second = comp.compile(GrammarSource(src.kind, src.text, src.param, src.json_options))
    assert second.cache_hit and second.seconds == 0.0 and second.grammar is first.grammar
    other_tok = GrammarCompiler(GuidanceTokenizer.from_json((DEMO / "tokenizer.json").read_text(),
                                                            n_vocab=N_VOCAB + 64, eos_ids=sorted(gtok.eos_ids)))
    assert not other_tok.compile(src).cache_hit  # the tokenizer is part of the key
    for rx in ("a", "b", "c"):  # LRU eviction at cache_size
        comp.compile(source_from_request(structured_outputs={"regex": rx}))
    assert not comp.compile(src).cache_hit
    res = asyncio.run(comp.compile_async(source_from_request(structured_outputs={"choice": ["x", "y"]})))
    assert not res.cache_hit and res.grammar.source.kind == "choice"


# ----------------------------------------------------------------------------------------------- tool grammar
def test_tool_call_grammar_accepts_the_template_format_only(compiler, tok):
    req = source_from_request(tools=[WEATHER, SEARCH], tool_choice="required")
    one = source_from_request(tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False)
    ok = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
          "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
          "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=code>\nJFK\n</parameter>\n"
          "</function>\n</tool_call>")
    second = "\n<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>"
    assert _accepts(compiler, tok, req, ok)
    assert _accepts(compiler, tok, req, ok + second)
    assert _accepts(compiler, tok, one, ok)
    assert not _accepts(compiler, tok, one, ok + second)  # parallel_tool_calls false: exactly one call
    bad = [
        ok.replace("<parameter=days>\n3\n</parameter>\n", ""),  # required parameter missing
        ok.replace("celsius", "kelvin"),  # enum
        ok.replace("\n3\n", "\n9\n"),  # maximum 7
        ok.replace("JFK", "jfk"),  # pattern
        ok.replace("[\"a\", \"b\"]", "[\"a\",\"b\"]"),  # JSON values are written as json.dumps does
        ok.replace("get_weather", "get_weather2"),  # unknown function
        "Sure! " + ok,  # nothing before the call
        ok.replace("<parameter=city>", "<parameter=town>"),  # undeclared parameter
    ]
    for text in bad:
        assert not _accepts(compiler, tok, req, text), text
    refs = ("<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two </parameter> not yet\n"
            "</parameter>\n<parameter=opts>\n{\"limit\": 5}\n</parameter>\n</function>\n</tool_call>")
    assert not _accepts(compiler, tok, req, refs)  # a string value cannot contain </parameter>
    assert _accepts(compiler, tok, req, refs.replace(" </parameter> not yet", ""))
    assert not _accepts(compiler, tok, req, refs.replace(" </parameter> not yet", "").replace("5}", "\"5\"}"))


def _random_args(rng: random.Random, name: str) -> dict:
    chars = "abc XYZ 012 <>/\"'{}[]\n\t\u00e9\u4e2d"
    text = lambda n: "".join(rng.choice(chars) for _ in range(rng.randint(0, n)))  # noqa: E731
    if name == "search":
        args = {"query": text(12)}
        if rng.random() < 0.5:
            args["opts"] = {"limit": rng.randint(-5, 500)}
        return args
    args = {"city": text(16)}
    if rng.random() < 0.5:
        args["unit"] = rng.choice(["celsius", "fahrenheit"])
    args["days"] = rng.randint(1, 7)
    if rng.random() < 0.5:
        args["tags"] = [text(4) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        args["code"] = "".join(rng.choice("ABCXYZ") for _ in range(3))
    return args


def test_template_rendered_calls_pass_the_grammar_and_parse_back(compiler, tok):
    """Calls rendered by the chat template (the format the model learns) are accepted by the forced grammar
    and parse back to the same, schema-valid arguments."""
    tools = [WEATHER, SEARCH]
    src = source_from_request(tools=tools, tool_choice="required")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    rng = random.Random(0)
    for _ in range(24):
        calls = [(n, _random_args(rng, n)) for n in rng.choices(["get_weather", "search"], k=rng.randint(1, 3))]
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                    for i, (n, a) in enumerate(calls)]}]
        turn = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False).split("<|im_start|>assistant")[-1]
        text = turn[turn.index("<tool_call>"): turn.rindex("</tool_call>") + len("</tool_call>")]
        assert _accepts(compiler, tok, src, text), text
        content, parsed = parse_tool_calls(text, tools)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        for name, args in calls:
            jsonschema.validate(args, schemas[name])


def test_value_types_and_conversion():
    root = {"$defs": {"N": {"type": "integer"}}}
    assert value_type({"type": ["string", "null"]}) == ("string", True)
    assert value_type({"anyOf": [{"type": "null"}, {"type": "number"}]}) == ("number", True)
    assert value_type({"$ref": "#/$defs/N"}, root) == ("integer", False)
    assert value_type({"enum": ["a", "b"]}) == ("string", False)
    assert value_type({}) == ("string", False)
    assert convert_param_value("42", {"type": "integer"}) == 42
    assert convert_param_value("2.5", {"type": "number"}) == 2.5
    assert convert_param_value("true", {"type": "boolean"}) is True
    assert convert_param_value("True", {"type": "boolean"}) is True
    assert convert_param_value("{'a': 1}", {"type": "object"}) == {"a": 1}
    assert convert_param_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert_param_value("null", {"type": ["integer", "null"]}) is None
    assert convert_param_value("None", {"type": ["string", "null"]}) is None
    assert convert_param_value("null", {"type": "string"}) == "null"
    assert convert_param_value(" 7 ", {"type": "string"}) == " 7 "
    assert convert_param_value("seven", {"type": "integer"}) == "seven"
    assert convert_param_value("NaN", {"type": "number"}) == "NaN"
    assert convert_param_value("x", None) == "x"
    assert [t.name for t in parse_tools([WEATHER, SEARCH])] == ["get_weather", "search"]


# ----------------------------------------------------------------------------------------------- constraint
def _mask_set(c: GuidanceConstraint) -> set[int]:
    return set(torch.nonzero(c.allowed_mask()).flatten().tolist())


def test_mask_matches_is_allowed_and_eos_rules(compiler, tok):
    src = source_from_request(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    c = _constraint(compiler, src)
    eos = set(tok.eos_token_ids)
    text = '{"name": "Bob", "age": 42}'
    ids = tok.encode(text)
    for i, t in enumerate(ids + [None]):
        allowed = _mask_set(c)
        assert allowed == {v for v in range(N_VOCAB) if c.is_allowed(v)}, i
        assert (eos <= allowed) == (i == len(ids)), i  # EOS only where the grammar accepts
        if t is None:
            break
        assert t in allowed
        c.consume(t)
    assert allowed == eos  # complete: only EOS
    row = torch.randn(N_VOCAB)
    masked = c.mask_logits(row)
    assert torch.isinf(masked).sum() == N_VOCAB - len(eos) and torch.equal(masked[list(eos)], row[list(eos)])
    c.consume(tok.eos_token_ids[0])
    assert _mask_set(c) == eos  # after EOS only EOS (ignore_eos cannot crash the request)
    with pytest.raises(ConstraintError):
        c.consume(ids[0])
    with pytest.raises(ValueError, match="entries"):
        c.mask_logits(torch.zeros(N_VOCAB - 1))


def test_forced_text_of_an_added_token_is_written_in_plain_tokens(compiler, tok):
    """A regex that spells `<tool_call>` as text: llguidance's mask would offer the added token (it tokenizes the
    forced bytes with added tokens) that its matcher then refuses; the constraint offers the plain tokens
    instead, so every allowed token is consumable and the walk completes the text."""
    forced = "Ok.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    c = _constraint(compiler, source_from_request(structured_outputs={"regex": re.escape(forced)}))
    special = {tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    out: list[int] = []
    for _ in range(64):
        allowed = _mask_set(c)
        if allowed <= set(tok.eos_token_ids):
            break
        assert not allowed & special
        for t in allowed:  # each allowed token is one the matcher takes
            assert c.is_allowed(t)
        t = min(allowed)
        c.consume(t)
        out.append(t)
    assert tok.decode(out) == forced


def test_draft_consumes_then_rolls_back(compiler, tok):
    src = source_from_request(structured_outputs={"regex": r"(ab|cd)+!"})
    ref, c = _constraint(compiler, src), _constraint(compiler, src)
    abc, d, ab, bang = tok.encode("abcdab!")
    x = tok.encode("x")[0]
    for k in (ref, c):
        k.consume(abc)
    # each draft is checked in the state the drafts before it reach; the chain stops at an illegal one
    c.draft_begin()
    assert c.draft_allowed(d) and c.draft_allowed(ab) and not c.draft_allowed(x)
    assert not c.draft_allowed(d)  # "abcdabd" cannot continue (ab|cd)+!
    assert _mask_set(c) == _mask_set(ref)  # nothing accepted: the next non-draft call sees the committed state
    # the verify walk accepts one draft, then checks a bonus that differs from the next draft
    c.draft_begin()
    assert c.draft_allowed(d) and c.draft_allowed(ab) and c.draft_allowed(bang)
    assert c.is_allowed(d)
    c.consume(d)
    ref.consume(d)
    assert c.is_allowed(ab) and not c.is_allowed(x)
    assert _mask_set(c) == _mask_set(ref)
    c.consume(ab)
    ref.consume(ab)
    # a fully accepted window, then the next round
    c.draft_begin()
    assert c.draft_allowed(bang)
    c.consume(bang)
    ref.consume(bang)
    assert _mask_set(c) == _mask_set(ref) == set(tok.eos_token_ids)
    c.draft_begin()  # an EOS draft ends the chain: nothing but EOS after it
    assert c.draft_allowed(tok.eos_token_ids[0]) and not c.draft_allowed(ab)
    assert _mask_set(c) == set(tok.eos_token_ids)


def test_window_and_draft_masks_follow_the_drafted_states(compiler, tok, gtok):
    """The hooks proposed for the engine: window_mask row j and draft_mask_logits after j drafts equal the
    mask of a fresh constraint that consumed the same j tokens (reasoning phase and separator included)."""
    src = source_from_request(structured_outputs={"regex": r"(ab|cd)+!"})
    think, nl = gtok.think_end_id, tok.encode("\n")[0]
    seq = tok.encode("hm") + [think, nl] + tok.encode("abcdab!")

    def mask_after(n):
        ref = _constraint(compiler, src, reasoning=True)
        for t in seq[:n]:
            ref.consume(t)
        return ref.allowed_mask()

    c = _constraint(compiler, src, reasoning=True)
    c.consume(seq[0])
    c.draft_begin()
    for n in range(1, len(seq)):
        assert torch.equal(torch.isfinite(c.draft_mask_logits(torch.zeros(N_VOCAB))), mask_after(n)), n
        assert c.draft_allowed(seq[n])
    w = c.window_mask(len(seq))
    assert w.shape == (len(seq), N_VOCAB)
    for j in range(len(seq)):
        assert torch.equal(w[j], mask_after(1 + j)), j
    with pytest.raises(ValueError):
        c.window_mask(len(seq) + 1)
    c.consume(seq[1])
    with pytest.raises(RuntimeError, match="before the verify walk"):
        c.window_mask(1)


def test_reasoning_phase_then_separator_then_grammar(compiler, tok, gtok):
    src = source_from_request(structured_outputs={"choice": ["yes", "no"]})
    think, nl = gtok.think_end_id, tok.encode("\n")[0]
    c = _constraint(compiler, src, reasoning=True)
    assert _mask_set(c) == set(range(N_VOCAB))  # inside <think>: everything
    row = torch.randn(N_VOCAB)
    assert torch.equal(c.mask_logits(row), row)
    for t in tok.encode("I think yes") + [nl]:
        c.consume(t)
    c.consume(think)
    grammar_first = _mask_set(_constraint(compiler, src))
    assert _mask_set(c) == grammar_first | gtok.newline_ids  # the template's "\n\n" may follow </think>
    for _ in range(SEPARATOR_MAX):
        assert c.is_allowed(nl)
        c.consume(nl)
    assert _mask_set(c) == grammar_first and not c.is_allowed(nl) and not c.is_allowed(think)
    for t in tok.encode("no"):
        c.consume(t)
    assert _mask_set(c) == set(tok.eos_token_ids)
    # </think> accepted inside a draft window switches the phase for the drafts after it, and rolls back
    d = _constraint(compiler, src, reasoning=True)
    yes = tok.encode("yes")
    d.draft_begin()
    assert d.draft_allowed(tok.encode("so")[0]) and d.draft_allowed(think)
    assert not d.draft_allowed(tok.encode("maybe")[0])  # grammar applies right after the drafted </think>
    assert d.draft_allowed(yes[0])
    assert _mask_set(d) == set(range(N_VOCAB))  # nothing accepted: still reasoning
    d.draft_begin()
    assert d.draft_allowed(think) and d.draft_allowed(yes[0])
    d.consume(think)  # verify accepted </think> only; bonus must obey the grammar
    assert not d.is_allowed(tok.encode("maybe")[0]) and d.is_allowed(yes[0])
    no_think = dataclasses.replace(compiler.compile(src).grammar, tokenizer=dataclasses.replace(gtok, think_end_id=None))
    with pytest.raises(ValueError, match="</think>"):
        GuidanceConstraint(no_think, reasoning=True)


def test_grammar_text_kinds():
    for kind, text in [("json_object", '{"type": "object"}'), ("regex", "a+"), ("lark", 'start: "a"'),
                       ("choice", '["a", "b"]')]:
        assert isinstance(grammar_text(GrammarSource(kind, text, "p")), str)
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        grammar_text(GrammarSource("yaml", "", "p"))
