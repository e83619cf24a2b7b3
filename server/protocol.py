"""OpenAI API shapes (pydantic): requests, responses, stream chunks, usage and errors.

Mirrors openai-python's types (`reference/serving-anchors.md` §4), fields in the official order. Requests
allow unknown fields; the server ignores them and logs one line naming them (`ignored_fields`).
Server extras that are not OpenAI fields (vLLM's spelling) are fenced under "nextn extras" below each
request and documented with `Field(description=...)`. Every request is bounded (the constants below: stop
strings, messages, fields per object, seed range); the bounds appear in the OpenAPI schema too.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator

from engine.spec import SpecSampling

#: `top_logprobs` / completions `logprobs` upper bound (OpenAI's own limit is 20).
MAX_TOP_LOGPROBS = 20
#: Stop strings per request (OpenAI allows 4; vLLM does not bound them) and characters per stop string.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: Messages per chat request (OpenAI's own bound) and content parts per message.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048
#: Keys per JSON object of a request, known and unknown fields together (bounds the work and the log
#: line that unknown fields cost).
MAX_OBJECT_FIELDS = 128
#: `seed` range: what the engine's generator takes (torch's); choice i of n uses seed + i, so
#: seed + n - 1 must stay in range too (checked by the server, param "seed").
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _omit_none(v: Any) -> bool:
    return v is None


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f9c...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _is_token_id(v: Any) -> bool:
    return type(v) is int  # JSON true/false are not token ids


def _check_prompt(v: Any) -> Any:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and (all(map(_is_token_id, v)) or all(isinstance(x, str) for x in v)
                                or all(isinstance(x, list) and all(map(_is_token_id, x)) for x in v)):
        return v
    raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) or a list of "
                     "lists of token ids")


def _check_stop(v: Any) -> Any:
    stops = [v] if isinstance(v, str) else v if v is not None else []
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
    return v


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
#: `prompt`: text, texts (one supported), token ids, or lists of token ids; JSON booleans are not token ids.
Prompt = Annotated[str | list[int] | list[str] | list[list[int]], PlainValidator(_check_prompt), WithJsonSchema({
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, _TOKEN_IDS,
              {"type": "array", "items": _TOKEN_IDS}]})]
_STOP = {"type": "string", "maxLength": MAX_STOP_CHARS}
#: `stop`: one string or a list, bounded by MAX_STOP_STRINGS x MAX_STOP_CHARS.
Stop = Annotated[str | list[str] | None, PlainValidator(_check_stop), WithJsonSchema({
    "anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]})]


class OpenAIBaseModel(BaseModel):
    """Request base: unknown fields are kept (so they can be named in a log line) and otherwise ignored;
    an object with more than MAX_OBJECT_FIELDS keys is rejected before its fields are validated."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _bounded_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > MAX_OBJECT_FIELDS:
            raise ValueError(f"an object may have at most {MAX_OBJECT_FIELDS} fields, got {len(data)}")
        return data

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of every unknown field, here and in nested request models."""
        out = [prefix + k for k in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, OpenAIBaseModel):
                    sub = f"{name}.{i}." if isinstance(value, list) else f"{name}."
                    out += item.ignored_fields(prefix + sub)
        return out


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ContentPart(OpenAIBaseModel):
    """One part of a list-valued message `content`; only ``text`` parts can be served (checked later)."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["developer", "system", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by both endpoints, with their OpenAI defaults and ranges."""

    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    user: str | None = None
    # --- nextn extras (vLLM's names) ---
    top_k: int = Field(0, ge=-1, description="sample from the k most likely tokens; 0 or -1 = all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p * the top probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="CTRL-style penalty; 1 = off")
    ignore_eos: bool = Field(False, description="keep generating past EOS until max_tokens")
    return_token_ids: bool = Field(False, description="also return prompt_token_ids and token_ids (vLLM)")

    def to_sampling(self) -> SpecSampling:
        """The engine's sampling parameters (temperature 0 is the exact greedy path)."""
        return SpecSampling(temperature=self.temperature, seed=self.seed, top_k=max(self.top_k, 0),
                            top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty)

    def stop_strings(self) -> list[str]:
        """`stop` as a list without empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str
    logprobs: bool = False
    max_completion_tokens: int | None = None
    max_tokens: int | None = Field(None, description="deprecated alias of max_completion_tokens")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per choice")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema {name, schema, strict}: the output is constrained to it")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (default with tools: calls are parsed from the output), "required" or '
                          '{"type": "function", "function": {"name": ...}} (the output is constrained to calls)')
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_OBJECT_FIELDS,
                                               description="function tools (rendered into the prompt)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # --- nextn extras ---
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=MAX_OBJECT_FIELDS,
        description="template switches; `enable_thinking` (bool) is passed to the chat template")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint: exactly one of json (a schema), regex, grammar (lark), choice (a list "
                          "of strings) or json_object (true); disable_any_whitespace, whitespace_pattern")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def ignored_fields(self, prefix: str = "") -> list[str]:
        kwargs = self.chat_template_kwargs or {}
        return super().ignored_fields(prefix) + [f"chat_template_kwargs.{k}" for k in kwargs if k != "enable_thinking"]

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives to record per token (None = logprobs off)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    model: str
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = 16

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------------------------------------- responses


class SpecUsage(BaseModel):
    """Speculative-decoding telemetry of one request (all its choices); nextn extra in `usage`."""

    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted)")
    pos_drafted: list[int] = Field(description="per draft position j < K: rounds that drafted position j")
    pos_accepted: list[int] = Field(description="per draft position j < K: rounds that accepted position j")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec: SpecUsage | None = Field(None, exclude_if=_omit_none, description="absent when speculation is off")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


#: Why a choice ended: a stop condition (EOS, stop string or token, a complete grammar), the token budget,
#: or a finished tool call.
FinishReason = Literal["stop", "length", "tool_calls"]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = Field(
        None, exclude_if=_omit_none, description="the text between <think> and </think> (vLLM's name)")


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_omit_none)
    arguments: str | None = Field(None, exclude_if=_omit_none)


class DeltaToolCall(BaseModel):
    """A tool-call fragment: the first of a call carries id, type and name; later ones argument text."""

    index: int
    id: str | None = Field(None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nextn"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

