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
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, StrictInt, StringConstraints,
                      WithJsonSchema, model_validator)

from engine.spec import SpecSampling

#: `logprob_token_ids` per request (vLLM's MAX_LOGPROB_TOKEN_IDS). How many logprobs a request may ask for is the
#: server's --max-logprobs, checked by the server.
MAX_LOGPROB_TOKEN_IDS = 128
#: Characters of a chat message's `role` (any role the chat template renders), and OpenAI's own roles.
MAX_ROLE_CHARS = 64
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")
#: Stop strings per request (OpenAI allows 4; vLLM does not bound them) and characters per stop string.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: Messages per chat request (OpenAI's own bound) and content parts per message.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048
#: Keys per JSON object of a request, known and unknown fields together (bounds the work and the log
#: line that unknown fields cost).
MAX_OBJECT_FIELDS = 128
#: `seed` range: a signed 64-bit integer (OpenAI's and vLLM's type); choice i of n uses seed + i, so
#: seed + n - 1 must stay in range too (checked by the server, param "seed").
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: `logit_bias` entries per request, and the bias range (OpenAI's).
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0
#: `stop_token_ids` per request.
MAX_STOP_TOKEN_IDS = 64
#: Prompts per completions request (each gets n choices; all choices together must fit the queue).
MAX_PROMPTS = 128


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


def _check_model_name(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("model must be a string")
    return v


#: A request's `model`: optional as in vLLM (absent: the served model), a string when given (null is a 400).
ModelName = Annotated[str | None, PlainValidator(_check_model_name), WithJsonSchema({"type": "string"})]
_MODEL_DOC = "the served model's name or an alias; optional, as in vLLM (absent: the served model)"

#: Strings a lax boolean accepts (vLLM's pydantic models validate laxly, so `"logprobs": "true"` is true there);
#: every other string is a 400, and so is a number.
LAX_BOOL_STRINGS = {"true": True, "True": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
                    "false": False, "False": False, "f": False, "no": False, "n": False, "off": False, "0": False}


def _lax_bool(v: Any) -> Any:
    return LAX_BOOL_STRINGS.get(v, v) if isinstance(v, str) else v


#: A boolean that also takes vLLM's lax strings ("true", "false", "1", "0", "yes", ...).
LaxBool = Annotated[bool, BeforeValidator(_lax_bool), WithJsonSchema({"anyOf": [
    {"type": "boolean"}, {"type": "string", "enum": list(LAX_BOOL_STRINGS)}]})]

#: A `logit_bias` key: a token id written as a JSON object key (decimal digits; OpenAI's and vLLM's form).
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
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
    """Only valid with `stream: true` (400 otherwise)."""

    include_usage: bool | None = Field(False, description="a last chunk with `usage` (and `choices: []`)")
    include_obfuscation: bool | None = Field(None, description="accepted; nextn never pads chunks")
    continuous_usage_stats: bool | None = Field(
        False, description="vLLM: with include_usage, every chunk carries the usage so far")


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ImageURL(OpenAIBaseModel):
    url: str = Field(description="a data: URL (base64), an http(s) URL, or file:// under --allowed-local-media-path")
    detail: str | None = Field(None, description="accepted (auto, low, high); the image is sized by the pixel bounds "
                                                 "(mm_processor_kwargs), not by detail")


class ContentPart(OpenAIBaseModel):
    """One part of a list-valued message `content`: ``text``, or ``image_url`` (``input_image`` from the Responses
    API); ``video_url`` is refused (not supported yet), as is any other type (checked later)."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = Field(None, description="image_url parts: {url, detail}; input_image parts: "
                                                              "the URL")
    detail: str | None = Field(None, description="input_image parts: accepted (as image_url.detail)")
    file_id: str | None = Field(None, description="input_image parts by file id: not supported (400: no Files API)")
    video_url: dict[str, Any] | None = Field(None, description="not supported yet (400)")


class ChatMessage(OpenAIBaseModel):
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS,
                      description="system, developer (= system), user, assistant, tool, or any other role the chat "
                                  "template renders (vLLM's behaviour; the template refuses what it cannot render)")
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
    user: str | None = Field(None, description="accepted; no effect")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=LOGIT_BIAS_MIN, le=LOGIT_BIAS_MAX)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (a decimal string, as JSON keys are) -> bias added "
                                                      "to its logit before sampling (-100 bans the token); ids must "
                                                      "be in the vocabulary")
    # --- nextn extras (vLLM's names) ---
    top_k: int = Field(0, ge=-1, description="sample from the k most likely tokens; 0 or -1 = all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p * the top probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="CTRL-style penalty; 1 = off")
    ignore_eos: bool = Field(False, description="keep generating past EOS until max_tokens")
    return_token_ids: bool = Field(False, description="also return prompt_token_ids and token_ids (vLLM)")
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids cannot end the output before this many "
                                                 "tokens (at most max_tokens)")
    stop_token_ids: list[StrictInt] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="token ids that end a choice like EOS (finish_reason stop)")
    prompt_logprobs: int | None = Field(
        None, ge=-1, description="logprobs of every prompt token plus this many alternatives (-1: the whole "
                                 "vocabulary; at most --max-logprobs; computed during prefill; not with stream)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep only N prompt tokens (truncation_side says which); -1: as many as the context "
                                 "leaves after the requested max tokens")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="with truncate_prompt_tokens: left (the default) keeps the last N tokens, right the first N")
    logprob_token_ids: list[StrictInt] | None = Field(
        None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS,
        description="with logprobs: the logprobs of these token ids at each generated position, instead of the most "
                    "likely alternatives")
    return_tokens_as_token_ids: bool = Field(
        False, description="logprobs name tokens as `token_id:N` (for tokens that are not valid UTF-8 alone)")
    skip_special_tokens: bool = Field(True, description="drop special tokens from the output text")
    include_stop_str_in_output: bool = Field(False, description="keep the matched stop string in the text")
    # --- vLLM's beam search: not supported, a 400 naming the field ---
    use_beam_search: bool = Field(False, description="beam search is not supported (400 when true)")
    length_penalty: float = Field(1.0, description="beam search only: 400 unless 1")
    early_stopping: bool = Field(False, description="beam search only: 400 when true")

    def to_sampling(self, defaults: Mapping[str, float | int] | None = None) -> SpecSampling:
        """The engine's sampling parameters (temperature 0 is the exact greedy path). `defaults` (the checkpoint's
        generation config, by field name) fill temperature, top_p, top_k, min_p and repetition_penalty where the
        request left them unset; a value the request gave always wins."""
        def pick(name: str) -> Any:
            if defaults is None or name in self.model_fields_set or name not in defaults:
                return getattr(self, name)
            return defaults[name]

        return SpecSampling(temperature=pick("temperature"), seed=self.seed, top_k=max(int(pick("top_k")), 0),
                            top_p=pick("top_p"), min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
                            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                            logit_bias=tuple(sorted(self.logit_bias_ids().items())), min_tokens=self.min_tokens)

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by token id."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def stop_strings(self) -> list[str]:
        """`stop` as a list without empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage on every chunk (needs include_usage too)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: ModelName = Field(None, description=_MODEL_DOC)
    logprobs: LaxBool = Field(False, description='also accepts vLLM\'s lax strings ("true", "false", "1", "0", ...)')
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
    top_logprobs: int | None = Field(None, ge=-1, description="alternatives per token, with logprobs true (-1: the "
                                                              "whole vocabulary; at most --max-logprobs)")
    # --- nextn extras ---
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=MAX_OBJECT_FIELDS,
        description="template switches; `enable_thinking` (bool) is passed to the chat template")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint: exactly one of json (a schema), regex, grammar (lark), choice (a list "
                          "of strings) or json_object (true); disable_any_whitespace, whitespace_pattern")
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, max_length=MAX_OBJECT_FIELDS,
        description="vLLM's: this request's image pixel bounds, {min_pixels, max_pixels} (or size {shortest_edge, "
                    "longest_edge}), over the server's --mm-processor-kwargs")
    echo: bool = Field(False, description="vLLM: start the output with the last message's content when its role "
                                          "is the reply's (continue_final_message)")
    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(
        False, description="vLLM: leave the last (assistant) message open and continue it; needs "
                           "add_generation_prompt false")
    # --- OpenAI fields accepted without effect (no state is kept; nothing is routed) ---
    metadata: dict[str, Any] | None = Field(None, description="accepted; no effect")
    store: bool | None = Field(None, description="accepted; nothing is stored")
    service_tier: str | None = Field(None, description="accepted; no effect")
    safety_identifier: str | None = Field(None, description="accepted; no effect")
    prompt_cache_key: str | None = Field(None, description="accepted; no effect")
    reasoning_effort: str | None = Field(
        None, description='"none" turns thinking off (as enable_thinking false); other values leave it on')
    # --- OpenAI fields nextn cannot honour: 400 when given (param names them) ---
    functions: list[dict[str, Any]] | None = Field(None, description="deprecated: use tools (400)")
    function_call: str | dict[str, Any] | None = Field(None, description="deprecated: use tool_choice (400)")
    audio: dict[str, Any] | None = Field(None, description="not supported (400)")
    modalities: list[str] | None = Field(None, description='only ["text"]')
    prediction: dict[str, Any] | None = Field(None, description="not supported (400)")
    web_search_options: dict[str, Any] | None = Field(None, description="not supported (400)")

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
    model: ModelName = Field(None, description=_MODEL_DOC)
    prompt: Prompt
    echo: bool = Field(False, description="the text starts with the prompt (and logprobs cover its tokens)")
    logprobs: int | None = Field(None, ge=-1, description="alternatives per token (-1: the whole vocabulary; at most "
                                                          "--max-logprobs)")
    max_tokens: int | None = 16
    best_of: int | None = Field(None, ge=1, description="only best_of == n (no server-side ranking)")
    suffix: str | None = Field(None, description="not supported (400 when non-empty)")
    response_format: ResponseFormat | None = Field(
        None, description="vLLM: text, json_object or json_schema; the text is constrained to it")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint (as in chat): json, regex, grammar, choice or json_object")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API), text and images in, text out. `input` is a string or a list of
    message items ({role, content} with content a string or input_text / input_image parts; `type: "message"`
    optional);
    `instructions` becomes the system message. Options that need state or tools nextn does not have are a 400."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1.0")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: dict[str, Any] | None = Field(None, description="text.format: text, json_object or json_schema {name, "
                                                          "schema, strict} (constrained as in chat)")
    reasoning: dict[str, Any] | None = Field(None, description='reasoning.effort "none" turns thinking off')
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, description='only "none"/"auto" without tools')
    tools: list[dict[str, Any]] | None = Field(None, description="not supported (400 when non-empty)")
    truncation: str | None = Field(None, description='only "disabled"')
    store: bool | None = Field(None, description="accepted; nothing is stored (no GET /v1/responses/{id})")
    metadata: dict[str, Any] | None = Field(None, description="accepted; echoed")
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    previous_response_id: str | None = Field(None, description="not supported (400)")
    conversation: str | dict[str, Any] | None = Field(None, description="not supported (400)")
    background: bool | None = Field(None, description="only false")
    include: list[str] | None = Field(None, description="not supported (400 when non-empty)")
    max_tool_calls: int | None = None
    top_logprobs: int | None = Field(None, description="not supported (400 when > 0)")
    prompt: dict[str, Any] | None = Field(None, description="prompt templates: not supported (400)")
    # --- nextn extras (as in chat) ---
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_OBJECT_FIELDS)


# --------------------------------------------------------------------------------------------- responses


class SpecUsage(BaseModel):
    """Speculative-decoding telemetry of one request (all its choices); nextn extra in `usage`."""

    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted)")
    pos_drafted: list[int] = Field(description="per draft position j < K: rounds that drafted position j")
    pos_accepted: list[int] = Field(description="per draft position j < K: rounds that accepted position j")
    mean_k: float = Field(0.0, description="mean draft tokens asked for per round (the speculation controller's k; "
                                           "0 = plain steps)")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens resumed from the exact prefix cache instead of prefilled "
                                              "(whole 256-token grid blocks; the answer's bits are a miss's)")
    image_tokens: int | None = Field(None, exclude_if=_omit_none,
                                     description="prompt tokens that are images' embeddings (absent without images)")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    spec: SpecUsage | None = Field(None, exclude_if=_omit_none, description="absent when speculation is off")


class PromptLogprob(BaseModel):
    """vLLM's prompt logprob entry (keys of the enclosing dict are token ids)."""

    logprob: float
    rank: int | None = Field(None, description="1 = the most likely token")
    decoded_token: str


#: `prompt_logprobs`: None for the first prompt token, then per token {token id: entry} for the token itself
#: and the `prompt_logprobs` most likely alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


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
    annotations: list[Any] | None = Field(None, description="always null (no web search)")
    audio: dict[str, Any] | None = Field(None, description="always null (no audio output)")
    function_call: FunctionCall | None = Field(None, description="always null (deprecated; see tool_calls)")
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = Field(
        None, exclude_if=_omit_none, description="the text between <think> and </think> (vLLM's name)")


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(None, description="vLLM's: the choice's token ids (return_token_ids; else "
                                                          "null)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    metadata: dict[str, str] | None = Field(None, description="always null (nothing is stored)")
    moderation: dict[str, Any] | None = Field(None, description="always null")
    service_tier: str | None = Field(None, description="always null (no tiers)")
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's: the prompt's token ids (return_token_ids; "
                                                                 "else null)")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's (prompt_logprobs; else null)")


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
    """With echo the first prompt token's entries are null (nothing predicts it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """vLLM's extras are present as null when not asked for (a client reading the attribute gets None)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's: the prompt's token ids (return_token_ids; "
                                                                 "else null)")
    token_ids: list[int] | None = Field(None, description="vLLM's: the choice's token ids (return_token_ids; else "
                                                          "null)")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's (prompt_logprobs; else null)")


class CompletionStreamChoice(CompletionChoice):
    """A streamed piece of a choice: vLLM's extras only when there is something to send (as vLLM's stream)."""

    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    system_fingerprint: str | None = None


class CompletionChunk(CompletionResponse):
    """One event of a streamed completion: a piece of one choice, or (`choices: []`) the usage."""

    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


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


class VersionResponse(BaseModel):
    version: str


class ServerLoadResponse(BaseModel):
    """vLLM's GET /load."""

    server_load: int = Field(description="generation requests in flight (/v1/chat/completions, /v1/completions, "
                                         "/v1/responses, /invocations): from their body's arrival until their "
                                         "response is done")


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: a completions-style `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = Field(None, description="prompt: true by default; messages: false")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_OBJECT_FIELDS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_OBJECT_FIELDS)
    return_token_strs: bool | None = Field(False, description="also return each token's text")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(None, exclude_if=_omit_none)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo



# ------------------------------------------------------------------------------------------ Responses API


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText]
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    spec: SpecUsage | None = Field(None, exclude_if=_omit_none, description="absent when speculation is off")


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The OpenAI `Response` object (text output items only)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseReasoningItem | ResponseOutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ErrorInfo | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, Any] = Field(default_factory=dict)
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False


class ResponseStreamEvent(BaseModel):
    """One SSE event of a streamed response (`type` names it; its other fields depend on the type, as in
    OpenAI's stream: response.created / in_progress / completed carry `response`; output_item.added / done
    `item`; content_part.added / done `part`; output_text.delta and reasoning_text.delta `delta`; ... .done
    the full `text`)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
