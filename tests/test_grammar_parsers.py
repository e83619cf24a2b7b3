"""Output parsers: reasoning split and Qwen3.5 tool calls, whole-text and streamed (split at every boundary,
char by char, and at random cuts), with the streamed deltas adding up to the whole-text result."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from grammar.parsers import (ReasoningParser, ToolCallParser, parse_tool_calls, prompt_opens_reasoning,
                             split_reasoning)

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")

REASONING_CASES = [
    ("Let me think.\n</think>\n\nThe answer.", True, ("Let me think.", "The answer.")),
    ("\n</think>\n\n{\"a\": 1}", True, (None, '{"a": 1}')),
    ("<think>\nhmm\n</think>\n\nok", True, ("hmm", "ok")),
    ("only thinking, cut off  \n", True, ("only thinking, cut off", None)),
    ("", True, (None, None)),
    ("Hello there", False, (None, "Hello there")),
    ("  keep  spaces \n", False, (None, "  keep  spaces \n")),
    ("a < b, </thin is no tag</think>x", True, ("a < b, </thin is no tag", "x")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("caf\u00e9 \u4e2d\u6587\n</think>\n\n\U0001F600 ok\n", True, ("caf\u00e9 \u4e2d\u6587", "\U0001F600 ok\n")),
    ("I should call it.\n" + CALL, True, ("I should call it.", CALL)),  # Qwen3.5: call without </think>
    ("The <tool_call> tag starts a call.\n</think>\n\nDone.", True, ("The <tool_call> tag starts a call.", "Done.")),
    ("ends with a tag <tool_call>\n", True, ("ends with a tag <tool_call>", None)),
    ("ends with <tool_call>\n<func", True, ("ends with <tool_call>\n<func", None)),
    ("x\n</think>\n\n  indented answer", True, ("x", "indented answer")),
    ("</think>", True, (None, None)),
    ("<think>", True, (None, None)),
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                         "opts": {"type": "object"}, "tags": {"type": "array"},
                                         "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}}}},
]


def _call(name, body):
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _p(name, value):
    return f"<parameter={name}>\n{value}\n</parameter>\n"


TOOL_CASES = [
    ("Just text, no calls.\n", ("Just text, no calls.\n", [])),
    (CALL, (None, [("get_weather", {"city": "New York", "days": 3})])),
    ("Let me check.\n\n" + CALL, ("Let me check.", [("get_weather", {"city": "New York", "days": 3})])),
    (CALL + "\n" + _call("run", _p("code", "print('hi')\nx = 1 < 2")),
     (None, [("get_weather", {"city": "New York", "days": 3}), ("run", {"code": "print('hi')\nx = 1 < 2"})])),
    (_call("get_weather", _p("city", "Oslo") + _p("metric", "true") + _p("ratio", "2.5") + _p("opts", '{"a": [1]}')
           + _p("tags", "['x', 'y']") + _p("note", "None") + _p("limit", "null") + _p("days", "three")),
     (None, [("get_weather", {"city": "Oslo", "metric": True, "ratio": 2.5, "opts": {"a": [1]}, "tags": ["x", "y"],
                              "note": None, "limit": None, "days": "three"})])),
    (_call("get_weather", _p("city", "null") + _p("extra", "42")),
     (None, [("get_weather", {"city": "null", "extra": "42"})])),  # string type keeps "null"; unknown stays text
    (_call("unknown_fn", _p("n", "5")), (None, [("unknown_fn", {"n": "5"})])),
    (_call("run", ""), (None, [("run", {})])),
    (_call("run", _p("code", "a </function> b")), (None, [("run", {"code": "a </function> b"})])),
    (_call("run", _p("code", "\nfirst line blank\n")), (None, [("run", {"code": "\nfirst line blank\n"})])),
    # malformed: no </parameter> before the next parameter / before </function>
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>",
     (None, [("get_weather", {"city": "Rome", "days": 2})])),
    # malformed: no </function>
    ("<tool_call>\n<function=run>\n<parameter=code>\nx\n</parameter>\n</tool_call>", (None, [("run", {"code": "x"})])),
    # cut off by max_tokens mid-value: closed with what it has
    ("<tool_call>\n<function=run>\n<parameter=code>\nprint(", (None, [("run", {"code": "print("})])),
    ("<tool_call>\n<function=run>\n<parameter=co", (None, [("run", {})])),
    # not calls: the tag in prose, an unfinished header
    ("Use the <tool_call> tag.", ("Use the <tool_call> tag.", [])),
    ("<tool_call>\n<function=get_we", ("<tool_call>\n<function=get_we", [])),
    ("text " + CALL + "\nand after.\n", ("text\nand after.\n", [("get_weather", {"city": "New York", "days": 3})])),
    (CALL + "\n\n", (None, [("get_weather", {"city": "New York", "days": 3})])),
]


def _splits(text: str, rng: random.Random):
    """Every 2-way split, char by char, and a few random multi-way splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,in_reasoning,want", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(text, in_reasoning, want):
    assert split_reasoning(text, in_reasoning) == want
    rng = random.Random(text)
    for chunks in _splits(text, rng):
        p = ReasoningParser(in_reasoning)
        r = c = ""
        for ch in chunks:
            dr, dc = p.push(ch)
            r, c = r + dr, c + dc
        dr, dc = p.finish()
        assert ((r + dr) or None, (c + dc) or None) == want, chunks


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>\nold\n</think>\n\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


@pytest.mark.parametrize("text,want", TOOL_CASES)
def test_tool_calls_whole_and_streamed(text, want):
    content, calls = parse_tool_calls(text, TOOLS, new_id=_ids())
    got = (content, [(c.name, json.loads(c.arguments)) for c in calls])
    assert got == want
    for c in calls:
        assert json.loads(c.arguments) == json.loads(json.dumps(json.loads(c.arguments)))
        assert c.to_openai()["type"] == "function"
    rng = random.Random(text)
    for chunks in _splits(text, rng):
        p = ToolCallParser(TOOLS, new_id=_ids())
        out, deltas = "", []
        for ch in chunks:
            dc, dd = p.push(ch)
            out += dc
            deltas += dd
        dc, dd = p.finish()
        out += dc
        deltas += dd
        assert (out or None) == content, chunks
        # deltas: each call's first fragment has id + name, the rest only arguments; they add up
        by_index: dict[int, list] = {}
        for d in deltas:
            by_index.setdefault(d.index, []).append(d)
        assert sorted(by_index) == list(range(len(calls)))
        for i, ds in by_index.items():
            assert ds[0].id == calls[i].id and ds[0].name == calls[i].name and ds[0].arguments == ""
            assert all(d.id is None and d.name is None for d in ds[1:])
            assert "".join(d.arguments for d in ds) == calls[i].arguments, chunks


def test_parallel_false_keeps_the_first_call():
    text = CALL + "\n" + _call("run", _p("code", "x"))
    content, calls = parse_tool_calls(text, TOOLS, parallel=False)
    assert content is None and [c.name for c in calls] == ["get_weather"]


def test_reasoning_then_tools_chain():
    """The server's chain: reasoning parser first, its content feeds the tool parser."""
    text = "I need the weather.\n</think>\n\nSure.\n" + CALL
    for chunks in _splits(text, random.Random(0)):
        rp, tp = ReasoningParser(True), ToolCallParser(TOOLS, new_id=_ids())
        reasoning = content = ""
        for ch in chunks + [None]:
            dr, dc = rp.push(ch) if ch is not None else rp.finish()
            reasoning += dr
            c2, _ = tp.push(dc)
            content += c2
        content += tp.finish()[0]
        assert reasoning == "I need the weather." and content == "Sure."
        assert [(c.name, json.loads(c.arguments)) for c in tp.calls] == [("get_weather", {"city": "New York", "days": 3})]
