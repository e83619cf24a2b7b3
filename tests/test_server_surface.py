"""The OpenAI / vLLM request surface: every field a client sends is honoured or refused with a 400 naming it.
One test per row of the field table (chat and completions where both apply, streamed and not), with the official
`openai` client where it can send the field and httpx otherwise; the Responses API with the SDK's create and
stream; vLLM's /version, /tokenize, /detokenize. A real uvicorn on the tiny model (K = 3), and on the demo."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from engine.cache import TAIL_MARGIN
from engine.spec import SpecSampling, SpecSession
from tests.server_fixtures import ServerThread, tiny_model_and_tokenizer

MSGS = [{"role": "user", "content": "Hello world!"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def srv():
    with ServerThread(max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok():
    return tiny_model_and_tokenizer()[1]


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json={"model": srv.model, **body}, timeout=60)


def sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert all(w in err["message"] for w in words), err["message"]


def plain(prompt_ids: list[int], n: int, sampling: SpecSampling = SpecSampling(), eos=None) -> list[int]:
    """The engine's plain greedy decode (K = 0), the reference for the server's K = 3 output."""
    model, tok = tiny_model_and_tokenizer()
    return SpecSession(model, prompt_ids, n, k=0, sampling=sampling,
                       eos_ids=tok.eos_token_ids if eos is None else eos).run()


def chat_ids(client, srv, **kw):
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.chat.completions.create(model=srv.model, messages=MSGS, **{"temperature": 0, **kw}, extra_body=extra)
    return r, r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]


# ------------------------------------------------------------------------------------- sampling fields


def test_logit_bias_applied_exact_and_bounded(client, srv, tok):
    free = client.completions.create(model=srv.model, prompt="The quick", max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = free.choices[0].model_extra["token_ids"]
    bias = {str(ids[0]): -100, str(ids[1]): -100, "65": 3.0}
    r = client.completions.create(model=srv.model, prompt="The quick", max_tokens=12, temperature=0, logit_bias=bias,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    got = r.choices[0].model_extra["token_ids"]
    ref = plain(r.choices[0].model_extra["prompt_token_ids"], 12,
                SpecSampling(logit_bias=((ids[0], -100.0), (ids[1], -100.0), (65, 3.0))), eos=[])
    assert got == ref and got != ids and ids[0] not in got  # K = 3 through the server == K = 0
    forced = {"80": 100}  # +100 wins every position, greedy or sampled, chat or completions, streamed or not
    r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=6, temperature=0, logit_bias=forced,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == [80] * 6
    r, _, out = chat_ids(client, srv, max_tokens=6, temperature=1.0, seed=3, logit_bias=forced,
                         extra_body={"ignore_eos": True})
    assert out == [80] * 6
    chunks = list(client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=6, logit_bias=forced,
                                                 stream=True, extra_body={"return_token_ids": True,
                                                                          "ignore_eos": True}))
    assert sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks if c.choices), []) == [80] * 6
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", {"messages": MSGS})):
        vocab = tiny_model_and_tokenizer()[0].config.vocab_size  # padding rows past the tokenizer's are ids too
        assert_400(post(srv, path, {**body, "logit_bias": {str(vocab): 1}}), "logit_bias", str(vocab),
                   f"vocabulary size is {vocab}")
        assert_400(post(srv, path, {**body, "logit_bias": {"5": 101}}), "logit_bias.5")


def test_min_tokens_and_stop_token_ids(client, srv, tok):
    r, prompt, free = chat_ids(client, srv, max_tokens=20, extra_body={"ignore_eos": True})
    stop = free[2]
    r, _, out = chat_ids(client, srv, max_tokens=20, extra_body={"stop_token_ids": [stop]})
    assert out == plain(prompt, 20, eos=tok.eos_token_ids + [stop]) and out[-1] == stop
    assert r.choices[0].finish_reason == "stop" and len(out) <= 3
    c = client.completions.create(model=srv.model, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [stop], "return_token_ids": True})
    assert c.choices[0].model_extra["token_ids"] == out and c.choices[0].finish_reason == "stop"
    assert c.choices[0].text == tok.decode(out[:-1], skip_special_tokens=True)  # the stop token's text is not output
    r, _, out = chat_ids(client, srv, max_tokens=20, extra_body={"stop_token_ids": [stop], "min_tokens": 8})
    assert len(out) >= 8 and stop not in out[:8]
    assert out == plain(prompt, 20, SpecSampling(min_tokens=8), eos=tok.eos_token_ids + [stop])
    st = client.completions.create(model=srv.model, prompt=prompt, max_tokens=20, temperature=0,
                                   stream=True, extra_body={"stop_token_ids": [stop], "min_tokens": 8,
                                                            "return_token_ids": True})
    chunks = [c for c in st if c.choices]
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == out
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", {"messages": MSGS})):
        vocab = tiny_model_and_tokenizer()[0].config.vocab_size  # padding rows past the tokenizer's are ids too
        assert_400(post(srv, path, {**body, "stop_token_ids": [vocab + 3]}), "stop_token_ids", str(vocab + 3),
                   f"vocabulary size is {vocab}")
        assert_400(post(srv, path, {**body, "min_tokens": 9, "max_tokens": 4}), "min_tokens")
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "min_tokens": 2,
                                               "response_format": {"type": "json_object"}}), "min_tokens", "grammar")


def test_seed_is_int64(srv):
    for seed, n in ((2**63, 1), (-(2**63) - 1, 1), (2**63 - 1, 2)):
        for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", {"messages": MSGS})):
            assert_400(post(srv, path, {**body, "seed": seed, "n": n, "max_tokens": 2}), "seed")
    assert post(srv, "/completions", {"prompt": "Hi", "seed": 2**63 - 1, "max_tokens": 2,
                                      "temperature": 1}).status_code == 200


def test_stream_options_needs_stream(srv):
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", {"messages": MSGS})):
        assert_400(post(srv, path, {**body, "stream_options": {"include_usage": True}}), "stream_options")


# ----------------------------------------------------------------------------------------- completions


def test_completions_echo_with_and_without_logprobs(client, srv, tok):
    prompt = "The quick brown fox"
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    plain_r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text == prompt + plain_r.choices[0].text
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, len(lp.tokens)))
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(prompt)
    chunks = list(client.completions.create(model=srv.model, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs


def test_completions_prompt_lists_times_n(client, srv, tok):
    one = [client.completions.create(model=srv.model, prompt=x, max_tokens=6, temperature=0) for x in ("a", "bc")]
    r = client.completions.create(model=srv.model, prompt=["a", "bc"], max_tokens=6, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [one[0].choices[0].text] * 2 + [one[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == len(tok.encode("a")) + len(tok.encode("bc"))
    assert r.usage.completion_tokens == 2 * (one[0].usage.completion_tokens + one[1].usage.completion_tokens)
    ids = [tok.encode("a"), tok.encode("bc")]
    r2 = client.completions.create(model=srv.model, prompt=ids, max_tokens=6, n=2, temperature=0)
    assert [c.text for c in r2.choices] == [c.text for c in r.choices]
    texts = ["", "", "", ""]
    for c in client.completions.create(model=srv.model, prompt=ids, max_tokens=6, n=2, temperature=0, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in r.choices]
    assert_400(post(srv, "/completions", {"prompt": ["x"] * 129}), "prompt")
    assert_400(post(srv, "/completions", {"prompt": [[1, 2], [10 ** 6]]}), "prompt.1", str(10 ** 6))


def test_completions_structured_outputs_per_choice(client, srv):
    import re

    rx = r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."
    r = client.completions.create(model=srv.model, prompt=["Hi", "Numbers"], n=2, max_tokens=30, temperature=0.8,
                                  seed=4, extra_body={"structured_outputs": {"regex": rx}})
    assert len(r.choices) == 4
    assert all(re.fullmatch(rx, c.text) for c in r.choices if c.finish_reason == "stop")
    assert sum(c.finish_reason == "stop" for c in r.choices) >= 3
    assert_400(post(srv, "/completions", {"prompt": "Hi", "structured_outputs": {"regex": "(("}}),
               "structured_outputs.regex")


def test_completions_logprobs_zero_gives_the_sampled_token(client, srv):
    r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    assert all(top == {t: v} for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))


def test_prompt_ids_in_the_padding_rows_are_refused(srv, tok):
    model, _ = tiny_model_and_tokenizer()
    assert model.config.vocab_size > tok.vocab_size  # the tiny model pads its vocabulary
    assert_400(post(srv, "/completions", {"prompt": [1, tok.vocab_size]}), "prompt", str(tok.vocab_size))
    assert post(srv, "/completions", {"prompt": [1, tok.vocab_size - 1], "max_tokens": 1}).status_code == 200


def test_suffix_and_best_of_are_refused(srv):
    assert_400(post(srv, "/completions", {"prompt": "Hi", "suffix": "end"}), "suffix")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "best_of": 3}), "best_of")
    assert post(srv, "/completions", {"prompt": "Hi", "best_of": 1, "max_tokens": 1}).status_code == 200


# ----------------------------------------------------------------------------------- usage and logprobs


def test_usage_prompt_tokens_details(client, srv):
    msgs = [{"role": "user", "content": "A question no earlier test asked: what does a prefix cache keep?"}]
    r = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=3)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    n = r.usage.prompt_tokens
    r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=3)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    last = list(client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=3, stream=True,
                                               stream_options={"include_usage": True}))[-1]
    # the same prompt again resumes at its tail (on the C path a prompt keeps its state TAIL_MARGIN tokens before
    # its end)
    assert last.usage.prompt_tokens_details.cached_tokens == n - TAIL_MARGIN > 0


def test_continuous_usage_stats(client, srv):
    for create, kw in ((client.chat.completions.create, {"messages": MSGS}),
                       (client.completions.create, {"prompt": "Hi"})):
        chunks = list(create(model=srv.model, max_tokens=8, stream=True, extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
        assert all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[-1] == 8
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_prompt_logprobs(client, srv, tok):
    r = client.completions.create(model=srv.model, prompt="The quick brown", max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    ids = tok.encode("The quick brown")
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for t, entry in zip(ids[1:], plp[1:]):
        assert str(t) in entry and 2 <= len(entry) <= 3
        assert entry[str(t)]["decoded_token"] == tok.decode([t])
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and entry[str(t)]["logprob"] <= 0
    c = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2,
                                       extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(c.model_extra["prompt_token_ids"]) and plp[0] is None
    assert all(len(e) == 1 and e[next(iter(e))]["rank"] >= 1 for e in plp[1:])
    assert_400(post(srv, "/completions", {"prompt": "Hi", "prompt_logprobs": -2}), "prompt_logprobs")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}), "prompt_logprobs")


def test_return_tokens_as_token_ids(client, srv):
    r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=3, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for d in r.choices[0].logprobs.top_logprobs for k in d)
    c = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    content = c.choices[0].logprobs.content
    assert [x.token for x in content] == [f"token_id:{t}" for t in c.choices[0].model_extra["token_ids"]]
    assert all(t.token.startswith("token_id:") for x in content for t in x.top_logprobs)


def test_truncate_prompt_tokens(client, srv, tok):
    text = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=srv.model, prompt=text, max_tokens=2, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == tok.encode(text)[-4:] and r.usage.prompt_tokens == 4
    c = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert len(c.model_extra["prompt_token_ids"]) == 5 and c.usage.prompt_tokens == 5


# ------------------------------------------------------------------------------------------------ chat


ASSISTANT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello, my friend"}]


def test_continue_final_message_add_generation_prompt_and_echo(client, srv, tok):
    body = {"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    r = client.chat.completions.create(model=srv.model, messages=ASSISTANT, max_tokens=5, temperature=0,
                                       extra_body=body)
    prompt = tok.decode(r.model_extra["prompt_token_ids"])
    assert prompt.endswith("Hello, my friend") and "<|im_end|>" not in prompt.split("assistant")[-1]
    assert not r.choices[0].message.model_extra.get("reasoning_content")  # the think block is closed
    e = client.chat.completions.create(model=srv.model, messages=ASSISTANT, max_tokens=5, temperature=0,
                                       extra_body={**body, "echo": True})
    assert e.choices[0].message.content == "Hello, my friend" + (r.choices[0].message.content or "")
    chunks = list(client.chat.completions.create(model=srv.model, messages=ASSISTANT, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={**body, "echo": True}))
    assert chunks[0].choices[0].delta.content == "Hello, my friend"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == e.choices[0].message.content
    no_gen = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2,
                                            extra_body={"add_generation_prompt": False, "return_token_ids": True})
    assert tok.decode(no_gen.model_extra["prompt_token_ids"]).endswith("<|im_end|>\n")
    echo_user = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2, temperature=0,
                                               extra_body={"echo": True, **NO_THINK})
    assert not (echo_user.choices[0].message.content or "").startswith("Hello world!")  # role differs: no echo
    assert_400(post(srv, "/chat/completions", {"messages": ASSISTANT, "continue_final_message": True}),
               "continue_final_message")


def test_reasoning_effort_none_turns_thinking_off(client, srv):
    a = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2,
                                       extra_body={"return_token_ids": True, **NO_THINK})
    b = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2, reasoning_effort="none",
                                       extra_body={"return_token_ids": True})
    assert a.model_extra["prompt_token_ids"] == b.model_extra["prompt_token_ids"]


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("web_search_options", {})])
def test_known_fields_that_cannot_be_honoured_are_400(srv, field, value):
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, field: value}), field)


# ------------------------------------------------------------------------------------- routes (vLLM, models)


def test_models_retrieve(client, srv):
    m = client.models.retrieve(srv.model)
    assert m.id == srv.model and m.object == "model" and m.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert "does not exist" in str(e.value)


def test_version_tokenize_detokenize(srv, tok):
    assert httpx.get(srv.url + "/version").json() == {"version": srv.app.version}
    r = httpx.post(srv.url + "/tokenize", json={"model": srv.model, "prompt": "Hello world",
                                                "return_token_strs": True}).json()
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert r == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": [tok.decode([t]) for t in ids]}
    r = httpx.post(srv.url + "/tokenize", json={"messages": MSGS}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True))
    assert "token_strs" not in r
    d = httpx.post(srv.url + "/detokenize", json={"model": srv.model, "tokens": ids}).json()
    assert d == {"prompt": tok.decode(ids)}
    assert_400(httpx.post(srv.url + "/detokenize", json={"tokens": [tok.vocab_size]}), "tokens")
    assert_400(httpx.post(srv.url + "/detokenize", json={"tokens": [True]}), "tokens.0")
    assert_400(httpx.post(srv.url + "/tokenize", json={"prompt": "a", "messages": MSGS}), "prompt")
    assert httpx.post(srv.url + "/tokenize", json={"model": "x", "prompt": "a"}).status_code == 404


# ------------------------------------------------------------------------------------------- Responses


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    capital: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def demo():
    with ServerThread(demo=True, max_model_len=1024) as s:
        yield s


def test_responses_create_and_stream(demo):
    c = openai.OpenAI(base_url=demo.base_url, api_key="unused", max_retries=0)
    kw = dict(model=demo.model, instructions="Be brief.", input="What is a for loop?", max_output_tokens=300,
              temperature=0)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.status == "completed" and r.output_text
    assert r.output[-1].type == "message" and r.output[-1].content[0].type == "output_text"
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens == 0
    assert u.model_extra["spec"]["rounds"] >= 1
    chat = c.chat.completions.create(model=demo.model, temperature=0, max_tokens=300,
                                     messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "What is a for loop?"}])
    assert r.output_text == chat.choices[0].message.content
    with c.responses.stream(**kw) as st:
        types = [ev.type for ev in st]
        final = st.get_final_response()
    assert final.output_text == r.output_text and final.status == "completed"
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.output_text.delta" in types and types.count("response.output_item.done") == len(final.output)
    short = c.responses.create(model=demo.model, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is a for loop?"}]}], max_output_tokens=5)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_text_format_and_refusals(demo):
    c = openai.OpenAI(base_url=demo.base_url, api_key="unused", max_retries=0)
    r = c.responses.parse(model=demo.model, input="What is the capital of France? Answer in JSON.", text_format=City,
                          temperature=0, max_output_tokens=100)
    assert isinstance(r.output_parsed, City)
    jsonschema.validate(json.loads(r.output_text), City.model_json_schema())
    for field, value in (("previous_response_id", "resp_x"), ("tools", [{"type": "web_search"}]),
                         ("background", True), ("include", ["reasoning.encrypted_content"])):
        r = httpx.post(demo.base_url + "/responses", json={"model": demo.model, "input": "Hi", field: value})
        assert_400(r, field)
    r = httpx.post(demo.base_url + "/responses", json={"model": demo.model, "input": [
        {"type": "function_call_output", "call_id": "c", "output": "1"}]})
    assert_400(r, "input.0.type")


def test_readme_field_table_lists_every_request_field():
    import re
    from pathlib import Path

    from server import protocol as p

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("### Request fields")[1].split("\n\n`usage`")[0]
    named = set(re.findall(r"`([a-z_]+)`", table))
    for model in (p.ChatCompletionRequest, p.CompletionRequest):
        missing = set(model.model_fields) - named
        assert not missing, f"README's field table misses {sorted(missing)}"
    responses = readme.split("`POST /v1/responses` takes")[1].split("Streaming sends")[0]
    missing = {f for f in p.ResponsesRequest.model_fields if f"`{f}`" not in responses and f"`{f}." not in responses}
    assert not missing, f"README's Responses paragraph misses {sorted(missing)}"


# ------------------------------------------------------ each row through both endpoints, streamed and not


@dataclasses.dataclass
class Out:
    """One choice of a request, read back the same way whichever endpoint and mode produced it."""

    token_ids: list[int]
    prompt_token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Any
    logprob_tokens: list[str]


def generate(client, srv, chat: bool, stream: bool, **kw) -> Out:
    """One request with the official client: chat (MSGS) or completions (`prompt`, default "Hi"), streamed (with
    include_usage) or not; vLLM's extras in `extra` go through extra_body, with return_token_ids."""
    extra = {"return_token_ids": True, **kw.pop("extra", {})}
    prompt = kw.pop("prompt", "Hi")
    if chat:
        top = kw.pop("logprobs", None)  # completions' count -> chat's logprobs + top_logprobs
        kw = {"messages": MSGS, **kw, **({"logprobs": True, "top_logprobs": top} if top is not None else {})}
        create = client.chat.completions.create
    else:
        kw = {"prompt": prompt, **kw}
        create = client.completions.create
    if stream:
        kw["stream_options"] = {"include_usage": True}
    r = create(model=srv.model, stream=stream, extra_body=extra, **{"temperature": 0, **kw})
    if not stream:
        c = r.choices[0]
        lp = ([x.token for x in c.logprobs.content] if chat else c.logprobs.tokens) if c.logprobs else []
        prompt_ids = (r if chat else c).model_extra["prompt_token_ids"]
        return Out(c.model_extra["token_ids"], prompt_ids, (c.message.content or "") if chat else c.text,
                   c.finish_reason, r.usage, lp)
    out = Out([], [], "", None, None, [])
    for ch in r:
        extra_top = ch.model_extra.get("prompt_token_ids") if chat else None
        out.prompt_token_ids += extra_top or []
        if ch.usage is not None:
            out.usage = ch.usage
        for c in ch.choices:
            out.prompt_token_ids += (c.model_extra.get("prompt_token_ids") or []) if not chat else []
            out.token_ids += c.model_extra.get("token_ids") or []
            out.text += (c.delta.content or "") if chat else c.text
            out.finish_reason = c.finish_reason or out.finish_reason
            if c.logprobs:
                out.logprob_tokens += [x.token for x in c.logprobs.content] if chat else c.logprobs.tokens
    return out


BOTH = pytest.mark.parametrize("chat,stream", [(False, False), (False, True), (True, False), (True, True)],
                               ids=["text", "text-stream", "chat", "chat-stream"])


@BOTH
def test_logit_bias_every_endpoint_and_mode(client, srv, chat, stream):
    free = generate(client, srv, chat, False, max_tokens=8, extra={"ignore_eos": True})
    bias = {str(free.token_ids[0]): -100, str(free.token_ids[1]): -100, "65": 2.5}
    got = generate(client, srv, chat, stream, max_tokens=8, logit_bias=bias, extra={"ignore_eos": True})
    ref = plain(free.prompt_token_ids, 8, SpecSampling(logit_bias=((free.token_ids[0], -100.0),
                                                                   (free.token_ids[1], -100.0), (65, 2.5))), eos=[])
    assert got.token_ids == ref and free.token_ids[0] not in ref  # K = 3 through the server == K = 0
    sampled = generate(client, srv, chat, stream, max_tokens=5, temperature=1.0, seed=11, logit_bias={"80": 100},
                       extra={"ignore_eos": True})
    assert sampled.token_ids == [80] * 5


@BOTH
def test_stop_token_ids_and_min_tokens_every_endpoint_and_mode(client, srv, tok, chat, stream):
    free = generate(client, srv, chat, False, max_tokens=16, extra={"ignore_eos": True})
    stop = free.token_ids[2]
    out = generate(client, srv, chat, stream, max_tokens=16, extra={"stop_token_ids": [stop]})
    ref = plain(free.prompt_token_ids, 16, eos=tok.eos_token_ids + [stop])
    assert out.token_ids == ref and ref[-1] == stop and out.finish_reason == "stop"
    held = generate(client, srv, chat, stream, max_tokens=16, extra={"stop_token_ids": [stop], "min_tokens": 6})
    ref = plain(free.prompt_token_ids, 16, SpecSampling(min_tokens=6), eos=tok.eos_token_ids + [stop])
    assert held.token_ids == ref and len(ref) >= 6 and stop not in ref[:6]


@BOTH
def test_usage_details_truncation_and_token_id_names_every_endpoint_and_mode(client, srv, tok, chat, stream):
    text = "The quick brown fox jumps over the lazy dog"
    out = generate(client, srv, chat, stream, prompt=text, max_tokens=3, logprobs=1,
                   extra={"truncate_prompt_tokens": 4, "return_tokens_as_token_ids": True})
    assert len(out.prompt_token_ids) == 4 and out.usage.prompt_tokens == 4
    if not chat:
        assert out.prompt_token_ids == tok.encode(text)[-4:]
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.logprob_tokens == [f"token_id:{t}" for t in out.token_ids]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_zero_streamed_and_not(client, srv, stream):
    r = client.completions.create(model=srv.model, prompt="Hi", max_tokens=4, temperature=0, logprobs=0,
                                  stream=stream, extra_body={"ignore_eos": True})
    pieces = list(r) if stream else [r]
    lps = [c.choices[0].logprobs for c in pieces if c.choices]
    tokens, values = sum((x.tokens for x in lps), []), sum((x.token_logprobs for x in lps), [])
    tops = sum((x.top_logprobs for x in lps), [])
    assert len(tops) == 4 and all(top == {t: v} for top, t, v in zip(tops, tokens, values))


def test_prompt_logprobs_with_stream_is_400_in_chat_too(srv):
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "prompt_logprobs": 1, "stream": True}),
               "prompt_logprobs")
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "prompt_logprobs": -2}), "prompt_logprobs")


@BOTH
def test_structured_outputs_choice_every_endpoint_and_mode(client, srv, chat, stream):
    out = generate(client, srv, chat, stream, max_tokens=10, temperature=0.7, seed=2,
                   extra={"structured_outputs": {"choice": ["alpha", "beta gamma"]}, **NO_THINK})
    assert out.text in ("alpha", "beta gamma") and out.finish_reason == "stop"
