"""Serving classes behind the routes: request -> prompt ids -> worker jobs -> OpenAI response or SSE.

`OpenAIServing` holds what both endpoints share (model check, length checks, job submission, usage);
`ServingChat` and `ServingCompletion` own their preprocessing and their full and streaming generators.
Text is detokenized incrementally per choice (`ChoiceState`), stop strings are matched on that text in
linear time (`StopMatcher`; the stop string is cut, the session cancelled), and a request's usage carries
the merged speculative telemetry of all its choices. Request preprocessing (chat template, tokenization)
runs in a worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.spec import SpecConstraint, SpecTelemetry, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from grammar import GrammarError, GrammarSource, ToolCallDelta, source_from_request
from metrics.prometheus import ServingMetrics
from server import protocol as p
from server.structured import ChatOutput, OutputDelta, StructuredOutputs, grammar_error, opens_reasoning
from server.worker import Job, JobEvent, QueueFull, Unavailable, Worker

log = logging.getLogger("nextn.serving")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1
#: Unknown field names named in the one log line per request (the rest are counted), and characters per name.
MAX_LOGGED_FIELDS = 16
MAX_LOGGED_FIELD_CHARS = 64


class APIError(Exception):
    """An error the client sees as an OpenAI error body with HTTP `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> p.ErrorResponse:
        fallback = "invalid_request_error" if self.status < 500 else "server_error"
        return p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=_ERROR_TYPES.get(self.status, fallback),
                                                 param=self.param, code=self.code))


def sse(payload: p.BaseModel | str) -> str:
    """One server-sent event line: ``data: <json>\\n\\n`` (or a literal such as ``[DONE]``)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def printable(value: object, limit: int = 200) -> str:
    """`value` as text fit for one log line or error message: at most `limit` characters (then "..."),
    with control, quote and non-ASCII characters escaped as in JSON (a newline cannot forge a log line)."""
    text = str(value)
    cut = len(text) > limit
    text = json.dumps(text[:limit])[1:-1][:limit]
    return text + "..." if cut else text


def internal_error(where: str, exc: BaseException, logger: logging.Logger = log) -> APIError:
    """Log an unexpected exception once: its traceback's frames and its message through `printable` (so
    neither a request body nor a newline from it reaches the log); return the 500 the client gets."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    logger.error("%s: %s: %s\nTraceback (most recent call last):\n%s", where, type(exc).__name__, printable(exc),
                 frames.rstrip())
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def log_ignored_fields(req: p.OpenAIBaseModel) -> None:
    """One warning naming the request's unknown fields: escaped, at most MAX_LOGGED_FIELDS names of at most
    MAX_LOGGED_FIELD_CHARS characters, then a count of the rest."""
    ignored = req.ignored_fields()
    if ignored:
        names = ", ".join(printable(f, MAX_LOGGED_FIELD_CHARS) for f in ignored[:MAX_LOGGED_FIELDS])
        more = f" (and {len(ignored) - MAX_LOGGED_FIELDS} more)" if len(ignored) > MAX_LOGGED_FIELDS else ""
        log.warning("ignoring unknown request field(s): %s%s", names, more)


class StopMatcher:
    """Finds the first stop string in a text fed piece by piece, in time linear in the text.

    One Knuth-Morris-Pratt automaton per stop string: after each character, `state[i]` is the length of
    the longest prefix of stop i that ends the text so far. `feed` returns the offset, in the text fed by
    that call, where the first completed stop string starts (the earliest-ending match; of those, the
    longest; negative when it began in earlier text), or None; `pending` is how many trailing characters
    may still begin a stop string (the text to hold back, never more than the longest stop string - 1).
    Work per character is amortized O(number of stop strings).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.fail = [self._failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)

    @staticmethod
    def _failure(s: str) -> list[int]:
        """fail[j] = length of the longest proper border of s[:j + 1]."""
        fail = [0] * len(s)
        k = 0
        for j in range(1, len(s)):
            while k and s[j] != s[k]:
                k = fail[k - 1]
            if s[j] == s[k]:
                k += 1
            fail[j] = k
        return fail

    @property
    def pending(self) -> int:
        return max(self.state, default=0)

    def feed(self, text: str) -> int | None:
        if not self.stops:
            return None
        for pos, ch in enumerate(text):
            hit = 0
            for i, s in enumerate(self.stops):
                k, fail = self.state[i], self.fail[i]
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):
                    hit = max(hit, k)
                    k = fail[k - 1]
                self.state[i] = k
            if hit:
                return pos + 1 - hit
        return None


@dataclass
class Delta:
    """What one event added to one choice: released text, its tokens and logprobs, and the finish."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceState:
    """Event-loop side of one choice: incremental detokenization and stop-string matching.

    Text that could still be the start of a stop string is held back until it cannot. On a stop
    string the text before it is released, the tokens up to the one that completed it are kept, and
    `stopped` is set (the caller cancels the session). `finished` is set when the choice's output is
    final; `done` when the worker has also retired the session (its telemetry is then final).
    """

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], stops: Sequence[str]) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
        self.matcher = StopMatcher(stops)
        self.held = ""
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stopped = False
        self.done = False
        self.telem: SpecTelemetry | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: JobEvent) -> Delta:
        """Apply one worker event. Raises nothing; an event with `error` is handled by the caller."""
        d = Delta(self.index)
        if ev.done:
            self.done, self.telem = True, ev.telem
        if self.finished:
            return d
        for i, tok in enumerate(ev.token_ids):
            d.token_ids.append(tok)
            if ev.logprobs is not None:
                d.logprobs.append(ev.logprobs[i])
            if self._add(self.detok.push([tok])):
                self.stopped = True
                d.finish_reason = "stop"
                break
        if ev.done and d.finish_reason is None:
            self.stopped = self._add(self.detok.flush())
            d.finish_reason = "stop" if self.stopped else (ev.finish_reason or "stop")
        d.text = self._release(final=d.finish_reason is not None)
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason
        return d

    def _add(self, text: str) -> bool:
        """Append new text to `held`; on a stop string cut `held` where it starts and return True."""
        at = self.matcher.feed(text)
        if at is None:
            self.held += text
            return False
        self.held = (self.held + text)[:len(self.held) + at]  # at < 0: the stop began in the held text
        return True

    def _release(self, final: bool) -> str:
        keep = 0 if final else min(self.matcher.pending, len(self.held))
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


@dataclass
class _Prepared:
    """A validated request turned into engine inputs."""

    prompt_ids: list[int]
    max_new_tokens: int
    grammar: GrammarSource | None = None  # chat: the constraint the request asks for
    in_reasoning: bool = False  # chat: the prompt leaves a <think> block open


class Generation:
    """The n jobs of one request and their shared event queue (all on one event loop).

    Request-level metrics are recorded here, once per request (vLLM's definitions; n choices are one
    request): prompt tokens, `request_success{finished_reason}` and end-to-end latency when the request
    ends, and generation tokens as tokens are delivered to a choice (after stop-string cuts), so the
    counter's increase equals the sum of the requests' `usage.completion_tokens`."""

    def __init__(self, jobs: list[Job], choices: list[ChoiceState], events: asyncio.Queue[JobEvent],
                 metrics: ServingMetrics, prompt_tokens: int) -> None:
        self.jobs, self.choices, self.events = jobs, choices, events
        self.cancelled = False
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrival = time.monotonic()
        self._recorded = False

    def cancel(self) -> None:
        """The client left: ask the worker to drop every unfinished job (idempotent; on the event loop).
        `deltas` then ends quietly instead of reporting the aborts."""
        self.cancelled = True
        for job, choice in zip(self.jobs, self.choices, strict=True):
            if not choice.done:
                job.cancel("abort")
        self._record("abort")

    def _record(self, reason: str) -> None:
        """The request ended with `reason` (stop, length, abort, error): its request-level metrics, once."""
        if self._recorded:
            return
        self._recorded = True
        self.metrics.add_prompt_tokens(self.prompt_tokens)
        self.metrics.request_finished(reason)
        self.metrics.observe_e2e(time.monotonic() - self.arrival)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield each choice's deltas until every job is done; a session error raises `APIError` (500)
        after cancelling the other jobs. Leaving early (client gone) cancels unfinished jobs."""
        try:
            ready: collections.deque[JobEvent] = collections.deque()
            while not all(c.done for c in self.choices):
                if not ready:  # wait for one event, then take every event that is ready too
                    ready.append(await self.events.get())
                    while not self.events.empty():
                        ready.append(self.events.get_nowait())
                ev = ready.popleft()
                while ready and (joined := ev.then(ready[0])) is not None:  # a choice's ready events: one delta
                    ev = joined
                    ready.popleft()
                choice = self.choices[ev.index]
                if ev.error is not None and not choice.finished:
                    self._record("error")
                    raise APIError(500, f"generation failed: {type(ev.error).__name__}: {printable(ev.error)}",
                                   code="internal_error")
                if ev.finish_reason == "abort" and not choice.finished:
                    self._record("abort")
                    if self.cancelled:
                        return
                    raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
                d = choice.feed(ev)
                if d.token_ids:
                    self.metrics.add_generation_tokens(len(d.token_ids))
                if choice.stopped:
                    self.jobs[ev.index].cancel("stop")
                if d.text or d.token_ids or d.finish_reason:
                    yield d
            self._record("length" if any(c.finish_reason == "length" for c in self.choices) else "stop")
        finally:
            for job, choice in zip(self.jobs, self.choices, strict=False):
                if not choice.done:
                    job.cancel("abort")
            self._record("abort")  # left early (the client went away); a no-op when already recorded

    def telemetry(self) -> SpecTelemetry:
        """The merged telemetry of all jobs (final once every job is done)."""
        total = SpecTelemetry()
        for c in self.choices:
            if c.telem is not None:
                total.merge(c.telem)
        return total


@dataclass
class SSEStream:
    """A streaming response whose jobs are already running: `body` yields the SSE lines; `cancel` drops
    the jobs (call it when the client leaves, whether or not `body` was ever iterated)."""

    body: AsyncIterator[str]
    cancel: Callable[[], None]


class OpenAIServing:
    """Shared by both endpoints. `k` is the server's speculation depth (0 = plain decode)."""

    def __init__(self, *, tokenizer: Tokenizer, worker: Worker, model_name: str, max_model_len: int,
                 vocab_size: int, k: int) -> None:
        self.tokenizer, self.worker = tokenizer, worker
        self.model_name, self.max_model_len = model_name, max_model_len
        self.vocab_size, self.k = vocab_size, k

    def check(self, req: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """Checks shared by both endpoints: the model exists, `n` fits the queue, every choice's seed is in
        range. Logs the request's unknown fields."""
        log_ignored_fields(req)
        if req.model != self.model_name:
            raise APIError(404, f"The model `{printable(req.model, 100)}` does not exist.", param="model",
                           code="model_not_found")
        if req.n > self.worker.max_queue:
            raise APIError(400, f"n must be <= {self.worker.max_queue} (the admission queue size)", param="n")
        if req.seed is not None and req.seed + req.n - 1 > p.SEED_MAX:
            raise APIError(400, f"seed + n - 1 must be <= {p.SEED_MAX} (choice i uses seed + i)", param="seed")

    def budget(self, prompt_ids: list[int], requested: int | None, *, param: str, prompt_param: str) -> _Prepared:
        """Check the prompt against the context; the completion budget is `requested` (the request field
        `param`) or, when None, all the context that is left."""
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if requested is not None and requested <= 0:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
        if n >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {n} tokens, leaving no room for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if requested is not None and n + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n + requested} tokens ({n} in the prompt, {requested} for the "
                                f"completion).", param=param, code="context_length_exceeded")
        return _Prepared(prompt_ids, requested if requested is not None else self.max_model_len - n)

    def start(self, req: p.ChatCompletionRequest | p.CompletionRequest, prep: _Prepared,
              constraint: Callable[[], SpecConstraint] | None = None) -> Generation:
        """Submit one job per choice (choice i gets seed + i; `constraint()` makes each choice's own grammar
        state). Raises `APIError` 429/503."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent] = asyncio.Queue()
        sampling = req.to_sampling()
        eos = [] if req.ignore_eos else self.tokenizer.eos_token_ids
        stops = req.stop_strings()
        jobs, choices = [], []
        for i in range(req.n):
            s = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
            jobs.append(Job(i, prep.prompt_ids, prep.max_new_tokens, s, eos, req.num_logprobs, loop, events,
                            constraint=constraint() if constraint is not None else None))
            choices.append(ChoiceState(i, self.tokenizer, prep.prompt_ids, stops))
        try:
            self.worker.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Unavailable as e:
            raise APIError(503, str(e), code="unavailable") from None
        return Generation(jobs, choices, events, self.worker.metrics, len(prep.prompt_ids))

    def usage(self, gen: Generation, prompt_tokens: int) -> p.UsageInfo:
        completion = sum(len(c.token_ids) for c in gen.choices)
        spec = p.SpecUsage(**gen.telemetry().to_dict(self.k)) if self.k > 0 else None
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                           total_tokens=prompt_tokens + completion, spec=spec)

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])


class ServingChat(OpenAIServing):
    """POST /v1/chat/completions: structured outputs and tool calls (`structured`), reasoning split."""

    def __init__(self, *, special_tokens_in_content: bool = False, structured: StructuredOutputs | None = None,
                 **kw: Any) -> None:
        """`special_tokens_in_content`: tokenize special-token text inside messages as control tokens (the
        --allow-special-tokens-in-content setting, for trusted callers); by default it is plain text.
        `structured`: the grammar compiler (None: requests that need a grammar get 400)."""
        super().__init__(**kw)
        self.special_tokens_in_content = special_tokens_in_content
        self.structured = structured

    async def create(self, req: p.ChatCompletionRequest) -> p.ChatCompletionResponse | SSEStream:
        """Validate, compile the request's grammar (off the event loop), submit, and return the full response,
        or an `SSEStream` when `req.stream`. Raises `APIError` for anything the client got wrong and for
        429/503/500."""
        prep = await asyncio.to_thread(self._prepare, req)
        constraint = None
        if prep.grammar is not None:
            if self.structured is None:
                raise APIError(400, "structured outputs are not available on this server", param=prep.grammar.param)
            grammar = await self.structured.compile(prep.grammar)
            constraint = await self.structured.constraint_factory(grammar, reasoning=prep.in_reasoning)
        gen = self.start(req, prep, constraint)
        rid = p.random_id("chatcmpl")
        if req.stream:
            return SSEStream(self._stream(req, rid, gen, prep), gen.cancel)
        return await self._full(req, rid, gen, prep)

    def _prepare(self, req: p.ChatCompletionRequest) -> _Prepared:
        """Checks, the grammar source, chat template and tokenization (runs in a worker thread)."""
        self.check(req)
        try:
            src = source_from_request(response_format=req.response_format, structured_outputs=req.structured_outputs,
                                      tools=req.tools, tool_choice=req.tool_choice,
                                      parallel_tool_calls=req.parallel_tool_calls)
        except GrammarError as e:
            raise grammar_error(e) from None
        prep = self.budget(self._prompt_ids(req), req.max_new_tokens, prompt_param="messages",
                           param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        prep.grammar = src
        prep.in_reasoning = opens_reasoning(self.tokenizer, prep.prompt_ids)
        return prep

    def _prompt_ids(self, req: p.ChatCompletionRequest) -> list[int]:
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                bad = [part.type for part in content if part.type != "text" or part.text is None]
                if bad:
                    raise APIError(400, f"only text content parts are supported, got {bad[0]!r}",
                                   param=f"messages.{i}.content")
                content = "\n".join(part.text for part in content)  # type: ignore[misc]
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            messages.append({"role": role, "content": content, "name": m.name, "tool_calls": m.tool_calls,
                             "tool_call_id": m.tool_call_id})
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=req.tools,
                                              enable_thinking=thinking,
                                              special_tokens_in_content=self.special_tokens_in_content)
        except ValueError as e:
            raise APIError(400, printable(e, 500), param="messages") from None

    @staticmethod
    def _output(req: p.ChatCompletionRequest, prep: _Prepared) -> ChatOutput:
        """A choice's output chain: reasoning split; tool-call parsing when tools are offered."""
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        return ChatOutput(in_reasoning=prep.in_reasoning, tools=tools, parallel=req.parallel_tool_calls is not False)

    @staticmethod
    def _finish_reason(reason: str | None, out: ChatOutput) -> str | None:
        return "tool_calls" if reason == "stop" and out.calls else reason

    @staticmethod
    def _tool_deltas(deltas: list[ToolCallDelta]) -> list[p.DeltaToolCall] | None:
        """Parser fragments -> OpenAI deltas, one per call (fragments of one call joined)."""
        out: dict[int, p.DeltaToolCall] = {}
        for d in deltas:
            cur = out.get(d.index)
            if cur is None:
                out[d.index] = p.DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                               function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments))
            else:
                cur.function.arguments = (cur.function.arguments or "") + d.arguments
        return list(out.values()) or None

    def _logprobs(self, lps: list[TokenLogprob]) -> p.ChatChoiceLogprobs:
        def entry(tok: int, lp: float) -> p.TopLogprob:
            text = self.token_text(tok)
            return p.TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

        return p.ChatChoiceLogprobs(content=[
            p.ChatTokenLogprob(**entry(x.token, x.logprob).model_dump(),
                               top_logprobs=[entry(t, v) for t, v in x.top]) for x in lps])

    async def _full(self, req: p.ChatCompletionRequest, rid: str, gen: Generation,
                    prep: _Prepared) -> p.ChatCompletionResponse:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for _ in deltas:
                pass
        choices = []
        for c in gen.choices:
            out = self._output(req, prep)
            out.push(c.text)
            out.finish()
            calls = [p.ToolCall(id=t.id, function=p.FunctionCall(name=t.name, arguments=t.arguments))
                     for t in out.calls]
            message = p.ChatResponseMessage(content=out.content or (None if calls or out.reasoning else ""),
                                            reasoning_content=out.reasoning or None, tool_calls=calls)
            choices.append(p.ChatCompletionChoice(
                index=c.index, message=message, logprobs=self._logprobs(c.logprobs) if req.logprobs else None,
                finish_reason=self._finish_reason(c.finish_reason, out),
                token_ids=c.token_ids if req.return_token_ids else None))
        return p.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                        usage=self.usage(gen, len(prep.prompt_ids)),
                                        prompt_token_ids=prep.prompt_ids if req.return_token_ids else None)

    async def _stream(self, req: p.ChatCompletionRequest, rid: str, gen: Generation,
                      prep: _Prepared) -> AsyncIterator[str]:
        created = int(time.time())
        outs = [self._output(req, prep) for _ in range(req.n)]

        def chunk(choices: list[p.ChatCompletionStreamChoice], **kw: Any) -> str:
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, **kw))

        try:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                         for i in range(req.n)],
                        prompt_token_ids=prep.prompt_ids if req.return_token_ids else None)
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    out = outs[d.index]
                    od = out.push(d.text)
                    if d.finish_reason is not None:
                        end = out.finish()
                        od = OutputDelta(od.reasoning + end.reasoning, od.content + end.content,
                                         od.tool_calls + end.tool_calls)
                    delta = p.DeltaMessage(content=od.content or None, reasoning_content=od.reasoning or None,
                                           tool_calls=self._tool_deltas(od.tool_calls))
                    lps = self._logprobs(d.logprobs) if req.logprobs and d.logprobs else None
                    ids = d.token_ids if req.return_token_ids else None
                    if delta.content or delta.reasoning_content or delta.tool_calls or d.finish_reason or lps or ids:
                        yield chunk([p.ChatCompletionStreamChoice(
                            index=d.index, delta=delta, logprobs=lps, token_ids=ids,
                            finish_reason=self._finish_reason(d.finish_reason, out))])
            if req.include_usage:
                yield chunk([], usage=self.usage(gen, len(prep.prompt_ids)))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield sse(internal_error("chat stream failed", e).body())
        yield sse("[DONE]")


class ServingCompletion(OpenAIServing):
    """POST /v1/completions (one prompt per request: text or token ids)."""

    async def create(self, req: p.CompletionRequest) -> p.CompletionResponse | SSEStream:
        """Validate, submit and return the full response, or an `SSEStream` when `req.stream`.
        Raises `APIError` for anything the client got wrong and for 429/503/500."""
        prep = await asyncio.to_thread(self._prepare, req)
        gen = self.start(req, prep)
        rid = p.random_id("cmpl")
        if req.stream:
            return SSEStream(self._stream(req, rid, gen, prep), gen.cancel)
        return await self._full(req, rid, gen, prep)

    def _prepare(self, req: p.CompletionRequest) -> _Prepared:
        """Checks and tokenization (runs in a worker thread)."""
        self.check(req)
        return self.budget(self._prompt_ids(req.prompt), req.max_tokens, param="max_tokens", prompt_param="prompt")

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]  # type: ignore[operator]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {self.vocab_size})", param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        for x in lps:
            text = self.token_text(x.token)
            out.tokens.append(text)
            out.token_logprobs.append(x.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in x.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _choice(self, req: p.CompletionRequest, c: ChoiceState | Delta, prompt_ids: list[int] | None,
                text: str, offset: int) -> p.CompletionChoice:
        return p.CompletionChoice(
            index=c.index, text=text, finish_reason=c.finish_reason,
            logprobs=self._logprobs(c.logprobs, offset) if req.logprobs is not None else None,
            prompt_token_ids=prompt_ids if req.return_token_ids else None,
            token_ids=c.token_ids if req.return_token_ids else None)

    async def _full(self, req: p.CompletionRequest, rid: str, gen: Generation,
                    prep: _Prepared) -> p.CompletionResponse:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for _ in deltas:
                pass
        return p.CompletionResponse(id=rid, model=self.model_name,
                                    choices=[self._choice(req, c, prep.prompt_ids, c.text, 0) for c in gen.choices],
                                    usage=self.usage(gen, len(prep.prompt_ids)))

    async def _stream(self, req: p.CompletionRequest, rid: str, gen: Generation,
                      prep: _Prepared) -> AsyncIterator[str]:
        head = p.CompletionResponse(id=rid, model=self.model_name, choices=[], usage=None)
        offsets = [0] * req.n
        sent_prompt = [False] * req.n
        try:
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    prompt_ids = None if sent_prompt[d.index] else prep.prompt_ids
                    sent_prompt[d.index] = True
                    choice = self._choice(req, d, prompt_ids, d.text, offsets[d.index])
                    if choice.logprobs is not None:
                        offsets[d.index] += sum(len(t) for t in choice.logprobs.tokens)
                    yield sse(head.model_copy(update={"choices": [choice]}))
            if req.include_usage:
                yield sse(head.model_copy(update={"usage": self.usage(gen, len(prep.prompt_ids))}))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield sse(internal_error("completion stream failed", e).body())
        yield sse("[DONE]")
