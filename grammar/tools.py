"""Qwen3.5 tool calls: the request's tool list, the call format the chat template teaches, a lark grammar
that forces calls in that format, and the schema-typed conversion of parameter values.

The format (engine/chat_template.jinja; calls separated by one newline)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string-typed VALUE is the raw text; any other VALUE is JSON (the template's `tojson`, i.e. `json.dumps`
separators ", " and ": "). `<tool_call>` / `</tool_call>` are single added tokens of the Qwen3.5 vocabulary; a
fine-tune or converted tokenizer may lack them, and then they are text like the rest of the format (the grammar
writes them as tokens when they are tokens, as text otherwise; the parser reads the decoded text either way).
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from .errors import GrammarError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"

# JSON text as the chat template writes it (`tojson` = json.dumps defaults), with no free whitespace.
JSON_OPTIONS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_NAME_RE = re.compile(r"[^\s<>\"']{1,256}")  # what can sit between `<function=` / `<parameter=` and `>`
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")  # vLLM qwen3_coder's string spellings


@dataclass(frozen=True)
class ToolSpec:
    """One `{"type": "function", "function": {...}}` entry: name and parameters schema (an object schema; {}
    when absent). `properties` keeps the schema's order, which is the order the forced grammar uses."""

    name: str
    parameters: dict[str, Any]

    @property
    def properties(self) -> dict[str, Any]:
        props = self.parameters.get("properties")
        return props if isinstance(props, dict) else {}

    @property
    def required(self) -> set[str]:
        req = self.parameters.get("required")
        return {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()


def parse_tools(tools: Any, param: str = "tools") -> list[ToolSpec]:
    """Validate an OpenAI `tools` list into ToolSpecs; GrammarError naming the bad entry."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list of function tools", param)
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise GrammarError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise GrammarError(f"{where}.function.name must be 1-256 characters without whitespace, quotes, '<' or '>'",
                               f"{where}.function.name")
        if name in seen:
            raise GrammarError(f"{where}: duplicate function name {name!r}", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise GrammarError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        spec = ToolSpec(name, params)
        for pname in spec.properties:
            if not _NAME_RE.fullmatch(pname):
                raise GrammarError(f"{where}: parameter name {pname!r} cannot be written in the tool-call format",
                                   f"{where}.function.parameters")
        out.append(spec)
    return out


def find_tool(tools: list[ToolSpec], name: str) -> ToolSpec | None:
    return next((t for t in tools if t.name == name), None)


# ----------------------------------------------------------------------------------------------- schema types
def _resolve(schema: Any, root: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """Follow a local `$ref` ("#/$defs/X", "#/definitions/X", any "#/a/b" pointer) within `root`."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 16:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return schema
        schema, depth = node, depth + 1
    return schema if isinstance(schema, dict) else {}


def value_type(schema: Any, root: dict[str, Any] | None = None) -> tuple[str, bool]:
    """(primary JSON type, nullable) of a parameter schema, read as vLLM's qwen3_coder parser reads it: `type`
    (the first non-null entry of a type list), else the first non-null `anyOf`/`oneOf` branch type; enum/const
    of strings -> string; no type at all -> string."""
    s = _resolve(schema, root or {})
    t = s.get("type")
    if isinstance(t, str):
        return t.strip().lower(), t.strip().lower() == "null"
    if isinstance(t, list):
        names = [str(x).lower() for x in t]
        rest = [x for x in names if x != "null"]
        return (rest[0] if rest else "null"), "null" in names
    for key in ("anyOf", "oneOf"):
        opts = s.get(key)
        if isinstance(opts, list):
            kinds = [value_type(o, root) for o in opts]
            rest = [k for k, _ in kinds if k != "null"]
            return (rest[0] if rest else "null"), any(k == "null" or n for k, n in kinds)
    if "enum" in s or "const" in s:
        vals = s["enum"] if isinstance(s.get("enum"), list) else [s.get("const")]
        return ("string" if all(isinstance(v, str) for v in vals) else "any"), None in vals
    if "properties" in s:
        return "object", False
    if "items" in s:
        return "array", False
    return "string", False


def is_string_type(kind: str) -> bool:
    return kind in _STRING_TYPES


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def convert_param_value(raw: str, schema: Any, root: dict[str, Any] | None = None) -> Any:
    """A parameter's raw text -> its JSON value by the schema's type (vLLM qwen3_coder semantics): no schema or a
    string type -> the text itself; a nullable type and "null"/"None" -> None; any other type -> JSON, else a
    Python literal (models echo `{'k': 'v'}` / True), else the text unchanged. Never raises."""
    if schema is None:
        return raw
    kind, nullable = value_type(schema, root)
    text = raw.strip()
    if nullable and text.lower() in ("null", "none"):
        return None
    if is_string_type(kind):
        return raw
    for parse in (json.loads, ast.literal_eval):
        try:
            v = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            break
        if isinstance(v, tuple):
            v = list(v)
        if _jsonable(v):
            return v
    return raw


# ----------------------------------------------------------------------------------------------- the grammar
def _lit(s: str) -> str:
    """A lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _rx(pattern: str) -> str:
    """A JSON-schema `pattern` as a lark /regex/ body matched in full (a leading ^ / trailing $ dropped: a value
    matching the whole pattern also matches the schema's search semantics)."""
    p = pattern
    if p.startswith("^"):
        p = p[1:]
    if p.endswith("$") and not p.endswith("\\$"):
        p = p[:-1]
    return re.sub(r"(?<!\\)/", r"\\/", p)


def _subschema(schema: Any, root: dict[str, Any]) -> dict[str, Any]:
    """A property schema made self-contained (root `$defs`/`definitions` carried along) with JSON_OPTIONS."""
    s = dict(schema) if isinstance(schema, dict) else {}
    for key in ("$defs", "definitions"):
        if key in root and key not in s:
            s[key] = root[key]
    s["x-guidance"] = {**JSON_OPTIONS, **(s.get("x-guidance") or {})}
    return s


def _value_rules(rule: str, schema: Any, root: dict[str, Any], out: list[str]) -> str:
    """Append the lark rules for one parameter VALUE plus its `\\n</parameter>\\n`; returns the rule to use."""
    kind, _ = value_type(schema, root)
    s = _resolve(schema, root)
    end = _lit("\n" + PARAMETER_END + "\n")
    if not is_string_type(kind):
        out.append(f"{rule}: %json {json.dumps(_subschema(schema, root), ensure_ascii=False)} {end}")
        return rule
    choices = s["enum"] if isinstance(s.get("enum"), list) else ([s["const"]] if "const" in s else None)
    if choices is not None and all(isinstance(c, str) for c in choices) and choices:
        out.append(f"{rule}: ({' | '.join(_lit(c) for c in choices)}) {end}")
        return rule
    parts = ["NO_PARAM_END"]
    if isinstance(s.get("pattern"), str):
        parts.append(f"/{_rx(s['pattern'])}/")
    lo, hi = s.get("minLength"), s.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        parts.append("/(?s:.){%d,%s}/" % (lo if isinstance(lo, int) else 0, hi if isinstance(hi, int) else ""))
    term = rule.upper() + "_T"
    out.append(f"{term}: ({' & '.join(parts)}) {end}")
    out.append(f"{rule}[lazy]: {term}")
    return rule


#: String values are any text without `</parameter>` (a terminal shared by every string parameter's rule).
_NO_PARAM_END = "NO_PARAM_END: /(?s:.*)/ & ~/(?s:.*)" + _rx(PARAMETER_END) + "(?s:.*)/"


def tool_calls_lark(tools: list[ToolSpec], *, parallel: bool, tags_as_tokens: bool = True) -> str:
    """Lark grammar (llguidance dialect) for one call (`parallel` False) or one-or-more newline-separated calls
    to any of `tools`. Parameters follow each schema's `properties` order; required ones must appear, optional
    ones may be skipped; no undeclared parameters. Non-string values are constrained by their JSON schema
    (inline `%json`); string values are raw text free of `</parameter>`, narrowed by enum/const, pattern,
    minLength/maxLength. `tags_as_tokens`: `<tool_call>` / `</tool_call>` are the vocabulary's single (special)
    tokens; False: the tokenizer lacks them, and they are text."""
    if not tools:
        raise GrammarError("a forced tool call needs at least one tool", "tools")
    open_tag, close_tag = (TOOL_CALL_START, TOOL_CALL_END) if tags_as_tokens else \
        (_lit(TOOL_CALL_START), _lit(TOOL_CALL_END))
    rules: list[str] = []
    calls: list[str] = []
    for i, t in enumerate(tools):
        root = t.parameters
        params = []
        for j, (pname, pschema) in enumerate(t.properties.items()):
            value = _value_rules(f"v{i}_{j}", pschema, root, rules)
            rules.append(f"p{i}_{j}: {_lit(PARAMETER_PREFIX + pname + '>' + chr(10))} {value}")
            params.append(f"p{i}_{j}" if pname in t.required else f"p{i}_{j}?")
        head = _lit("\n" + FUNCTION_PREFIX + t.name + ">\n")
        rules.append(f"call{i}: {open_tag} {head} {' '.join(params)} {_lit(FUNCTION_END + chr(10))} {close_tag}")
        calls.append(f"call{i}")
    top = ["start: call" + (' ("\\n" call)*' if parallel else ""), "call: " + " | ".join(calls), _NO_PARAM_END]
    return "\n".join(top + rules) + "\n"


def tool_value_problem(tools: list[ToolSpec]) -> tuple[str, str] | None:
    """The first parameter of `tools` whose value grammar does not compile, as (the request field, the problem in
    the user's terms: llguidance's message about their schema or pattern, without grammar text), else None. Each
    value is checked alone, as `tool_calls_lark` writes it (only when the whole grammar failed: it costs a compile
    per parameter)."""
    for t in tools:
        for pname, pschema in t.properties.items():
            rules: list[str] = []
            rule = _value_rules("v", pschema, t.parameters, rules)
            try:
                problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(
                    "\n".join([f"start: {rule}", _NO_PARAM_END, *rules]) + "\n"))
            except ValueError as e:
                problem = str(e)
            if problem:
                return "tools", f"tools: function {t.name!r}, parameter {pname!r}: {user_problem(problem)}"
    return None


def user_problem(message: str) -> str:
    """llguidance's error message without its place in the grammar (`at 4(7): `) or the grammar lines it quotes."""
    lines = []
    for line in re.sub(r"^at \d+\(\d+\): ", "", message.strip()).splitlines():
        if re.match(r"^\s*\d+ \| ", line):
            break
        lines.append(line)
    return "\n".join(lines).strip().removeprefix("failed to compile JSON schema: ")
