"""Metric semantics as vLLM defines them: a request with n choices is one request (prompt tokens,
request_success and e2e latency once), generation tokens are the tokens the requests report in their usage
(stop-string cuts excluded), and inter-token latency is one sample per emission."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_fixtures import ServerThread, wait_until

M = "nextn_"


@pytest.fixture(scope="module")
def plain():
    with ServerThread(num_speculative_tokens=0, max_model_len=1024) as s:
        yield s


def _idle(s: ServerThread) -> None:
    assert wait_until(lambda: s.worker.num_active == 0 and s.worker.num_waiting == 0, timeout=30)


def test_n_choices_are_one_request(plain):
    s = plain
    c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
    before = {k: s.metric(M + k) for k in ("prompt_tokens_total", "e2e_request_latency_seconds_count")}
    ok_before = s.metric(M + "request_success_total", finished_reason="length")
    r = c.completions.create(model=s.model, prompt="The quick brown fox", max_tokens=6, n=2, temperature=0.7,
                             seed=3, extra_body={"ignore_eos": True})
    _idle(s)
    assert len(r.choices) == 2
    assert s.metric(M + "prompt_tokens_total") - before["prompt_tokens_total"] == r.usage.prompt_tokens
    assert s.metric(M + "e2e_request_latency_seconds_count") - before["e2e_request_latency_seconds_count"] == 1
    assert s.metric(M + "request_success_total", finished_reason="length") - ok_before == 1


def test_generation_tokens_equal_the_usage_sum(plain):
    s = plain
    c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
    before = s.metric(M + "generation_tokens_total")
    greedy = c.completions.create(model=s.model, prompt="Hello world!", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
    assert stop.strip(), greedy
    total = 0
    r = c.completions.create(model=s.model, prompt="Hello world!", max_tokens=24, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 24  # cut by the stop string
    total += r.usage.completion_tokens
    stream = c.completions.create(model=s.model, prompt="Hi", max_tokens=9, n=2, temperature=0.5, seed=1, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    total += [ch for ch in stream if ch.usage is not None][-1].usage.completion_tokens
    _idle(s)
    assert s.metric(M + "generation_tokens_total") - before == 24 + total


def test_one_itl_sample_per_emission(plain):
    s = plain  # K = 0: every token is its own emission
    before = s.metric(M + "inter_token_latency_seconds_count")
    r = httpx.post(s.base_url + "/completions", json={"model": s.model, "prompt": "Hi", "max_tokens": 17,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    _idle(s)
    assert r["usage"]["completion_tokens"] == 17
    assert s.metric(M + "inter_token_latency_seconds_count") - before == 16
