"""Structured outputs, tool calls and reasoning for the chat route: the glue between requests and `grammar/`.

`StructuredOutputs` owns the served tokenizer's grammar compiler. Its llguidance tokenizer (seconds at the
real 248,320 vocabulary) is built in a background thread started with the server, so startup and the event
loop never wait for it; the first request that needs a grammar awaits it. Compiles run off the event loop,
bounded in size and time and cached (`grammar.GrammarCompiler`); every cache miss is one sample of
`nextn_grammar_compile_seconds`. A source that cannot be served (bad schema / regex / lark, unknown tool,
over a bound) is a 400 naming the request field.

`ChatOutput` is one choice's output chain: the reasoning split (`<think>...</think>` -> `reasoning_content`),
then, when the request has tools and tool_choice is not "none", the Qwen3.5 tool-call parser (-> `tool_calls`).
Pushing a stream's text deltas one by one gives exactly the deltas of pushing the whole text at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from grammar import (CompiledGrammar, GrammarCompiler, GrammarError, GrammarSource, GuidanceConstraint,
                     GuidanceTokenizer, ReasoningParser, ToolCall, ToolCallDelta, ToolCallParser,
                     prompt_opens_reasoning)
from grammar.parsers import THINK_END, THINK_START
from grammar.tools import TOOL_CALL_END, TOOL_CALL_START
from server.errors import APIError

log = logging.getLogger("nextn.structured")


def grammar_error(e: GrammarError) -> APIError:
    """The 400 a GrammarError becomes."""
    return APIError(400, e.message, param=e.param, code="invalid_grammar")


class StructuredOutputs:
    """The grammar compiler of one served tokenizer. `start()` builds the llguidance tokenizer in a
    background thread; `compile` awaits it, then compiles off the event loop."""

    def __init__(self, tokenizer: Any, *, n_vocab: int, metrics: Any, max_bytes: int, timeout_s: float,
                 cache_size: int) -> None:
        self.tokenizer, self.n_vocab, self.metrics = tokenizer, n_vocab, metrics
        self.max_bytes, self.timeout_s, self.cache_size = max_bytes, timeout_s, cache_size
        self._compiler: concurrent.futures.Future[GrammarCompiler] = concurrent.futures.Future()
        self._started = False

    def start(self) -> None:
        """Build the llguidance tokenizer in a daemon thread (idempotent)."""
        if not self._started:
            self._started = True
            threading.Thread(target=self._build, name="nextn-grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        try:
            gtok = GuidanceTokenizer.from_tokenizer(self.tokenizer, n_vocab=self.n_vocab)
            self._compiler.set_result(GrammarCompiler(gtok, max_bytes=self.max_bytes, timeout_s=self.timeout_s,
                                                      cache_size=self.cache_size))
        except Exception as e:  # noqa: BLE001 - reported to every grammar request instead
            log.warning("structured outputs are unavailable: %s: %s", type(e).__name__, e)
            self._compiler.set_exception(e)

    def compiler_blocking(self) -> GrammarCompiler:
        """The compiler, waiting for its tokenizer in this thread (the engine process's compile threads); raises
        what building it raised."""
        self.start()
        return self._compiler.result()

    async def compiler(self) -> GrammarCompiler:
        self.start()
        try:
            return await asyncio.wrap_future(self._compiler)
        except Exception as e:  # noqa: BLE001
            raise APIError(400, f"structured outputs are not available for this model: {e}",
                           code="grammar_unavailable") from None

    async def compile(self, src: GrammarSource) -> CompiledGrammar:
        """Compile (or fetch) `src`; APIError 400 when it cannot be served. Observes the compile histogram on
        cache misses."""
        compiler = await self.compiler()
        try:
            res = await compiler.compile_async(src)
        except GrammarError as e:
            raise grammar_error(e) from None
        if not res.cache_hit:
            self.metrics.observe_grammar_compile(res.seconds)
        return res.grammar

    async def constraint_factory(self, grammar: CompiledGrammar, *, reasoning: bool) -> Any:
        """A callable making one fresh constraint per choice (reasoning: output starts inside `<think>`)."""
        compiler = await self.compiler()
        reasoning = reasoning and compiler.tokenizer.think_end_id is not None

        def make() -> GuidanceConstraint:
            return compiler.constraint(grammar, reasoning=reasoning)

        return make


def opens_reasoning(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Does the prompt leave a `<think>` block open (Qwen3.5's generation prompt with thinking on)? Decided on
    the token ids when the vocabulary has both tags as tokens (so message text spelling them does not count),
    else on the decoded text."""
    start, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    if start is None or end is None:
        return prompt_opens_reasoning(tokenizer.decode(prompt_ids))

    def last(tok: int) -> int:
        return max((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] == tok), default=-1)

    return last(start) > last(end)


def tool_tags_are_special(tokenizer: Any) -> bool:
    """Are `<tool_call>` / `</tool_call>` tokens marked special (some fine-tunes mark them), which decoding with
    skip_special_tokens would drop? Then a request whose calls are parsed decodes special tokens, as vLLM's tool
    parsers have it, so the parser sees the tags."""
    return bool({tokenizer.token_to_id(TOOL_CALL_START), tokenizer.token_to_id(TOOL_CALL_END)}
                & tokenizer.special_token_ids)


@dataclass
class OutputDelta:
    """What one piece of a choice's text adds: reasoning, content, tool-call fragments."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutput:
    """One choice's output chain: reasoning split, then tool-call parsing (when `tools` is given)."""

    def __init__(self, *, in_reasoning: bool, tools: list[dict[str, Any]] | None = None, parallel: bool = True) -> None:
        self._rp = ReasoningParser(in_reasoning)
        self._tp = ToolCallParser(tools, parallel=parallel) if tools is not None else None
        self.reasoning = ""
        self.content = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self._tp.calls if self._tp is not None else []

    def push(self, text: str) -> OutputDelta:
        r, c = self._rp.push(text) if text else ("", "")
        return self._content(r, c, final=False)

    def finish(self) -> OutputDelta:
        r, c = self._rp.finish()
        return self._content(r, c, final=True)

    def _content(self, r: str, c: str, final: bool) -> OutputDelta:
        d = OutputDelta(reasoning=r)
        if self._tp is None:
            d.content = c
        else:
            d.content, d.tool_calls = self._tp.push(c) if c else ("", [])
            if final:
                c2, t2 = self._tp.finish()
                d.content += c2
                d.tool_calls += t2
        self.reasoning += d.reasoning
        self.content += d.content
        return d
