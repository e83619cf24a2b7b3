"""The model-server protocol a gateway's endpoint picker reads, checked on real scrapes of `nextn serve` under load.

The Gateway API Inference Extension's protocol (kubernetes-sigs/gateway-api-inference-extension v1.6.0,
docs/proposals/003-model-server-protocol; the endpoint picker's table in llm-d/llm-d-router v0.10.0,
docs/plugin-metric-protocol.md) names three gauges: TotalQueuedRequests ("the current total number of requests in
the queue", vLLM's `vllm:num_requests_waiting`), TotalRunningRequests ("the current total number of requests
actively being served", `vllm:num_requests_running`) and KVCacheUtilization (a 0..1 fraction,
`vllm:kv_cache_usage_perc`).
nextn exports them as `nextn_` + `MODEL_SERVER_PROTOCOL[...]`, and under `--metrics-compat vllm` as `vllm:` + the
same. The server here has 2 state-pool slots; the test drives it through states the client controls (requests
long enough not to end on their own; a closed stream cancels its request) and checks, on every scrape, the type and
range of each gauge and that the two names agree, and in each settled state the values the protocol defines.

Beside the gauges, the prefix cache's two counters, which the picker's prefix affinity does not read (it keeps its
own index) but which show whether it works: `prefix_cache_queries` and `prefix_cache_hits`, vLLM's counters (in
vLLM: "Prefix cache queries, in terms of number of queried tokens" / "Prefix cache hits, in terms of number of
cached tokens"), as `nextn_prefix_cache_*_total` and, under compat, `vllm:prefix_cache_*_total`. A repeated
prompt longer than the cache's grid moves hits by the tokens the second request resumed past, on the same server.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.cache import PREFILL_GRID, TAIL_MARGIN
from engine.tokenizer import Tokenizer
from metrics.prometheus import MODEL_SERVER_PROTOCOL
from tests.server_fixtures import DEMO_DIR, nextn_serve

SLOTS = 2  # --max-num-seqs
QUEUED = 3  # requests beyond the slots
MAX_TOKENS = 2000  # far more than the test needs: a request never ends before the test closes it
WAITING, RUNNING, USAGE = (MODEL_SERVER_PROTOCOL[k] for k in
                           ("TotalQueuedRequests", "TotalRunningRequests", "KVCacheUtilization"))
PREFIX = ("nextn_", "vllm:")  # the two names of each family (vllm: under --metrics-compat vllm)
# the prefix cache's counters, vLLM's semantics: {family name after the prefix: what it counts}
QUERIES, HITS = "prefix_cache_queries", "prefix_cache_hits"
PREFIX_CACHE_COUNTERS = {
    QUERIES: "prompt tokens looked up: each request that resumes adds its prompt length when it is scheduled",
    HITS: "prompt tokens found: each request adds the tokens it resumed past (its usage's cached_tokens)",
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """One `nextn serve` of the demo with SLOTS slots and the vLLM names beside nextn's; yields its base URL."""
    with nextn_serve(str(DEMO_DIR), "--metrics-compat", "vllm", "--max-num-seqs", str(SLOTS),
                     "--cpu-kernel-threads", "1", "--log-level", "warning") as (base, _):
        yield base


def read(text: str) -> dict[str, tuple[str, float]]:
    """{family name: (type, value)} of the protocol's families, under both prefixes (each has one sample)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for prefix in PREFIX:
            if fam.name.startswith(prefix) and fam.name[len(prefix):] in MODEL_SERVER_PROTOCOL.values():
                assert len(fam.samples) == 1, fam
                out[fam.name] = (fam.type, fam.samples[0].value)
    return out


def check_scrape(m: dict[str, tuple[str, float]]) -> dict[str, float]:
    """What holds on every scrape: all six families present as gauges, each `vllm:` twin equal to its `nextn_`
    name, counts whole and within the pool, the usage a fraction of whole slots. Returns {name: value}."""
    for name in MODEL_SERVER_PROTOCOL.values():
        for full in ("nextn_" + name, "vllm:" + name):
            assert full in m and m[full][0] == "gauge", (full, m)
        assert m["vllm:" + name][1] == m["nextn_" + name][1], (name, m)
    v = {name: m["nextn_" + name][1] for name in MODEL_SERVER_PROTOCOL.values()}
    assert v[WAITING] == int(v[WAITING]) and v[RUNNING] == int(v[RUNNING]), v
    # a request sent is queued until scheduled (just sent, all of them are), then runs in a slot
    assert 0 <= v[RUNNING] <= SLOTS and 0 <= v[WAITING] and v[WAITING] + v[RUNNING] <= SLOTS + QUEUED, v
    assert 0 <= v[USAGE] <= 1 and (v[USAGE] * SLOTS).is_integer(), v
    return v


async def scenario(base: str) -> list[dict[str, float]]:
    """Drive the server through its states; returns every scrape's values, in order."""
    seen: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=16)) as client:

        async def scrape() -> dict[str, float]:
            r = await client.get("/metrics")
            assert r.status_code == 200
            seen.append(check_scrape(read(r.text)))
            read_counters(r.text)  # the prefix cache's counters hold their invariants under load too
            return seen[-1]

        async def settle(**want: float) -> dict[str, float]:
            """Scrape until the gauges read `want` (the server reaches each state within a scheduler step)."""
            for _ in range(1500):
                v = await scrape()
                if v == want:
                    return v
                await asyncio.sleep(0.02)
            pytest.fail(f"the gauges never read {want}; last scrape {seen[-1]}")

        tokens = [0] * (SLOTS + QUEUED)
        ended: list[int] = []  # streams that ended by themselves (none may)

        async def stream(i: int) -> None:
            body = {"model": "demo", "prompt": f"Story {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        ended.append(i)
                    elif line.startswith("data: "):
                        tokens[i] += len(json.loads(line[6:])["choices"])

        await settle(**{WAITING: 0, RUNNING: 0, USAGE: 0.0})  # present at 0 before any request
        tasks = [asyncio.create_task(stream(i)) for i in range(SLOTS + QUEUED)]
        # every slot held, the rest queued: waiting counts the requests not yet scheduled
        await settle(**{WAITING: QUEUED, RUNNING: SLOTS, USAGE: 1.0})
        for _ in range(1500):  # the running ones have produced tokens
            if sum(t > 0 for t in tokens) == SLOTS:
                break
            await asyncio.sleep(0.02)
        queued = [i for i, t in enumerate(tokens) if t == 0]
        running = [i for i, t in enumerate(tokens) if t > 0]
        assert len(queued) == QUEUED and len(running) == SLOTS, tokens
        # the queued clients leave: the queue empties, the running requests keep their slots
        for i in queued:
            tasks[i].cancel()
        await settle(**{WAITING: 0, RUNNING: SLOTS, USAGE: 1.0})
        assert all(tokens[i] == 0 for i in queued), "a queued request was never scheduled, so it produced nothing"
        # one running client leaves: one slot frees
        tasks[running[0]].cancel()
        await settle(**{WAITING: 0, RUNNING: 1, USAGE: 1 / SLOTS})
        before = tokens[running[1]]
        for _ in range(1500):  # the one left is still being served
            if tokens[running[1]] > before:
                break
            await asyncio.sleep(0.02)
        assert tokens[running[1]] > before
        tasks[running[1]].cancel()
        await settle(**{WAITING: 0, RUNNING: 0, USAGE: 0.0})
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not ended, f"streams {ended} ended before the test closed them: raise MAX_TOKENS"
    return seen


def test_protocol_gauges_on_real_scrapes_under_load(server: str):
    seen = asyncio.run(scenario(server))
    # how the gauges moved: from idle to a full pool with a queue, and back to idle
    assert seen[0] == {WAITING: 0, RUNNING: 0, USAGE: 0.0} == seen[-1]
    assert max(v[RUNNING] for v in seen) == SLOTS and max(v[WAITING] for v in seen) >= QUEUED
    assert {v[USAGE] for v in seen} >= {0.0, 1 / SLOTS, 1.0}


def read_counters(text: str) -> dict[str, float]:
    """{counter name: value} of the prefix cache's counters, checked as on every scrape: each family present under
    both names as a counter with one `_total` series, each `vllm:` twin equal to its `nextn_` name, hits never
    above queries. Keys are the names after the prefix."""
    found: dict[str, tuple[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for prefix in PREFIX:
            if fam.name.startswith(prefix) and fam.name[len(prefix):] in PREFIX_CACHE_COUNTERS:
                totals = [x for x in fam.samples if x.name == fam.name + "_total"]
                assert len(totals) == 1, fam
                found[fam.name] = (fam.type, totals[0].value)
    for name in PREFIX_CACHE_COUNTERS:
        for full in (prefix + name for prefix in PREFIX):
            assert full in found and found[full][0] == "counter", (full, found)
        assert found["vllm:" + name][1] == found["nextn_" + name][1], (name, found)
    v = {name: found["nextn_" + name][1] for name in PREFIX_CACHE_COUNTERS}
    assert v[QUERIES] == int(v[QUERIES]) and v[HITS] == int(v[HITS]) and 0 <= v[HITS] <= v[QUERIES], v
    return v


@pytest.mark.slow
def test_prefix_cache_counters_move_on_a_repeated_long_prompt(server: str):
    """The same prompt of two grid blocks and a part, sent twice: each request moves queries by its prompt length
    and hits by its cached tokens, the first none (a miss), the second its whole grid blocks (the prompt's last
    token is always prefilled); under both names, and the counters never go down."""
    tok = Tokenizer.from_dir(DEMO_DIR)
    ids = tok.encode(" ".join(f"Shelf {i}: a hammer, a saw, a level and a box of nails." for i in range(80)))
    ids = ids[:2 * PREFILL_GRID + 100]
    assert len(ids) == 2 * PREFILL_GRID + 100, "the demo tokenizer made a shorter prompt"
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=server, timeout=120) as client:
        last: dict[str, float] = {}

        def scrape() -> dict[str, float]:
            nonlocal last
            r = client.get("/metrics")
            assert r.status_code == 200
            v = read_counters(r.text)
            assert all(v[k] >= last.get(k, 0) for k in v), (last, v)
            last = v
            return v

        def settle(want: dict[str, float]) -> None:
            """Scrape until the counters read `want` (the engine process relays them to the server's registry)."""
            for _ in range(500):
                if scrape() == want:
                    return
                time.sleep(0.02)
            pytest.fail(f"the counters never read {want}; last scrape {last}")

        scrape()
        # the repeat resumes at the first request's prompt tail (the C path: TAIL_MARGIN tokens before its end)
        for expect_cached in (0, max(len(ids) - TAIL_MARGIN,
                                     (len(ids) - 1) // PREFILL_GRID * PREFILL_GRID)):
            before = last
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == len(ids)
            assert usage["prompt_tokens_details"]["cached_tokens"] == expect_cached, usage
            settle({QUERIES: before[QUERIES] + len(ids), HITS: before[HITS] + expect_cached})
        assert expect_cached > 2 * PREFILL_GRID
