"""Helpers for the server tests: a tiny checkpoint, and a real uvicorn server on a free local port.

`ServerThread` runs `server.cli.build_server` (the same wiring as `nextn serve`) in a background
thread of the test process, so tests can reach the worker (`.worker.num_active`) and inject a
`session_factory`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from config.settings import ServeSettings, resolve
from server.cli import NextnServer, build_server

API_KEY = "sk-test"


@functools.cache
def tiny_checkpoint() -> Path:
    """One random tiny Qwen3.5 checkpoint (with MTP weights and tokenizer) per test process."""
    from tests.tiny import make_checkpoint

    return make_checkpoint(Path(tempfile.mkdtemp(prefix="nextn-tiny-")) / "tiny", seed=0)


@functools.cache
def tiny_model_and_tokenizer() -> tuple[Any, Any]:
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    path = tiny_checkpoint()
    return load_model(path), Tokenizer.from_dir(path)


DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"


@functools.cache
def demo_model_and_tokenizer() -> tuple[Any, Any]:
    """The bundled demo checkpoint (trained: answers chats, writes JSON), loaded once per test process."""
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    return load_model(DEMO_DIR), Tokenizer.from_dir(DEMO_DIR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NEXTN = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())"]


@contextlib.contextmanager
def nextn_serve(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, list[str]]]:
    """`nextn serve ARGS --port P` as a real process (one torch thread): yields (base url, stderr lines), the
    lines filled in after the block, once the server drained on SIGTERM and exited 0 (it is killed if not)."""
    port = free_port()
    proc = subprocess.Popen(NEXTN + ["serve", *args, "--port", str(port)], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    base, lines = f"http://127.0.0.1:{port}", []
    try:
        assert wait_until(lambda: http_ready(base), timeout=60), "server did not become ready"
        yield base, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        lines += proc.communicate()[1].splitlines()


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate()` until it is truthy; False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def http_ready(base: str) -> bool:
    """`GET base/ready` answers 200 (False while nothing listens yet)."""
    try:
        return httpx.get(base + "/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


class ServerThread:
    """A real nextn server (uvicorn + worker) on 127.0.0.1 in a background thread; a context manager.

    `settings` override `ServeSettings` fields; `worker_kw` go to `Worker` (e.g. `session_factory`); the worker
    runs in this process (engine_process=False) unless a test asks for the engine process;
    `tokenizer` replaces the tiny checkpoint's (tests wrap it to block or fail on cue); `demo` serves the
    bundled demo model instead of the tiny random one.
    """

    def __init__(self, worker_kw: dict[str, Any] | None = None, tokenizer: Any = None, demo: bool = False,
                 **settings: Any) -> None:
        model, tok = demo_model_and_tokenizer() if demo else tiny_model_and_tokenizer()
        tok = tokenizer if tokenizer is not None else tok
        s = ServeSettings(**{"model_dir": DEMO_DIR if demo else tiny_checkpoint(), "port": free_port(), "device": "cpu",
                             "dtype": "float32", "log_level": "warning", "engine_process": False, **settings})
        self.settings, _ = resolve(s, cuda_available=False, has_mtp=model.config.has_mtp,
                                   max_position_embeddings=model.config.max_position_embeddings)
        self.server: NextnServer = build_server(self.settings, model, tok, **(worker_kw or {}))
        self.worker = self.server.worker
        self.app = self.server.config.app
        self.url = self.settings.url
        self.base_url = self.url + "/v1"
        self.model = self.settings.served_model_name
        self._thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> ServerThread:
        # One intra-op thread: on a 2-core box shared with other processes, OpenMP teams of 2 spin
        # against each other (a tiny-model burst goes from ms to seconds); results are unaffected.
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._thread.start()
        if not wait_until(lambda: self.server.started, timeout=20):
            raise RuntimeError("test server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=20)
        self.worker.shutdown(timeout=20)
        torch.set_num_threads(self._threads)

    @property
    def open_connections(self) -> int:
        """HTTP connections uvicorn holds open now."""
        return len(self.server.server_state.connections)

    @property
    def handlers_running(self) -> int:
        """Requests whose ASGI handler has not returned yet."""
        return len(self.server.server_state.tasks)

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample on /metrics (0 if absent)."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def gated_sessions(gate: threading.Event) -> type:
    """A SpecSession class whose prefill waits for `gate`: it holds the worker (one session active, the rest
    queued) until the test opens the gate."""
    from engine.spec import SpecSession

    class GatedSession(SpecSession):
        def next_chunk(self) -> list[int]:
            gate.wait(30)
            return super().next_chunk()

        def next_chunks(self, n: int) -> list[list[int]]:  # (a prompt's last blocks in one row: a tail's cut)
            gate.wait(30)
            return super().next_chunks(n)

    return GatedSession
