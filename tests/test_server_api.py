"""The OpenAI API end to end: a real uvicorn server on the tiny checkpoint, driven by the official
`openai` client (sync and async) and httpx."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from engine.spec import SpecSession
from grammar import split_reasoning
from server.serving import ChoiceState
from server.worker import JobEvent
from tests.server_fixtures import API_KEY, ServerThread, gated_sessions, tiny_model_and_tokenizer, wait_until

#: Completions whose prompt is exactly these ids raise inside `step` after two tokens (test hook).
FAIL_PROMPT = [5, 5, 5, 5, 5]
MAX_MODEL_LEN = 1024
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


class ExplodingSession(SpecSession):
    """A real session whose round raises once it has emitted 2 tokens, for FAIL_PROMPT only."""

    def commit_round(self, *args, **kwargs) -> None:
        if self.prompt_ids == FAIL_PROMPT and len(self.emitted) >= 2:
            raise RuntimeError("injected failure")
        super().commit_round(*args, **kwargs)


@pytest.fixture(scope="module")
def srv():
    with ServerThread(worker_kw={"session_factory": ExplodingSession}, api_key=API_KEY,
                      max_model_len=MAX_MODEL_LEN, spec_adaptive=False) as s:  # drafted counts at fixed K
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def plain_greedy(prompt_ids: list[int], max_new: int, eos: bool = True) -> list[int]:
    """The engine's plain greedy decode (no speculation): the reference for temperature 0."""
    model, tok = tiny_model_and_tokenizer()
    return SpecSession(model, prompt_ids, max_new, k=0, eos_ids=tok.eos_token_ids if eos else ()).run()


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    _, tok = tiny_model_and_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def collect_sse(resp: httpx.Response) -> list[dict | str]:
    """Parse an SSE body into JSON payloads (and the literal "[DONE]")."""
    out: list[dict | str] = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --------------------------------------------------------------------------- detokenizing, stop strings


def test_stop_string_spanning_tokens_is_never_released():
    _, tok = tiny_model_and_tokenizer()
    ids = tok.encode("Hello world! The quick brown fox")
    st = ChoiceState(0, tok, [], ["quick", "The end"])
    released, fed = "", 0
    for t in ids:
        fed += 1
        d = st.feed(JobEvent(0, [t]))
        released += d.text
        if d.finish_reason:
            break
        assert any(stop.startswith(st.held) for stop in st.matcher.stops)  # only a possible stop prefix is held
    assert (released, st.text, st.finish_reason, st.stopped) == ("Hello world! The ", "Hello world! The ", "stop", True)
    assert st.token_ids == ids[:fed] and tok.decode(st.token_ids).endswith("quick")


def test_false_stop_prefix_is_released_at_the_end():
    _, tok = tiny_model_and_tokenizer()
    ids = tok.encode("Hello world! The")
    st = ChoiceState(0, tok, [], ["The end"])
    released = "".join(st.feed(JobEvent(0, [t])).text for t in ids)
    assert released == "Hello world! "  # "The" might still become "The end"
    d = st.feed(JobEvent(0, [], done=True, finish_reason="length"))
    assert (d.text, d.finish_reason, st.text) == ("The", "length", "Hello world! The")


@pytest.mark.parametrize("split", [False, True])
def test_stop_strings_are_dormant_inside_reasoning(split):
    """Thinking on: a stop string in the reasoning (or in `</think>` itself, or in the whitespace the split drops
    after it) does not cut; the first one in the answer does. Tokens fed one by one, or all in one event (a
    spec round that accepts `</think>` and the answer together)."""
    _, tok = tiny_model_and_tokenizer()
    text = "The end of a quick thought.</think>\n\nHello. The end is near"
    ids = tok.encode(text)
    st = ChoiceState(0, tok, [], ["The end", "th", "\n\n", "ink"], reasoning=True)
    events = [JobEvent(0, ids)] if split else [JobEvent(0, [t]) for t in ids]
    out = "".join(st.feed(ev).text for ev in events)
    assert (out, st.finish_reason) == ("The end of a quick thought.</think>\n\nHello. ", "stop")
    assert split_reasoning(out, True)[1] == "Hello. "
    plain = ChoiceState(0, tok, [], ["The end"])  # no reasoning: the first occurrence cuts
    assert "".join(plain.feed(JobEvent(0, [t])).text for t in ids) == ""


# ------------------------------------------------------------------------------------------ basics


def test_health_ready_metrics_need_no_key(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/ready").json() == {"status": "ready"}
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and "nextn_num_requests_running" in r.text


def test_models_lists_served_model(client, srv):
    models = client.models.list()
    assert [m.id for m in models.data] == [srv.model]
    assert models.data[0].object == "model"


def test_chat_non_stream_shape_and_spec_usage(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == srv.model
    assert r.created > 0 and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(chat_prompt_ids(MESSAGES))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 1 <= u.completion_tokens <= 12
    spec = u.model_extra["spec"]
    k = srv.settings.num_speculative_tokens
    assert set(spec) == {"rounds", "drafted", "accepted", "acceptance_rate", "pos_drafted", "pos_accepted", "mean_k"}
    assert 0 <= spec["mean_k"] <= k
    assert len(spec["pos_drafted"]) == k and len(spec["pos_accepted"]) == k
    assert spec["rounds"] >= 1 and spec["drafted"] == sum(spec["pos_drafted"])
    assert spec["acceptance_rate"] == (spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0)


def test_greedy_chat_equals_plain_decode(client, srv):
    """temperature 0 through the server (K=3) == the engine's plain greedy decode (k=0)."""
    r = client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=40, temperature=0,
                                       extra_body={"return_token_ids": True})
    prompt = chat_prompt_ids(MESSAGES)
    assert r.model_extra["prompt_token_ids"] == prompt
    ref = plain_greedy(prompt, 40)
    assert r.choices[0].model_extra["token_ids"] == ref
    _, tok = tiny_model_and_tokenizer()
    reasoning, content = split_reasoning(tok.decode(ref, skip_special_tokens=True))  # thinking is on by default
    m = r.choices[0].message
    assert (m.model_extra.get("reasoning_content"), m.content) == (reasoning, content)
    assert r.usage.completion_tokens == len(ref)


def test_developer_role_text_parts_and_tool_turns(client, srv):
    same = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}]
    r = client.chat.completions.create(model=srv.model, messages=same, max_tokens=2,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == chat_prompt_ids(MESSAGES)  # developer == system
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    turns = [{"role": "user", "content": "Add"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    r = client.chat.completions.create(model=srv.model, messages=turns, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_equals_non_stream(client, srv):
    kw = dict(model=srv.model, messages=MESSAGES, max_tokens=30, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (text or None) == full.choices[0].message.content
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert (reasoning or None) == full.choices[0].message.model_extra.get("reasoning_content")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format(srv):
    body = {"model": srv.model, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", srv.base_url + "/chat/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.split("\n\n") if block)


def test_completions_text_and_token_prompt(client, srv):
    _, tok = tiny_model_and_tokenizer()
    text = "The quick brown fox"
    kw = dict(model=srv.model, max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
    a = client.completions.create(prompt=text, **kw)
    b = client.completions.create(prompt=tok.encode(text), **kw)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.choices[0].text == b.choices[0].text
    ref = plain_greedy(tok.encode(text), 20)
    assert a.choices[0].model_extra["token_ids"] == ref
    assert a.choices[0].model_extra["prompt_token_ids"] == tok.encode(text)
    chunks = list(client.completions.create(prompt=text, stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), []) == ref


def test_seeded_sampling_repeats(client, srv):
    kw = dict(model=srv.model, prompt="Numbers 0 1 2", max_tokens=24, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=99, **kw).choices[0].text
    assert a == b
    assert a != c


def test_n_choices_are_indexed(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7,
                                       n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({c.message.model_extra.get("reasoning_content") for c in r.choices}) > 1  # seed + i per choice
    chunks = list(client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=8,
                                                 temperature=1.0, seed=7, n=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += (c.delta.model_extra.get("reasoning_content") or "") + (c.delta.content or "")
    assert texts == [(c.message.model_extra.get("reasoning_content") or "") + (c.message.content or "")
                     for c in r.choices]


def test_stop_string_cuts_text_and_frees_session(client, srv):
    kw = dict(model=srv.model, prompt="Hello world! The quick", max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 12
    stop = full[6:9]
    expect = full[:full.find(stop)]
    r = client.completions.create(stop=[stop, "never-there"], **kw)
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_until(lambda: srv.worker.num_active == 0, timeout=5)


def test_logprobs(client, srv):
    r = client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the top token
    c = client.completions.create(model=srv.model, prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 4
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)


def test_usage_spec_sums_to_metrics(client, srv):
    """The request's usage.spec equals the increase of the /metrics spec counters."""
    before = srv.metric("nextn_spec_decode_num_draft_tokens_total")
    rounds_before = srv.metric("nextn_spec_decode_num_drafts_total")
    r = client.completions.create(model=srv.model, prompt="Speculative decoding", max_tokens=30, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    spec = r.usage.model_extra["spec"]
    assert srv.metric("nextn_spec_decode_num_draft_tokens_total") - before == spec["drafted"] > 0
    assert srv.metric("nextn_spec_decode_num_drafts_total") - rounds_before == spec["rounds"]


# ------------------------------------------------------------------------------------- concurrency


def test_eight_concurrent_streams_match_single_requests(srv):
    prompts = [f"Client {i} says: the quick brown fox {i}" for i in range(8)]
    sync = openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0)
    single = [sync.completions.create(model=srv.model, prompt=p, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=srv.model, prompt=prompt, max_tokens=48, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == single
    assert wait_until(lambda: srv.worker.num_active == 0, timeout=5)


def _long_completion(srv) -> dict:
    return {"model": srv.model, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0,
            "ignore_eos": True, "stream": True}


def test_stream_disconnect_frees_session(srv):
    aborted = srv.metric("nextn_request_success_total", finished_reason="abort")
    with httpx.stream("POST", srv.base_url + "/completions", json=_long_completion(srv), headers=auth()) as r:
        lines = r.iter_lines()
        next(lines)
        assert srv.worker.num_active == 1
    assert wait_until(lambda: srv.worker.num_active == 0, timeout=5)
    assert wait_until(lambda: srv.metric("nextn_request_success_total", finished_reason="abort") == aborted + 1)


def test_non_stream_disconnect_frees_session(srv):
    aborted = srv.metric("nextn_request_success_total", finished_reason="abort")
    body = dict(_long_completion(srv), stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/completions", json=body, headers=auth(), timeout=httpx.Timeout(5, read=0.3))
    assert wait_until(lambda: srv.worker.num_active == 0, timeout=5)
    assert wait_until(lambda: srv.metric("nextn_request_success_total", finished_reason="abort") == aborted + 1)


def test_session_error_fails_only_that_request(client, srv):
    results: dict[str, object] = {}

    def healthy() -> None:
        results["ok"] = client.completions.create(model=srv.model, prompt="Hello world", max_tokens=60,
                                                  temperature=0, extra_body={"ignore_eos": True})

    t = threading.Thread(target=healthy)
    t.start()
    with pytest.raises(openai.InternalServerError) as e:
        # greedy + ignore_eos: the session cannot finish before it has emitted 2 tokens and raises
        client.completions.create(model=srv.model, prompt=FAIL_PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert "injected failure" in str(e.value)
    body = {"model": srv.model, "prompt": FAIL_PROMPT, "max_tokens": 20, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", srv.base_url + "/completions", json=body, headers=auth()) as r:
        events = collect_sse(r)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["type"] == "server_error" and "injected failure" in events[-2]["error"]["message"]
    t.join(30)
    assert results["ok"].choices[0].finish_reason == "length"
    assert srv.worker.alive
    again = client.completions.create(model=srv.model, prompt="Hello", max_tokens=3, temperature=0)
    assert again.choices[0].text is not None
    assert srv.metric("nextn_request_success_total", finished_reason="error") >= 2


# ------------------------------------------------------------------------------------------ errors


def _chat(srv, **over) -> dict:
    return {"model": srv.model, "messages": MESSAGES, "max_tokens": 4, **over}


BAD_REQUESTS = [
    # id, path, body (dict, or bytes sent raw), headers override, status, param
    ("malformed-json", "/chat/completions", b'{"model": ', None, 400, None),
    ("not-an-object", "/chat/completions", b"[1, 2]", None, 400, None),
    ("temperature-type", "/chat/completions", {"temperature": "hot"}, None, 400, "temperature"),
    ("messages-type", "/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("empty-messages", "/chat/completions", {"messages": []}, None, 400, "messages"),
    ("unknown-role", "/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages.0.role"),
    ("image-part-without-vision-tower", "/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400,
     "messages.0.content.0"),
    ("audio-part", "/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]}, None, 400,
     "messages.0.content.0"),
    ("max-tokens-zero", "/chat/completions", {"max_tokens": 0}, None, 400, "max_tokens"),
    ("max-completion-tokens-negative", "/chat/completions", {"max_completion_tokens": -1}, None, 400,
     "max_completion_tokens"),
    ("n-zero", "/chat/completions", {"n": 0}, None, 400, "n"),
    ("n-too-large", "/chat/completions", {"n": 1000}, None, 400, "n"),
    ("bad-response-format", "/chat/completions", {"response_format": {"type": "yaml"}}, None, 400,
     "response_format.type"),
    ("bad-tools", "/chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]}, None, 400,
     "tools[0].function.name"),
    ("unknown-model", "/chat/completions", {"model": "gpt-9"}, None, 404, "model"),
    ("missing-key", "/chat/completions", {}, {}, 401, None),
    ("bad-key", "/chat/completions", {}, {"Authorization": "Bearer nope"}, 401, None),
    ("prompt-over-context", "/completions", {"prompt": [1] * MAX_MODEL_LEN, "messages": None}, None, 400,
     "prompt"),
    ("prompt-plus-max-tokens-over-context", "/completions",
     {"prompt": [1] * 10, "max_tokens": MAX_MODEL_LEN, "messages": None}, None, 400, "max_tokens"),
    ("token-id-out-of-range", "/completions", {"prompt": [10 ** 6], "messages": None}, None, 400, "prompt"),
    ("unknown-route", "/nothing-here", {}, None, 404, None),
]


@pytest.mark.parametrize("path,body,headers,status,param", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(srv, path, body, headers, status, param):
    h = auth() if headers is None else headers
    if isinstance(body, bytes):
        r = httpx.post(srv.base_url + path, content=body, headers={**h, "content-type": "application/json"})
    else:
        payload = {k: v for k, v in _chat(srv, **body).items() if v is not None}
        r = httpx.post(srv.base_url + path, json=payload, headers=h)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(srv.base_url + "/completions", headers=auth(),
                    json={"model": srv.model, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200  # still serving


def test_body_too_large_is_413(srv):
    big = b'{"model": "x", "prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    r = httpx.post(srv.base_url + "/completions", content=big, headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_sdk_maps_errors_to_exceptions(client, srv):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=srv.model, messages=[], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=3)
    bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_fields_are_ignored(client, srv, caplog):
    with caplog.at_level("WARNING", logger="nextn.serving"):
        r = client.chat.completions.create(
            model=srv.model, max_tokens=2, messages=[{"role": "user", "content": "Hi", "mood": "happy"}],
            extra_body={"frobnicate": 1, "response_format": {"type": "text"},
                        "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert r.choices[0].message.content is not None
    lines = [rec.getMessage() for rec in caplog.records if "ignoring unknown request field" in rec.getMessage()]
    assert len(lines) == 1
    assert all(f in lines[0] for f in ("frobnicate", "messages.0.mood", "chat_template_kwargs.x"))
    assert "enable_thinking" not in lines[0] and "response_format" not in lines[0]


# ----------------------------------------------------------------------------- other server settings


def test_queue_full_gets_429_with_retry_after():
    gate = threading.Event()

    with ServerThread(worker_kw={"session_factory": gated_sessions(gate)}, max_num_seqs=1, max_queue=1) as s:
        body = {"model": s.model, "prompt": "Hi", "max_tokens": 2}
        done: list[int] = []
        threads = [threading.Thread(target=lambda: done.append(
            httpx.post(s.base_url + "/completions", json=body, timeout=30).status_code)) for _ in range(2)]
        threads[0].start()
        assert wait_until(lambda: s.worker.num_active == 1)
        threads[1].start()
        assert wait_until(lambda: s.worker.num_waiting == 1)
        r = httpx.post(s.base_url + "/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        n2 = httpx.post(s.base_url + "/completions", json={**body, "n": 2})
        assert n2.status_code == 400 and n2.json()["error"]["param"] == "n"
        gate.set()
        for t in threads:
            t.join(30)
        assert done == [200, 200]


def test_plain_decode_server_has_no_spec_usage_and_same_output(client, srv):
    kw = dict(prompt="The quick brown fox", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    spec_text = client.completions.create(model=srv.model, **kw).choices[0].text
    with ServerThread(num_speculative_tokens=0) as s:
        plain = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        r = plain.completions.create(model=s.model, **kw)
        assert r.choices[0].text == spec_text
        assert "spec" not in (r.usage.model_extra or {})
