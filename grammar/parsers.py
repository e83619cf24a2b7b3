"""Output parsers: reasoning (`<think>...</think>` -> reasoning_content / content) and Qwen3.5 tool calls
(`<tool_call>` blocks -> OpenAI `tool_calls` with JSON `arguments`).

Both are incremental: `push(text)` returns the deltas that text completes and `finish()` the rest; the
one-shot functions (`split_reasoning`, `parse_tool_calls`) are exactly push(all) + finish(), so a stream's
deltas always add up to the non-streamed result, however the text is split.

Chaining in the server: reasoning parser first; its content deltas feed the tool-call parser (when the
request has tools and tool_choice is not "none"); the tool parser's content deltas are the message content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .tools import (FUNCTION_END, FUNCTION_PREFIX, PARAMETER_END, PARAMETER_PREFIX, TOOL_CALL_END, TOOL_CALL_START,
                    ToolSpec, convert_param_value, find_tool, parse_tools)

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (0 if none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _ws_tail(text: str) -> int:
    return len(text) - len(text.rstrip())


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Does the rendered prompt leave the model inside a `<think>` block (the Qwen3.5 template's generation
    prompt with thinking on), so that output starts as reasoning? False when enable_thinking=false closed it."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


# ----------------------------------------------------------------------------------------------- reasoning
class ReasoningParser:
    """Streaming reasoning split, as vLLM's qwen3 reasoning parser reads Qwen3.5 output.

    `in_reasoning=True` (prompt_opens_reasoning): output is reasoning until `</think>`, or until a
    `<tool_call>` followed (after whitespace) by `<function=` (Qwen3.5 sometimes calls tools without closing
    the think block; that call is content). No end at all: everything is reasoning (truncated thinking). A
    stray leading `<think>` is dropped. Whitespace around the reasoning and between `</think>` and the
    answer (the template's `\\n\\n`) is dropped. `in_reasoning=False`: everything is content, verbatim.
    """

    def __init__(self, in_reasoning: bool = True) -> None:
        self._reasoning = in_reasoning
        self._buf = ""
        self._started = False  # some reasoning text was emitted (leading whitespace / <think> is behind us)
        self._strip_content = False  # drop the whitespace right after the reasoning

    def push(self, text: str) -> tuple[str, str]:
        """Add model text; returns (reasoning delta, content delta), either possibly empty."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: the held-back text."""
        return self._drain(final=True)

    def _end_of_reasoning(self, buf: str, final: bool) -> tuple[int, int] | None:
        """(end of reasoning text, start of content) if the reasoning ends in buf; (-1, i) if it may end at a
        `<tool_call>` at i not yet confirmed (hold from i); None if it does not end in buf."""
        te = buf.find(THINK_END)
        pos = 0
        while True:
            tc = buf.find(TOOL_CALL_START, pos)
            if tc == -1 or (te != -1 and te < tc):
                return (te, te + len(THINK_END)) if te != -1 else None
            after = buf[tc + len(TOOL_CALL_START):].lstrip()
            if after.startswith(FUNCTION_PREFIX):
                return tc, tc
            if not final and FUNCTION_PREFIX.startswith(after):
                return -1, tc  # undecided: hold from tc
            pos = tc + 1

    def _drain(self, final: bool) -> tuple[str, str]:
        r = c = ""
        if self._reasoning:
            buf = self._buf
            if not self._started:
                buf = buf.lstrip()
                if buf.startswith(THINK_START):
                    buf = buf[len(THINK_START):].lstrip()
                elif not final and THINK_START.startswith(buf):
                    self._buf = buf
                    return "", ""
            end = self._end_of_reasoning(buf, final)
            if end is not None and end[0] >= 0:
                r = buf[: end[0]].rstrip()
                self._reasoning, self._strip_content = False, True
                self._buf = buf[end[1]:]
            elif final:
                r, self._buf = buf.rstrip(), ""
            else:  # hold a possible tag start and trailing whitespace (dropped if the reasoning ends there)
                cut = end[1] if end is not None else len(buf) - _partial_suffix(buf, THINK_END, TOOL_CALL_START)
                cut -= _ws_tail(buf[:cut])
                r, self._buf = buf[:cut], buf[cut:]
            if r:
                self._started = True
        if not self._reasoning:
            buf = self._buf
            if self._strip_content:
                buf = buf.lstrip()
                if buf:
                    self._strip_content = False
            c, self._buf = buf, ""
        return r, c


def split_reasoning(text: str, in_reasoning: bool = True) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for an empty part."""
    p = ReasoningParser(in_reasoning)
    r1, c1 = p.push(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, (c1 + c2) or None


# ----------------------------------------------------------------------------------------------- tool calls
@dataclass
class ToolCallDelta:
    """One streamed tool-call fragment (OpenAI `delta.tool_calls[i]`): the first fragment of a call carries
    id and name (arguments ""), later ones carry argument text; concatenated arguments are the JSON object."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A parsed call: OpenAI `message.tool_calls[i]` with `function.arguments` a JSON object string."""

    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_TEXT, _OPEN, _PARAMS, _VALUE, _AFTER = range(5)


@dataclass
class _Call:
    call: ToolCall
    spec: ToolSpec | None
    n_params: int = 0
    emit: bool = True
    pending: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Streaming Qwen3.5 tool-call parser (tool_choice "auto", and the forced output of tool_choice
    "required"/named, which the grammar keeps in this format).

    A call starts at `<tool_call>` followed (after whitespace) by `<function=NAME>`; other text is content,
    verbatim, except whitespace before a call and whitespace-only text after the last one. A parameter value runs from `<parameter=ARG>` to the first
    `</parameter>` (one leading and one trailing newline dropped); a missing `</parameter>` ends at the next
    `<parameter=`, `</function>` or `</tool_call>`. Values are converted by the tool's schema types
    (`tools.convert_param_value`); unknown tools / parameters keep strings. `parallel=False` keeps only the
    first call. A call cut off by the end of output is closed with what it has.
    """

    def __init__(self, tools: list[ToolSpec] | list[dict[str, Any]] | None, *, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        tools = tools or []
        self.tools = list(tools) if all(isinstance(t, ToolSpec) for t in tools) else parse_tools(tools)
        self.parallel, self._new_id = parallel, new_id
        self.calls: list[ToolCall] = []  # every call started so far (arguments complete once closed)
        self._buf = ""
        self._state = _TEXT
        self._cur: _Call | None = None
        self._seen_call = False  # the last thing parsed was a call (whitespace-only text after it is dropped)
        self._ws_before = ""  # whitespace held before a `<tool_call>` not yet confirmed
        self._pname = ""  # parameter whose value is being read (state _VALUE)
        self._scanned = 0  # chars of that value already searched for its end

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add content text; returns (content delta, tool-call deltas)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held-back content, and the close of a call the output cut off."""
        return self._drain(final=True)

    # ------------------------------------------------------------------ machinery
    def _start_call(self, name: str) -> list[ToolCallDelta]:
        emit = self.parallel or not self.calls
        call = ToolCall(self._new_id(), name)
        self._cur = _Call(call, find_tool(self.tools, name), emit=emit)
        if not emit:
            return []
        self.calls.append(call)
        return [ToolCallDelta(len(self.calls) - 1, call.id, name, "")]

    def _args(self, text: str) -> list[ToolCallDelta]:
        cur = self._cur
        assert cur is not None
        if not cur.emit:
            return []
        cur.call.arguments += text
        return [ToolCallDelta(len(self.calls) - 1, arguments=text)]

    def _param(self, name: str, raw: str) -> list[ToolCallDelta]:
        cur = self._cur
        assert cur is not None
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        spec = cur.spec
        schema = spec.properties.get(name) if spec is not None else None
        value = convert_param_value(raw, schema, spec.parameters if spec is not None else None)
        sep = "{" if cur.n_params == 0 else ", "
        cur.n_params += 1
        return self._args(f"{sep}{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")

    def _close_call(self) -> list[ToolCallDelta]:
        cur = self._cur
        assert cur is not None
        out = self._args("}" if cur.n_params else "{}")
        self._cur = None
        self._seen_call = True
        return out

    def _drain(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            progressed = self._step(final, content, deltas)
            if not progressed:
                break
        return "".join(content), deltas

    def _step(self, final: bool, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One state transition; False when it needs more text (or, final, when everything is out)."""
        buf = self._buf
        if self._state == _TEXT:
            i = buf.find(TOOL_CALL_START)
            if i == -1:
                if final:  # whitespace left after the last call is the call's, not content
                    content.append("" if self._seen_call and not buf.strip() else buf)
                    self._buf = ""
                    return False
                keep = _partial_suffix(buf, TOOL_CALL_START)
                keep += _ws_tail(buf[: len(buf) - keep])
                if keep < len(buf):
                    content.append(buf[: len(buf) - keep])
                    self._seen_call = False
                self._buf = buf[len(buf) - keep:]
                return False
            content.append(buf[:i].rstrip())  # whitespace before a call is the call's
            ws = buf[:i][len(buf[:i].rstrip()):]
            self._buf, self._state, self._ws_before = buf[i:], _OPEN, ws
            return True
        if self._state == _OPEN:
            rest = buf[len(TOOL_CALL_START):]
            s = rest.lstrip()
            if s.startswith(FUNCTION_PREFIX):
                gt = s.find(">")
                name = s[len(FUNCTION_PREFIX): gt if gt != -1 else len(s)]
                bad = any(ch.isspace() or ch in "<\"'" for ch in name)
                if gt != -1 and name and not bad:
                    deltas.extend(self._start_call(name))
                    self._buf, self._state = s[gt + 1:], _PARAMS
                    return True
                if gt == -1 and not bad and not final:
                    return False
            elif not final and FUNCTION_PREFIX.startswith(s):
                return False
            # not a call: the tag is text
            content.append(self._ws_before + TOOL_CALL_START)
            self._buf, self._state = rest, _TEXT
            return True
        if self._state == _VALUE:  # buf is the value text so far
            start = max(0, self._scanned - len(TOOL_CALL_END))  # long values: search only the new text
            pe, te = buf.find(PARAMETER_END, start), buf.find(TOOL_CALL_END, start)
            if pe != -1 and (te == -1 or pe < te):
                deltas.extend(self._param(self._pname, buf[:pe]))
                self._buf, self._state = buf[pe + len(PARAMETER_END):], _PARAMS
                return True
            if te == -1 and not final:
                self._scanned = len(buf)
                return False
            # no </parameter>: the value ends at the next structural tag (or the end of output)
            limit = te if te != -1 else len(buf)
            cands = [k for k in (buf.find("\n" + PARAMETER_PREFIX, 0, limit), buf.find(FUNCTION_END, 0, limit))
                     if k != -1]
            end = min(cands) if cands else limit
            deltas.extend(self._param(self._pname, buf[:end]))
            self._buf, self._state = buf[end:], _PARAMS
            return True
        if self._state == _PARAMS:
            s = buf.lstrip()
            if s.startswith(PARAMETER_PREFIX):
                gt = s.find(">")
                name = s[len(PARAMETER_PREFIX): gt if gt != -1 else len(s)]
                if gt == -1 or "\n" in name:
                    if gt == -1 and "\n" not in name and not final:
                        return False
                    if gt == -1 and final:  # cut off inside the parameter name
                        deltas.extend(self._close_call())
                        self._buf, self._state = "", _TEXT
                        return False
                    self._buf = s[len(PARAMETER_PREFIX):]  # malformed name: skip the tag
                    return True
                self._buf, self._state, self._pname, self._scanned = s[gt + 1:], _VALUE, name, 0
                return True
            if s.startswith(FUNCTION_END):
                deltas.extend(self._close_call())
                self._buf, self._state = s[len(FUNCTION_END):], _AFTER
                return True
            if s.startswith(TOOL_CALL_END):  # missing </function>
                deltas.extend(self._close_call())
                self._buf, self._state = s[len(TOOL_CALL_END):], _TEXT
                return True
            if not final and any(tag.startswith(s) for tag in (PARAMETER_PREFIX, FUNCTION_END, TOOL_CALL_END)):
                return False
            if final:
                deltas.extend(self._close_call())
                self._buf, self._state = "", _TEXT
                return False
            k = s.find("<", 1)  # stray text inside the function: skip to the next tag
            if k == -1:
                self._buf = ""
                return False
            self._buf = s[k:]
            return True
        # _AFTER: expect </tool_call>
        s = buf.lstrip()
        if s.startswith(TOOL_CALL_END):
            self._buf, self._state = s[len(TOOL_CALL_END):], _TEXT
            return True
        if not final and TOOL_CALL_END.startswith(s):
            return False
        self._buf, self._state = s, _TEXT  # missing </tool_call>
        return True


def parse_tool_calls(text: str, tools: list[ToolSpec] | list[dict[str, Any]] | None, *, parallel: bool = True,
                     new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output; content None when empty."""
    p = ToolCallParser(tools, parallel=parallel, new_id=new_id)
    c1, _ = p.push(text)
    c2, _ = p.finish()
    return (c1 + c2) or None, p.calls
