"""A rolling restart behind a real load balancer loses nothing: two `nextn serve` replicas of the demo behind HAProxy.

HAProxy (Debian's package; tools/test.sh installs it as root, like promtool) balances 16 streaming clients over two
replicas, health-checking `/ready`, and retries a request whose answer is a 503 or whose connection failed on the
other replica (`retry-on`; a replica's drain 503 comes before any byte of a response, so no stream is ever retried).
While every client streams, replica a gets SIGTERM with streams in flight (one of them long, sent to a itself, so
that a's engine is busy when the signal lands): its `/ready` turns 503, HAProxy marks it down and sends it nothing
more, every stream it had finishes, new requests land on b, and a exits 0 once drained.
Then a starts again and takes traffic. Every stream of the whole run must be complete and equal to the same
request's answer from one replica alone (greedy). The test asserts no timing: only the order of events it observes.
The deployment in deploy/kubernetes/ relies on the same drain (README "Deploy").
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import DEMO_DIR, NEXTN, free_port, http_ready, wait_until

HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (Debian: apt-get install haproxy; "
                                                        "tools/test.sh installs it when run as root)")

CLIENTS = 16
MAX_TOKENS = 32
LONG = CLIENTS  # the prompt of one long stream sent to replica a itself: in its engine when a gets SIGTERM
LONG_TOKENS = 200
GRACE_S = 60  # the drain must end within this (a pod's terminationGracePeriodSeconds); the streams are short
STARTUP_S = 120  # a cold `nextn serve` on a shared 2-core box
REPO = Path(__file__).resolve().parents[1]


def prompt(i: int) -> str:
    return f"Tell me a story about the number {i}."


class Replica:
    """One `nextn serve` of the demo on a fixed port, as a process (its log in `dir`)."""

    def __init__(self, name: str, port: int, dir: Path):
        self.name, self.port, self.dir = name, port, dir
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.dir / f"{self.name}-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            NEXTN + ["serve", str(DEMO_DIR), "--port", str(self.port), "--max-model-len", "256",
                     "--cpu-kernel-threads", "1", "--log-level", "warning"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_ready(self) -> None:
        assert self.proc is not None
        ok = wait_until(lambda: self.proc.poll() is not None or http_ready(self.url), timeout=STARTUP_S, interval=0.1)
        assert ok and self.proc.poll() is None, f"replica {self.name} did not start:\n{self.log()}"

    def log(self) -> str:
        return (self.dir / f"{self.name}-{self.starts}.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


HAPROXY_CFG = """\
global
    stats socket {sock} mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    option http-buffer-request
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
frontend nextn
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk
    http-check send meth GET uri /ready
    http-check expect status 200
    http-response set-header X-Nextn-Replica %[srv_name]
    default-server check inter 100ms fall 1 rise 2
{servers}
"""


class HAProxy:
    """HAProxy in the foreground on 127.0.0.1, with an admin socket for its per-server state."""

    def __init__(self, replicas: list[Replica], dir: Path):
        self.port, self.sock = free_port(), str(dir / "haproxy.sock")
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = dir / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(sock=self.sock, port=self.port, servers="\n".join(
            f"    server {r.name} 127.0.0.1:{r.port}" for r in replicas)))
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(dir / "haproxy.log", "w")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=self.log, stderr=subprocess.STDOUT)

    def stats(self) -> dict[str, dict[str, str]]:
        """`show stat` of the backend's servers: {server name: {column: value}}."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.sock)
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        cols = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(cols, line.split(","))) for line in lines[1:] if line]
        return {r["svname"]: r for r in rows if r["pxname"] == "replicas" and r["svname"] != "BACKEND"}

    def status(self, name: str) -> str:
        try:
            return self.stats()[name]["status"]
        except OSError:
            return "?"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Stream:
    """One streamed request as its client saw it."""

    i: int
    start: float
    end: float = 0.0
    replica: str = ""
    status: int = 0
    text: str = ""
    finish: str | None = None
    done: bool = False  # `data: [DONE]` arrived
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish == "length" and not self.error


def stream(url: str, i: int, client: httpx.Client, on_first: threading.Event | None = None) -> Stream:
    """POST a greedy streamed completion of `prompt(i)`; the answer as the client saw it (errors recorded).
    `on_first` is set when the first tokens arrive."""
    s = Stream(i, time.monotonic())
    body = {"model": "demo", "prompt": prompt(i), "max_tokens": LONG_TOKENS if i == LONG else MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            s.status, s.replica = r.status_code, r.headers.get("x-nextn-replica", "")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    s.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        s.error = str(chunk["error"])
                        continue
                    choice = chunk["choices"][0]
                    s.text += choice["text"]
                    s.finish = choice.get("finish_reason") or s.finish
                    if on_first is not None:
                        on_first.set()
            if r.status_code != 200:
                s.error = r.read().decode(errors="replace")[:300]
    except Exception as e:  # noqa: BLE001 - whatever went wrong, this request failed
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.monotonic()
    return s


@pytest.mark.slow
def test_rolling_restart_behind_haproxy_drops_nothing():
    tmp = Path(tempfile.mkdtemp(prefix="nextn-rolling-"))
    a, b = Replica("a", free_port(), tmp), Replica("b", free_port(), tmp)
    lb: HAProxy | None = None
    stop = threading.Event()
    records: list[Stream] = []
    threads: list[threading.Thread] = []
    try:
        a.start()
        b.start()
        a.wait_ready()
        b.wait_ready()
        # each prompt's answer from one replica alone, one request at a time
        with httpx.Client(timeout=60) as c:
            reference = {}
            for i in range(CLIENTS + 1):
                s = stream(a.url, i, c)
                assert s.ok, s
                reference[i] = s.text
        lb = HAProxy([a, b], tmp)
        assert wait_until(lambda: lb.status("a") == "UP" and lb.status("b") == "UP", timeout=30), lb.stats()

        def client(i: int) -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    records.append(stream(lb.url, i, c))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()

        def served_by(name: str, after: float) -> int:
            return sum(1 for s in list(records) if s.replica == name and s.ok and s.start > after)

        # both replicas serve; a long stream runs on a (its first tokens arrived): then a gets SIGTERM
        assert wait_until(lambda: served_by("a", 0) >= 4 and served_by("b", 0) >= 4, timeout=120)
        first = threading.Event()
        long: list[Stream] = []

        def long_stream() -> None:
            with httpx.Client(timeout=60) as c:
                long.append(stream(a.url, LONG, c, first))

        threads.append(threading.Thread(target=long_stream, daemon=True))
        threads[-1].start()
        assert first.wait(60)
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        answers: list[int] = []

        def ready_status() -> bool:
            try:
                answers.append(httpx.get(a.url + "/ready", timeout=2).status_code)
            except httpx.TransportError:
                answers.append(0)  # a already exited
            return answers[-1] == 503

        assert wait_until(ready_status, timeout=10, interval=0.005), f"a's /ready answered {answers}"
        assert wait_until(lambda: lb.status("a").startswith("DOWN"), timeout=30), lb.stats()
        t_down = time.monotonic()
        sessions_at_down = int(lb.stats()["a"]["stot"])
        assert a.proc.wait(GRACE_S) == 0, f"the drained replica did not exit 0:\n{a.log()}"
        # new requests land on b while a is away
        assert wait_until(lambda: served_by("b", t_down) >= CLIENTS, timeout=120)
        assert int(lb.stats()["a"]["stot"]) == sessions_at_down, "HAProxy sent the drained replica a request"
        # a comes back and takes traffic again
        t_restart = time.monotonic()
        a.start()
        a.wait_ready()
        assert wait_until(lambda: lb.status("a") == "UP", timeout=30), lb.stats()
        t_up = time.monotonic()
        assert wait_until(lambda: served_by("a", t_up) >= 4, timeout=120)
        stop.set()
        for t in threads:
            t.join(120)
        stats = lb.stats()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        if lb is not None:
            lb.stop()
        a.stop()
        b.stop()

    # the long stream, in a's engine at SIGTERM, finished there, complete
    assert long and long[0].ok and long[0].start < t_term < long[0].end, long
    records += long
    failed = [s for s in records if not s.ok]
    assert not failed, f"{len(failed)} of {len(records)} requests failed, e.g. {failed[:3]}"
    wrong = [s for s in records if s.text != reference[s.i]]
    assert not wrong, f"{len(wrong)} streams differ from their single-replica answer, e.g. {wrong[:2]}"
    drained = [s for s in records if s.start < t_term < s.end and s.replica != "b"]  # via HAProxy, and the long one
    # after HAProxy saw a's /ready fail, and until a started again, every request went to b
    assert all(s.replica == "b" for s in records if t_down < s.start < t_restart)
    assert {s.replica for s in records if s.start > t_up} == {"a", "b"}
    print(f"{len(records)} streams, {len(drained)} drained on a; HAProxy retries {stats['a']['wretr']} (a), "
          f"{stats['b']['wretr']} (b), redispatches {stats['a']['wredis']} (a)")
    shutil.rmtree(tmp, ignore_errors=True)
