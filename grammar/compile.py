"""Request fields -> grammar source -> compiled llguidance grammar, bounded and cached.

Server flow (phase 2):

    src = source_from_request(response_format=..., structured_outputs=..., tools=..., tool_choice=...,
                              parallel_tool_calls=...)            # fast, on the event loop; GrammarError -> 400
    if src is not None:
        res = await compiler.compile_async(src)                   # off the loop; GrammarError -> 400
        metrics.observe_grammar_compile(res.seconds) if not res.cache_hit
        constraint = compiler.constraint(res.grammar, reasoning=...)   # one per request/choice

Compiling means building an llguidance `LLMatcher` for (grammar, tokenizer): the lexer and parser tables.
The cache keeps one pristine compiled matcher per (tokenizer, kind, source text); a constraint starts from a
`deep_copy()` of it (microseconds). Failures are cached too, so a bad or slow grammar fails fast next time.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance import LLMatcher, LLTokenizer

from .compiled import CompiledGrammar
from .constraint import GuidanceConstraint
from .errors import GrammarError
from .tools import (JSON_OPTIONS, TOOL_CALL_END, TOOL_CALL_START, find_tool, parse_tools, tool_calls_lark,
                    tool_value_problem, user_problem)

log = logging.getLogger("nextn.grammar")

DEFAULT_MAX_GRAMMAR_BYTES = 256 * 1024  # canonical source text (schema JSON, regex, lark, choices, tools)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
THINK_END = "</think>"
_MAX_SEPARATOR_NEWLINES = 8  # "\n" * n tokens looked up for the post-</think> separator

@dataclass(frozen=True)
class GrammarSource:
    """What to compile. kind: json_schema | json_object | regex | lark | choice | tool_calls. `text` is the
    JSON dump (key order kept) of a schema / choice list / tool list, or the regex / lark text as given;
    `param` is the request field it came from (for error messages)."""

    kind: str
    text: str
    param: str
    json_options: tuple[tuple[str, Any], ...] = ()  # JSON compile options (json_schema / json_object)
    parallel: bool = True  # tool_calls: more than one call allowed

    @property
    def key(self) -> tuple:
        """Cache key (param included: cached errors name the field they came from)."""
        return (self.kind, self.text, self.json_options, self.parallel, self.param)


def _json_text(value: Any, param: str, what: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{param}: {what} is not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"{param}: {what} must be a JSON object", param)
    return json.dumps(value, ensure_ascii=False)


def _json_options(so: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """vLLM's structured_outputs whitespace switches -> llguidance JSON options (default: JSON_OPTIONS)."""
    opts = dict(JSON_OPTIONS)
    if so.get("disable_any_whitespace"):
        opts.update(item_separator=",", key_separator=":", whitespace_flexible=False)
    elif isinstance(so.get("whitespace_pattern"), str):
        opts.update(whitespace_flexible=True, whitespace_pattern=so["whitespace_pattern"])
    return tuple(sorted(opts.items()))


def _tool_choice(tool_choice: Any, tools: Any, parallel_tool_calls: bool | None) -> GrammarSource | None:
    if tool_choice is None or tool_choice in ("auto", "none"):
        parse_tools(tools)  # still validated: "auto" parses calls with these schemas
        return None
    specs = parse_tools(tools)
    if tool_choice == "required":
        chosen = specs
        if not chosen:
            raise GrammarError("tool_choice \"required\" needs a non-empty tools list", "tool_choice")
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise GrammarError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}', "tool_choice")
        tool = find_tool(specs, name)
        if tool is None:
            known = ", ".join(repr(t.name) for t in specs) or "none"
            raise GrammarError(f"tool_choice names function {name!r}, which is not in tools (known: {known})",
                               "tool_choice")
        chosen = [tool]
    else:
        raise GrammarError(f"tool_choice {tool_choice!r} is not one of \"none\", \"auto\", \"required\" or a "
                           "named function", "tool_choice")
    text = json.dumps([{"name": t.name, "parameters": t.parameters} for t in chosen], ensure_ascii=False)
    return GrammarSource("tool_calls", text, "tools", parallel=parallel_tool_calls is not False)


def source_from_request(*, response_format: Any = None, structured_outputs: Any = None, tools: Any = None,
                        tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> GrammarSource | None:
    """The grammar a chat request asks for, or None (free text). Cheap; raises GrammarError for bad shapes.

    - tool_choice "required" / {"type": "function", "function": {"name": N}}: forced Qwen3.5 tool call(s)
      (one call when parallel_tool_calls is False); this wins over response_format, as in vLLM.
    - response_format {"type": "json_object"} / {"type": "json_schema", "json_schema": {"name", "schema",
      "strict"}} / {"type": "text"} (no grammar); objects may be pydantic models (`model_dump()`ed).
    - structured_outputs (vLLM extra): exactly one of json (schema object or JSON text), regex, grammar (lark
      or GBNF), choice (list of strings), json_object (true); disable_any_whitespace / whitespace_pattern.
    Giving both response_format (non-text) and structured_outputs is an error.
    """
    forced = _tool_choice(tool_choice, tools, parallel_tool_calls)
    rf = response_format.model_dump() if hasattr(response_format, "model_dump") else response_format
    so = structured_outputs.model_dump() if hasattr(structured_outputs, "model_dump") else structured_outputs
    if forced is not None:
        return forced
    rf_src = _from_response_format(rf) if rf is not None else None
    so_src = _from_structured_outputs(so) if so is not None else None
    if rf_src is not None and so_src is not None:
        raise GrammarError("give either response_format or structured_outputs, not both", "structured_outputs")
    return rf_src or so_src


def _from_response_format(rf: Any) -> GrammarSource | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise GrammarError("response_format must be an object with a type", param)
    kind = rf.get("type")
    opts = tuple(sorted(JSON_OPTIONS.items()))
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSource("json_object", json.dumps({"type": "object"}), param, opts)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("response_format.json_schema must be an object with name and schema", param)
        schema = js.get("schema", js.get("schema_"))  # openai SDK models dump the field as schema_
        if schema is None:
            raise GrammarError("response_format.json_schema.schema is required", f"{param}.json_schema.schema")
        return GrammarSource("json_schema", _json_text(schema, f"{param}.json_schema.schema", "the schema"),
                             f"{param}.json_schema.schema", opts)
    raise GrammarError(f"response_format.type {kind!r} is not one of text, json_object, json_schema", param)


def _from_structured_outputs(so: Any) -> GrammarSource | None:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise GrammarError("structured_outputs must be an object", param)
    given = [k for k in ("json", "regex", "grammar", "choice", "json_object", "structural_tag")
             if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise GrammarError(f"structured_outputs: give exactly one of json, regex, grammar, choice, json_object "
                           f"(got {', '.join(given)})", param)
    if not given:
        return None
    k = given[0]
    p = f"{param}.{k}"
    opts = _json_options(so)
    if k == "json":
        return GrammarSource("json_schema", _json_text(so[k], p, "the schema"), p, opts)
    if k == "json_object":
        return GrammarSource("json_object", json.dumps({"type": "object"}), p, opts)
    if k in ("regex", "grammar"):
        if not isinstance(so[k], str) or not so[k]:
            raise GrammarError(f"{p} must be a non-empty string", p)
        return GrammarSource("regex" if k == "regex" else "lark", so[k], p)
    if k == "choice":
        ch = so[k]
        if not isinstance(ch, list) or not ch or not all(isinstance(c, str) for c in ch):
            raise GrammarError(f"{p} must be a non-empty list of strings", p)
        return GrammarSource("choice", json.dumps(ch, ensure_ascii=False), p)
    raise GrammarError(f"{p} is not supported", p)


def grammar_text(src: GrammarSource, *, tool_call_tokens: bool = True) -> str:
    """The llguidance grammar string for a source; `tool_call_tokens`: the tokenizer has `<tool_call>` and
    `</tool_call>` as tokens (`GuidanceTokenizer.tool_call_tokens`; else the tool-call grammar writes them as text).
    GrammarError when it cannot be built."""
    try:
        if src.kind in ("json_schema", "json_object"):
            return LLMatcher.grammar_from_json_schema(src.text, defaults=dict(src.json_options))
        if src.kind == "regex":
            return LLMatcher.grammar_from_regex(src.text)
        if src.kind == "lark":
            return llguidance.grammar_from("grammar", src.text)  # lark, or GBNF converted to lark
        if src.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(src.text)))
        if src.kind == "tool_calls":
            specs = parse_tools([{"type": "function", "function": t} for t in json.loads(src.text)], src.param)
            return LLMatcher.grammar_from_lark(tool_calls_lark(specs, parallel=src.parallel,
                                                               tags_as_tokens=tool_call_tokens))
    except ValueError as e:  # GrammarError is a ValueError too
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(f"invalid {src.param}: {e}", src.param) from None
    raise GrammarError(f"unknown grammar kind {src.kind!r}", src.param)


# ----------------------------------------------------------------------------------------------- tokenizer
@dataclass(frozen=True, eq=False)
class GuidanceTokenizer:
    """An llguidance tokenizer plus the token facts a constraint needs. Build once per served model (about
    1.7 s at the real 248,320 vocab). `n_vocab` is the model's logit width (>= the tokenizer's vocab)."""

    llt: LLTokenizer
    n_vocab: int
    eos_ids: frozenset[int]
    think_end_id: int | None  # the `</think>` token, if the vocabulary has it
    newline_ids: frozenset[int]  # tokens that are "\n" * n (the chat template's `</think>\n\n` separator)
    key: str  # identity for cache keys: hash of tokenizer.json, n_vocab, eos ids
    special_ids: frozenset[int] = frozenset()  # added tokens other than EOS: special to llguidance (`<[id]>`)
    tool_call_tokens: bool = True  # `<tool_call>` and `</tool_call>` are tokens (a grammar may name them)

    @functools.cached_property
    def _plain_ids(self) -> dict[bytes, int]:
        """bytes -> id of every ordinary (not special) token; built on first use (a pass over the vocabulary)."""
        out: dict[bytes, int] = {}
        for t in range(self.llt.vocab_size):
            if not self.llt.is_special_token(t):
                out.setdefault(self.llt.decode_bytes([t]), t)
        return out

    def plain_prefix_tokens(self, data: bytes, limit: int = 64) -> list[int]:
        """Ordinary tokens whose bytes are a prefix of `data` (at most `limit` bytes long)."""
        ids = self._plain_ids
        return [t for n in range(1, min(len(data), limit) + 1) if (t := ids.get(data[:n])) is not None]

    @classmethod
    def from_json(cls, tokenizer_json: str, *, n_vocab: int, eos_ids: list[int] | tuple[int, ...]) -> GuidanceTokenizer:
        """From tokenizer.json text. eos_ids: the ids that end generation (allowed only where the grammar
        accepts)."""
        if not eos_ids:
            raise ValueError("a grammar constraint needs at least one EOS id")
        llt = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids))
        think = llt.tokenize_str(THINK_END, parse_special=True)
        tags = [llt.tokenize_str(tag, parse_special=True) for tag in (TOOL_CALL_START, TOOL_CALL_END)]
        newlines = set()
        for n in range(1, _MAX_SEPARATOR_NEWLINES + 1):
            ids = llt.tokenize_str("\n" * n)
            if len(ids) == 1:
                newlines.add(ids[0])
        h = hashlib.sha256(tokenizer_json.encode())
        h.update(json.dumps([n_vocab, sorted(eos_ids)]).encode())
        added = json.loads(tokenizer_json).get("added_tokens") or []
        special = frozenset(a["id"] for a in added if isinstance(a.get("id"), int) and a["id"] < n_vocab
                            and llt.is_special_token(a["id"])) - set(eos_ids)
        return cls(llt, n_vocab, frozenset(eos_ids), think[0] if len(think) == 1 else None, frozenset(newlines),
                   h.hexdigest()[:16], special,
                   all(len(ids) == 1 and llt.is_special_token(ids[0]) for ids in tags))

    @classmethod
    def from_tokenizer(cls, tok: Any, *, n_vocab: int) -> GuidanceTokenizer:
        """From an `engine.tokenizer.Tokenizer` (its tokenizer.json and eos ids)."""
        return cls.from_json(tok.to_json_str(), n_vocab=n_vocab, eos_ids=tok.eos_token_ids)


@dataclass(frozen=True)
class CompileResult:
    """What `GrammarCompiler.compile` returns: the grammar, the seconds this call spent compiling (0.0 on a
    cache hit) and whether it was a hit. Feed `seconds` to the compile histogram on misses only."""

    grammar: CompiledGrammar
    seconds: float
    cache_hit: bool


class GrammarCompiler:
    """Compiles GrammarSources for one tokenizer, bounded (source size, compile time) and LRU-cached by
    (tokenizer key, GrammarSource.key). Thread-safe: call `compile` from worker threads."""

    def __init__(self, tokenizer: GuidanceTokenizer, *, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer, self.max_bytes, self.timeout_s, self.cache_size = tokenizer, max_bytes, timeout_s, cache_size
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, key: tuple) -> CompiledGrammar | GrammarError | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _put(self, key: tuple, value: CompiledGrammar | GrammarError) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def compile(self, src: GrammarSource) -> CompileResult:
        """Compile (or fetch) `src`. Blocking (milliseconds for typical schemas, seconds for huge ones): run it
        off the event loop. GrammarError: source over max_bytes, invalid (llguidance's message), or compile took
        longer than timeout_s."""
        n = len(src.text.encode())
        if n > self.max_bytes:
            raise GrammarError(f"{src.param} is {n} bytes, over the {self.max_bytes}-byte grammar limit", src.param)
        key = (self.tokenizer.key,) + src.key
        hit = self._get(key)
        if isinstance(hit, GrammarError):
            raise GrammarError(hit.message, hit.param)  # a fresh exception: no traceback build-up
        if hit is not None:
            return CompileResult(hit, 0.0, True)
        t0 = time.perf_counter()
        try:
            m = self._matcher(src)
            dt = time.perf_counter() - t0
            if dt > self.timeout_s:
                raise GrammarError(f"{src.param}: grammar compile took {dt:.1f} s, over the {self.timeout_s:g} s "
                                   "limit", src.param)
        except GrammarError as e:
            self._put(key, e)
            raise
        compiled = CompiledGrammar(src, self.tokenizer, m, dt)
        self._put(key, compiled)
        return CompileResult(compiled, dt, False)

    def _matcher(self, src: GrammarSource) -> LLMatcher:
        """The compiled matcher of `src`; GrammarError in the user's terms (`_user_error`)."""
        try:
            m = LLMatcher(self.tokenizer.llt, grammar_text(src, tool_call_tokens=self.tokenizer.tool_call_tokens),
                          log_level=0)
            if m.is_error():
                raise GrammarError(f"invalid {src.param}: {m.get_error().strip()}", src.param)
            return m
        except GrammarError as e:
            raise self._user_error(src, e) from None

    @staticmethod
    def _user_error(src: GrammarSource, err: GrammarError) -> GrammarError:
        """A failure in the user's terms. A regex's grammar is ours: the regex's problem without that grammar's
        text. A tool-call grammar is ours too: its failure is told as the tool parameter whose schema or pattern
        caused it (or, if none alone does, without the grammar's text, which goes to the log). Other sources'
        messages are about the user's own text (schema, lark) and stay as they are."""
        if src.kind == "regex":
            prefix = f"invalid {src.param}: "
            return GrammarError(prefix + user_problem(err.message.removeprefix(prefix)), src.param)
        if src.kind != "tool_calls":
            return err
        specs = parse_tools([{"type": "function", "function": t} for t in json.loads(src.text)], src.param)
        found = tool_value_problem(specs)
        if found is not None:
            return GrammarError(found[1], found[0])
        log.warning("a tool-call grammar failed to compile: %s", err.message)
        return GrammarError("tools: these tools cannot be turned into a tool-call grammar", src.param)

    async def compile_async(self, src: GrammarSource) -> CompileResult:
        """`compile` in a worker thread, answered within timeout_s (GrammarError past it; the thread finishes
        and caches its outcome, so a repeat fails or succeeds fast)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.compile, src), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(f"{src.param}: grammar compile took longer than the {self.timeout_s:g} s limit",
                               src.param) from None

    def constraint(self, grammar: CompiledGrammar, *, reasoning: bool = False) -> GuidanceConstraint:
        """A fresh per-request constraint (see GuidanceConstraint)."""
        return GuidanceConstraint(grammar, reasoning=reasoning)
