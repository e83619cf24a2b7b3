"""The prefix cache through `nextn serve` (a real uvicorn, the official `openai` client): a six-turn conversation
reports `usage.prompt_tokens_details.cached_tokens` covering the earlier turns up to the last grid boundary or tail
(the C kernels: each request's prompt and answer end on the 64-token grid) the chat template renders identically,
and answers exactly as a server with the cache off; /metrics counts the queried and hit tokens; the streamed usage
chunk and the Responses API report the hit too."""
from __future__ import annotations

import json

import openai
import pytest

from engine.cache import PREFILL_GRID as G
from engine.cache import TAIL_MARGIN
from tests.server_fixtures import ServerThread

SYSTEM = ("You are a careful assistant for a hardware store. You can use these tools when they help:\n"
          + "\n".join(json.dumps({"type": "function", "function": {
              "name": f"lookup_{name}", "description": f"Look up the {name} of a product by its catalogue number.",
              "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}})
                      for name in ("price", "stock", "weight", "colour", "supplier", "warranty"))
          + "\nAnswer briefly.")
TURNS = ["What is a hammer for?", "And a screwdriver?", "Which of the two is heavier?", "Name a good saw.",
         "How do I keep it sharp?", "Thank you. Anything else I should buy?"]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expect(prompt: list[int], earlier: list[tuple[list[int], list[int]]]) -> int:
    """The hit a prompt gets from earlier requests (each: its prompt, and its sequence in the cache = prompt + answer
    but its last token): the longest run of whole blocks they share with it, or a tail TAIL_MARGIN tokens before an
    earlier prompt's end or at its answer's end, never the prompt's last token."""
    best = 0
    for p, seq in earlier:
        c = min(_common(seq, prompt), len(prompt) - 1)
        best = max(best, c // G * G)
        gen = len(seq)
        for B in (len(p) - TAIL_MARGIN, gen if gen > len(p) else 0):
            if B % G and B <= c:
                best = max(best, B)
    return best


def _repeated(got: int, n: int) -> bool:
    """The hit of a prompt of n tokens sent again: its tail, or its whole blocks where they reach further."""
    return got == max(n - TAIL_MARGIN, (n - 1) // G * G) > 0


@pytest.fixture(scope="module")
def servers():
    with ServerThread(demo=True, max_model_len=2048) as on, \
            ServerThread(demo=True, max_model_len=2048, prefix_cache_gb=0) as off:
        yield on, off


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0)


def test_a_six_turn_conversation_hits_the_earlier_turns_and_answers_as_without_the_cache(servers):
    """Chat: each turn resumes from the longest run of grid blocks, or the tail, an earlier turn left. The template
    renders an earlier answer without its thinking block (the generation prompt ends `assistant\n<think>\n`, the
    history `assistant\n` + the answer), so the sequences part right after the previous turn's `assistant\n`: a
    turn re-prefills the previous answer and the previous generation prompt's TAIL_MARGIN tokens, no more."""
    on, off = servers
    history = [{"role": "system", "content": SYSTEM}]
    done: list[tuple[list[int], list[int]]] = []  # earlier turns: (prompt, prompt + answer but its last token)
    for n, text in enumerate(TURNS):
        history.append({"role": "user", "content": text})
        kw = dict(messages=history, max_tokens=40, temperature=0, extra_body={"return_token_ids": True})
        r = _client(on).chat.completions.create(model=on.model, **kw)
        cold = _client(off).chat.completions.create(model=off.model, **kw)
        prompt, out = r.prompt_token_ids, r.choices[0].token_ids
        assert cold.prompt_token_ids == prompt and cold.choices[0].token_ids == out, f"turn {n + 1}"
        assert r.choices[0].message.content == cold.choices[0].message.content
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        expect = _expect(prompt, done)
        got = r.usage.prompt_tokens_details.cached_tokens
        assert got == expect, f"turn {n + 1}: cached {got}, expected {expect}"
        assert n == 0 or got >= _common(done[-1][0], prompt) - TAIL_MARGIN, "a turn resumes where it parts"
        done.append((prompt, prompt + out[:-1]))
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    assert len(done[-1][1]) > 3 * G, "the conversation grew past three grid blocks"


def test_a_token_id_conversation_hits_through_the_previous_answer(servers):
    """Completions with token-id prompts (a client that keeps the generated ids): turn n's prompt is turn n-1's
    prompt + its completion + new ids, so it resumes past the previous answer's grid boundaries (blocks that decode
    steps completed), with the bits of a cold prefill."""
    on, off = servers
    first = _client(on).completions.create(model=on.model, prompt=SYSTEM, max_tokens=1,
                                           extra_body={"return_token_ids": True}).choices[0]
    ids = first.prompt_token_ids
    done = [(ids, ids + first.token_ids[:-1])]
    past = 0
    for n in range(4):
        kw = dict(prompt=ids, max_tokens=120, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        r = _client(on).completions.create(model=on.model, **kw)
        cold = _client(off).completions.create(model=off.model, **kw)
        out = r.choices[0].token_ids
        assert out == cold.choices[0].token_ids and r.choices[0].text == cold.choices[0].text
        got = r.usage.prompt_tokens_details.cached_tokens
        assert got == _expect(ids, done), n
        past += n > 0 and got > prev_prompt
        prev_prompt = len(ids)
        done.append((ids, ids + out[:-1]))
        ids = ids + out + ids[5:12]
    assert past, "a turn resumed inside the previous answer"


def test_metrics_count_queried_and_hit_tokens(servers):
    on, _ = servers
    q0, h0 = on.metric("nextn_prefix_cache_queries_total"), on.metric("nextn_prefix_cache_hits_total")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Price of a hammer?"}]
    first = _client(on).chat.completions.create(model=on.model, messages=msgs, max_tokens=4, temperature=0)
    second = _client(on).chat.completions.create(model=on.model, messages=msgs, max_tokens=4, temperature=0)
    assert _repeated(second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens)
    assert on.metric("nextn_prefix_cache_queries_total") - q0 == 2 * first.usage.prompt_tokens
    assert on.metric("nextn_prefix_cache_hits_total") - h0 == first.usage.prompt_tokens_details.cached_tokens + \
        second.usage.prompt_tokens_details.cached_tokens
    assert on.metric("nextn_prefix_cache_blocks") >= 1 and on.metric("nextn_prefix_cache_bytes") > 0
    assert _client(servers[1]).models.list() and servers[1].metric("nextn_prefix_cache_capacity_bytes") == 0


def test_streamed_usage_and_the_responses_api_report_the_hit(servers):
    on, _ = servers
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stock of saws?"}]
    c = _client(on)
    c.chat.completions.create(model=on.model, messages=msgs, max_tokens=2, temperature=0)
    last = None
    for chunk in c.chat.completions.create(model=on.model, messages=msgs, max_tokens=2, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        last = chunk
    assert _repeated(last.usage.prompt_tokens_details.cached_tokens, last.usage.prompt_tokens)
    r = c.responses.create(model=on.model, instructions=SYSTEM, input="Stock of saws?", max_output_tokens=2)
    assert _repeated(r.usage.input_tokens_details.cached_tokens, r.usage.input_tokens)
