"""POST /v1/responses: OpenAI's Responses API over the chat path (`input_image` parts are chat's image parts).

A request becomes a chat request (`instructions` -> the system message, `input` -> messages, `text.format` ->
response_format, `max_output_tokens` -> max_completion_tokens, `reasoning.effort` "none" -> thinking off) and
runs exactly as chat does (template, grammar, speculation, reasoning split). The output is a `reasoning` item
(when the model thought aloud) and a `message` item with one `output_text` part. Streaming sends OpenAI's
events in order: response.created, response.in_progress, then per item output_item.added, (content_part.added,)
the text deltas and dones, output_item.done, and response.completed carrying the whole response; every event
has a `sequence_number`. Options that need what nextn does not keep or run (previous responses, conversations,
background runs, tools, include) are a 400 naming the field. Nothing is stored.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from server import protocol as p
from server.multimodal import IMAGE_PARTS, VIDEO_PARTS
from server.serving import (APIError, Generation, ServingChat, SSEStream, _Prepared, internal_error, log_ignored_fields,
                            printable)
from server.structured import ChatOutput

#: Roles an input message item may have, and the content part types whose `text` is taken.
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
#: Parts passed to chat as they are: images (`input_image`: image_url a data: or http(s) URL, `detail`), and videos
#: (chat refuses them by name).
_IMAGE_PARTS = IMAGE_PARTS + VIDEO_PARTS


def _name_input(err: APIError, req: p.ResponsesRequest) -> None:
    """Rename a chat error's `messages.N...` place (its param, and its message's mention) to where it is in the
    Responses request, `input.M...` (M = N less the system message `instructions` became; `input` itself when it
    is a string)."""
    m = re.fullmatch(r"messages\.(\d+)(.*)", err.param or "")
    offset = 1 if req.instructions else 0
    if m is None or int(m.group(1)) < offset:
        return
    where = "input" if isinstance(req.input, str) else f"input.{int(m.group(1)) - offset}{m.group(2)}"
    err.message = err.message.replace(str(err.param), where, 1)
    err.param = where


def _event(seq: list[int], type_: str, **fields: Any) -> str:
    """One SSE event (`event:` and `data:` lines) with the next sequence number."""
    ev = p.ResponseStreamEvent(type=type_, sequence_number=seq[0], **fields)
    seq[0] += 1
    return f"event: {type_}\ndata: {ev.model_dump_json()}\n\n"


class ServingResponses:
    """The Responses API on top of `ServingChat` (same model, template, grammar and worker)."""

    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat
        self.admission = chat.admission

    async def create(self, req: p.ResponsesRequest) -> p.ResponseObject | SSEStream:
        """Validate, submit as chat, and return the finished `ResponseObject`, or an `SSEStream` of Responses
        events when `req.stream`. Raises `APIError` as chat does."""
        log_ignored_fields(req)
        chat_req = self.to_chat(req)
        try:
            prep, gen = await self.chat.submit(chat_req)
        except APIError as e:
            _name_input(e, req)
            raise
        rid = p.random_id("resp")
        base = self._base(req, rid)
        if req.stream:
            return SSEStream(self._stream(chat_req, base, gen, prep), gen.cancel)
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for _ in deltas:
                pass
        out = self.chat.output(chat_req, prep)
        out.push(gen.choices[0].text)
        out.finish()
        return self._final(base, rid, gen, prep, out)

    # ------------------------------------------------------------------ request
    def to_chat(self, req: p.ResponsesRequest) -> p.ChatCompletionRequest:
        """The chat request a Responses request means; 400 for what cannot be served."""
        refused = {"previous_response_id": req.previous_response_id, "conversation": req.conversation,
                   "prompt": req.prompt, "background": req.background or None, "include": req.include or None,
                   "tools": req.tools or None, "top_logprobs": req.top_logprobs or None}
        for name, value in refused.items():
            if value is not None:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools, which are not supported here", param="tool_choice")
        if req.truncation not in (None, "disabled"):
            raise APIError(400, 'truncation: only "disabled" is supported', param="truncation")
        messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        for i, item in enumerate(items):
            messages.append(self._message(item, f"input.{i}"))
        body: dict[str, Any] = {"model": req.model, "messages": messages, "seed": req.seed,
                                "max_completion_tokens": req.max_output_tokens,
                                "chat_template_kwargs": req.chat_template_kwargs}
        if req.temperature is not None:
            body["temperature"] = req.temperature
        if req.top_p is not None:
            body["top_p"] = req.top_p
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
        effort = (req.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        fmt = (req.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = self._format(fmt)
        try:
            return p.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(x) for x in first["loc"])
            raise APIError(400, f"input: {where}: {first['msg']}", param="input") from None

    @staticmethod
    def _message(item: Any, where: str) -> dict[str, Any]:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise APIError(400, f"{where}: only message items are supported, got {printable(kind, 64)}",
                           param=f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _IMAGE_PARTS:  # chat's image parts take it as it is (URL, detail, file_id)
                    parts.append(part)
                elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise APIError(400, f"{where}.content.{j}: only text and image parts are supported",
                                   param=f"{where}.content.{j}")
            has_image = any(x["type"] != "text" for x in parts)
            content = parts if has_image else "\n".join(x["text"] for x in parts)
        if not isinstance(content, str | list):
            raise APIError(400, f"{where}.content must be a string or a list of text and image parts",
                           param=f"{where}.content")
        return {"role": role, "content": content}

    @staticmethod
    def _format(fmt: Any) -> dict[str, Any]:
        """Responses `text.format` -> chat `response_format`."""
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}

    # ------------------------------------------------------------------ response
    def _base(self, req: p.ResponsesRequest, rid: str) -> p.ResponseObject:
        return p.ResponseObject(
            id=rid, created_at=int(time.time()), status="in_progress", model=self.chat.model_name,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature if req.temperature is not None else 1.0,
            top_p=req.top_p if req.top_p is not None else 1.0, metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False, reasoning=req.reasoning, user=req.user,
            text=req.text or {"format": {"type": "text"}})

    def _usage(self, gen: Generation, prep: _Prepared) -> p.ResponseUsage:
        u = self.chat.usage(gen, len(prep.prompt_ids))
        ids = gen.choices[0].token_ids
        end = self.chat.tokenizer.token_to_id("</think>")
        reasoning = 0
        if prep.in_reasoning and end is not None:  # the think block's tokens, `</think>` included
            reasoning = ids.index(end) + 1 if end in ids else len(ids)
        return p.ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                               input_tokens_details=p.InputTokensDetails(
                                   cached_tokens=u.prompt_tokens_details.cached_tokens),
                               output_tokens_details=p.OutputTokensDetails(reasoning_tokens=reasoning),
                               total_tokens=u.total_tokens, spec=u.spec)

    def _final(self, base: p.ResponseObject, rid: str, gen: Generation, prep: _Prepared,
               out: ChatOutput) -> p.ResponseObject:
        """The finished response: a reasoning item when there was reasoning, the message item."""
        incomplete = gen.choices[0].finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        items: list[p.ResponseReasoningItem | p.ResponseOutputMessage] = []
        if out.reasoning:
            items.append(p.ResponseReasoningItem(id=f"rs_{rid[5:]}", status="completed",
                                                 content=[p.ResponseReasoningText(text=out.reasoning)]))
        if out.content or not out.reasoning:
            items.append(p.ResponseOutputMessage(id=f"msg_{rid[5:]}", status=status,
                                                 content=[p.ResponseOutputText(text=prep.echo + out.content)]))
        return base.model_copy(update={
            "status": status, "output": items, "usage": self._usage(gen, prep),
            "incomplete_details": p.IncompleteDetails(reason="max_output_tokens") if incomplete else None})

    async def _stream(self, chat_req: p.ChatCompletionRequest, base: p.ResponseObject, gen: Generation,
                      prep: _Prepared) -> AsyncIterator[str]:
        seq = [0]
        rid = base.id
        out = self.chat.output(chat_req, prep)
        reasoning_id, message_id = f"rs_{rid[5:]}", f"msg_{rid[5:]}"
        opened: dict[str, int] = {}  # item kind -> output index
        closed: set[str] = set()

        def dump(model: Any) -> Any:
            return json.loads(model.model_dump_json())

        def open_item(kind: str) -> list[str]:
            opened[kind] = len(opened)
            idx = opened[kind]
            if kind == "reasoning":
                item = p.ResponseReasoningItem(id=reasoning_id, status="in_progress", content=[])
                return [_event(seq, "response.output_item.added", output_index=idx, item=dump(item))]
            item = p.ResponseOutputMessage(id=message_id, status="in_progress", content=[])
            return [_event(seq, "response.output_item.added", output_index=idx, item=dump(item)),
                    _event(seq, "response.content_part.added", item_id=message_id, output_index=idx,
                           content_index=0, part=dump(p.ResponseOutputText(text="")))]

        def close_item(kind: str, status: str) -> list[str]:
            closed.add(kind)
            idx = opened[kind]
            if kind == "reasoning":
                part = p.ResponseReasoningText(text=out.reasoning)
                item = p.ResponseReasoningItem(id=reasoning_id, status="completed", content=[part])
                return [_event(seq, "response.reasoning_text.done", item_id=reasoning_id, output_index=idx,
                               content_index=0, text=out.reasoning),
                        _event(seq, "response.output_item.done", output_index=idx, item=dump(item))]
            part = p.ResponseOutputText(text=prep.echo + out.content)
            msg = p.ResponseOutputMessage(id=message_id, status=status, content=[part])  # type: ignore[arg-type]
            return [_event(seq, "response.output_text.done", item_id=message_id, output_index=idx, content_index=0,
                           text=part.text, logprobs=[]),
                    _event(seq, "response.content_part.done", item_id=message_id, output_index=idx, content_index=0,
                           part=dump(part)),
                    _event(seq, "response.output_item.done", output_index=idx, item=dump(msg))]

        def text_events(reasoning: str, content: str) -> list[str]:
            evs: list[str] = []
            if reasoning:
                if "reasoning" not in opened:
                    evs += open_item("reasoning")
                evs.append(_event(seq, "response.reasoning_text.delta", item_id=reasoning_id,
                                  output_index=opened["reasoning"], content_index=0, delta=reasoning))
            if content:
                if "reasoning" in opened and "reasoning" not in closed:
                    evs += close_item("reasoning", "completed")
                if "message" not in opened:
                    evs += open_item("message")
                evs.append(_event(seq, "response.output_text.delta", item_id=message_id, output_index=opened["message"],
                                  content_index=0, delta=content, logprobs=[]))
            return evs

        try:
            yield _event(seq, "response.created", response=dump(base))
            yield _event(seq, "response.in_progress", response=dump(base))
            for ev in text_events("", prep.echo):
                yield ev
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    od = out.push(d.text)
                    for ev in text_events(od.reasoning, od.content):
                        yield ev
            end = out.finish()
            for ev in text_events(end.reasoning, end.content):
                yield ev
            final = self._final(base, rid, gen, prep, out)
            if "message" not in opened and any(i.type == "message" for i in final.output):
                for ev in open_item("message"):
                    yield ev
            for kind in list(opened):
                if kind not in closed:
                    for ev in close_item(kind, final.status if kind == "message" else "completed"):
                        yield ev
            yield _event(seq, "response.completed", response=dump(final))
        except APIError as e:
            body = e.body().error
            yield _event(seq, "error", code=body.code, message=body.message, param=body.param, error=dump(body))
        except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
            body = internal_error("responses stream failed", e).body().error
            yield _event(seq, "error", code=body.code, message=body.message, param=body.param, error=dump(body))
