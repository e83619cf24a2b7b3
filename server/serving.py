"""Serving classes behind the routes: request -> prompt ids -> worker jobs -> OpenAI response or SSE.

`OpenAIServing` holds what both endpoints share (model check, length checks, job submission, usage);
`ServingChat` and `ServingCompletion` own their preprocessing and their full and streaming generators.
Text is detokenized incrementally per choice (`ChoiceState`), stop strings are matched on that text
(the stop string is cut, the session cancelled), and a request's usage carries the merged speculative
telemetry of all its choices.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.spec import SpecTelemetry, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from server import protocol as p
from server.worker import Job, JobEvent, QueueFull, Unavailable, Worker

log = logging.getLogger("nextn.serving")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable"}
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1


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


def log_ignored_fields(req: p.OpenAIBaseModel) -> None:
    ignored = req.ignored_fields()
    if ignored:
        log.warning("ignoring unknown request field(s): %s", ", ".join(ignored))


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
        self.stops = list(stops)
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
            self.held += self.detok.push([tok])
            if self._cut_at_stop():
                self.stopped = True
                d.finish_reason = "stop"
                break
        if ev.done and d.finish_reason is None:
            self.held += self.detok.flush()
            self.stopped = self._cut_at_stop()
            d.finish_reason = "stop" if self.stopped else (ev.finish_reason or "stop")
        d.text = self._release(final=d.finish_reason is not None)
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason
        return d

    def _cut_at_stop(self) -> bool:
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = self.held[:min(hits)]
        return bool(hits)

    def _release(self, final: bool) -> str:
        keep = 0 if final else max((n for s in self.stops for n in range(len(s) - 1, 0, -1)
                                    if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


@dataclass
class _Prepared:
    """A validated request turned into engine inputs."""

    prompt_ids: list[int]
    max_new_tokens: int


class Generation:
    """The n jobs of one request and their shared event queue (all on one event loop)."""

    def __init__(self, jobs: list[Job], choices: list[ChoiceState], events: asyncio.Queue[JobEvent]) -> None:
        self.jobs, self.choices, self.events = jobs, choices, events

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield each choice's deltas until every job is done; a session error raises `APIError` (500)
        after cancelling the other jobs. Leaving early (client gone) cancels unfinished jobs."""
        try:
            while not all(c.done for c in self.choices):
                ev = await self.events.get()
                choice = self.choices[ev.index]
                if ev.error is not None and not choice.finished:
                    raise APIError(500, f"generation failed: {type(ev.error).__name__}: {ev.error}",
                                   code="internal_error")
                if ev.finish_reason == "abort" and not choice.finished:
                    raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
                d = choice.feed(ev)
                if choice.stopped:
                    self.jobs[ev.index].cancel("stop")
                if d.text or d.token_ids or d.finish_reason:
                    yield d
        finally:
            for job, choice in zip(self.jobs, self.choices, strict=False):
                if not choice.done:
                    job.cancel("abort")

    def telemetry(self) -> SpecTelemetry:
        """The merged telemetry of all jobs (final once every job is done)."""
        total = SpecTelemetry()
        for c in self.choices:
            if c.telem is not None:
                total.merge(c.telem)
        return total


class OpenAIServing:
    """Shared by both endpoints. `k` is the server's speculation depth (0 = plain decode)."""

    def __init__(self, *, tokenizer: Tokenizer, worker: Worker, model_name: str, max_model_len: int,
                 vocab_size: int, k: int) -> None:
        self.tokenizer, self.worker = tokenizer, worker
        self.model_name, self.max_model_len = model_name, max_model_len
        self.vocab_size, self.k = vocab_size, k

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_n(self, n: int) -> None:
        if n > self.worker.max_queue:
            raise APIError(400, f"n must be <= {self.worker.max_queue} (the admission queue size)", param="n")

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

    def start(self, req: p.ChatCompletionRequest | p.CompletionRequest, prep: _Prepared) -> Generation:
        """Submit one job per choice (choice i gets seed + i). Raises `APIError` 429/503."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent] = asyncio.Queue()
        sampling = req.to_sampling()
        eos = [] if req.ignore_eos else self.tokenizer.eos_token_ids
        stops = req.stop_strings()
        jobs, choices = [], []
        for i in range(req.n):
            s = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
            jobs.append(Job(i, prep.prompt_ids, prep.max_new_tokens, s, eos, req.num_logprobs, loop, events))
            choices.append(ChoiceState(i, self.tokenizer, prep.prompt_ids, stops))
        try:
            self.worker.submit(jobs)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Unavailable as e:
            raise APIError(503, str(e), code="unavailable") from None
        return Generation(jobs, choices, events)

    def usage(self, gen: Generation, prompt_tokens: int) -> p.UsageInfo:
        completion = sum(len(c.token_ids) for c in gen.choices)
        spec = p.SpecUsage(**gen.telemetry().to_dict(self.k)) if self.k > 0 else None
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                           total_tokens=prompt_tokens + completion, spec=spec)

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    async def encode_async(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.encode, text)


class ServingChat(OpenAIServing):
    """POST /v1/chat/completions."""

    async def create(self, req: p.ChatCompletionRequest) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """Validate, submit and return the full response, or an SSE iterator when `req.stream`.
        Raises `APIError` for anything the client got wrong and for 429/503/500."""
        log_ignored_fields(req)
        self.check_model(req.model)
        self.check_n(req.n)
        if req.tools or (req.response_format is not None and req.response_format.type != "text"):
            raise APIError(400, "structured output (response_format json_object/json_schema, tools) is not "
                                "available yet", param="tools" if req.tools else "response_format")
        prompt_ids = await self.encode_async(self._render(req))
        prep = self.budget(prompt_ids, req.max_new_tokens, prompt_param="messages",
                           param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        gen = self.start(req, prep)
        rid = p.random_id("chatcmpl")
        if req.stream:
            return self._stream(req, rid, gen, prep)
        return await self._full(req, rid, gen, prep)

    def _render(self, req: p.ChatCompletionRequest) -> str:
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
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      enable_thinking=thinking)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

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
        choices = [p.ChatCompletionChoice(
            index=c.index, message=p.ChatResponseMessage(content=c.text),
            logprobs=self._logprobs(c.logprobs) if req.logprobs else None, finish_reason=c.finish_reason,
            token_ids=c.token_ids if req.return_token_ids else None) for c in gen.choices]
        return p.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                        usage=self.usage(gen, len(prep.prompt_ids)),
                                        prompt_token_ids=prep.prompt_ids if req.return_token_ids else None)

    async def _stream(self, req: p.ChatCompletionRequest, rid: str, gen: Generation,
                      prep: _Prepared) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[p.ChatCompletionStreamChoice], **kw: Any) -> str:
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, **kw))

        try:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                         for i in range(req.n)],
                        prompt_token_ids=prep.prompt_ids if req.return_token_ids else None)
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=d.index, delta=p.DeltaMessage(content=d.text or None),
                        logprobs=self._logprobs(d.logprobs) if req.logprobs and d.logprobs else None,
                        finish_reason=d.finish_reason, token_ids=d.token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], usage=self.usage(gen, len(prep.prompt_ids)))
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")


class ServingCompletion(OpenAIServing):
    """POST /v1/completions (one prompt per request: text or token ids)."""

    async def create(self, req: p.CompletionRequest) -> p.CompletionResponse | AsyncIterator[str]:
        """Validate, submit and return the full response, or an SSE iterator when `req.stream`.
        Raises `APIError` for anything the client got wrong and for 429/503/500."""
        log_ignored_fields(req)
        self.check_model(req.model)
        self.check_n(req.n)
        prompt_ids = await self._prompt_ids(req.prompt)
        prep = self.budget(prompt_ids, req.max_tokens, param="max_tokens", prompt_param="prompt")
        gen = self.start(req, prep)
        rid = p.random_id("cmpl")
        if req.stream:
            return self._stream(req, rid, gen, prep)
        return await self._full(req, rid, gen, prep)

    async def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.encode_async(prompt)
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
        yield sse("[DONE]")
