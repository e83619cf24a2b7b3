"""Soak, short form: 32 concurrent clients against `nextn serve` (a subprocess on 127.0.0.1, the tiny random
checkpoint, K = 3, 4 state-pool slots so most requests queue), 4 requests each of the mix in bench/soak.py
(chat / completions, stream / not, greedy / sampled, n = 1 / 2, stop strings), 10% abandoned at a random
point. Every finished response is complete, greedy ones equal their single-client answer, the running and
waiting gauges return to 0, /health stays 200, and the server's RSS grows < 10% over the load.
`bench/soak.py` is the long form (the demo model, a duration, figures for bench/RESULTS.md).
"""
from __future__ import annotations

import asyncio

import pytest

from bench.soak import ServerProcess, SoakConfig, run_soak
from tests.server_fixtures import tiny_checkpoint

pytestmark = pytest.mark.slow  # 32 clients against a real nextn serve process


def test_soak_32_clients_mixed_with_disconnects() -> None:
    cfg = SoakConfig(clients=32, requests=4, max_tokens=8, disconnect_fraction=0.1, seed=0)
    with ServerProcess(tiny_checkpoint(), "--num-speculative-tokens", "3", "--max-num-seqs", "4",
                       "--max-queue", "128", "--max-model-len", "512") as server:
        report = asyncio.run(run_soak(server, cfg))
        assert server.proc.poll() is None  # alive after the load
    report.check()
    assert report.finished + report.abandoned == cfg.clients * cfg.requests  # (a transport error is a failure)
    assert report.abandoned > 0 and report.server_aborts > 0 and report.greedy_finished > 0
    for kind in ("chat", "completions", "stream", "non-stream", "sampled", "n=2", "stop", "abandoned (drawn)"):
        assert report.kinds.get(kind), f"the mix drew no {kind} request: {report.kinds}"
