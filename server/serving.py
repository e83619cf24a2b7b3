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

from config.settings import DEFAULT_MAX_LOGPROBS, FULL_VOCAB_LOGPROB_ENTRIES
from engine.gen_defaults import GenerationDefaults
from engine.images import ImageConfig, ImageInput
from engine.spec import SpecConstraint, SpecTelemetry, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from grammar import GrammarError, GrammarSource, ToolCallDelta, source_from_request
from grammar.parsers import THINK_END
from metrics.prometheus import ServingMetrics
from server import protocol as p
from server.admission import Admission
from server.errors import APIError
from server.multimodal import ImageRef, ImageServing, message_content
from server.structured import (ChatOutput, OutputDelta, StructuredOutputs, grammar_error, opens_reasoning,
                               tool_tags_are_special)
from server.worker import Job, JobEvent, QueueFull, Unavailable, Worker

log = logging.getLogger("nextn.serving")

#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1
#: Unknown field names named in the one log line per request (the rest are counted), and characters per name.
MAX_LOGGED_FIELDS = 16
MAX_LOGGED_FIELD_CHARS = 64


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


def session_error(err: BaseException) -> APIError:
    """The error a request gets when one of its sessions failed while generating (its other rows of the batch go
    on): 400 when the request's own input caused it (a `GrammarError`: the grammar the request gave cannot be
    followed; its `param` names the field), else 500 `internal_error` naming the failure."""
    if isinstance(err, GrammarError):
        return grammar_error(err)
    return APIError(500, f"generation failed: {type(err).__name__}: {printable(err)}", code="internal_error")


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
        self.matched = 0  # length of the stop string the last match completed

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
                self.matched = hit
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
    string the text before it is released (with the stop string when `include_stop`), the tokens up to the
    one that completed it are kept, and `stopped` is set (the caller cancels the session). A token of
    `stop_ids` (EOS, stop_token_ids) ends the choice without adding text, as in vLLM. `finished` is set
    when the choice's output is final; `done` when the worker has also retired the session (its telemetry
    is then final). `prompt_logprobs` arrive with the first event when the job asked for them.

    `reasoning`: the output starts inside a `<think>` block (chat with thinking on). Stop strings then apply
    to the answer only, as vLLM does (PR #14550) and hosted APIs do: they are dormant until `</think>` and
    the whitespace after it (which the reasoning split drops from `content`) have passed.
    """

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], stops: Sequence[str], *,
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 stop_ids: frozenset[int] = frozenset(), reasoning: bool = False) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self.matcher = StopMatcher(stops)
        self.include_stop, self.stop_ids = include_stop, stop_ids
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache held (arrives with the first event)
        #: inside the reasoning block: the text's last len(THINK_END) - 1 characters (None: stops are live)
        self._think_tail: str | None = "" if reasoning and stops else None
        self._skip_ws = False  # the whitespace right after `</think>` is not matched either
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
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.cached_tokens is not None:
            self.cached_tokens = ev.cached_tokens
        if self.finished:
            return d
        for i, tok in enumerate(ev.token_ids):
            d.token_ids.append(tok)
            if ev.logprobs is not None:
                d.logprobs.append(ev.logprobs[i])
            if tok in self.stop_ids:  # the session ends on it; its text is not output
                continue
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
        if self._think_tail is not None:  # reasoning: stops dormant until `</think>`
            buf = self._think_tail + text
            j = buf.find(THINK_END)
            if j < 0:
                self.held += text
                self._think_tail = buf[len(buf) - len(THINK_END) + 1:]
                return False
            cut = j + len(THINK_END) - len(self._think_tail)  # >= 1: the marker ends inside `text`
            self.held += text[:cut]
            text, self._think_tail, self._skip_ws = text[cut:], None, True
        if self._skip_ws:
            ws = len(text) - len(text.lstrip())
            self.held += text[:ws]
            text = text[ws:]
            if not text:
                return False
            self._skip_ws = False
        at = self.matcher.feed(text)
        if at is None:
            self.held += text
            return False
        end = at + (self.matcher.matched if self.include_stop else 0)
        self.held = (self.held + text)[:len(self.held) + end]  # at < 0: the stop began in the held text
        return True

    def _release(self, final: bool) -> str:
        keep = 0 if final else min(self.matcher.pending, len(self.held))
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


@dataclass
class _Prepared:
    """A validated prompt turned into engine inputs (a completions request has one per prompt)."""

    prompt_ids: list[int]
    max_new_tokens: int
    grammar: GrammarSource | None = None  # chat: the constraint the request asks for
    in_reasoning: bool = False  # chat: the prompt leaves a <think> block open
    echo: str = ""  # text the output starts with (chat and completions `echo`)
    keep_special: bool = False  # decode special tokens whatever skip_special_tokens says (tool tags that are special)
    image_refs: list[ImageRef] = field(default_factory=list)  # chat: the image parts, loaded after `_prepare`
    image_config: ImageConfig | None = None  # chat: their preprocessing (the request's pixel bounds applied)
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order; `prompt_ids` holds their expanded pads

    @property
    def image_tokens(self) -> int:
        return sum(x.n_tokens for x in self.images)


class Generation:
    """The n jobs of one request and their shared event queue (all on one event loop).

    Request-level metrics are recorded here, once per request (vLLM's definitions; n choices are one
    request): prompt tokens, `request_success{finished_reason}` and end-to-end latency when the request
    ends, and generation tokens as tokens are delivered to a choice (after stop-string cuts), so the
    counter's increase equals the sum of the requests' `usage.completion_tokens`."""

    def __init__(self, jobs: list[Job], choices: list[ChoiceState], events: asyncio.Queue[JobEvent],
                 metrics: ServingMetrics, prompt_tokens: int, n: int = 1, image_tokens: int = 0) -> None:
        self.jobs, self.choices, self.events = jobs, choices, events
        self.n = n  # choices per prompt (choice index = prompt index * n + i)
        self.image_tokens = image_tokens  # of the prompt tokens, those that are images' embeddings
        self.cancelled = False
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrival = time.monotonic()
        self._recorded = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, summed over the prompts (each prompt's first choice's)."""
        return sum(c.cached_tokens for c in self.choices[::self.n])

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
        """Yield each choice's deltas until every job is done; a session error raises `APIError`
        (`session_error`) after cancelling the other jobs. Leaving early (client gone) cancels unfinished jobs."""
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
                    raise session_error(ev.error)
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
    """Shared by the endpoints. `k` is the server's speculation depth (0 = plain decode)."""

    def __init__(self, *, tokenizer: Tokenizer, worker: Worker, model_name: str, max_model_len: int,
                 vocab_size: int, k: int, structured: StructuredOutputs | None = None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, model_aliases: Sequence[str] = (),
                 generation_defaults: GenerationDefaults | None = None) -> None:
        """`structured`: the grammar compiler (None: requests that need a grammar get 400); `max_logprobs`: the most
        logprobs a request may ask for per token (vLLM's --max-logprobs; -1: the whole vocabulary); `model_aliases`:
        more names a request's `model` may give (responses report `model_name`); `generation_defaults`: the
        checkpoint's sampling defaults for fields a request leaves unset (None: the built-in ones)."""
        self.tokenizer, self.worker = tokenizer, worker
        #: how jobs reach the worker (`build_app` makes every endpoint of a server share one)
        self.admission = Admission(worker)
        self.model_name, self.max_model_len = model_name, max_model_len
        #: every name a request may give, the reported one first (vLLM's --served-model-name NAME ALIAS...)
        self.served_names = tuple(dict.fromkeys((model_name, *model_aliases)))
        self.model_names = frozenset(self.served_names)
        self.defaults = generation_defaults.values() if generation_defaults is not None else {}
        self.vocab_size, self.k = vocab_size, k
        self.structured = structured
        #: Token ids a prompt may name: the tokenizer's (the model's logit rows past it are padding).
        self.n_tokens = min(vocab_size, tokenizer.vocab_size)
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{printable(model, 100)}` does not exist.", param="model",
                           code="model_not_found")

    def check_ids(self, ids: Sequence[int], param: str, *, model_rows: bool = False) -> None:
        """Every id names a token of the tokenizer (prompt ids) or, with `model_rows`, a row of the model's logits:
        any id below the config's vocab_size, padding rows included, as vLLM validates logit_bias, stop_token_ids
        and logprob_token_ids. 400 naming the first id that does not and the size it is checked against."""
        n = self.vocab_size if model_rows else self.n_tokens
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            size = f"the model's vocabulary size is {n}" if model_rows else f"the vocabulary has {n} tokens"
            raise APIError(400, f"{param}: token id {bad} is out of range: {size} (ids 0 to {n - 1})", param=param)

    def check(self, req: p.ChatCompletionRequest | p.CompletionRequest, n_prompts: int = 1) -> None:
        """Checks shared by both endpoints: the model exists, the choices fit the queue, every choice's seed is
        in range, token ids name tokens, stream_options only with stream, no beam search, the logprobs asked for
        (`check_logprobs`). Logs the unknown fields."""
        log_ignored_fields(req)
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        if req.n * n_prompts > self.worker.max_queue:
            what = "n" if n_prompts == 1 else "n x the number of prompts"
            raise APIError(400, f"{what} must be <= {self.worker.max_queue} (the admission queue size)", param="n")
        if req.seed is not None and req.seed + req.n - 1 > p.SEED_MAX:
            raise APIError(400, f"seed + n - 1 must be <= {p.SEED_MAX} (choice i uses seed + i)", param="seed")
        self.check_ids(list(req.logit_bias_ids()), "logit_bias", model_rows=True)
        self.check_ids(req.stop_token_ids or [], "stop_token_ids", model_rows=True)
        for name, why in _BEAM_FIELDS.items():
            if getattr(req, name) != type(req).model_fields[name].default:  # asks for beam search
                raise APIError(400, f"{name}: {why}", param=name)
        self.check_logprobs(req)

    def check_logprobs(self, req: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """vLLM's logprobs rules: a count of -1 means the whole vocabulary, and no count may exceed --max-logprobs;
        chat's top_logprobs needs logprobs true; logprob_token_ids needs logprobs and names rows of the model's
        logits."""
        chat = isinstance(req, p.ChatCompletionRequest)
        param = "top_logprobs" if chat else "logprobs"
        if chat and not req.logprobs and req.top_logprobs is not None and req.top_logprobs != 0:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for name, value, what in ((param, req.num_logprobs, "sample"), ("prompt_logprobs", req.prompt_logprobs,
                                                                         "prompt")):
            n = self.logprob_count(value)
            if value == -1:  # the whole vocabulary: bounded by the response's size instead (`check_full_vocab`)
                continue
            if n is not None and n > self.max_logprobs:
                raise APIError(400, f"{name}: requested {what} logprobs of {n}, which is greater than max allowed: "
                                    f"{self.max_logprobs} (the server's --max-logprobs)", param=name)
        if req.logprob_token_ids is not None:
            if req.num_logprobs is None:
                raise APIError(400, f"logprob_token_ids needs {'logprobs: true' if chat else 'logprobs'}",
                               param="logprob_token_ids")
            self.check_ids(req.logprob_token_ids, "logprob_token_ids", model_rows=True)

    def check_full_vocab(self, req: p.ChatCompletionRequest | p.CompletionRequest, preps: list[_Prepared]) -> None:
        """-1 (vLLM's "the whole vocabulary") is answered whatever --max-logprobs says, as vLLM's own tests ask of a
        server (test_chat_echo reads len(top_logprobs) == vocab size), but never past FULL_VOCAB_LOGPROB_ENTRIES
        entries in one response: the prompt's tokens (prompt_logprobs) or max_tokens (logprobs) times the vocabulary,
        times n. Past it, a 400 that says what would fit, so one request cannot exhaust the server's memory."""
        param = "top_logprobs" if isinstance(req, p.ChatCompletionRequest) else "logprobs"
        for name, value, count in ((param, req.num_logprobs, max(pr.max_new_tokens for pr in preps) * req.n),
                                   ("prompt_logprobs", req.prompt_logprobs, max(len(pr.prompt_ids) for pr in preps))):
            if value != -1:
                continue
            entries = count * self.vocab_size
            if entries > FULL_VOCAB_LOGPROB_ENTRIES:
                what = "generated tokens (max_tokens x n)" if name == param else "prompt tokens"
                raise APIError(400, f"{name}: -1 asks for the whole vocabulary ({self.vocab_size} entries) at each of "
                                    f"{count} {what}: {entries} entries, more than the {FULL_VOCAB_LOGPROB_ENTRIES} "
                                    f"one response may carry; ask for fewer tokens or a count up to "
                                    f"{self.max_logprobs}", param=name)

    def logprob_count(self, n: int | None) -> int | None:
        """A request's logprobs count with -1 (vLLM's: the whole vocabulary) resolved."""
        return self.vocab_size if n == -1 else n

    def job_logprobs(self, req: p.ChatCompletionRequest | p.CompletionRequest) -> int | tuple[int, ...] | None:
        """What each job records per emitted token (`SpecSession`'s `logprobs`): nothing, the n most likely
        alternatives, or the logprobs of `logprob_token_ids` instead."""
        n = self.logprob_count(req.num_logprobs)
        return tuple(req.logprob_token_ids) if n is not None and req.logprob_token_ids else n

    def grammar_source(self, req: p.ChatCompletionRequest | p.CompletionRequest, **tools: Any) -> GrammarSource | None:
        """The grammar the request asks for (None: free output); 400 for a bad source or min_tokens with one."""
        try:
            src = source_from_request(response_format=req.response_format, structured_outputs=req.structured_outputs,
                                      **tools)
        except GrammarError as e:
            raise grammar_error(e) from None
        if src is not None and req.min_tokens:
            raise APIError(400, "min_tokens cannot be combined with a grammar (the grammar decides where the output "
                                "may end)", param="min_tokens")
        return src

    async def constraint(self, prep: _Prepared) -> Callable[[], SpecConstraint] | None:
        """Compile the prepared request's grammar off the event loop; a factory of per-choice constraints."""
        if prep.grammar is None:
            return None
        if self.structured is None:
            raise APIError(400, "structured outputs are not available on this server", param=prep.grammar.param)
        grammar = await self.structured.compile(prep.grammar)
        return await self.structured.constraint_factory(grammar, reasoning=prep.in_reasoning)

    def truncate(self, req: p.ChatCompletionRequest | p.CompletionRequest, ids: list[int]) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: keep N prompt tokens, the last N (`truncation_side` left, the default) or
        the first N (right); -1 keeps as many as the context leaves after the requested max tokens. 400 for an N
        below 1 or over that room."""
        n = req.truncate_prompt_tokens
        if n is None:
            return ids
        room = self.max_model_len - (req.max_new_tokens or 0)
        keep = room if n == -1 else n
        if not 1 <= keep <= room:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or 1 to {room} (the context, {self.max_model_len} "
                                f"tokens, less the requested max tokens), got {n}", param="truncate_prompt_tokens")
        return ids[:keep] if req.truncation_side == "right" else ids[-keep:]

    def default_max_tokens(self, req: p.ChatCompletionRequest | p.CompletionRequest) -> int | None:
        """The request's max tokens: its own value, else the generation config's max_new_tokens (a completions
        request's own default of 16 capped by it, as vLLM takes the smaller), else None (chat: the rest of the
        context)."""
        given = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
        if given or "max_tokens" not in self.defaults:
            return req.max_new_tokens
        default = int(self.defaults["max_tokens"])
        return default if req.max_new_tokens is None else min(req.max_new_tokens, default)

    def budget(self, prompt_ids: list[int], requested: int | None, *, param: str, prompt_param: str,
               min_tokens: int = 0, image_tokens: int = 0) -> _Prepared:
        """Check the prompt against the context; the completion budget is `requested` (the request field
        `param`) or, when None, all the context that is left. `image_tokens`: how many of the prompt's tokens are
        images' (said in the message)."""
        n = len(prompt_ids)
        of_images = f" ({image_tokens} of them for images)" if image_tokens else ""
        if n == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if requested is not None and requested <= 0:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
        if n >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {n} tokens{of_images}, leaving no room for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if requested is not None and n + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n + requested} tokens ({n} in the prompt{of_images}, {requested} for the "
                                f"completion).", param=param, code="context_length_exceeded")
        budget = requested if requested is not None else self.max_model_len - n
        if min_tokens > budget:
            raise APIError(400, f"min_tokens ({min_tokens}) must be <= {param} ({budget})", param="min_tokens")
        return _Prepared(prompt_ids, budget)

    async def start(self, req: p.ChatCompletionRequest | p.CompletionRequest, preps: list[_Prepared],
                    constraint: Callable[[], SpecConstraint] | None = None,
                    prompt_logprobs: int | None = None) -> Generation:
        """Submit n jobs per prompt: choice index = prompt index * n + i, choice i gets seed + i, `constraint()`
        makes each choice's own grammar state, and the first choice of each prompt computes its prompt
        logprobs when `prompt_logprobs` is set. Raises `APIError` 429/503."""
        self.check_full_vocab(req, preps)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent] = asyncio.Queue()
        sampling = req.to_sampling(self.defaults)
        logprobs = self.job_logprobs(req)
        eos = ([] if req.ignore_eos else list(self.tokenizer.eos_token_ids)) + list(req.stop_token_ids or [])
        stops = req.stop_strings()
        jobs, choices = [], []
        for prep in preps:
            for i in range(req.n):
                s = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
                index = len(jobs)
                jobs.append(Job(index, prep.prompt_ids, prep.max_new_tokens, s, eos, logprobs, loop, events,
                                constraint=constraint() if constraint is not None else None,
                                prompt_logprobs=prompt_logprobs if i == 0 else None, images=prep.images))
                choices.append(ChoiceState(index, self.tokenizer, prep.prompt_ids, stops,
                                           skip_special_tokens=req.skip_special_tokens and not prep.keep_special,
                                           include_stop=req.include_stop_str_in_output, stop_ids=frozenset(eos),
                                           reasoning=prep.in_reasoning))
        try:
            await self.admission.submit(jobs)  # with the requests that arrived with this one (server/admission.py)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Unavailable as e:
            raise APIError(503, str(e), code="unavailable") from None
        return Generation(jobs, choices, events, self.worker.metrics, sum(len(x.prompt_ids) for x in preps), req.n,
                          image_tokens=sum(x.image_tokens for x in preps))

    def usage(self, gen: Generation, prompt_tokens: int, final: bool = True) -> p.UsageInfo:
        """The request's usage (`final` False: the counts so far, without spec telemetry)."""
        completion = sum(len(c.token_ids) for c in gen.choices)
        spec = p.SpecUsage(**gen.telemetry().to_dict(self.k)) if self.k > 0 and final else None
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                           total_tokens=prompt_tokens + completion, spec=spec,
                           prompt_tokens_details=p.PromptTokensDetails(cached_tokens=gen.cached_tokens,
                                                                       image_tokens=gen.image_tokens or None))

    def token_text(self, tok: int, as_id: bool = False) -> str:
        """A token's text (`token_id:N` when `as_id`, vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{tok}" if as_id else self.tokenizer.decode([tok])

    def prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> p.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token {token id: (logprob, rank, text)} for the token itself and
        the top alternatives (None for the first token)."""
        if lps is None:
            return None
        out: p.PromptLogprobs = []
        for x in lps:
            if x is None:
                out.append(None)
                continue
            entry = {str(t): p.PromptLogprob(logprob=v, rank=r + 1, decoded_token=self.token_text(t))
                     for r, (t, v) in enumerate(x.top)}
            entry[str(x.token)] = p.PromptLogprob(logprob=x.logprob, rank=x.rank, decoded_token=self.token_text(x.token))
            out.append(entry)
        return out


def _content_text(content: str | list[p.ContentPart] | None) -> str:
    return content if isinstance(content, str) else "\n".join(part.text or "" for part in content or [])


#: vLLM's beam-search fields (a 400 naming the field when it asks for beam search), with why.
_BEAM_FIELDS = {"use_beam_search": "beam search is not supported", "length_penalty": "applies to beam search only, "
                "which is not supported (leave it at 1)", "early_stopping": "applies to beam search only, which is "
                                                                            "not supported"}
#: Chat fields nextn knows and cannot honour (each a 400 naming it), with why.
_CHAT_UNSUPPORTED = {"functions": "deprecated: use tools", "function_call": "deprecated: use tool_choice",
                     "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
                     "web_search_options": "web search is not supported"}


class ServingChat(OpenAIServing):
    """POST /v1/chat/completions: structured outputs and tool calls (`structured`), reasoning split."""

    def __init__(self, *, special_tokens_in_content: bool = False, images: ImageServing | None = None,
                 **kw: Any) -> None:
        """`special_tokens_in_content`: tokenize special-token text inside messages as control tokens (the
        --allow-special-tokens-in-content setting, for trusted callers); by default it is plain text. `images`: what
        the server does with image parts (None: every image is refused)."""
        super().__init__(**kw)
        self.special_tokens_in_content = special_tokens_in_content
        self.images = images

    async def create(self, req: p.ChatCompletionRequest) -> p.ChatCompletionResponse | SSEStream:
        """Validate, compile the request's grammar (off the event loop), submit, and return the full response,
        or an `SSEStream` when `req.stream`. Raises `APIError` for anything the client got wrong and for
        429/503/500."""
        prep, gen = await self.submit(req)
        rid = p.random_id("chatcmpl")
        if req.stream:
            return SSEStream(self._stream(req, rid, gen, prep), gen.cancel)
        return await self._full(req, rid, gen, prep)

    async def submit(self, req: p.ChatCompletionRequest) -> tuple[_Prepared, Generation]:
        """Prepare (in a thread), load the images (on the media threads) and expand their pads (in a thread), compile
        the grammar, submit the jobs."""
        prep = await asyncio.to_thread(self._prepare, req)
        if prep.image_refs:
            assert self.images is not None and prep.image_config is not None
            decoded = await self.images.load(prep.image_refs)
            await asyncio.to_thread(self._add_images, req, prep, decoded)
        constraint = await self.constraint(prep)
        n = self.logprob_count(req.prompt_logprobs)
        return prep, await self.start(req, [prep], constraint, prompt_logprobs=n)

    def _prepare(self, req: p.ChatCompletionRequest) -> _Prepared:
        """Checks, the grammar source, chat template and tokenization (runs in a worker thread)."""
        self.check(req)
        for name, why in _CHAT_UNSUPPORTED.items():
            if getattr(req, name) is not None:
                raise APIError(400, f"{name}: {why}", param=name)
        if req.modalities is not None and req.modalities != ["text"]:
            raise APIError(400, 'modalities: only ["text"] is supported', param="modalities")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")
        src = self.grammar_source(req, tools=req.tools, tool_choice=req.tool_choice,
                                  parallel_tool_calls=req.parallel_tool_calls)
        messages, refs = self.chat_messages(req.messages)
        cfg = self._image_config(req, refs) if refs else None
        ids = self.render_chat(messages, req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs,
                               reasoning_effort=req.reasoning_effort)
        if cfg is not None:
            ImageServing.check_pads(ids, refs, cfg)
        prep = self._budget(req, self.truncate(req, ids))  # with images: a first check, one pad per image
        prep.image_refs, prep.image_config = refs, cfg
        prep.grammar = src
        prep.in_reasoning = opens_reasoning(self.tokenizer, prep.prompt_ids)
        prep.keep_special = self.parses_tools(req) and tool_tags_are_special(self.tokenizer)
        last = req.messages[-1]
        if req.echo and last.role == ("assistant" if req.add_generation_prompt else last.role):
            prep.echo = _content_text(last.content)
        return prep

    def _budget(self, req: p.ChatCompletionRequest, ids: list[int], image_tokens: int = 0) -> _Prepared:
        return self.budget(ids, self.default_max_tokens(req), prompt_param="messages", min_tokens=req.min_tokens,
                           param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                           image_tokens=image_tokens)

    def _image_config(self, req: p.ChatCompletionRequest, refs: list[ImageRef]) -> ImageConfig:
        """The image config of a request with images (400 when the server takes none, over the limit, bad
        mm_processor_kwargs, or with truncate_prompt_tokens, which could cut an image's pads apart)."""
        if self.images is None:
            raise APIError(400, f"{refs[0].param}: this server does not take images", param=refs[0].param)
        cfg = self.images.check(refs, req.mm_processor_kwargs)
        if req.truncate_prompt_tokens is not None:
            raise APIError(400, "truncate_prompt_tokens cannot be combined with images", param="truncate_prompt_tokens")
        return cfg

    def _add_images(self, req: p.ChatCompletionRequest, prep: _Prepared, decoded: list[Any]) -> None:
        """The loaded images resized (`ImageInput`s), their pads expanded in the prompt, the budget checked again
        on the expanded prompt (runs in a worker thread)."""
        assert self.images is not None and prep.image_config is not None
        images = self.images.inputs(decoded, prep.image_config, prep.image_refs)
        ids = self.images.expand(prep.prompt_ids, images, prep.image_config)
        checked = self._budget(req, ids, image_tokens=sum(x.n_tokens for x in images))
        prep.prompt_ids, prep.max_new_tokens, prep.images = checked.prompt_ids, checked.max_new_tokens, images

    def chat_prompt_ids(self, msgs: list[p.ChatMessage], *, tools: list[dict[str, Any]] | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        kwargs: dict[str, Any] | None = None, reasoning_effort: str | None = None) -> list[int]:
        """The chat template's prompt ids of text-only messages (400 for content that cannot be served, an image
        part included, or a template error)."""
        messages, refs = self.chat_messages(msgs)
        if refs:
            raise APIError(400, f"{refs[0].param}: /tokenize does not take image parts (their token counts depend on "
                                "the images; usage.prompt_tokens of a chat completion counts them)",
                           param=refs[0].param)
        return self.render_chat(messages, msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, kwargs=kwargs,
                                reasoning_effort=reasoning_effort)

    @staticmethod
    def chat_messages(msgs: list[p.ChatMessage]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
        """The messages as the chat template takes them, and their image parts in order (each one
        `{"type": "image"}` part in its message); 400 for content that cannot be served (`message_content`)."""
        messages: list[dict[str, Any]] = []
        refs: list[ImageRef] = []
        for i, m in enumerate(msgs):
            content: Any = m.content
            if isinstance(content, list):
                content = message_content(content, i, m.role, refs)
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            messages.append({"role": role, "content": content, "name": m.name, "tool_calls": m.tool_calls,
                             "tool_call_id": m.tool_call_id})
        return messages, refs

    def render_chat(self, messages: list[dict[str, Any]], msgs: list[p.ChatMessage], *,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                    reasoning_effort: str | None = None) -> list[int]:
        """`chat_messages`' output through the chat template to token ids, one image pad per image part (400 for a
        template error; `msgs`, the request's messages, name the param)."""
        thinking = (kwargs or {}).get("enable_thinking")
        if thinking is None and reasoning_effort == "none":
            thinking = False
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                              enable_thinking=thinking, continue_final_message=continue_final_message,
                                              special_tokens_in_content=self.special_tokens_in_content)
        except ValueError as e:  # the template's message; a role of its own that it names is the param
            odd = next((i for i, m in enumerate(msgs) if m.role not in p.OPENAI_ROLES and m.role in str(e)), None)
            param = "messages" if odd is None else f"messages.{odd}.role"
            raise APIError(400, printable(e, 500), param=param) from None

    @staticmethod
    def parses_tools(req: p.ChatCompletionRequest) -> bool:
        """Tool calls are parsed out of the output: tools are offered and tool_choice is not "none"."""
        return bool(req.tools) and req.tool_choice != "none"

    def output(self, req: p.ChatCompletionRequest, prep: _Prepared) -> ChatOutput:
        """A choice's output chain: reasoning split; tool-call parsing when tools are offered."""
        tools = req.tools if self.parses_tools(req) else None
        return ChatOutput(in_reasoning=prep.in_reasoning, tools=tools, parallel=req.parallel_tool_calls is not False)

    @staticmethod
    def finish_reason(reason: str | None, out: ChatOutput) -> str | None:
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

    def _logprobs(self, req: p.ChatCompletionRequest, lps: list[TokenLogprob]) -> p.ChatChoiceLogprobs:
        as_id = req.return_tokens_as_token_ids

        def entry(tok: int, lp: float) -> p.TopLogprob:
            text = self.token_text(tok, as_id)
            return p.TopLogprob(token=text, logprob=lp, bytes=list(self.token_text(tok).encode()))

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
            out = self.output(req, prep)
            out.push(c.text)
            out.finish()
            calls = [p.ToolCall(id=t.id, function=p.FunctionCall(name=t.name, arguments=t.arguments))
                     for t in out.calls]
            content = prep.echo + out.content
            message = p.ChatResponseMessage(content=content or (None if calls or out.reasoning else ""),
                                            reasoning_content=out.reasoning or None, tool_calls=calls)
            choices.append(p.ChatCompletionChoice(
                index=c.index, message=message, logprobs=self._logprobs(req, c.logprobs) if req.logprobs else None,
                finish_reason=self.finish_reason(c.finish_reason, out),
                token_ids=c.token_ids if req.return_token_ids else None))
        return p.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                        usage=self.usage(gen, len(prep.prompt_ids)),
                                        prompt_token_ids=prep.prompt_ids if req.return_token_ids else None,
                                        prompt_logprobs=self.prompt_logprobs(gen.choices[0].prompt_logprobs))

    async def _stream(self, req: p.ChatCompletionRequest, rid: str, gen: Generation,
                      prep: _Prepared) -> AsyncIterator[str]:
        created = int(time.time())
        outs = [self.output(req, prep) for _ in range(req.n)]
        n_prompt = len(prep.prompt_ids)

        def chunk(choices: list[p.ChatCompletionStreamChoice], **kw: Any) -> str:
            if req.continuous_usage and choices:
                kw["usage"] = self.usage(gen, n_prompt, final=False)
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, **kw))

        try:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant",
                                                                                     content=prep.echo))
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
                    lps = self._logprobs(req, d.logprobs) if req.logprobs and d.logprobs else None
                    ids = d.token_ids if req.return_token_ids else None
                    if delta.content or delta.reasoning_content or delta.tool_calls or d.finish_reason or lps or ids:
                        yield chunk([p.ChatCompletionStreamChoice(
                            index=d.index, delta=delta, logprobs=lps, token_ids=ids,
                            finish_reason=self.finish_reason(d.finish_reason, out))])
            if req.include_usage:
                yield chunk([], usage=self.usage(gen, n_prompt))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield sse(internal_error("chat stream failed", e).body())
        yield sse("[DONE]")

    # -------------------------------------------------------------------- vLLM's /tokenize, /detokenize

    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        """Token ids of a prompt (tokenizer.encode) or of chat messages (the chat template), vLLM's shapes."""
        log_ignored_fields(req)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                               param="continue_final_message")
            ids = self.chat_prompt_ids(req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       kwargs=req.chat_template_kwargs)
        else:
            ids = self.tokenizer.encode(req.prompt or "", add_special_tokens=bool(req.add_special_tokens
                                                                                  is not False))
        strs = [self.token_text(t) for t in ids] if req.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        log_ignored_fields(req)
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


class ServingCompletion(OpenAIServing):
    """POST /v1/completions: one or more prompts (text or token ids), n choices each."""

    async def create(self, req: p.CompletionRequest) -> p.CompletionResponse | SSEStream:
        """Validate, submit and return the full response, or an `SSEStream` when `req.stream`.
        Raises `APIError` for anything the client got wrong and for 429/503/500."""
        preps = await asyncio.to_thread(self._prepare, req)
        constraint = await self.constraint(preps[0])
        want = [x for x in (req.prompt_logprobs, req.logprobs if req.echo else None) if x is not None]
        gen = await self.start(req, preps, constraint,
                               prompt_logprobs=max(map(self.logprob_count, want)) if want else None)
        rid = p.random_id("cmpl")
        if req.stream:
            return SSEStream(self._stream(req, rid, gen, preps), gen.cancel)
        return await self._full(req, rid, gen, preps)

    def _prepare(self, req: p.CompletionRequest) -> list[_Prepared]:
        """Checks and tokenization (runs in a worker thread)."""
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            else [req.prompt]
        if len(prompts) > p.MAX_PROMPTS:
            raise APIError(400, f"at most {p.MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        self.check(req, n_prompts=len(prompts))
        if req.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (no server-side ranking of choices)", param="best_of")
        src = self.grammar_source(req)
        preps = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            ids = self.truncate(req, self._prompt_ids(prompt, where))  # type: ignore[arg-type]
            prep = self.budget(ids, self.default_max_tokens(req), param="max_tokens", prompt_param=where,
                               min_tokens=req.min_tokens)
            prep.grammar = src  # completions are raw text: no reasoning phase
            if req.echo:
                prep.echo = prompt if isinstance(prompt, str) and req.truncate_prompt_tokens is None \
                    else self.tokenizer.decode(prep.prompt_ids)
            preps.append(prep)
        return preps

    def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        self.check_ids(prompt, param)
        return list(prompt)

    def _logprobs(self, req: p.CompletionRequest, entries: Sequence[tuple[int, TokenLogprob | None]],
                  offset: int, n_top: int | None) -> p.CompletionLogprobs:
        """Completions logprobs of (token, logprob) entries starting at text `offset`: each token's text, logprob
        and its first `n_top` alternatives (None: all), the token itself always among them (so logprobs 0 gives
        its entry); None entries (the first echoed prompt token) are null."""
        as_id = req.return_tokens_as_token_ids
        out = p.CompletionLogprobs()
        for tok, x in entries:
            text = self.token_text(tok, as_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(self.token_text(tok))
            if x is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(x.logprob)
            top = {self.token_text(t, as_id): v for t, v in x.top[:n_top]}
            top.setdefault(text, x.logprob)
            out.top_logprobs.append(top)
        return out

    def _echo_logprobs(self, req: p.CompletionRequest, gen: Generation, prep: _Prepared,
                       index: int) -> p.CompletionLogprobs | None:
        first = gen.choices[index - index % req.n]  # the prompt's first choice computed its prompt logprobs
        if not (req.echo and req.logprobs is not None and first.prompt_logprobs is not None):
            return None
        return self._logprobs(req, list(zip(prep.prompt_ids, first.prompt_logprobs)), 0,
                              self.logprob_count(req.logprobs))

    def _choice(self, req: p.CompletionRequest, gen: Generation, prep: _Prepared, c: ChoiceState | Delta,
                text: str, offset: int, head: bool,
                cls: type[p.CompletionChoice] = p.CompletionChoice) -> p.CompletionChoice:
        """One choice (or, `cls` CompletionStreamChoice, a streamed piece); `head`: the first piece of the choice
        (echo, prompt ids and prompt logprobs go with it)."""
        logprobs = None
        if req.logprobs is not None:
            n_top = None if req.logprob_token_ids else self.logprob_count(req.logprobs)  # (the listed ids: all)
            logprobs = self._logprobs(req, [(x.token, x) for x in c.logprobs], offset + (len(prep.echo) if head else 0),
                                      n_top)
            echo = self._echo_logprobs(req, gen, prep, c.index) if head else None
            if echo is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    setattr(logprobs, name, getattr(echo, name) + getattr(logprobs, name))
        first = gen.choices[c.index - c.index % req.n]
        return cls(
            index=c.index, text=(prep.echo if head else "") + text, finish_reason=c.finish_reason, logprobs=logprobs,
            prompt_token_ids=prep.prompt_ids if req.return_token_ids and head else None,
            token_ids=c.token_ids if req.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs(first.prompt_logprobs) if head and req.prompt_logprobs is not None
            else None)

    async def _full(self, req: p.CompletionRequest, rid: str, gen: Generation,
                    preps: list[_Prepared]) -> p.CompletionResponse:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for _ in deltas:
                pass
        choices = [self._choice(req, gen, preps[c.index // req.n], c, c.text, 0, True) for c in gen.choices]
        return p.CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                    usage=self.usage(gen, sum(len(x.prompt_ids) for x in preps)))

    async def _stream(self, req: p.CompletionRequest, rid: str, gen: Generation,
                      preps: list[_Prepared]) -> AsyncIterator[str]:
        head = p.CompletionChunk(id=rid, model=self.model_name, choices=[])
        n_choices = len(gen.choices)
        offsets = [0] * n_choices
        started = [False] * n_choices
        n_prompt = sum(len(x.prompt_ids) for x in preps)
        try:
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    prep = preps[d.index // req.n]
                    first = not started[d.index]
                    started[d.index] = True
                    choice = self._choice(req, gen, prep, d, d.text, offsets[d.index], first, p.CompletionStreamChoice)
                    offsets[d.index] += len(choice.text)
                    usage = self.usage(gen, n_prompt, final=False) if req.continuous_usage else None
                    yield sse(head.model_copy(update={"choices": [choice], "usage": usage}))
            if req.include_usage:
                yield sse(head.model_copy(update={"usage": self.usage(gen, n_prompt)}))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            yield sse(internal_error("completion stream failed", e).body())
        yield sse("[DONE]")
