"""A replica whose device fails for good reports itself broken and exits; a session that cannot join fails alone.

A sticky CUDA error is injected on a CPU: the engine's round raises what torch raises for one (`torch.AcceleratorError`
"CUDA error: an illegal memory access was encountered"), and the device probe, which on a CPU always passes, is
replaced by one that fails. Then every request in flight ends with an error naming the device, /health, /ping and
/ready answer 503 with the reason, new requests get 503, and the process exits non-zero (in-thread: the exit is
recorded; the slow test runs a real `nextn serve`, with its engine process, and watches it exit). An error the probe
does not confirm fails only the requests it hit. Then `scheduler.add` (the prefix cache's lookup, restore and resume)
raising for one request fails that request alone: its slot comes back and the request beside it is unchanged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

import engine.scheduler
import server.worker
from server.worker import DEVICE_LOST_EXIT, DeviceLost, device_error, probe_device
from tests.server_fixtures import DEMO_DIR, ServerThread, free_port, http_ready, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
MARK = 300  # a prompt token that arms the injected failure (the tiny vocabulary has 333 ids)
ILLEGAL = "CUDA error: an illegal memory access was encountered"


def test_what_counts_as_a_device_error():
    assert device_error(torch.AcceleratorError(ILLEGAL))
    assert device_error(RuntimeError(ILLEGAL))
    assert device_error(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert device_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    try:
        try:
            raise torch.AcceleratorError(ILLEGAL)
        except RuntimeError as inner:
            raise ValueError("the verify forward failed") from inner
    except ValueError as outer:
        assert device_error(outer), "a device error raised from inside another one"
    assert not device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not device_error(RuntimeError("shape mismatch"))
    assert not device_error(ValueError("CUDA error: in a ValueError: not torch's"))
    assert probe_device("cpu") is None and probe_device(torch.device("cpu")) is None


def _arm(monkeypatch, err: BaseException | None, state: dict) -> None:
    """The round raises `err` once a running session whose prompt holds MARK has emitted 2 tokens. While
    `state["hold"]()` is false, a round without such a session waits for it (the request decoding alone stays
    running until the marked one has arrived; the wait changes no bit)."""
    real = engine.scheduler.spec_round

    def spec_round(model, rows, runner):
        marked = any(MARK in s.prompt_ids for s in rows)
        if not marked and "hold" in state:
            assert wait_until(state["hold"], timeout=30), "the marked request never arrived"
            del state["hold"]
        if err is not None and any(MARK in s.prompt_ids and len(s.emitted) >= 2 for s in rows):
            state["raised"] = state.get("raised", 0) + 1
            state["rows"] = len(rows)
            raise err
        return real(model, rows, runner)

    monkeypatch.setattr(engine.scheduler, "spec_round", spec_round)


def _stream(url: str, body: dict, out: list) -> None:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])


def test_a_lost_device_fails_every_request_turns_health_503_and_exits(monkeypatch):
    probes: list[object] = []
    monkeypatch.setattr(server.worker, "probe_device",
                        lambda device: probes.append(device) or f"AcceleratorError: {ILLEGAL}")
    state: dict = {}
    _arm(monkeypatch, torch.AcceleratorError(ILLEGAL), state)
    lost: list[tuple[DeviceLost, list]] = []
    with ServerThread(worker_kw={"on_device_lost": lambda e, jobs: lost.append((e, jobs))}, max_num_seqs=4) as s:
        url = s.base_url + "/completions"
        body = {"model": s.model, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        events: list[str] = []
        state["hold"] = lambda: s.worker.num_waiting > 0
        t = threading.Thread(target=_stream, args=(url, body, events))
        t.start()
        assert wait_until(lambda: s.worker.num_active == 1, timeout=30), "the stream never started"
        r = httpx.post(url, json={**body, "prompt": [5, MARK, 7], "max_tokens": 50}, timeout=60)
        t.join(30)
        assert not t.is_alive(), "a client was left waiting on a lost device"
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "DeviceLost: the device failed" in r.json()["error"]["message"] and ILLEGAL in r.json()["error"]["message"]
        assert events[-1] == "[DONE]" and "the device failed" in json.loads(events[-2])["error"]["message"], events[-2:]
        assert state["raised"] == 1 and state["rows"] == 2 and len(probes) == 1
        for path in ("/health", "/ping", "/ready"):
            h = httpx.get(s.url + path)
            assert h.status_code == 503 and ILLEGAL in h.json()["reason"], (path, h.text)
            assert h.json()["reason"].startswith("DeviceLost: the device failed"), h.text
        assert httpx.post(s.url + "/ping").status_code == 503
        (err, jobs), = lost
        assert isinstance(err, DeviceLost) and len(jobs) == 2 and all(j.done for j in jobs)
        late = httpx.post(url, json={**body, "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("err", [torch.AcceleratorError(ILLEGAL), RuntimeError("a kernel's own bug")],
                         ids=["unconfirmed-device-error", "not-a-device-error"])
def test_an_error_the_probe_does_not_confirm_fails_only_its_request(monkeypatch, err):
    probes: list[object] = []
    monkeypatch.setattr(server.worker, "probe_device", lambda device: probes.append(device))  # the device is fine
    state: dict = {}
    _arm(monkeypatch, err, state)
    lost: list = []
    with ServerThread(worker_kw={"on_device_lost": lambda e, jobs: lost.append(e)}) as s:
        url = s.base_url + "/completions"
        body = {"model": s.model, "prompt": [5, MARK, 7], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 500 and type(err).__name__ in r.json()["error"]["message"], r.text
        assert len(probes) == (1 if isinstance(err, torch.AcceleratorError) else 0)
        ok = httpx.post(url, json={**body, "prompt": [5, 6, 7]}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
        assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/ready").status_code == 200
        assert "reason" not in httpx.get(s.url + "/health").json()
        assert not lost and state["raised"] == 1


def test_a_session_that_cannot_join_fails_alone(monkeypatch):
    """The prefix cache's lookup (inside `scheduler.add`) raises for one request: it gets a 500 naming the failure,
    its slot comes back, the stream decoding beside it gets what it gets alone, and the worker goes on."""
    with ServerThread(max_num_seqs=2, prefix_cache_gb=0.25) as s:
        url = s.base_url + "/completions"
        body = {"model": s.model, "prompt": [5, 6, 7], "max_tokens": 600, "temperature": 0, "ignore_eos": True}
        alone: list[str] = []
        _stream(url, body, alone)
        sched = s.worker.scheduler
        free = sched.pool.num_free
        real, seen = sched.cache.lookup, {}

        def lookup(tokens, keys):
            if MARK in tokens:
                seen["running"] = len(sched.running)
                raise RuntimeError("injected lookup failure")
            return real(tokens, keys)

        monkeypatch.setattr(sched.cache, "lookup", lookup)
        _arm(monkeypatch, None, {"hold": lambda: s.worker.num_waiting > 0})
        events: list[str] = []
        t = threading.Thread(target=_stream, args=(url, body, events))
        t.start()
        assert wait_until(lambda: s.worker.num_active == 1, timeout=30)
        r = httpx.post(url, json={**body, "prompt": [5, MARK, 7]}, timeout=60)
        t.join(60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "injected lookup failure" in r.json()["error"]["message"]
        assert seen["running"] == 1, "the other request was not decoding when this one failed to join"
        text = lambda evs: "".join(json.loads(e)["choices"][0]["text"] for e in evs if e != "[DONE]" and  # noqa: E731
                                   json.loads(e)["choices"])
        assert events[-1] == "[DONE]" and text(events) == text(alone)
        assert wait_until(lambda: s.worker.num_active == 0 and sched.pool.num_free == free)
        again = httpx.post(url, json={**body, "prompt": [5, 8, 7], "max_tokens": 4}, timeout=60)
        assert again.status_code == 200 and httpx.get(s.url + "/health").status_code == 200


SERVE_BROKEN = '''
"""`nextn serve` on a device that breaks: the round raises a sticky CUDA error once a request whose prompt holds
token {mark} has emitted 2 tokens, and the device probe fails (a round without that request takes 20 ms more, so a
stream lasts until it comes). Run as a script file, so the spawned engine process (which imports this file as its
main module) applies the same patches."""
import sys
import time

import torch

import engine.scheduler
import server.worker

_real = engine.scheduler.spec_round


def _round(model, rows, runner):
    if any({mark} in s.prompt_ids and len(s.emitted) >= 2 for s in rows):
        raise torch.AcceleratorError("{illegal}")
    if not any({mark} in s.prompt_ids for s in rows):
        time.sleep(0.02)
    return _real(model, rows, runner)


engine.scheduler.spec_round = _round
server.worker.probe_device = lambda device: "AcceleratorError: {illegal}"

if __name__ == "__main__":
    from server.cli import main

    sys.exit(main())
'''


@pytest.mark.slow  # a whole nextn serve with its engine process (~15 s)
def test_nextn_serve_exits_non_zero_when_its_device_is_lost(tmp_path):
    script = tmp_path / "serve_broken.py"
    script.write_text(SERVE_BROKEN.format(mark=MARK, illegal=ILLEGAL))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(script), "serve", str(DEMO_DIR), "--port", str(port), "--device",
                             "cpu", "--max-model-len", "1024", "--log-level", "warning"], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    try:
        assert wait_until(lambda: http_ready(base), timeout=120), "the server did not become ready"
        assert httpx.get(base + "/health").json()["status"] == "ok"
        url = base + "/v1/completions"
        body = {"model": httpx.get(base + "/v1/models").json()["data"][0]["id"], "prompt": [5, 6, 7],
                "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        events: list[str] = []
        t = threading.Thread(target=_stream, args=(url, body, events))
        t.start()
        assert wait_until(lambda: events, timeout=30), "the stream never started"
        r = httpx.post(url, json={**body, "prompt": [5, MARK, 7], "max_tokens": 50}, timeout=60)
        health = httpx.get(base + "/health")  # within the second the server lingers after answering
        t.join(30)
        assert r.status_code == 500 and ILLEGAL in r.json()["error"]["message"], r.text
        assert events and events[-1] == "[DONE]" and "the device failed" in events[-2], events[-2:]
        assert health.status_code == 503 and ILLEGAL in health.json()["reason"], health.text
        assert proc.wait(timeout=30) == DEVICE_LOST_EXIT
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate()[1]
    assert "device lost" in err, err[-3000:]
