"""The engine in its own process (`--engine-process`, `nextn serve`'s default): a real uvicorn whose worker is an
`EngineProcess`, compared with the in-process worker, driven by the official `openai` client.

What must hold: the same requests give the same tokens, logprobs, tool calls and usage (greedy, sampled with a
seed, grammar-constrained); a session that fails fails its own request only; a cancelled stream frees its slot;
the queue bound answers 429; when the engine process dies, every open request ends with an error, /health turns
503 and new requests are refused (nobody waits on a dead engine); when `nextn serve` itself is killed, its engine
process exits too.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.spec import SpecSession
from server.engine_proc import EngineProcess
from tests.server_fixtures import ServerThread, free_port, http_ready, tiny_checkpoint, wait_until

pytestmark = pytest.mark.slow  # every test runs an engine process or a whole nextn serve

REPO_ROOT = Path(__file__).resolve().parents[1]
FAIL_MARK = 300  # a prompt token that makes `failing_session` raise (the tiny vocabulary has 333 ids)
KILL_LOOP_MARK = 301  # ... and one that makes it fail the worker loop itself

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class LoopKiller(BaseException):
    """Not an Exception: the worker's per-session guard lets it through, so it fails the loop itself."""


def failing_session(*args, **kw):
    """A session factory for the engine process (module level: it is pickled by name): raises for a prompt that
    contains FAIL_MARK, fails the worker loop for one with KILL_LOOP_MARK, else a normal `SpecSession`."""
    if FAIL_MARK in args[1]:
        raise RuntimeError("injected session failure")
    if KILL_LOOP_MARK in args[1]:
        raise LoopKiller("injected loop failure")
    return SpecSession(*args, **kw)


@pytest.fixture(scope="module")
def pair():
    """The demo model served twice, K = 3 fixed (equal usage counts): in this process and with an engine process."""
    with ServerThread(demo=True, max_model_len=1024, spec_adaptive=False) as inproc, \
            ServerThread(demo=True, max_model_len=1024, engine_process=True, spec_adaptive=False) as proc:
        assert isinstance(proc.worker, EngineProcess) and not isinstance(inproc.worker, EngineProcess)
        yield inproc, proc


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)


def _chat(s: ServerThread, **kw) -> dict:
    return _client(s).chat.completions.create(model=s.model, **kw).model_dump()


def _stream_text(s: ServerThread, **kw) -> tuple[str, list[int], dict]:
    text, ids, usage = "", [], None
    for ch in _client(s).completions.create(model=s.model, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}, **kw):
        for c in ch.choices:
            text += c.text
            ids += getattr(c, "token_ids", None) or []
        if ch.usage is not None:
            usage = ch.usage.model_dump()
    return text, ids, usage


def test_engine_process_answers_what_the_in_process_worker_answers(pair):
    """Greedy chat with logprobs, n = 2 sampled with a seed, a streamed completion (token ids), a JSON schema and
    a forced tool call: the engine process gives the same tokens, logprobs, calls and usage (with usage.spec)."""
    inproc, proc = pair
    msgs = [{"role": "user", "content": "What is a Python list?"}]
    cases = [
        dict(messages=msgs, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2),
        dict(messages=msgs, max_tokens=24, temperature=0.9, seed=7, n=2),
        dict(messages=[{"role": "user", "content": "Give me a JSON object for a person named Alice, 30."}],
             max_tokens=60, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}),
        dict(messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}], max_tokens=60, temperature=0,
             tools=[WEATHER], tool_choice="required"),
    ]
    for kw in cases:
        a, b = _chat(inproc, **kw), _chat(proc, **kw)
        for d in (a, b):
            d.pop("id"), d.pop("created")
            for c in d["choices"]:
                for call in c["message"].get("tool_calls") or []:
                    call.pop("id")
        assert a == b, kw
    person = json.loads(_chat(proc, **cases[2])["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"}
    call = _chat(proc, **cases[3])["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    kw = dict(prompt="The list type", max_tokens=48, temperature=0)
    sa, sb = _stream_text(inproc, **kw), _stream_text(proc, **kw)
    assert sa == sb and len(sa[1]) == 48 and sb[2]["spec"]["rounds"] > 0


def test_a_failing_session_fails_its_request_only():
    with ServerThread(engine_process=True, worker_kw={"session_factory": failing_session}) as s:
        c = _client(s)
        for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C / group-wide SIGTERM is for the server, not its engine
            os.kill(s.worker._proc.pid, sig)
        good = c.completions.create(model=s.model, prompt=[5, 6, 7], max_tokens=8, temperature=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=s.model, prompt=[5, FAIL_MARK, 7], max_tokens=8, temperature=0)
        assert "injected session failure" in str(e.value)
        again = c.completions.create(model=s.model, prompt=[5, 6, 7], max_tokens=8, temperature=0)
        assert again.choices[0].text == good.choices[0].text
        assert httpx.get(s.url + "/health").status_code == 200 and s.worker.alive


def _stream_until(url: str, body: dict, stop: threading.Event, got: list[str]) -> None:
    """Read a streamed completion's chunks into `got` until `stop` is set, then close it (a client leaving)."""
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got.append(line)
            if stop.is_set():
                return


def test_cancel_frees_the_slot_and_the_queue_bound_answers_429():
    with ServerThread(engine_process=True, max_num_seqs=1, max_queue=1) as s:
        # ~3 s of tokens each on this model: the first stays running while the test looks (leaving ends both)
        body = {"model": s.model, "prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        url = s.url + "/v1/completions"
        stops, gots = [threading.Event(), threading.Event()], [[], []]
        threads = [threading.Thread(target=_stream_until, args=(url, body, stops[i], gots[i])) for i in range(2)]
        threads[0].start()
        assert wait_until(lambda: s.worker.num_active == 1 and gots[0])
        threads[1].start()
        assert wait_until(lambda: s.worker.num_waiting == 1)  # the second waits for the slot
        third = httpx.post(url, json={**body, "stream": False}, timeout=60)
        assert third.status_code == 429, third.text[:300]
        assert not gots[1]
        stops[0].set()  # the first client leaves: its slot goes to the queued request at once
        assert wait_until(lambda: gots[1], timeout=30)
        stops[1].set()
        for t in threads:
            t.join(30)
        assert wait_until(lambda: s.worker.num_active == 0 and s.worker.num_waiting == 0, timeout=30)
        assert wait_until(lambda: _sample(s, "nextn_request_success_total", 'finished_reason="abort"') == 2)
        # the cancels reached the engine: it stopped both sessions early (a job run to its 4000 tokens takes at
        # least 4000 / (K + 1) = 1000 rounds)
        assert _sample(s, "nextn_spec_decode_num_drafts_total") < 1000
        done = _client(s).completions.create(model=s.model, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4


def _sample(s: ServerThread, name: str, label: str = "") -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} sample")


SLOW_ENGINE = """
import builtins, multiprocessing, os, sys, time
_import = builtins.__import__
def _slow(mod, name, env):
    fn = getattr(mod, name)
    def slow(*a, **k):
        if multiprocessing.parent_process() is not None and os.environ.get(env):  # the engine process only
            time.sleep(float(os.environ[env]))
        return fn(*a, **k)
    setattr(mod, name, slow)
def _hook(name, *a, **k):  # test hook: engine-side grammar compiles / model loads take seconds
    m = _import(name, *a, **k)
    for modname, cls, attr, env in (("grammar.compile", "GrammarCompiler", "compile", "NEXTN_TEST_SLOW_COMPILE_S"),
                                    ("engine.loader", None, "load_model", "NEXTN_TEST_SLOW_LOAD_S")):
        mod = sys.modules.get(modname)
        owner = mod if mod is None or cls is None else getattr(mod, cls, None)
        if owner is not None and hasattr(owner, attr) and not hasattr(mod, "_nextn_slow_" + attr):
            setattr(mod, "_nextn_slow_" + attr, True)
            _slow(owner, attr, env)
    return m
builtins.__import__ = _hook
"""


def _slow_engine_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """Environment whose spawned engine process imports the SLOW_ENGINE sitecustomize."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_ENGINE)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]), **env}


def test_a_grammar_compiling_in_the_engine_holds_up_no_other_request(tmp_path, monkeypatch):
    """The engine compiles a request's grammar again (from its source) off its command loop: while one request's
    grammar compiles there (made to take 4 s by a sitecustomize the spawned engine imports), another request is
    served at once."""
    for k, v in _slow_engine_env(tmp_path, NEXTN_TEST_SLOW_COMPILE_S="4").items():
        monkeypatch.setenv(k, v)
    with ServerThread(engine_process=True) as s:
        took: dict[str, float] = {}

        def constrained() -> None:
            t0 = time.monotonic()
            r = httpx.post(s.base_url + "/chat/completions", timeout=60, json={
                "model": s.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
            took["constrained"] = time.monotonic() - t0 if r.status_code == 200 else -1.0

        t = threading.Thread(target=constrained)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        plain = _client(s).completions.create(model=s.model, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        took["plain"] = time.monotonic() - t0
        t.join(60)
        assert plain.usage.completion_tokens == 4 and took["plain"] < 2.0, took
        assert took["constrained"] >= 4.0, took  # the slow compile did happen, in the engine


def test_a_dead_engine_fails_every_open_request_and_health():
    with ServerThread(engine_process=True, max_num_seqs=2) as s:
        body = {"model": s.model, "prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as h, h.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            t0 = time.monotonic()
            os.kill(s.worker._proc.pid, signal.SIGKILL)
            rest = list(lines)  # the stream ends (it does not hang) with an error event
            assert time.monotonic() - t0 < 30
        assert any('"error"' in line and "engine process exited" in line for line in rest), rest[-3:]
        assert wait_until(lambda: httpx.get(s.url + "/health").status_code == 503)
        late = httpx.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert late.status_code == 503 and late.json()["error"]["message"]


def test_a_dead_worker_loop_ends_the_engine_process():
    """The loop inside the engine fails (not one session): its jobs fail, the engine process exits and the
    server reports it (/health 503, new requests 503), as the in-process worker does."""
    with ServerThread(engine_process=True, worker_kw={"session_factory": failing_session}) as s:
        c = _client(s)
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model=s.model, prompt=[5, KILL_LOOP_MARK, 7], max_tokens=8, temperature=0)
        assert wait_until(lambda: httpx.get(s.url + "/health").status_code == 503, timeout=30)
        assert s.worker._proc.exitcode == 70
        late = httpx.post(s.base_url + "/completions", json={"model": s.model, "prompt": [5], "max_tokens": 2})
        assert late.status_code == 503


def test_a_checkpoint_the_engine_cannot_load_is_one_line(tmp_path):
    """The engine process loads the model: its failure reaches `nextn serve` as the usual one line, exit 1."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_checkpoint().iterdir():
        (bad / f.name).write_bytes(b"not a safetensors file" if f.suffix == ".safetensors" else f.read_bytes())
    r = subprocess.run([sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve",
                        str(bad), "--port", str(free_port()), "--device", "cpu"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nextn serve: error: cannot load {bad}"), r.stderr[-2000:]


def test_ctrl_c_while_the_engine_loads_stops_both_processes(tmp_path):
    """A Ctrl-C reaches the whole process group while the engine loads its model (made to take 60 s): the engine
    ignores it, `nextn serve` stops it and exits; nothing is left waiting."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve",
                             str(tiny_checkpoint()), "--port", str(free_port()), "--device", "cpu"], cwd=REPO_ROOT,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **_slow_engine_env(tmp_path, NEXTN_TEST_SLOW_LOAD_S="60")})
    try:
        assert wait_until(lambda: _engine_of(proc.pid), timeout=60)
        kid = _engine_of(proc.pid)
        time.sleep(2)  # inside the (slowed) load
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert wait_until(lambda: not _alive(kid), timeout=15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _engine_of(pid: int) -> int | None:
    """The engine process among `pid`'s children (not multiprocessing's resource tracker)."""
    for p in os.listdir("/proc"):
        if p.isdigit() and _ppid(int(p)) == pid:
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes():
                    return int(p)
    return None


def test_killing_nextn_serve_takes_its_engine_process_down():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve",
                             str(tiny_checkpoint()), "--port", str(port), "--device", "cpu", "--log-level", "warning"],
                            cwd=REPO_ROOT, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: http_ready(f"http://127.0.0.1:{port}"), timeout=120)
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid]
        assert kids, "no engine process"
        proc.kill()
        proc.wait(30)
        assert wait_until(lambda: not any(_alive(k) for k in kids), timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
