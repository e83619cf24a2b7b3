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
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrics.prometheus import MODEL_SERVER_PROTOCOL
from tests.server_fixtures import DEMO_DIR, nextn_serve

SLOTS = 2  # --max-num-seqs
QUEUED = 3  # requests beyond the slots
MAX_TOKENS = 2000  # far more than the test needs: a request never ends before the test closes it
WAITING, RUNNING, USAGE = (MODEL_SERVER_PROTOCOL[k] for k in
                           ("TotalQueuedRequests", "TotalRunningRequests", "KVCacheUtilization"))


def read(text: str) -> dict[str, tuple[str, float]]:
    """{family name: (type, value)} of the protocol's families, under both prefixes (each has one sample)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for prefix in ("nextn_", "vllm:"):
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


def test_protocol_gauges_on_real_scrapes_under_load():
    with nextn_serve(str(DEMO_DIR), "--metrics-compat", "vllm", "--max-num-seqs", str(SLOTS),
                     "--cpu-kernel-threads", "1", "--log-level", "warning") as (base, _):
        seen = asyncio.run(scenario(base))
    # how the gauges moved: from idle to a full pool with a queue, and back to idle
    assert seen[0] == {WAITING: 0, RUNNING: 0, USAGE: 0.0} == seen[-1]
    assert max(v[RUNNING] for v in seen) == SLOTS and max(v[WAITING] for v in seen) >= QUEUED
    assert {v[USAGE] for v in seen} >= {0.0, 1 / SLOTS, 1.0}
