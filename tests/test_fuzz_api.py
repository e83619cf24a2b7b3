"""Schemathesis against the server's own /openapi.json: a real uvicorn on 127.0.0.1 (tests/server_fixtures.py
ServerThread, the tiny checkpoint, a 64-token context so every request is cheap), bounded examples per
operation, in both of schemathesis' modes:

- positive: bodies that follow the schema (the `model` field set to the served name so requests reach the
  engine; chat requests get a final user message so most of them generate);
- negative: bodies that break it (wrong types, out-of-range values, missing fields, bytes that are not JSON).

Every response must be a documented one: no 5xx; a documented status, content type, headers and body
schema (non-streamed bodies and, for streams, every event: its `data` is the documented chunk or error as
JSON, or `[DONE]`); and a body that breaks the schema is rejected (4xx): the request bounds in the schema are
the ones the server enforces, and no value is coerced (0 is not a boolean, "2" is not a number).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck, Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz_util import fuzz_settings
from tests.server_fixtures import ServerThread

pytestmark = pytest.mark.slow  # schemathesis over every operation of a live server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
#: (method, path, CI examples per mode): the generating routes get most of the budget.
OPERATIONS = [("POST", "/v1/chat/completions", 100), ("POST", "/v1/completions", 100), ("POST", "/v1/responses", 40),
              ("POST", "/tokenize", 20), ("POST", "/detokenize", 20), ("GET", "/v1/models", 5),
              ("GET", "/v1/models/{model_id}", 5), ("GET", "/version", 5), ("GET", "/health", 5), ("GET", "/ready", 5),
              ("GET", "/metrics", 5), ("POST", "/invocations", 30), ("GET", "/ping", 5), ("POST", "/ping", 5),
              ("GET", "/load", 5)]
#: Responses options that are a documented 400 whatever their value (positive bodies drop them to reach the engine).
RESPONSES_REFUSED = ("previous_response_id", "conversation", "prompt", "background", "include", "tools", "top_logprobs",
                     "tool_choice", "truncation", "text")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(max_model_len=64, max_queue=8, max_num_seqs=4) as s:
        yield s


@pytest.fixture(scope="module")
def api(server: ServerThread) -> Any:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.max_stream_events = 10_000  # read whole streams (schemathesis stops after 20 events by default)
    return schema


def sse_validator(doc: dict[str, Any], path: str) -> jsonschema.Draft202012Validator:
    """Validator of one stream event's `data` payload, from the document's own event schema."""
    event = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    payload = next(s["contentSchema"] for s in event["properties"]["data"]["anyOf"] if "contentSchema" in s)
    return jsonschema.Draft202012Validator({**payload, "components": doc["components"]})


def check_events(response: Any, validator: jsonschema.Draft202012Validator, path: str) -> None:
    """Every event of a stream is `data: <JSON the schema documents>`, and the last is `data: [DONE]`; a Responses
    stream's events are `event: <type>` + `data: <that type's event>`, the last response.completed or error."""
    assert not response.stream_cut_short
    events = [e for e in response.text.split("\n\n") if e]
    if path == "/v1/responses":
        for e in events:
            head, _, data = e.partition("\ndata: ")
            assert head.startswith("event: ") and "\n" not in data, e[:200]
            validator.validate(json.loads(data))
            assert json.loads(data)["type"] == head[len("event: "):]
        assert events and events[-1].split("\n")[0] in ("event: response.completed", "event: error"), events[-1:]
        return
    assert events and events[-1] == "data: [DONE]", events[-1:]
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, e[:200]
        validator.validate(json.loads(e[len("data: "):]))


def prepare(case: Any, mode: GenerationMode, model: str, vocab: int) -> None:
    """Point the body at the served model (no schema constraint on it, so the mode is kept). Positive bodies
    stay valid but are steered to generate: chat gets a final user message (the template wants one), a
    completions prompt is a single non-empty prompt of in-vocabulary ids, max_tokens fits the context; a
    Responses body gets a text input and no option that is always refused; /tokenize gets exactly one of prompt
    and messages, /detokenize in-vocabulary ids."""
    if case.path == "/v1/models/{model_id}" and mode == GenerationMode.POSITIVE:
        case.path_parameters = {"model_id": model}
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    if mode != GenerationMode.POSITIVE:
        return
    if case.path == "/v1/responses":
        body["input"] = body["input"] if isinstance(body.get("input"), str) else "Hi"
        for name in RESPONSES_REFUSED:
            body.pop(name, None)
        if isinstance(body.get("max_output_tokens"), int):
            body["max_output_tokens"] = 1 + body["max_output_tokens"] % 16
        return
    if case.path == "/tokenize":
        body.pop("messages", None)
        body["prompt"] = body["prompt"] if isinstance(body.get("prompt"), str) else "x"
    if case.path == "/detokenize" and isinstance(body.get("tokens"), list):
        body["tokens"] = [t % vocab for t in body["tokens"]]
    if isinstance(body.get("messages"), list):
        body["messages"] = [m for m in body["messages"] if m.get("role") in ("user", "assistant")][-3:] + \
            [{"role": "user", "content": "Hi"}]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
        body["prompt"] = [t % vocab for t in prompt][:32] or [0] if isinstance(prompt, list) else prompt
    if not body.get("prompt", "x"):
        body["prompt"] = "x"
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int):
            body[name] = 1 + body[name] % 16


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("method", "path", "examples"), OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_every_response_is_documented(server: ServerThread, api: Any, method: str, path: str, examples: int,
                                      mode: GenerationMode) -> None:
    operation = api[path][method]
    session = requests.Session()
    streams = "text/event-stream" in api.raw_schema["paths"][path][method.lower()]["responses"]["200"]["content"]
    events = sse_validator(api.raw_schema, path) if streams else None
    statuses: dict[int, int] = {}

    @fuzz_settings(examples)
    @given(case=operation.as_strategy(mode))
    def run(case: Any) -> None:
        prepare(case, mode, server.model, server.app.state.serving_chat.n_tokens)
        response = case.call_and_validate(session=session, checks=CHECKS, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if events is not None and response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            check_events(response, events, path)

    try:
        run()
    except (Unsatisfiable, FailedHealthCheck):  # an operation without parameters or body (or with only a free-text
        op = api.raw_schema["paths"][path][method.lower()]  # path parameter) has no negative cases
        assert mode == GenerationMode.NEGATIVE and "requestBody" not in op
        return
    if method == "POST" and mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) >= examples // 3, statuses  # the fuzz reached the engine, not only errors
    assert server.worker.alive


# Raw bytes where JSON expects text: invalid UTF-8, NUL, lone-surrogate escapes, control characters.
RAW_TEXT = st.lists(st.one_of(st.binary(max_size=6), st.sampled_from([b"\\ud800", b"\\udfff\\ud800", b"\\u0000",
                                                                      b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80",
                                                                      b"\\n", b"\xe4\xb8\xad"])),
                    max_size=6).map(b"".join)


@fuzz_settings(80)
@given(raw=RAW_TEXT, chat=st.booleans())
def test_raw_bytes_in_text_fields_are_400_or_served(server: ServerThread, raw: bytes, chat: bool) -> None:
    """Any bytes inside a JSON string (invalid UTF-8, escaped lone surrogates, NUL) get a documented answer:
    400 invalid_json / invalid_request_error, or 200 when the bytes are valid text. Never 5xx."""
    inner = b'"' + raw.replace(b'"', b"") + b'"'
    field = b'"messages": [{"role": "user", "content": ' + inner + b"}]" if chat else b'"prompt": ' + inner
    body = b'{"model": "' + server.model.encode() + b'", "max_tokens": 2, ' + field + b"}"
    r = httpx.post(server.base_url + ("/chat/completions" if chat else "/completions"), content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_wrong_method_is_405_with_allow(server: ServerThread) -> None:
    """RFC 9110: a 405 names the allowed methods (an OpenAI error body too)."""
    for method, path, allow in [("DELETE", "/v1/models", "GET"), ("GET", "/v1/completions", "POST"),
                                ("POST", "/health", "GET")]:
        r = httpx.request(method, server.url + path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path, r.headers)
        assert r.json()["error"]["type"] == "invalid_request_error"
