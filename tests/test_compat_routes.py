"""vLLM's operational routes: /ping and /invocations (the SageMaker-style pair) and /load (the server-load figure),
through the official `openai` client's generic post (the routes are outside /v1) and httpx. A real uvicorn on the
tiny model."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.server_fixtures import API_KEY, ServerThread, gated_sessions, wait_until

MSGS = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def srv():
    with ServerThread(max_model_len=256, api_key=API_KEY) as s:
        yield s


def root_client(s: ServerThread, key: str | None = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=key or "wrong", max_retries=0)


def test_ping_is_health_by_get_and_post(srv):
    for method in ("GET", "POST"):
        r = httpx.request(method, srv.url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}  # no API key needed, as /health


def test_invocations_serve_chat_and_completion_bodies(srv):
    c = root_client(srv)
    chat = c.post("/invocations", cast_to=ChatCompletion, body={
        "model": srv.model, "messages": MSGS, "max_tokens": 3, "temperature": 0, "return_token_ids": True})
    direct = openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0).chat.completions.create(
        model=srv.model, messages=MSGS, max_tokens=3, temperature=0, extra_body={"return_token_ids": True})
    assert chat.object == "chat.completion" and chat.choices[0].token_ids == direct.choices[0].token_ids
    done = c.post("/invocations", cast_to=Completion, body={"model": srv.model, "prompt": "Hi", "max_tokens": 2})
    assert done.object == "text_completion" and done.usage.completion_tokens == 2
    stream = c.post("/invocations", cast_to=ChatCompletionChunk, stream=True,
                    stream_cls=openai.Stream[ChatCompletionChunk],
                    body={"model": srv.model, "messages": MSGS, "max_tokens": 3, "temperature": 0, "stream": True,
                          "return_token_ids": True})
    streamed = [t for chunk in stream if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids", [])]
    assert streamed == direct.choices[0].token_ids
    with pytest.raises(openai.BadRequestError) as e:  # neither messages nor prompt
        c.post("/invocations", cast_to=Completion, body={"model": srv.model, "max_tokens": 2})
    assert "messages" in e.value.message and "prompt" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a chat body's own error, named
        c.post("/invocations", cast_to=ChatCompletion, body={"model": srv.model, "messages": MSGS, "temperature": 9})
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):  # it generates: the API key applies, as on /v1
        root_client(srv, key=None).post("/invocations", cast_to=Completion,
                                        body={"model": srv.model, "prompt": "Hi", "max_tokens": 1})


def test_load_counts_generation_requests_in_flight():
    """From the body's arrival until the response is done: held requests count, streams until their last event or
    their client leaving; finished ones do not."""
    gate = threading.Event()
    with ServerThread(worker_kw={"session_factory": gated_sessions(gate)}, max_num_seqs=1) as s:
        load = lambda: httpx.get(s.url + "/load").json()["server_load"]  # noqa: E731
        assert load() == 0
        chat = {"model": s.model, "messages": MSGS, "max_tokens": 2, "stream": True}
        held = [threading.Thread(target=httpx.post, args=(s.base_url + "/completions",), kwargs={
            "json": {"model": s.model, "prompt": "Hi", "max_tokens": 2}, "timeout": 60}) for _ in range(2)]
        held.append(threading.Thread(target=lambda: httpx.post(s.base_url + "/chat/completions", json=chat,
                                                               timeout=60).text))
        for t in held:
            t.start()
        assert wait_until(lambda: load() == 3)  # the worker is held at the first prefill
        gate.set()
        for t in held:
            t.join(60)
        assert wait_until(lambda: load() == 0)
        gate.clear()
        with httpx.stream("POST", s.base_url + "/chat/completions", json=chat, timeout=60):
            assert wait_until(lambda: load() == 1)  # the stream has begun; its tokens are held
        assert wait_until(lambda: load() == 0)  # its client left
        gate.set()
        assert s.worker.alive
