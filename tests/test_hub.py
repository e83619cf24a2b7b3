"""`nextn serve ORG/NAME` against a stand-in Hugging Face hub on 127.0.0.1.

`StandInHub` serves tiny repos through the endpoints huggingface_hub calls: GET /api/models/{repo}/revision/{rev}
(repo_info: the commit sha), GET /api/models/{repo}/tree/{rev} (the file list), HEAD and GET
/{repo}/resolve/{rev}/{file} (X-Repo-Commit, ETag, Content-Length; the bytes), with the hub's error headers
(X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo). Repos: `nextn-test/tiny` (a tiny Qwen3.5 checkpoint plus
files the server must not fetch), a gated copy, a GGUF-only repo and a Llama checkpoint.

The resolver runs in-process (engine.hub.resolve_model with an explicit endpoint and cache); `nextn serve` runs as a
process for what the command line owns: the download and serve on a terminal (a pty: the progress bar), a second
start offline from the cache, and the exit code and one line of each failure.
"""
from __future__ import annotations

import fcntl
import hashlib
import http.server
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import pytest

from engine.hub import ALLOW_PATTERNS, HubError, is_repo_id, resolve_model
from tests.server_fixtures import NEXTN, free_port, http_ready, nextn_serve, wait_until
from tests.tiny import make_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_granted"


class StandInHub(http.server.ThreadingHTTPServer):
    """A stand-in hub: `repos` maps ORG/NAME to {file: bytes}; `gated` repos need `Authorization: Bearer hf_granted`
    to download a file (401 without a token, 403 with another, as the hub answers). `requests` logs each path."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos, self.gated = repos, gated
        self.requests: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"})

    def _route(self) -> None:
        path = unquote(urlparse(self.path).path)
        self.server.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        files = self.server.repos.get(repo)
        if files is None:
            return self._error(404 if api else 401, "RepoNotFound", "Repository not found")
        rest = parts[4:] if api else parts[2:]
        if not rest or rest[1:2] == [] or rest[1] not in ("main", COMMIT):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if api and rest[0] == "revision":
            body = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                    "gated": "manual" if repo in self.server.gated else False,
                    "siblings": [{"rfilename": f} for f in files]}
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        if api and rest[0] == "tree":
            body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in files.items()]
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        name = "/".join(rest[2:])
        if api or rest[0] != "resolve" or name not in files:
            return self._error(404, "EntryNotFound", "Entry not found")
        if repo in self.server.gated:
            auth = self.headers.get("Authorization", "")
            if auth != f"Bearer {TOKEN}":
                return self._error(403 if auth else 401, "GatedRepo", f"Access to model {repo} is restricted.")
        data = files[name]
        self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                               "Content-Type": "application/octet-stream"})

    do_GET = do_HEAD = _route


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hub") / "tiny", seed=3)


@pytest.fixture(scope="module")
def hub(ckpt: Path) -> Iterator[StandInHub]:
    tiny = {f.name: f.read_bytes() for f in sorted(ckpt.iterdir())}
    extra = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 64, "tiny-Q4_K_M.gguf": b"GGUF" + b"\0" * 60,
             "original/params.json": b"{}"}
    llama = {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode(),
             "model.safetensors": tiny["model.safetensors"]}
    server = StandInHub({"nextn-test/tiny": {**tiny, **extra}, "nextn-test/gated": dict(tiny),
                         "nextn-test/tiny-GGUF": {"README.md": b"# q\n", "tiny-Q4_K_M.gguf": b"GGUF"},
                         "nextn-test/llama": llama}, gated={"nextn-test/gated"})
    thread = threading.Thread(target=server.serve_forever, name="stand-in-hub", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def dead_endpoint() -> str:
    """A local URL nothing listens on (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


def test_repo_id_form():
    assert all(map(is_repo_id, ("Qwen/Qwen3.5-9B", "a/b", "org.x/m_1-2")))
    assert not any(map(is_repo_id, ("/abs/dir", "a/b/c", "demo", "./a", "a/", "a/..", "Qwen/Qwen3.5-9B.")))


def test_download_what_the_server_needs_then_serve_offline_from_the_cache(hub, ckpt, tmp_path):
    cache = tmp_path / "cache"
    src = resolve_model("nextn-test/tiny", download_dir=cache, endpoint=hub.url, token=False)
    assert src.repo_id == "nextn-test/tiny" and src.commit == COMMIT and src.path.parent.name == "snapshots"
    got = {f.name for f in src.path.iterdir()}
    assert got == {f.name for f in ckpt.iterdir()}  # config, weights, tokenizer, generation config; nothing else
    assert all((src.path / f).read_bytes() == (ckpt / f).read_bytes() for f in got)
    assert not any(p.endswith((".bin", ".gguf", ".md")) for p in hub.requests if p.startswith("GET /nextn-test"))
    assert set(ALLOW_PATTERNS) >= {"*.safetensors", "config.json", "tokenizer.json", "generation_config.json"}
    before = len(hub.requests)
    again = resolve_model("nextn-test/tiny", download_dir=cache, endpoint=dead_endpoint(), offline=True, token=False)
    assert again.path == src.path and len(hub.requests) == before  # the cache alone, no request
    local = resolve_model(src.path)  # an existing path wins over any id; no hub involved
    assert local.path == src.path and local.repo_id is None


@pytest.mark.parametrize("repo,kw,needle", [
    ("nextn-test/nope", {}, "nextn-test/nope is neither a local directory nor a model on http://127.0.0.1:"),
    ("nextn-test/gated", {}, "nextn-test/gated is gated: accept its terms on http://127.0.0.1:"),
    ("nextn-test/gated", {"token": "hf_other"}, "is gated and your token has no access to it"),
    ("nextn-test/tiny", {"offline": True}, "is not in the cache"),
    ("nextn-test/tiny", {"endpoint": "dead"}, "cannot reach http://127.0.0.1:"),
    ("nextn-test/tiny-GGUF", {}, "holds GGUF files only (1, e.g. tiny-Q4_K_M.gguf), a llama.cpp format"),
    ("nextn-test/llama", {}, "nextn-test/llama is a LlamaForCausalLM checkpoint (model_type llama); nextn serves"),
    ("nextn-test/tiny", {"revision": "v9"}, "nextn-test/tiny has no revision 'v9': check --revision"),
    ("no/such/dir", {}, "model directory no/such/dir does not exist (and no/such/dir is not a hub id"),
], ids=["404", "gated-401", "gated-403", "offline-not-cached", "unreachable", "gguf-only", "llama", "revision",
        "not-an-id"])
def test_failures_say_what_to_do(hub, tmp_path, repo, kw, needle):
    cache = tmp_path / "cache"
    kw = {"token": False, "endpoint": hub.url, **kw}
    if kw["endpoint"] == "dead":
        kw["endpoint"] = dead_endpoint()
    with pytest.raises(HubError) as e:
        resolve_model(repo, download_dir=cache, **kw)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    if "gated" in repo and kw["token"] is False:
        assert "hf auth login" in msg and "HF_TOKEN" in msg
    weights = list(cache.rglob("*.safetensors")) + list(cache.rglob("*.gguf"))
    assert not weights  # refused before any weight was fetched


def test_gated_repo_with_a_granted_token_downloads(hub, tmp_path):
    src = resolve_model("nextn-test/gated", download_dir=tmp_path, endpoint=hub.url, token=TOKEN)
    assert (src.path / "model.safetensors").is_file()


# --------------------------------------------------------------------------- `nextn serve` as a process


def hub_env(hub_url: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `nextn serve` run against `hub_url` with its own HF_HOME (no real token, no real cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": hub_url, "HF_HOME": str(home), "OMP_NUM_THREADS": "1", **extra}


def run_in_pty(argv: list[str], env: dict[str, str], until: str, timeout: float = 90) -> tuple[subprocess.Popen,
                                                                                                 int, str]:
    """Start `argv` with a pty as its stdout and stderr; read its output until `until` appears (bounded)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower, close_fds=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    while until.encode() not in out and time.monotonic() < deadline and proc.poll() is None:
        if select.select([leader], [], [], 0.5)[0]:
            try:
                out += os.read(leader, 65536)
            except OSError:
                break
    return proc, leader, out.decode(errors="replace")


@pytest.mark.slow
def test_serve_hub_id_on_a_terminal_then_offline_from_the_cache(hub, tmp_path):
    home = tmp_path / "hf"
    port = free_port()
    argv = NEXTN + ["serve", "nextn-test/tiny", "--no-engine-process", "--port", str(port)]
    proc, leader, out = run_in_pty(argv, hub_env(hub.url, home), until="nextn serving model=")
    try:
        assert "nextn serving model=nextn-test/tiny" in out, out[-3000:]
        assert "100%|" in out and "Fetching" in out, out[-3000:]  # huggingface_hub's tqdm bars on a terminal
        assert "hub: nextn-test/tiny" in out and "token: none" in out
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "nextn-test/tiny"
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "nextn-test/tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "nextn-test/tiny"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        os.close(leader)
    snapshots = list((home / "hub").glob("models--nextn-test--tiny/snapshots/*"))
    assert [s.name for s in snapshots] == [COMMIT]
    before = len(hub.requests)
    env = hub_env(dead_endpoint(), home, HF_HUB_OFFLINE="1")
    with nextn_serve("nextn-test/tiny", "--no-engine-process", "--served-model-name", "tiny", "alias",
                     env=env) as (base, lines):
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "tiny"
        for name in ("tiny", "alias"):  # every served name is accepted; the first is reported
            r = httpx.post(base + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert len(hub.requests) == before
    assert any("offline: the cache only" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("repo,endpoint,needle", [
    ("nextn-test/nope", "hub", "is neither a local directory nor a model on"),
    ("nextn-test/gated", "hub", "is gated: accept its terms on"),
    ("nextn-test/tiny", "dead", "cannot reach"),
], ids=["404", "gated-401", "unreachable"])
def test_serve_failures_exit_1_with_one_line(hub, tmp_path, repo, endpoint, needle):
    url = hub.url if endpoint == "hub" else dead_endpoint()
    r = subprocess.run(NEXTN + ["serve", repo, "--port", str(free_port()), "--log-level", "warning"], cwd=REPO_ROOT,
                       env=hub_env(url, tmp_path), capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and needle in lines[0], r.stderr
    assert lines[0].startswith("nextn serve: error: ") and "Traceback" not in r.stderr
    assert not list(tmp_path.rglob("*.safetensors"))
