"""vLLM's request and response fields as a vLLM client sends and reads them: token ids validated against the model's
vocabulary size (padding rows included), `top_logprobs` / `prompt_logprobs` -1 answered at the defaults (bounded by the response's size),
`truncation_side`, `logprob_token_ids`, the beam-search fields refused by name, roles other than OpenAI's through the
chat template, and vLLM's optional response fields present as null. A real uvicorn on the tiny model, the official
`openai` client (httpx where it cannot send the field)."""
from __future__ import annotations

import json
import math
import shutil

import httpx
import openai
import pytest

from engine.spec import SpecSampling, SpecSession
from engine.tokenizer import Tokenizer
from tests.server_fixtures import ServerThread, tiny_checkpoint, tiny_model_and_tokenizer

MSGS = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def srv():
    with ServerThread(max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def wide():
    """--max-logprobs -1: a request may ask for the whole vocabulary."""
    with ServerThread(max_model_len=256, max_logprobs=-1) as s:
        yield s


def client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)


def post(s: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.base_url + path, json={"model": s.model, **body}, timeout=60)


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert all(w in err["message"] for w in words), err["message"]


def vocab() -> int:
    return tiny_model_and_tokenizer()[0].config.vocab_size


# ------------------------------------------------------------------------------------------------ token ids


def test_logit_bias_and_stop_token_ids_take_any_row_of_the_model(srv):
    model, tok = tiny_model_and_tokenizer()
    pad = vocab() - 1
    assert pad >= tok.vocab_size  # a padding row: no token of the tokenizer
    c = client(srv)
    r = c.completions.create(model=srv.model, prompt="Hi", max_tokens=4, temperature=0, logit_bias={str(pad): 100},
                             extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == [pad] * 4 and r.choices[0].text == ""  # emitted, no text, nothing broke
    r = c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=6, temperature=0,
                                  logit_bias={str(pad): 100},
                                  extra_body={"stop_token_ids": [pad], "return_token_ids": True})
    assert r.choices[0].token_ids == [pad] and r.choices[0].finish_reason == "stop"
    ref = SpecSession(model, r.prompt_token_ids, 6, k=0, sampling=SpecSampling(logit_bias=((pad, 100.0),)),
                      eos_ids=tok.eos_token_ids + [pad]).run()
    assert ref == [pad]
    for body in ({"prompt": "Hi"}, {"messages": MSGS}):
        path = "/completions" if "prompt" in body else "/chat/completions"
        assert_400(post(srv, path, {**body, "logit_bias": {str(vocab()): 1}}), "logit_bias", str(vocab()),
                   f"vocabulary size is {vocab()}")
        assert_400(post(srv, path, {**body, "stop_token_ids": [vocab()]}), "stop_token_ids",
                   f"vocabulary size is {vocab()}")
    # prompt ids stay checked against the tokenizer: a padding row is no prompt token
    assert_400(post(srv, "/completions", {"prompt": [1, pad]}), "prompt", f"has {tok.vocab_size} tokens")


# ------------------------------------------------------------------------------------------------ logprobs


def test_logprobs_minus_one_is_the_vocabulary_at_the_defaults(srv, wide):
    r = post(srv, "/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": -1, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab()
    r = post(srv, "/completions", {"prompt": "Hi", "logprobs": -1, "max_tokens": 1})
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]  # keyed by token text: equal texts collapse
    assert r.status_code == 200 and len(top) > 20
    r = post(srv, "/completions", {"prompt": "Hi", "prompt_logprobs": -1, "max_tokens": 1})
    assert r.status_code == 200 and all(len(e) >= vocab() for e in r.json()["choices"][0]["prompt_logprobs"][1:])
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}),
               "top_logprobs", "max allowed: 20")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "logprobs": -2}), "logprobs")
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "top_logprobs": 2}), "top_logprobs",
               "logprobs: true")  # vLLM's rule: top_logprobs asks for logprobs
    assert post(srv, "/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 20,
                                           "max_tokens": 1}).status_code == 200

    r = client(wide).chat.completions.create(model=wide.model, messages=MSGS, max_tokens=3, temperature=0,
                                             logprobs=True, top_logprobs=-1,
                                             extra_body={"return_tokens_as_token_ids": True,
                                                         "return_token_ids": True, "prompt_logprobs": -1})
    for tok_id, entry in zip(r.choices[0].token_ids, r.choices[0].logprobs.content, strict=True):
        alts = {t.token: t.logprob for t in entry.top_logprobs}
        assert len(entry.top_logprobs) == len(alts) == vocab()  # every row of the model, each once
        assert math.isclose(sum(math.exp(v) for v in alts.values()), 1.0, rel_tol=1e-4)
        assert alts[f"token_id:{tok_id}"] == entry.logprob == max(alts.values())  # greedy: the top token
    plp = r.prompt_logprobs
    assert plp[0] is None and all(len(e) == vocab() for e in plp[1:])


def test_logprob_token_ids_are_those_ids_logprobs(srv, wide):
    listed = [5, vocab() - 1, 17]  # any row of the model, in the order given
    full = client(wide).chat.completions.create(model=wide.model, messages=MSGS, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=-1,
                                                extra_body={"return_tokens_as_token_ids": True})
    want = [[{t.token: t.logprob for t in e.top_logprobs}[f"token_id:{i}"] for i in listed]
            for e in full.choices[0].logprobs.content]
    c = client(srv)
    r = c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"logprob_token_ids": listed,
                                                              "return_tokens_as_token_ids": True})
    got = r.choices[0].logprobs.content
    assert [[t.token for t in e.top_logprobs] for e in got] == [[f"token_id:{i}" for i in listed]] * 4
    assert [[t.logprob for t in e.top_logprobs] for e in got] == want  # the same bits as the whole vocabulary's
    assert [e.logprob for e in got] == [e.logprob for e in full.choices[0].logprobs.content]
    chunks = list(c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=4, temperature=0,
                                            logprobs=True, stream=True,
                                            extra_body={"logprob_token_ids": listed,
                                                        "return_tokens_as_token_ids": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [[t.logprob for t in e.top_logprobs] for e in streamed] == want
    cr = c.completions.create(model=srv.model, prompt="Hello", max_tokens=3, temperature=0, logprobs=1,
                              extra_body={"logprob_token_ids": listed[:2], "return_tokens_as_token_ids": True,
                                          "return_token_ids": True})
    tops = cr.choices[0].logprobs.top_logprobs
    assert all({f"token_id:{i}" for i in listed[:2]} <= set(top) for top in tops)
    assert_400(post(srv, "/chat/completions", {"messages": MSGS, "logprob_token_ids": [5]}), "logprob_token_ids",
               "logprobs: true")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "logprob_token_ids": [5]}), "logprob_token_ids")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": [vocab()]}),
               "logprob_token_ids", f"vocabulary size is {vocab()}")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": []}),
               "logprob_token_ids")


# ------------------------------------------------------------------------------------------------ truncation


def test_truncation_side_and_truncate_minus_one(srv):
    tok = tiny_model_and_tokenizer()[1]
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    c = client(srv)

    def kept(**extra) -> list[int]:
        r = c.completions.create(model=srv.model, prompt=text, max_tokens=2,
                                 extra_body={"return_token_ids": True, **extra})
        return r.choices[0].prompt_token_ids

    assert kept(truncate_prompt_tokens=4) == ids[-4:] == kept(truncate_prompt_tokens=4, truncation_side="left")
    assert kept(truncate_prompt_tokens=4, truncation_side="right") == ids[:4]
    assert kept(truncate_prompt_tokens=-1) == ids  # the context leaves room for all of them
    long = list(range(10, 10 + 300))  # longer than the 256-token context
    r = c.completions.create(model=srv.model, prompt=long, max_tokens=6, extra_body={
        "truncate_prompt_tokens": -1, "truncation_side": "right", "return_token_ids": True})
    assert r.choices[0].prompt_token_ids == long[:250]  # 256 - max_tokens, the first ones
    chat = c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True})
    full = c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2, extra_body={
        "return_token_ids": True})
    assert chat.prompt_token_ids == full.prompt_token_ids[:3]
    for n in (0, 255):
        assert_400(post(srv, "/completions", {"prompt": "Hi", "max_tokens": 2, "truncate_prompt_tokens": n}),
                   "truncate_prompt_tokens", "1 to 254")
    assert_400(post(srv, "/completions", {"prompt": "Hi", "truncate_prompt_tokens": 2, "truncation_side": "up"}),
               "truncation_side")


# --------------------------------------------------------------------------------------------- beam search


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("length_penalty", 0.5),
                                         ("early_stopping", True)])
def test_beam_search_fields_are_refused_by_name(srv, field, value):
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", {"messages": MSGS})):
        assert_400(post(srv, path, {**body, field: value}), field, "beam search")
    off = {"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False}
    assert post(srv, "/completions", {"prompt": "Hi", "max_tokens": 1, **off}).status_code == 200


# ------------------------------------------------------------------------------------------------- roles


GENERIC_TEMPLATE = ("{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
                    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def test_roles_other_than_openais_go_through_the_chat_template(srv, tmp_path):
    msgs = [{"role": "critic", "content": "Be harsh."}, {"role": "user", "content": "Rate this."}]
    # the bundled Qwen3.5 template refuses a role it does not know: its message, as a 400
    assert_400(post(srv, "/chat/completions", {"messages": msgs}), "messages.0.role",
               "Unsupported message role: critic")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_checkpoint() / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(GENERIC_TEMPLATE)
    tok = Tokenizer.from_dir(tmp_path)
    with ServerThread(tokenizer=tok, max_model_len=256) as s:
        r = client(s).chat.completions.create(model=s.model, messages=msgs, max_tokens=2,
                                              extra_body={"return_token_ids": True})
        assert tok.decode(r.prompt_token_ids).startswith("<|im_start|>critic\nBe harsh.<|im_end|>")
        counted = httpx.post(s.url + "/tokenize", json={"messages": msgs}).json()
        assert counted["tokens"] == r.prompt_token_ids


# ------------------------------------------------------------------------------------------ response fields


def test_vllms_optional_response_fields_are_null_when_not_asked_for(srv):
    c = client(srv)
    r = c.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=2)
    assert r.prompt_token_ids is None and r.prompt_logprobs is None and r.choices[0].token_ids is None
    t = c.completions.create(model=srv.model, prompt="Hi", max_tokens=2)
    ch = t.choices[0]
    assert ch.prompt_token_ids is None and ch.token_ids is None and ch.prompt_logprobs is None
    t = c.completions.create(model=srv.model, prompt="Hi", max_tokens=2, extra_body={"return_token_ids": True})
    assert t.choices[0].prompt_token_ids and len(t.choices[0].token_ids) == 2
    # streamed chunks carry them only when filled (as vLLM's stream)
    with httpx.stream("POST", srv.base_url + "/completions", json={"model": srv.model, "prompt": "Hi", "max_tokens": 2,
                                                                   "stream": True}, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events and all(set(e["choices"][0]) == {"index", "text", "logprobs", "finish_reason"} for e in events)
