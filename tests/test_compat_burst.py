"""Bursts queue instead of 429: a batch job that sends hundreds of requests at once is served whole at the default
queue bound (sized from memory, thousands), as on vLLM; `--max-queue` still gives back-pressure (429 with Retry-After:
tests/test_server_api.py). A real uvicorn on the bundled demo model, the official `openai` client without retries."""
from __future__ import annotations

import asyncio

import openai

from config.settings import DEFAULT_MAX_QUEUE_RANGE
from tests.server_fixtures import ServerThread

BURST = 300


def test_a_burst_of_300_all_complete_at_the_default_queue_bound():
    with ServerThread(demo=True) as s:
        assert s.settings.max_queue >= DEFAULT_MAX_QUEUE_RANGE[0] > BURST  # resolved from memory, not 64

        async def burst() -> list[openai.types.Completion]:
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120) as client:
                return await asyncio.gather(*(client.completions.create(
                    model=s.model, prompt=f"Count {i}", max_tokens=1, temperature=0) for i in range(BURST)))

        done = asyncio.run(burst())  # a 429 raises openai.RateLimitError here (no retries)
        assert len(done) == BURST and all(len(r.choices) == 1 and r.usage.completion_tokens == 1 for r in done)
        assert s.worker.alive and s.metric("nextn_request_success_total", finished_reason="length") == BURST
