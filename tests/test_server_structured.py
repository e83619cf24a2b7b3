"""Structured outputs, tool calls and the reasoning split through the server: a real uvicorn on the demo model
(trained: answers chats, writes JSON) and on the tiny random model, driven by the official `openai` client.

What the demo model can and cannot do: it was trained on chats and JSON answers with an empty think block, not
on tool calls. Forced tool calls (tool_choice "required" / named) are written under the tool-call grammar; the
"auto" path (calls parsed out of free output) is exercised with a regex that makes the demo write a call while
tool_choice stays "auto" (the parser never sees the grammar), and on text the parser gets from the model.
"""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from engine.spec import SpecSession
from grammar import GrammarCompiler, GuidanceTokenizer, source_from_request, split_reasoning
from tests.server_fixtures import ServerThread, demo_model_and_tokenizer, tiny_model_and_tokenizer

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
TOOL_SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


S = {"type": "string", "maxLength": 24}
#: (prompt, schema): enums, nested objects, arrays, integers and numbers with bounds, strings with patterns.
SCHEMAS = [
    ("Give me a JSON object for a person named Alice who is 30 years old and lives in Paris.",
     _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": S})),
    ("Create a JSON record: name Bob, age 41, city Rome.",
     _obj({"name": S, "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo", "Lima"]}})),
    ("Give me a JSON object for a person named Chen who lives in Tokyo.",
     _obj({"user": _obj({"name": S, "address": _obj({"city": S, "zip": {"type": "string",
                                                                     "pattern": "^[0-9]{5}$"}})})})),
    ("Give the first 4 square numbers as JSON.",
     _obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "minItems": 1, "maxItems": 5}})),
    ("Put these colors in a JSON list: red, green, blue.",
     _obj({"colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue", "black"]},
                      "maxItems": 4}})),
    ("Is while a Python keyword? Answer in JSON.", _obj({"word": S, "keyword": {"type": "boolean"}})),
    ("Return a JSON object with name Dana and age 52.",
     _obj({"name": S, "age": {"type": "integer", "minimum": 18, "maximum": 65}})),
    ("Make JSON for Eve, age 7.",
     _obj({"name": S, "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("What does the json module do? Answer in JSON.",
     _obj({"module": S, "score": {"type": "number", "minimum": 0, "maximum": 10}})),
    ("What is the capital of France? Answer in JSON.", _obj({"country": S, "capital": S})),
    ("List 2 people as JSON: Ann aged 5 and Ben aged 9.",
     _obj({"people": {"type": "array", "maxItems": 2, "items": _obj({"name": S, "age": {
         "type": "integer", "minimum": 0, "maximum": 99}})}})),
    ("Make a JSON object with name \"Finn\" and age 12.",
     _obj({"name": S, "nickname": {"anyOf": [S, {"type": "null"}]}})),
]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    city: Literal["Paris", "Rome", "Tokyo", "Lisbon", "Berlin"]


@pytest.fixture(scope="module")
def demo():
    with ServerThread(demo=True, max_model_len=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny():
    with ServerThread(grammar_max_bytes=2048) as s:
        yield s


def _chat(c: openai.OpenAI, s: ServerThread, messages, **kw):
    return c.chat.completions.create(model=s.model, messages=messages, temperature=0, **kw)


# ------------------------------------------------------------------------------------------ JSON outputs


def test_parse_returns_valid_instances(client, demo):
    names = ["Alice", "Bob", "Chen"]
    for name in names:
        msgs = [{"role": "user", "content": f"Give me a JSON object for a person named {name} who is 30 years old."}]
        r = client.chat.completions.parse(model=demo.model, messages=msgs, response_format=Person, temperature=0,
                                          max_tokens=80)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Person), msg.content
        assert Person.model_validate_json(msg.content) == msg.parsed
        assert "</think>" not in msg.content  # the reasoning block never leaks into content


def test_a_dozen_json_schemas_validate(client, demo):
    finished = 0
    for prompt, schema in SCHEMAS:
        r = _chat(client, demo, [{"role": "user", "content": prompt}], max_tokens=120,
                  response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                          "strict": True}})
        c = r.choices[0]
        if c.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(c.message.content), schema)
    assert finished == len(SCHEMAS)


def test_json_object_and_sampled_choices_each_valid(client, demo):
    r = _chat(client, demo, [{"role": "user", "content": "Describe the math module in JSON."}], max_tokens=100,
              response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS[0][1]
    r = client.chat.completions.create(  # sampled (constrained rows decode plainly), one grammar state per choice
        model=demo.model, messages=[{"role": "user", "content": SCHEMAS[0][0]}], max_tokens=120, n=3,
        temperature=1.0, seed=5, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
    assert sum(c.finish_reason == "stop" for c in r.choices) >= 2


def test_structured_outputs_regex_choice_lark(client, demo):
    q = [{"role": "user", "content": "What is the capital of Italy?"}]
    rx = r"The capital is [A-Z][a-z]{2,10}\."
    r = _chat(client, demo, q, max_tokens=40, extra_body={"structured_outputs": {"regex": rx}})
    assert re.fullmatch(rx, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    options = ["Rome", "Paris", "Milan"]
    r = _chat(client, demo, q, max_tokens=10, extra_body={"structured_outputs": {"choice": options}})
    assert r.choices[0].message.content in options
    lark = 'start: "Answer: " CITY "!"\nCITY: /[A-Z][a-z]{2,8}/'
    r = _chat(client, demo, q, max_tokens=30, extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"Answer: [A-Z][a-z]{2,8}!", r.choices[0].message.content)


def test_constrained_server_output_equals_constrained_plain_greedy(client, demo):
    """Through the server (K=3, batched) == the engine's constrained plain greedy (k=0)."""
    prompt, schema = SCHEMAS[2]
    msgs = [{"role": "user", "content": prompt}]
    r = _chat(client, demo, msgs, max_tokens=100, extra_body={"return_token_ids": True},
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    model, tok = demo_model_and_tokenizer()
    comp = GrammarCompiler(GuidanceTokenizer.from_tokenizer(tok, n_vocab=model.config.vocab_size))
    res = comp.compile(source_from_request(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema}}))
    ids = r.model_extra["prompt_token_ids"]
    ref = SpecSession(model, ids, 100, k=0, constraint=comp.constraint(res.grammar, reasoning=True),
                      eos_ids=tok.eos_token_ids).run()
    assert r.choices[0].model_extra["token_ids"] == ref


def test_compile_time_goes_to_the_histogram_on_misses_only(client, demo):
    def count() -> float:
        return demo.metric("nextn_grammar_compile_seconds_count")

    schema = _obj({"unique_field_for_the_histogram": {"type": "integer"}})
    rf = {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}
    before = count()
    _chat(client, demo, [{"role": "user", "content": "Hi"}], max_tokens=20, response_format=rf)
    assert count() == before + 1
    _chat(client, demo, [{"role": "user", "content": "Hello"}], max_tokens=20, response_format=rf)
    assert count() == before + 1  # cached


# ------------------------------------------------------------------------------------------------ tools


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_call_streamed_and_not(client, demo, choice):
    kw = dict(max_tokens=120, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    r = _chat(client, demo, WEATHER_Q, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    _check_calls(c.message.tool_calls, {"get_weather"} if isinstance(choice, dict) else set(TOOL_SCHEMAS))
    assert len(c.message.tool_calls) == 1  # parallel_tool_calls=False
    chunks = list(_chat(client, demo, WEATHER_Q, stream=True, **kw))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            cur = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert d.type == "function" and cur["id"] is None
                cur["id"], cur["name"] = d.id, d.function.name
            cur["arguments"] += d.function.arguments or ""
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    want = c.message.tool_calls[0].function
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [(want.name, want.arguments)]
    with client.chat.completions.stream(model=demo.model, messages=WEATHER_Q, temperature=0, **kw) as st:
        final = st.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == want.arguments


def test_parallel_required_calls_all_valid(client, demo):
    r = _chat(client, demo, WEATHER_Q, max_tokens=200, tools=TOOLS, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length")
    if c.finish_reason == "tool_calls":
        _check_calls(c.message.tool_calls, set(TOOL_SCHEMAS))


AUTO_CALL = (r"Let me check\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
             r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")


def test_auto_tool_call_written_by_the_model_is_parsed(client, demo):
    kw = dict(max_tokens=120, tools=TOOLS, extra_body={"structured_outputs": {"regex": AUTO_CALL}})
    r = _chat(client, demo, WEATHER_Q, **kw)  # tool_choice defaults to "auto"
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    _check_calls(c.message.tool_calls, {"get_weather"})
    content, args = "", ""
    for ch in _chat(client, demo, WEATHER_Q, stream=True, **kw):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            args += "".join(d.function.arguments or "" for d in ch.choices[0].delta.tool_calls or [])
    assert content == "Let me check." and args == c.message.tool_calls[0].function.arguments
    # tool_choice "none": the same text stays content
    r = _chat(client, demo, WEATHER_Q, tool_choice="none", **kw)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.startswith("Let me check.\n<tool_call>")


def test_auto_without_a_call_is_content(client, demo):
    r = _chat(client, demo, [{"role": "user", "content": "Hello!"}], max_tokens=40, tools=TOOLS)
    c = r.choices[0]
    assert not c.message.tool_calls and c.finish_reason in ("stop", "length") and c.message.content


# -------------------------------------------------------------------------------------------- reasoning


def test_reasoning_split_streamed_and_not(tiny):
    """Thinking on (the template's default) and a model that never closes the block: all output is reasoning;
    enable_thinking false: all of it is content."""
    c = openai.OpenAI(base_url=tiny.base_url, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Hello world!"}]
    r = _chat(c, tiny, msgs, max_tokens=30, extra_body={"return_token_ids": True})
    _, tok = tiny_model_and_tokenizer()
    text = tok.decode(r.choices[0].model_extra["token_ids"], skip_special_tokens=True)
    want_r, want_c = split_reasoning(text, in_reasoning=True)
    m = r.choices[0].message
    assert (m.model_extra.get("reasoning_content"), m.content) == (want_r, want_c)
    assert want_r
    reasoning, content = "", ""
    for ch in _chat(c, tiny, msgs, max_tokens=30, stream=True):
        if ch.choices:
            reasoning += ch.choices[0].delta.model_extra.get("reasoning_content") or ""
            content += ch.choices[0].delta.content or ""
    assert (reasoning or None, content or None) == (want_r, want_c)
    off = _chat(c, tiny, msgs, max_tokens=30, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and "reasoning_content" not in off.choices[0].message.model_extra


def test_demo_thinking_block_never_leaks(client, demo):
    r = _chat(client, demo, [{"role": "user", "content": "What is a for loop?"}], max_tokens=60)
    assert "</think>" not in (r.choices[0].message.content or "")
    r2 = _chat(client, demo, [{"role": "user", "content": "What is a for loop?"}], max_tokens=60,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the empty think block the demo writes costs tokens, not content
    assert r2.choices[0].message.content.startswith(r.choices[0].message.content)
    assert "reasoning_content" not in r.choices[0].message.model_extra


# ------------------------------------------------------------------------------------------------ errors


BAD = [  # id, body, param, a word the message must contain
    ("bad-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}}, "response_format.json_schema.schema", "foo"),
    ("schema-not-object", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "object"),
    ("bad-regex", {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex", "unclosed"),
    ("bad-lark", {"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar", "Expected"),
    ("unknown-tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("bad-tool", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "name"),
    ("two-sources", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ("over-size-bound", {"structured_outputs": {"choice": ["x" * 100] * 30}}, "structured_outputs.choice",
     "2048-byte"),
]


@pytest.mark.parametrize("body,param,word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_grammars_are_400_naming_the_problem(tiny, body, param, word):
    r = httpx.post(tiny.base_url + "/chat/completions", json={"model": tiny.model, "max_tokens": 4,
                                                              "messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert word in err["message"], err["message"]


def test_compile_time_bound_is_400():
    with ServerThread(grammar_compile_timeout=1e-6) as s:
        r = httpx.post(s.base_url + "/chat/completions", json={
            "model": s.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "structured_outputs": {"regex": "[a-z]{1,5}( [a-z]{1,5}){1,40}"}})
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
