"""Tool calls on any tokenizer: a fine-tune or converted tokenizer may lack `<tool_call>` / `</tool_call>` as tokens
(then the tool-call grammar writes them as text) or mark them special (then decoding keeps them for the parser). The
bundled demo model with tokenizers made from its own (the tags renamed away, or made special), through the official
`openai` client; and a tool whose schema cannot be compiled gets a 400 in the user's terms, never grammar text."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.tokenizer import Tokenizer
from tests.server_fixtures import DEMO_DIR, ServerThread

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
AUTO_CALL = (r"Let me check\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
             r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
#: What the grammars nextn builds are made of (none of it may reach an error message).
GRAMMAR_TEXT = ("NO_PARAM_END", "x-guidance", " | ", "<tool_call>", "at 1(", "at 4(")


@pytest.fixture(scope="module")
def tiny():
    with ServerThread() as s:
        yield s


def demo_tokenizer(out: Path, edit) -> Tokenizer:
    """The demo's tokenizer files with `edit(added_token)` applied to the tool-call tags' entries."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_DIR / name, out / name)
    tj, tc = json.loads((out / "tokenizer.json").read_text()), json.loads((out / "tokenizer_config.json").read_text())
    for entry in [*tj["added_tokens"], *tc["added_tokens_decoder"].values()]:
        if entry["content"] in ("<tool_call>", "</tool_call>"):
            edit(entry)
    (out / "tokenizer.json").write_text(json.dumps(tj))
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return Tokenizer.from_dir(out)


def chat(s: ServerThread, **kw):
    c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    return c.chat.completions.create(model=s.model, messages=ASK, temperature=0, tools=TOOLS, max_tokens=120,
                                     **kw)


def assert_weather_call(choice) -> None:
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_tokenizer_without_the_tool_call_tokens_serves_forced_and_auto_calls(tmp_path):
    tok = demo_tokenizer(tmp_path, lambda e: e.update(content=e["content"].replace("tool_call", "tc_unused")))
    assert tok.token_to_id("<tool_call>") is None and len(tok.encode("<tool_call>")) > 1
    with ServerThread(demo=True, tokenizer=tok, max_model_len=1024) as s:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = chat(s, tool_choice=choice, parallel_tool_calls=False, extra_body={"return_token_ids": True})
            assert_weather_call(r.choices[0])  # the tags written as text, several tokens each
            assert tok.decode(r.choices[0].token_ids).count("<tool_call>") == 1
        r = chat(s, extra_body={"structured_outputs": {"regex": AUTO_CALL}, **NO_THINK})  # tool_choice "auto"
        assert_weather_call(r.choices[0])
        assert r.choices[0].message.content == "Let me check."
        streamed = "".join(d.function.arguments or "" for ch in chat(s, stream=True, extra_body={
            "structured_outputs": {"regex": AUTO_CALL}, **NO_THINK}) if ch.choices
            for d in ch.choices[0].delta.tool_calls or [])
        assert streamed == r.choices[0].message.tool_calls[0].function.arguments


def test_tool_call_tags_marked_special_still_reach_the_parser(tmp_path):
    tok = demo_tokenizer(tmp_path, lambda e: e.update(special=True))
    assert tok.token_to_id("<tool_call>") in tok.special_token_ids  # skip_special_tokens would drop it
    with ServerThread(demo=True, tokenizer=tok, max_model_len=1024) as s:
        assert_weather_call(chat(s, tool_choice="required", parallel_tool_calls=False).choices[0])
        tag = tok.token_to_id("<tool_call>")
        plain = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0).chat.completions.create(
            model=s.model, messages=ASK, max_tokens=2, temperature=0, logit_bias={str(tag): 100},
            extra_body={"return_token_ids": True, **NO_THINK})
        assert plain.choices[0].token_ids == [tag] * 2 and plain.choices[0].message.content == ""  # no tools: skipped


@pytest.mark.parametrize("schema,problem", [({"type": "integer", "minimum": "x"}, "Expected f64 for 'minimum'"),
                                            ({"type": "string", "pattern": "(("}, "unclosed group"),
                                            ({"type": "object", "properties": {"a": {"type": "strin"}}},
                                             "Invalid type: strin")])
def test_a_tool_schema_that_cannot_compile_is_a_400_in_the_users_terms(tiny, schema, problem):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": schema}, "required": ["n"]}}}]
    c = openai.OpenAI(base_url=tiny.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tiny.model, messages=ASK, tools=bad, tool_choice="required", max_tokens=4)
    err = e.value.body
    assert err["param"] == "tools" and err["code"] == "invalid_grammar"
    assert "function 'f', parameter 'n'" in err["message"] and problem in err["message"]
    assert not any(w in err["message"] for w in GRAMMAR_TEXT)


def test_a_bad_regex_is_a_400_without_the_grammar_made_of_it(tiny):
    c = openai.OpenAI(base_url=tiny.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tiny.model, messages=ASK, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(("}})
    err = e.value.body
    assert err["param"] == "structured_outputs.regex" and "unclosed group" in err["message"]
    assert not any(w in err["message"] for w in GRAMMAR_TEXT + ("start:",))
