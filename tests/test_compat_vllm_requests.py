"""The requests of vLLM's own OpenAI tests that nextn answered differently, each through the official `openai`
client or httpx against a real uvicorn on the tiny model:

- test_chat_echo: `"logprobs": "true"` (a string: vLLM's models validate laxly), `top_logprobs: -1` and
  `prompt_logprobs: -1` (the whole vocabulary), answered at the default settings. vLLM bounds -1 by --max-logprobs
  (its test serves with `--max-logprobs 151936`, Qwen2's vocabulary, which Qwen3.5's 248,320 would exceed); nextn
  answers -1 whatever --max-logprobs says and bounds the response's size instead (FULL_VOCAB_LOGPROB_ENTRIES).
- test_basic test_server_load: a completion without `model` (optional in vLLM) is served and counted by /load.
- test_chat_completion test_invocations: /invocations answers exactly what /v1/chat/completions answers, keys
  included (the SDK's `model_dump()` of the chat response against the raw /invocations JSON).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server_fixtures import ServerThread, gated_sessions, wait_until

MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Beijing is the capital of which country?"}]
VLLM_TEST_MAX_LOGPROBS = 151936  # vLLM's test_chat_echo server flag (Qwen2's vocabulary)


@pytest.fixture(scope="module")
def gate() -> threading.Event:
    g = threading.Event()
    g.set()
    return g


@pytest.fixture(scope="module")
def srv(gate: threading.Event) -> Iterator[ServerThread]:
    with ServerThread(worker_kw={"session_factory": gated_sessions(gate)}) as s:  # --max-logprobs at its default
        yield s


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)


def test_chat_echo_logprobs_minus_one(srv, client):
    vocab = srv.app.state.serving_chat.vocab_size
    c = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=1,
                                       extra_body={"top_logprobs": -1, "logprobs": "true"})
    content = c.choices[0].logprobs.content
    assert content and len(content[0].top_logprobs) == vocab
    c = client.chat.completions.create(model=srv.model, messages=MSGS, extra_body={"prompt_logprobs": -1},
                                       max_tokens=2)
    plp = c.prompt_logprobs
    assert plp[0] is None and len(plp) == c.usage.prompt_tokens and all(len(e) >= vocab for e in plp[1:])


@pytest.mark.parametrize("value,ok", [("true", True), ("True", True), ("1", True), ("yes", True), ("false", False),
                                      ("0", False), ("maybe", None), (1, None), (None, None)])
def test_chat_logprobs_is_a_lax_boolean(srv, value, ok):
    r = httpx.post(srv.base_url + "/chat/completions", json={"model": srv.model, "messages": MSGS, "max_tokens": 1,
                                                             "logprobs": value})
    if ok is None:  # any other string, a number or null: a 400 naming the field
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    else:
        assert r.status_code == 200 and (r.json()["choices"][0]["logprobs"] is not None) == ok


def test_minus_one_is_bounded_by_the_response_size(srv, monkeypatch):
    import server.serving as serving
    vocab = srv.app.state.serving_chat.vocab_size
    monkeypatch.setattr(serving, "FULL_VOCAB_LOGPROB_ENTRIES", vocab * 4)  # four positions' worth
    ok = httpx.post(srv.base_url + "/chat/completions", json={"model": srv.model, "messages": MSGS, "max_tokens": 4,
                                                              "logprobs": "true", "top_logprobs": -1})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
    for body, param in (({"prompt_logprobs": -1, "max_tokens": 1}, "prompt_logprobs"),  # the prompt is > 4 tokens
                        ({"logprobs": "true", "top_logprobs": -1, "max_tokens": 5}, "top_logprobs")):
        r = httpx.post(srv.base_url + "/chat/completions", json={"model": srv.model, "messages": MSGS, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
        assert f"whole vocabulary ({vocab} entries)" in err["message"] and str(vocab * 4) in err["message"]
    r = httpx.post(srv.base_url + "/chat/completions", json={"model": srv.model, "messages": MSGS, "max_tokens": 1,
                                                             "logprobs": "true", "top_logprobs": 21})
    assert r.status_code == 400 and "greater than max allowed: 20" in r.json()["error"]["message"]  # n > 20: vLLM's


def test_load_counts_a_request_without_model(srv, gate):
    load = lambda: httpx.get(srv.url + "/load").json()["server_load"]  # noqa: E731
    assert load() == 0
    gate.clear()
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(srv.base_url + "/completions", timeout=60, json={
        "prompt": "Give me a long story", "max_tokens": 20, "temperature": 0})))
    t.start()
    try:
        assert wait_until(lambda: load() == 1)  # admitted and held: in flight
    finally:
        gate.set()
        t.join(60)
    assert out[0].status_code == 200 and out[0].json()["model"] == srv.model
    assert wait_until(lambda: load() == 0)


def test_invocations_body_is_the_chat_body(srv, client):
    request_args = {"model": srv.model, "messages": MSGS, "max_completion_tokens": 5, "temperature": 0.0,
                    "logprobs": False}
    chat_output = client.chat.completions.create(**request_args).model_dump()
    invocation_output = httpx.post(srv.url + "/invocations", json=request_args).json()
    assert chat_output.keys() == invocation_output.keys()
    assert chat_output["choices"] == invocation_output["choices"]
    raw_chat = httpx.post(srv.base_url + "/chat/completions", json=request_args).json()
    assert raw_chat.keys() == invocation_output.keys() and raw_chat["choices"] == invocation_output["choices"]
    body = {"model": srv.model, "prompt": "Hi", "max_tokens": 3, "temperature": 0}
    completion = client.completions.create(**body).model_dump()
    invocation_output = httpx.post(srv.url + "/invocations", json=body).json()
    assert completion.keys() == invocation_output.keys() and completion["choices"] == invocation_output["choices"]
