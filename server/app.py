"""FastAPI app: thin routes over the serving classes in `app.state`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (API key checked on /v1/* when
configured), GET /health (liveness), GET /ready (200 when serving, 503 while draining or if the worker
died), GET /metrics (Prometheus text). Every error is an OpenAI error body (`serving.APIError`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrics.prometheus import ServingMetrics
from server import protocol as p
from server.serving import APIError, ServingChat, ServingCompletion
from server.worker import Worker

log = logging.getLogger("nextn.app")

#: Largest request body accepted (413 above it).
MAX_BODY_BYTES = 8 * 1024 * 1024
_M = TypeVar("_M", bound=BaseModel)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


async def read_request(raw: Request, model: type[_M]) -> _M:
    """Parse the JSON body into `model`: 413 over MAX_BODY_BYTES, 400 for malformed JSON or a value
    that fails validation (param = the first offending field's dotted path)."""
    if int(raw.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    body = bytearray()
    async for part in raw.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise APIError(400, f"{where}: {first['msg']}{more}", param=where or None) from None


async def check_api_key(raw: Request) -> None:
    """Dependency of /v1/*: with --api-key set, require `Authorization: Bearer <key>` (401 otherwise)."""
    key: str | None = raw.app.state.api_key
    if key is None:
        return
    scheme, _, given = raw.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key", code="invalid_api_key")


async def _until_disconnect(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (its cleanup frees the sessions) and
    return None. Used for non-streaming responses (streams are cancelled by the ASGI server)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        log.info("client disconnected; request cancelled")
        return None
    return task.result()


def _respond(result: BaseModel | AsyncIterator[str] | None) -> Response:
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@v1.post("/chat/completions")
async def create_chat_completion(raw: Request) -> Response:
    req = await read_request(raw, p.ChatCompletionRequest)
    serving: ServingChat = raw.app.state.serving_chat
    if req.stream:
        return _respond(await serving.create(req))
    return _respond(await _until_disconnect(raw, serving.create(req)))


@v1.post("/completions")
async def create_completion(raw: Request) -> Response:
    req = await read_request(raw, p.CompletionRequest)
    serving: ServingCompletion = raw.app.state.serving_completion
    if req.stream:
        return _respond(await serving.create(req))
    return _respond(await _until_disconnect(raw, serving.create(req)))


@v1.get("/models")
async def list_models(raw: Request) -> p.ModelList:
    return raw.app.state.model_list


ops = APIRouter()


@ops.get("/health")
async def health(raw: Request) -> JSONResponse:
    alive = raw.app.state.worker.alive
    return JSONResponse({"status": "ok" if alive else "worker dead"}, status_code=200 if alive else 503)


@ops.get("/ready")
async def ready(raw: Request) -> JSONResponse:
    worker: Worker = raw.app.state.worker
    if worker.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not worker.alive:
        return JSONResponse({"status": "worker dead"}, status_code=503)
    return JSONResponse({"status": "ready"})


@ops.get("/metrics")
async def metrics(raw: Request) -> Response:
    body, content_type = raw.app.state.metrics.render()
    return Response(body, media_type=content_type)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail),
                                   code="not_found" if exc.status_code == 404 else None))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))


def build_app(*, serving_chat: ServingChat, serving_completion: ServingCompletion, worker: Worker,
              metrics: ServingMetrics, model_root: str, api_key: str | None) -> FastAPI:
    """The ASGI app; the caller owns the worker's lifetime (start before serving, drain/shutdown after)."""
    app = FastAPI(title="nextn", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving_chat = serving_chat
    app.state.serving_completion = serving_completion
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.api_key = api_key
    app.state.model_list = p.ModelList(data=[p.ModelCard(
        id=serving_chat.model_name, created=int(time.time()), root=model_root,
        max_model_len=serving_chat.max_model_len)])
    app.include_router(v1)
    app.include_router(ops)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    return app
