"""FastAPI app: thin routes over the serving classes in `app.state`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models and
GET /v1/models/{model_id}; vLLM's POST /tokenize, POST /detokenize and POST /invocations (SageMaker-style: a chat
completion or completion body; the API key, when configured, is checked on these and on every /v1 route);
GET /version, GET /health (liveness) and GET|POST /ping (SageMaker's name for it), GET /load (vLLM's server load:
generation requests in flight), GET /ready (200 when serving, 503 while draining or if the worker died),
GET /metrics (Prometheus text), GET /openapi.json and GET /docs (the schema of every route, request body and
error response). Every error is an OpenAI error body
(`serving.APIError`).

Each request's work is tied to its connection: a client that leaves, at any point, has its jobs
cancelled (`_until_disconnect` while the response is being prepared, a watcher task while a stream is
sent). Body parsing and validation run in a worker thread, so a large or hostile body never stalls the
event loop; an exception that escapes every handler becomes a 500 logged without the request.
"""
from __future__ import annotations

import asyncio
import json
import importlib.metadata
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pydantic_core
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrics.prometheus import ServingMetrics
from server import protocol as p
from server.responses import ServingResponses
from server.serving import APIError, ServingChat, ServingCompletion, SSEStream, internal_error, printable
from server.worker import Worker

log = logging.getLogger("nextn.app")

#: Largest request body accepted (413 above it).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: The request models whose schemas /openapi.json documents as request bodies.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (p.ChatCompletionRequest, p.CompletionRequest, p.ResponsesRequest,
                                               p.TokenizeRequest, p.DetokenizeRequest)
#: Models only described in text (the SSE events), added to /openapi.json's components so they can be read.
EVENT_MODELS: tuple[type[BaseModel], ...] = (p.ChatCompletionChunk, p.CompletionChunk, p.ResponseStreamEvent)
_M = TypeVar("_M", bound=BaseModel)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


async def read_body(raw: Request) -> bytes:
    """Read the body (413 over MAX_BODY_BYTES; 408 if it takes longer than the app's `timeout_body` seconds)."""
    too_large = APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large",
                         headers={"Connection": "close"})
    if int(raw.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    timeout: float = raw.app.state.timeout_body
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for part in raw.stream():
                body += part
                if len(body) > MAX_BODY_BYTES:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return bytes(body)


async def read_request(raw: Request, model: type[_M]) -> _M:
    """`read_body`, then parse it into `model` in a worker thread (`parse_body`)."""
    return await asyncio.to_thread(parse_body, model, await read_body(raw))


def parse_body(model: type[_M], body: bytes) -> _M:
    """JSON bytes -> `model`. 400 (code invalid_json) for malformed JSON, invalid UTF-8, a lone surrogate
    escape or nesting deeper than the parser's limit; 400 for a value that fails validation, with param =
    the offending field's dotted path (pydantic's union-member tags left out). Validation is strict, as
    OpenAI's: a JSON value of another type is never coerced ("2" is no number, 0 no boolean, 2.0 no integer),
    so what the OpenAPI schema rejects the server rejects too."""
    return validate_body(model, json_object(body))


def json_object(body: bytes) -> dict[str, Any]:
    """JSON bytes -> a dict; 400 (code invalid_json) as `parse_body` says."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {printable(e)}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def validate_body(model: type[_M], data: dict[str, Any]) -> _M:
    """A JSON object -> `model`, strictly; 400 as `parse_body` says."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = _param(data, first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise APIError(400, f"{where or 'body'}: {msg}{more}", param=where or None) from None


def _param(data: Any, loc: tuple[int | str, ...]) -> str:
    """The dotted path of `loc` as far as it walks through `data`; a missing field's name ends it."""
    path: list[str] = []
    node = data
    for key in loc:
        if isinstance(node, dict) and isinstance(key, str):
            path.append(printable(key, 64))
            if key not in node:
                break
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            path.append(str(key))
            node = node[key]
        else:  # a union member's tag (pydantic's "str", "list[int]"...), not a place in the body
            break
    return ".".join(path)


async def check_api_key(raw: Request) -> None:
    """Dependency of every /v1 route: with --api-key set, require `Authorization: Bearer <key>`
    (constant-time compare; 401 otherwise)."""
    key: str | None = raw.app.state.api_key
    if key is None:
        return
    scheme, _, given = raw.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


async def _disconnected(raw: Request) -> None:
    """Return once the client has gone (or the response is complete: the ASGI server then reports a
    disconnect too). Only called once the body has been read, so no request data is consumed."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (its cleanup cancels any jobs it started)
    and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        log.info("client disconnected; request cancelled")
        return None
    return task.result()


async def _relay(stream: SSEStream, watcher: asyncio.Future[None]) -> AsyncIterator[str]:
    try:
        async for line in stream.body:
            yield line
    finally:
        watcher.cancel()
        stream.cancel()
        await stream.body.aclose()  # type: ignore[attr-defined]


Serving = ServingChat | ServingCompletion | ServingResponses


class ServerLoad:
    """vLLM's server-load figure (GET /load): generation requests in flight, each counted from the arrival of its
    body until its response is done (a stream: its last event sent, or its client gone). Event-loop only."""

    def __init__(self) -> None:
        self.value = 0

    def enter(self) -> None:
        self.value += 1

    def leave(self) -> None:
        self.value -= 1


async def _generate(raw: Request, parse: Callable[[bytes], tuple[Serving, BaseModel]]) -> Response:
    """A generation route: read the body, then, counted as preparing by the server's `Admission` until its jobs
    are submitted (requests that arrive together start together), `parse` it into the serving class that answers
    it and its request (in a worker thread), and respond. Counted in the server load until the response is done."""
    body = await read_body(raw)
    load: ServerLoad = raw.app.state.load
    load.enter()
    streaming = False
    try:
        with raw.app.state.serving_chat.admission.preparing():
            serving, req = await asyncio.to_thread(parse, body)
            response = await _respond(raw, serving.create(req), on_stream_end=load.leave)  # type: ignore[arg-type]
            streaming = isinstance(response, StreamingResponse)
            return response
    finally:
        if not streaming:
            load.leave()


def _parser(serving: Serving, model: type[BaseModel]) -> Callable[[bytes], tuple[Serving, BaseModel]]:
    """`_generate`'s `parse` for a route with one request model."""
    return lambda body: (serving, parse_body(model, body))


#: What /invocations serves, in vLLM's order (the first whose body fits wins): the field that marks the body, its
#: request model and the `app.state` serving class that answers it.
INVOCATIONS: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("messages", p.ChatCompletionRequest, "serving_chat"), ("prompt", p.CompletionRequest, "serving_completion"))


def _invocation(state: Any) -> Callable[[bytes], tuple[Serving, BaseModel]]:
    """/invocations' `parse` (SageMaker-style, as vLLM serves it): a body with `messages` is a chat completion, one
    with `prompt` a completion (a body with both: the first that validates); 400 for neither, or the first
    candidate's validation error."""

    def parse(body: bytes) -> tuple[Serving, BaseModel]:
        data = json_object(body)
        errors: list[APIError] = []
        for key, model, serving in INVOCATIONS:
            if key in data:
                try:
                    return getattr(state, serving), validate_body(model, data)
                except APIError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
        raise APIError(400, "an invocation is a chat completion body (with messages) or a completion body (with "
                            "prompt)", param="messages")

    return parse


async def _respond(raw: Request, work: Awaitable[BaseModel | SSEStream],
                   on_stream_end: Callable[[], None] = lambda: None) -> Response:
    """The response for `work` (a serving `create`), tied to the connection: a client that leaves while
    it runs cancels it; a stream's jobs are cancelled as soon as the client leaves, even if the stream's
    body is never iterated (a client gone before the first chunk). `on_stream_end` runs once when a stream
    is over (sent, or its client gone)."""
    result = await _until_disconnect(raw, work)
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    watcher = asyncio.ensure_future(_disconnected(raw))
    watcher.add_done_callback(lambda _: result.cancel())
    watcher.add_done_callback(lambda _: on_stream_end())
    return StreamingResponse(_relay(result, watcher), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------------------------------ OpenAPI documents

_ERROR_DOCS = {
    400: "Bad request: malformed JSON, a field of the wrong type or out of range (param names it), a prompt "
         "longer than the context, an image that cannot be used (the message names it and the problem)",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    404: "Unknown model",
    408: "The request body was not received in time (--timeout-body)",
    413: f"Request body over {MAX_BODY_BYTES} bytes",
    429: "The admission queue is full; retry after Retry-After seconds",
    500: "Internal error; only this request failed",
    503: "The server is draining for shutdown, or its worker stopped",
}


#: What a generating route may answer besides 200.
GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    docs: dict[int | str, dict[str, Any]] = {c: {"model": p.ErrorResponse, "description": _ERROR_DOCS[c]}
                                             for c in codes}
    if 429 in docs:
        docs[429]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    return docs


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _sse_event(*chunks: type[BaseModel]) -> dict[str, Any]:
    """The schema of one server-sent event of a stream (an OpenAPI 3.1 `text/event-stream` schema describes one
    event): its `data` is one of `chunks` or an ErrorResponse as JSON, or the literal `[DONE]`."""
    payload = {"anyOf": [_ref(m) for m in (*chunks, p.ErrorResponse)]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _body_route(model: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel] | None = None,
                stream_doc: str | None = None) -> dict[str, Any]:
    """Route arguments documenting a JSON request body of `model` (parsed by `read_request`, so FastAPI
    does not see it), its response (`response`, or SSE `chunk`s when `stream` is true) and its errors."""
    ok: dict[str, Any] = {"model": response, "description": f"A {response.__name__}"}
    if chunk is not None:
        ok["description"] += stream_doc or (
            f"; with `stream: true` a text/event-stream of `data: <{chunk.__name__} JSON>` events ending with "
            f"`data: [DONE]` (an error mid-stream is a `data: <ErrorResponse JSON>` event)")
        ok["content"] = {"text/event-stream": {"schema": _sse_event(chunk)}}
    codes = GENERATION_ERRORS if chunk is not None else (400, 401, 404, 408, 413, 500)
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref(model)}}}},
        "responses": {200: ok, **_errors(*codes)},
    }


def _invocations_route() -> dict[str, Any]:
    """Route arguments documenting /invocations: a body of any of INVOCATIONS' request models, answered as that
    model's route answers it (JSON, or SSE events when `stream` is true), with the generating routes' errors."""
    ok = {"description": "what /v1/chat/completions (a body with messages) or /v1/completions (a body with prompt) "
                         "answers: a ChatCompletionResponse or CompletionResponse, or with `stream: true` their "
                         "text/event-stream", "content": {
                             "application/json": {"schema": {"anyOf": [_ref(p.ChatCompletionResponse),
                                                                       _ref(p.CompletionResponse)]}},
                             "text/event-stream": {"schema": _sse_event(p.ChatCompletionChunk, p.CompletionChunk)}}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"anyOf": [_ref(model) for _, model, _ in INVOCATIONS]}}}}},
        "responses": {200: ok, **_errors(*GENERATION_ERRORS)}}


class HealthStatus(BaseModel):
    status: str
    reason: str | None = Field(None, description="With 503 (not draining): why the server stopped serving, e.g. its "
                                                 "device failed (the process then exits for its orchestrator to "
                                                 "restart it)")
    kernels: dict[str, str] | None = Field(
        None, description="CUDA only: each Triton kernel's startup self-check verdict, triton (it runs) or torch (it "
                          "failed and its torch twin runs instead)")


#: Routes outside /v1 that need the API key (the `tokens` router's).
KEYED_PATHS = ("/tokenize", "/detokenize", "/invocations")


_HEALTH_DOCS: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthStatus, "description": "serving"}, 503: {"model": HealthStatus, "description": "not"}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies' models (validation mode), the SSE events' models and,
    with --api-key, the bearer scheme on every /v1 operation."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS]
                                     + [(m, "serialization") for m in EVENT_MODELS],
                                     ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {})
        known = components.setdefault("schemas", {})
        for name, model_schema in defs.get("$defs", {}).items():
            known.setdefault(name, model_schema)
        if app.state.api_key is not None:
            components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
            for path, ops in schema["paths"].items():
                if path.startswith("/v1/") or path in KEYED_PATHS:
                    for op in ops.values():
                        op["security"] = [{"bearerAuth": []}]
        app.openapi_schema = schema
    return app.openapi_schema


# ----------------------------------------------------------------------------------------------- routes

v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@v1.post("/chat/completions", summary="Create a chat completion",
         **_body_route(p.ChatCompletionRequest, p.ChatCompletionResponse, p.ChatCompletionChunk))
async def create_chat_completion(raw: Request) -> Response:
    return await _generate(raw, _parser(raw.app.state.serving_chat, p.ChatCompletionRequest))


@v1.post("/completions", summary="Create a completion (legacy)",
         **_body_route(p.CompletionRequest, p.CompletionResponse, p.CompletionChunk))
async def create_completion(raw: Request) -> Response:
    return await _generate(raw, _parser(raw.app.state.serving_completion, p.CompletionRequest))


@v1.post("/responses", summary="Create a response (OpenAI Responses API; text in and out)",
         **_body_route(p.ResponsesRequest, p.ResponseObject, p.ResponseStreamEvent, stream_doc=(
             "; with `stream: true` a text/event-stream of `event: <type>` / `data: <ResponseStreamEvent JSON>` "
             "events: response.created, response.in_progress, per output item output_item.added, "
             "content_part.added, output_text.delta / reasoning_text.delta, their .done, output_item.done, then "
             "response.completed (an error mid-stream is an `error` event)")))
async def create_response(raw: Request) -> Response:
    return await _generate(raw, _parser(raw.app.state.serving_responses, p.ResponsesRequest))


@v1.get("/models", summary="List the served model (one card per served name)", responses=_errors(401, 500))
async def list_models(raw: Request) -> p.ModelList:
    return raw.app.state.model_list


@v1.get("/models/{model_id:path}", summary="Retrieve the served model", responses=_errors(401, 404, 500))
async def retrieve_model(raw: Request, model_id: str) -> p.ModelCard:
    for card in raw.app.state.model_list.data:
        if model_id == card.id:
            return card
    raise APIError(404, f"The model `{printable(model_id, 100)}` does not exist.", param="model",
                   code="model_not_found")


tokens = APIRouter(dependencies=[Depends(check_api_key)])


@tokens.post("/tokenize", summary="Tokenize a prompt or chat messages (vLLM)",
             **_body_route(p.TokenizeRequest, p.TokenizeResponse))
async def tokenize(raw: Request) -> Response:
    req = await read_request(raw, p.TokenizeRequest)
    serving: ServingChat = raw.app.state.serving_chat
    result = await asyncio.to_thread(serving.tokenize, req)
    return Response(result.model_dump_json(), media_type="application/json")


@tokens.post("/detokenize", summary="Detokenize token ids (vLLM)", **_body_route(p.DetokenizeRequest,
                                                                                 p.DetokenizeResponse))
async def detokenize(raw: Request) -> Response:
    req = await read_request(raw, p.DetokenizeRequest)
    serving: ServingChat = raw.app.state.serving_chat
    result = await asyncio.to_thread(serving.detokenize, req)
    return Response(result.model_dump_json(), media_type="application/json")


@tokens.post("/invocations", summary="SageMaker-style inference (vLLM): a chat completion or a completion",
             **_invocations_route())
async def invocations(raw: Request) -> Response:
    return await _generate(raw, _invocation(raw.app.state))


ops = APIRouter()


@ops.get("/version", summary="Server version (vLLM)")
async def version(raw: Request) -> p.VersionResponse:
    return p.VersionResponse(version=raw.app.version)


@ops.get("/health", summary="Liveness: the worker and its device are alive", responses=_HEALTH_DOCS)
async def health(raw: Request) -> JSONResponse:
    worker = raw.app.state.worker
    alive = worker.alive
    body: dict[str, Any] = {"status": "ok" if alive else "worker dead"}
    if not alive and worker.failure:  # why: a lost device (the process exits), a failed loop, a dead engine
        body["reason"] = worker.failure
    kernels = getattr(worker, "kernel_info", None)
    if kernels:  # CUDA: each Triton kernel's startup verdict, "triton" or "torch" (its twin runs instead)
        body["kernels"] = kernels
    costs = getattr(raw.app.state.metrics, "spec_costs", None)
    if costs:  # the speculation controller's cost table: ms per round by batch bucket and verify width T
        body["spec_cost_ms"] = costs
    return JSONResponse(body, status_code=200 if alive else 503)


@ops.get("/ping", summary="SageMaker's health check (vLLM): as /health", responses=_HEALTH_DOCS)
@ops.post("/ping", summary="SageMaker's health check (vLLM): as /health", responses=_HEALTH_DOCS)
async def ping(raw: Request) -> JSONResponse:
    r = await health(raw)
    body = {k: v for k, v in json.loads(r.body).items() if k in ("status", "reason")}  # the verdict, not the detail
    return JSONResponse(body, status_code=r.status_code)


@ops.get("/load", summary="Server load (vLLM): generation requests in flight")
async def load(raw: Request) -> p.ServerLoadResponse:
    return p.ServerLoadResponse(server_load=raw.app.state.load.value)


@ops.get("/ready", summary="Readiness: serving, not draining", responses=_HEALTH_DOCS)
async def ready(raw: Request) -> JSONResponse:
    worker: Worker = raw.app.state.worker
    if worker.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not worker.alive:
        body = {"status": "worker dead"}
        if worker.failure:
            body["reason"] = worker.failure
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ready"})


@ops.get("/metrics", summary="Prometheus metrics (text format)", response_class=PlainTextResponse,
         responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(raw: Request) -> Response:
    body, content_type = raw.app.state.metrics.render()
    return Response(body, media_type=content_type)


# ------------------------------------------------------------------------------------------------ errors


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers,  # 405: Allow
                                   code="not_found" if exc.status_code == 404 else None))


class InternalErrors:
    """ASGI middleware: an exception that escaped every handler is logged once (`internal_error`: frames
    and a bounded message, never the request) and answered with a 500 OpenAI error body if the response
    has not started. It is not re-raised, so the ASGI server does not log it again in full."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            err = internal_error("unhandled error", exc, log)
            if scope["type"] == "http" and not started:
                await error_response(err)(scope, receive, send)


def build_app(*, serving_chat: ServingChat, serving_completion: ServingCompletion, worker: Worker,
              metrics: ServingMetrics, model_root: str, api_key: str | None, timeout_body: float = 60.0) -> FastAPI:
    """The ASGI app; the caller owns the worker's lifetime (start before serving, drain/shutdown after).
    `timeout_body`: seconds a client has to send a request body (408 after)."""
    try:
        version = importlib.metadata.version("nextn")
    except importlib.metadata.PackageNotFoundError:
        version = "0+unknown"
    app = FastAPI(title="nextn", version=version, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible server for Qwen3.5 with exact MTP speculative decoding. Errors "
                              "are OpenAI error bodies; nextn extras are documented per field.")
    serving_completion.admission = serving_chat.admission  # one for the server: arrivals gather across endpoints
    app.state.serving_chat = serving_chat
    app.state.serving_completion = serving_completion
    app.state.serving_responses = ServingResponses(serving_chat)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.api_key = api_key
    app.state.load = ServerLoad()
    app.state.timeout_body = timeout_body
    created = int(time.time())
    app.state.model_list = p.ModelList(data=[p.ModelCard(  # one card per served name, as vLLM lists them
        id=name, created=created, root=model_root, max_model_len=serving_chat.max_model_len)
        for name in serving_chat.served_names])
    app.include_router(v1)
    app.include_router(tokens)
    app.include_router(ops)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(InternalErrors)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
