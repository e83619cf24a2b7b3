"""The worker loop itself fails (not one session): every client gets an error, nobody waits forever, and
/health and /ready report the dead worker."""
from __future__ import annotations

import json
import threading

import httpx

from tests.server_fixtures import ServerThread, gated_sessions, wait_until


def test_loop_failure_fails_every_job_and_health_turns_503():
    gate = threading.Event()

    with ServerThread(worker_kw={"session_factory": gated_sessions(gate)}, max_num_seqs=1, max_queue=8) as s:
        body = {"model": s.model, "prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "temperature": 0}
        results: dict[str, object] = {}

        def post(name: str) -> None:
            r = httpx.post(s.base_url + "/completions", json=body, timeout=30)
            results[name] = (r.status_code, r.json())

        def stream(name: str) -> None:
            with httpx.stream("POST", s.base_url + "/completions", json={**body, "stream": True}, timeout=30) as r:
                results[name] = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                                 for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=post, args=("active",))]
        threads[0].start()
        assert wait_until(lambda: s.worker.num_active == 1)
        threads += [threading.Thread(target=post, args=("waiting",)), threading.Thread(target=stream, args=("stream",))]
        for t in threads[1:]:
            t.start()
        assert wait_until(lambda: s.worker.num_waiting == 2)
        assert httpx.get(s.url + "/health").status_code == 200

        def boom(_: int) -> None:  # fails in the loop's own bookkeeping, outside any session's burst
            raise RuntimeError("injected loop failure")

        s.worker.metrics.set_running = boom  # type: ignore[method-assign]
        gate.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client was left waiting on a dead worker"
        for name in ("active", "waiting"):
            status, payload = results[name]  # type: ignore[misc]
            assert status == 500 and payload["error"]["type"] == "server_error", (name, payload)
        events = results["stream"]
        assert events[-1] == "[DONE]" and "error" in events[-2], events  # type: ignore[index]
        assert httpx.get(s.url + "/health").status_code == 503
        assert httpx.get(s.url + "/ready").status_code == 503
        after = httpx.post(s.base_url + "/completions", json=body, timeout=10)
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"
        assert s.worker.num_active == 0 and s.worker.num_waiting == 0
