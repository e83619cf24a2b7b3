"""Settings precedence and validation, and `nextn serve` as a process: bad values, SIGTERM drain."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import tomllib
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from config.settings import DEFAULT_CONFIG_FILE, REPO_ROOT, ServeSettings, SettingsError, load_settings, resolve
from engine.model.ops import cpu
from server.cli import build_parser, settings_from_args
from tests.server_fixtures import NEXTN, free_port, http_ready, nextn_serve, tiny_checkpoint, wait_until


def write_toml(path: Path, **serve: object) -> Path:
    lines = ["[serve]"] + [f"{k} = {json.dumps(v)}" for k, v in serve.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    cfg = write_toml(tmp_path / "c.toml", model_dir=str(tmp_path), port=1111, host="0.0.0.0", max_queue=5,
                     max_num_seqs=2)
    env = {"NEXTN_PORT": "2222", "NEXTN_MAX_NUM_SEQS": "3", "NEXTN_API_KEY": "from-env"}
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "3333"])
    s = settings_from_args(args, environ=env)
    assert s.port == 3333  # CLI beats env and file
    assert s.max_num_seqs == 3 and s.api_key.get_secret_value() == "from-env"  # env beats file
    assert s.host == "0.0.0.0" and s.max_queue == 5  # file beats defaults
    assert s.max_num_batched_tokens == 512 and s.num_speculative_tokens == 3  # defaults
    assert s.model_dir == tmp_path


def test_config_file_from_env_and_positional_model_dir(tmp_path):
    other = tmp_path / "m"
    other.mkdir()
    cfg = write_toml(tmp_path / "c.toml", model_dir=str(tmp_path), max_num_batched_tokens=9)
    args = build_parser().parse_args(["serve", str(other)])
    s = settings_from_args(args, environ={"NEXTN_CONFIG": str(cfg)})
    assert s.max_num_batched_tokens == 9 and s.model_dir == other


def test_default_toml_matches_field_defaults():
    table = tomllib.loads(DEFAULT_CONFIG_FILE.read_text())["serve"]
    fields = ServeSettings.model_fields
    assert table and all(fields[k].default == v for k, v in table.items())
    commented = {line.split("=")[0].strip("# ").strip() for line in DEFAULT_CONFIG_FILE.read_text().splitlines()
                 if line.startswith("# ") and "=" in line}
    assert set(table) | commented == set(fields)  # every setting is documented in the file


def test_settings_are_frozen(tmp_path):
    s = ServeSettings(model_dir=tmp_path)
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("cli,env,toml,needle", [
    ({"port": "abc"}, {}, {}, "--port"),
    ({}, {"NEXTN_DEVICE": "tpu"}, {}, "NEXTN_DEVICE"),
    ({}, {}, {"max_num_seqs": 0}, "max_num_seqs in"),
    ({"num_speculative_tokens": "5", "spec_capmax": "4"}, {}, {}, "exceeds spec_capmax"),
    ({}, {}, {"no_such_setting": 1}, "unknown setting no_such_setting in"),
    ({"spec_draft_p_min": "1.5"}, {}, {}, "--spec-draft-p-min"),
], ids=["cli-type", "env-choice", "toml-range", "cross-field", "toml-unknown", "cli-range"])
def test_bad_values_raise_one_line(tmp_path, cli, env, toml, needle):
    cfg = write_toml(tmp_path / "c.toml", model_dir=str(tmp_path), **toml)
    with pytest.raises(SettingsError) as e:
        load_settings(cli, config_file=cfg, environ=env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_auto_values_are_resolved_with_notes(tmp_path):
    s = ServeSettings(model_dir=tmp_path)
    r, notes = resolve(s, cuda_available=False, max_position_embeddings=262144, has_mtp=False, cores=4, environ={})
    assert (r.device, r.dtype, r.served_model_name, r.max_model_len) == ("cpu", "float32", tmp_path.name, 4096)
    assert r.num_speculative_tokens == 0 and r.cpu_threads == 3 and r.cpu_kernel_threads == 2
    text = "\n".join(msg for _, msg in notes)
    assert all(w in text for w in ("device auto -> cpu", "dtype auto -> float32", "served_model_name None -> ",
                                   "max_model_len None -> 4096", "num_speculative_tokens 3 -> 0",
                                   "cpu_threads None -> 3 (4 usable core(s)",
                                   "cpu_kernel_threads None -> 2 (4 usable core(s))", "max_queue None -> "))
    assert notes[-1][0] == logging.WARNING
    # the queue bound: sized from the available memory (thousands), within its range, logged
    for memory, want in ((2**40, 16384), (2**33, 2**33 // 8 // (4096 * 64 + 65536)), (2**20, 1024), (None, 1024)):
        r, notes = resolve(s, cuda_available=False, max_position_embeddings=262144, has_mtp=True, cores=4,
                           environ={}, memory=lambda m=memory: m)
        assert r.max_queue == want and any(msg.startswith(f"max_queue None -> {want} (") for _, msg in notes)
    # threads: OMP_NUM_THREADS wins over the core count; one core still gets one thread; cuda leaves torch's
    for env, cores, want in (({"OMP_NUM_THREADS": "5"}, 4, 5), ({}, 1, 1), ({"OMP_NUM_THREADS": "x"}, 2, 1)):
        r = resolve(s, cuda_available=False, max_position_embeddings=4096, has_mtp=True, cores=cores, environ=env)[0]
        assert r.cpu_threads == want and r.cpu_kernel_threads == min(2, cores)
    r = resolve(s, cuda_available=True, max_position_embeddings=4096, has_mtp=True, cores=8, environ={})[0]
    assert r.cpu_threads is None and r.cpu_kernel_threads is None
    r, notes = resolve(ServeSettings(model_dir=tmp_path, device="cpu", dtype="bfloat16", served_model_name="x",
                                     max_model_len=100, max_queue=64, cpu_threads=2, cpu_kernel_threads=1),
                       cuda_available=False, max_position_embeddings=4096, has_mtp=True)
    assert notes == [] and r.num_speculative_tokens == 3 and r.cpu_threads == 2 and r.cpu_kernel_threads == 1
    with pytest.raises(SettingsError):
        resolve(ServeSettings(model_dir=tmp_path, device="cuda"), cuda_available=False,
                max_position_embeddings=4096, has_mtp=True)
    with pytest.raises(SettingsError):
        resolve(ServeSettings(model_dir=tmp_path, max_model_len=9000), cuda_available=False,
                max_position_embeddings=4096, has_mtp=True)
    # the engine process is the default; the research door keeps the engine in the serving process (logged)
    assert s.engine_process and resolve(s, cuda_available=False, max_position_embeddings=4096,
                                        has_mtp=True)[0].engine_process
    r, notes = resolve(ServeSettings(model_dir=tmp_path, research_opti_controller_q=0.5), cuda_available=False,
                       max_position_embeddings=4096, has_mtp=True)
    assert not r.engine_process and notes[-1] == (
        logging.WARNING, "engine_process True -> False (the research door's controller and counters live in the "
                         "serving process)")


# ------------------------------------------------------------------------------------ as a process


def run_nextn(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(NEXTN + list(argv), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv,env,needle", [
    (["--port", "abc"], {}, "--port"),
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    (["--device", "tpu"], {}, "--device"),
    ([], {"NEXTN_MAX_QUEUE": "-1"}, "NEXTN_MAX_QUEUE"),
    (["--max-model-len", "100000"], {}, "max_position_embeddings"),
], ids=["type", "unknown-flag", "choice", "env", "over-checkpoint"])
@pytest.mark.slow
def test_bad_flag_exits_nonzero_with_one_line(argv, env, needle):
    r = run_nextn("serve", str(tiny_checkpoint()), *argv, env=env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_missing_model_dir_exits_nonzero_with_one_line():
    r = run_nextn("serve", "/no/such/dir")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model directory /no/such/dir does not exist" in lines[0], r.stderr
    assert r.returncode == 2


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero():
    port = free_port()
    proc = subprocess.Popen(NEXTN + ["serve", str(tiny_checkpoint()), "--port", str(port)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: http_ready(base), timeout=60), "server did not become ready"
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(base + "/ready").status_code == 503, timeout=5)
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert t.is_alive(), "the long stream should still be running while draining"
        t.join(120)
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == 1000
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    startup = [line for line in stderr.splitlines() if "nextn serving" in line]
    assert len(startup) == 1 and f"model=tiny device=cpu dtype=float32 K=3 url={base}" in startup[0]
    if cpu.available():  # the engine process built (or found) the C kernel and says so at startup
        assert "step GEMMs: C kernels" in stderr, stderr


@pytest.mark.slow
def test_no_cpu_kernel_reaches_the_engine_process_and_serves():
    with nextn_serve(str(tiny_checkpoint()), "--no-cpu-kernel") as (base, stderr):
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert any("step GEMMs: torch ops (--no-cpu-kernel)" in line for line in stderr), stderr


@pytest.mark.slow
@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch path runs")
def test_cpu_kernel_threads_reach_the_engine_process_and_keep_the_tokens():
    """Two kernel threads in the engine process (logged at startup): the same greedy tokens as the C kernels on one
    thread in this process (which thread computes an output never changes its bits)."""
    from engine.loader import load_model
    from engine.spec import generate_spec

    prompt = list(range(5, 25))
    prev = cpu.set_threads(1)
    try:
        want = generate_spec(load_model(tiny_checkpoint()), prompt, 12, k=3)[0]
    finally:
        cpu.set_threads(prev)
    with nextn_serve(str(tiny_checkpoint()), "--cpu-kernel-threads", "2") as (base, stderr):
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                       "ignore_eos": True, "return_token_ids": True, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    assert any("C kernels" in line and "on 2 threads" in line for line in stderr), stderr


def test_the_http_event_loop_is_uvloop_when_installed_and_logged(monkeypatch, caplog):
    """uvicorn runs on uvloop (a dependency) and says so; without uvloop it falls back to asyncio, also logged."""
    import importlib.util

    from server.cli import event_loop
    from tests.server_fixtures import ServerThread

    with caplog.at_level(logging.INFO, logger="nextn"):
        with ServerThread() as st:  # the served loop: uvicorn's listening server belongs to it
            assert type(st.server.servers[0]).__module__.startswith("uvloop"), type(st.server.servers[0])
            assert httpx.get(st.url + "/health", timeout=10).status_code == 200
    assert "HTTP event loop: uvloop" in caplog.text
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nextn"):
        assert event_loop() == "asyncio"
    assert "asyncio (uvloop is not installed)" in caplog.text
