"""Soak: many concurrent clients against a real `nextn serve` on loopback, mixed requests, some walking away.

Each client loops for a number of requests or a duration, each request drawn at random: chat or legacy
completions, streamed or not, greedy or sampled, n = 1 or 2, sometimes with a stop string, and a fraction of
them (10% by default) abandoned at a random point (as soon as the response starts, after a few stream
events, or after a random delay while a non-streamed answer is computed).

Checked, for every request that was not abandoned (`check` raises `SoakFailure` listing what failed):
- it succeeded (200, no error event) and is complete: each of its n choices has exactly one finish_reason;
  without a stop string (ignore_eos) it ran to "length" with exactly max_tokens tokens; usage counts them;
  a stream starts with the role chunk (chat), ends with its usage chunk and `data: [DONE]`;
- greedy answers equal the same request's answer when it ran alone (references taken one request at a time
  before the load): the same token ids (a shorter max_tokens gives a prefix), or with a stop string the
  reference text cut before its first occurrence;
- after the load, the running and waiting gauges on /metrics return to 0;
- the server's resident memory at the end is within `max_rss_growth` of its value after a warm-up.

Figures (`SoakReport.markdown`): requests finished / abandoned / failed, tokens received, tokens/s, RSS at
start, peak and end. CI runs a short form on a tiny random checkpoint (tests/test_soak.py); the long form
runs on the demo model:

    .venv/bin/python bench/soak.py [--clients 32] [--duration 120] [--max-tokens 64] [--model models/demo]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
PROMPTS = [
    "What is a list in Python?",
    "Explain the for statement.",
    "Answer in JSON: name and age of a user called Alice who is 31.",
    "Hello! Who are you?",
    "Write a haiku about speculation.",
    "caf\u00e9 \u4e2d\u6587 \U0001f600: say it again.",
]


class SoakFailure(AssertionError):
    """The soak found responses that were wrong, or a server that did not settle."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid` in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class ServerProcess:
    """`nextn serve MODEL ARGS` in a subprocess on a free 127.0.0.1 port, one torch thread (the clients get the
    other core); a context manager that waits for /ready and terminates the server (SIGTERM drains)."""

    def __init__(self, model: Path, *args: str, ready_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEXTN_")}, "OMP_NUM_THREADS": "1"}
        exe = Path(sys.executable).with_name("nextn")
        self.proc = subprocess.Popen([str(exe), "serve", str(model), "--port", str(self.port), "--device", "cpu",
                                      "--log-level", "warning", *args], env=env)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nextn serve exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("nextn serve did not become ready")
            time.sleep(0.2)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)


@dataclass(frozen=True)
class SoakConfig:
    """What the clients do. `requests` per client, or (when None) as many as fit in `duration_s`."""

    clients: int = 32
    requests: int | None = 4
    duration_s: float = 60.0
    max_tokens: int = 16
    disconnect_fraction: float = 0.1
    #: max_tokens of the requests a client abandons: long, so one the server failed to cancel stays visible
    leave_max_tokens: int = 400
    seed: int = 0
    max_rss_growth: float = 0.10
    settle_timeout_s: float = 60.0
    request_timeout_s: float = 600.0


@dataclass
class Req:
    """One drawn request: its endpoint, body, how it is checked, and where (if at all) the client leaves."""

    chat: bool
    body: dict[str, Any]
    prompt: int
    greedy: bool
    stop: str | None
    leave: tuple[str, float] | None  # ("start" | "events" | "delay", amount)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def key(self) -> tuple[bool, int]:
        return self.chat, self.prompt

    def kinds(self) -> list[str]:
        """The features of this request, for the mix figures."""
        b = self.body
        return ["chat" if self.chat else "completions", "stream" if b["stream"] else "non-stream",
                "greedy" if self.greedy else "sampled", f"n={b['n']}"] + ["stop"] * (self.stop is not None) + \
            ["abandoned (drawn)"] * (self.leave is not None)


@dataclass
class SoakReport:
    """What happened; `failures` is empty when every check passed."""

    config: SoakConfig
    finished: int = 0
    abandoned: int = 0
    greedy_finished: int = 0
    greedy_equal: int = 0
    server_aborts: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    settle_s: float = 0.0
    rss_start_kib: int = 0
    rss_peak_kib: int = 0
    rss_end_kib: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        return (self.rss_end_kib - self.rss_start_kib) / max(self.rss_start_kib, 1)

    def check(self) -> None:
        if self.failures:
            shown = "\n".join(self.failures[:20])
            raise SoakFailure(f"{len(self.failures)} soak failure(s):\n{shown}")

    def markdown(self) -> str:
        c = self.config
        rows = [
            ("clients", c.clients),
            ("requests per client" if c.requests is not None else "duration (s)",
             c.requests if c.requests is not None else c.duration_s),
            ("max_tokens", c.max_tokens),
            ("requests finished / abandoned by the client / failures",
             f"{self.finished} / {self.abandoned} / {len(self.failures)}"),
            ("request mix (drawn)", ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))),
            ("greedy answers equal to their single-client answer", f"{self.greedy_equal} / {self.greedy_finished}"),
            ("requests the server counted as aborted", self.server_aborts),
            ("tokens received", self.tokens),
            ("wall time of the load (s)", f"{self.wall_s:.1f}"),
            ("tokens/s (all clients)", f"{self.tokens / max(self.wall_s, 1e-9):.1f}"),
            ("running + waiting back to 0 after the load (s)", f"{self.settle_s:.2f}"),
            ("server RSS start / peak / end (MiB)",
             f"{self.rss_start_kib / 1024:.1f} / {self.rss_peak_kib / 1024:.1f} / {self.rss_end_kib / 1024:.1f}"),
            ("RSS growth (end vs start)", f"{100 * self.rss_growth:+.1f}%"),
        ]
        return "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def draw_request(rng: random.Random, cfg: SoakConfig, model: str, references: dict[tuple[bool, int], Any]) -> Req:
    """One random request of the mix (greedy stop strings are cut from the reference answers)."""
    chat = rng.random() < 0.5
    prompt = rng.randrange(len(PROMPTS))
    greedy = rng.random() < 0.7
    n = 2 if rng.random() < 0.2 else 1
    stream = rng.random() < 0.5
    max_tokens = rng.randint(max(1, cfg.max_tokens // 2), cfg.max_tokens)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n": n, "stream": stream,
                            "return_token_ids": True, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[prompt]}]
    else:
        body["prompt"] = PROMPTS[prompt]
    if stream:
        body["stream_options"] = {"include_usage": True}
    if greedy:
        body["temperature"] = 0
    else:
        body.update(temperature=0.9, top_p=0.95, seed=rng.randrange(2**31))
    stop = None
    ref = references.get((chat, prompt))
    if greedy and ref is not None and len(ref.text) >= 4 and rng.random() < 0.2:
        body["max_tokens"] = cfg.max_tokens  # the reference's full length, so its text is the one to cut
        i = rng.randrange(1, len(ref.text) - 2)
        stop = ref.text[i:i + 2]
        body["stop"] = [stop]
    leave = None
    if rng.random() < cfg.disconnect_fraction:
        leave = (("start", 0.0) if rng.random() < 0.3 else ("events", float(rng.randint(1, 4)))) if stream \
            else ("delay", rng.uniform(0.0, 0.3))
        body["max_tokens"] = cfg.leave_max_tokens
        body.pop("stop", None)
        stop = None
    return Req(chat, body, prompt, greedy, stop, leave)


@dataclass
class Reference:
    """A greedy answer computed alone: token ids and their text (max_tokens of the config, ignore_eos)."""

    token_ids: list[int]
    text: str


@dataclass
class Answer:
    """A response as the client saw it: per choice the text, token ids and finish reasons; usage; errors."""

    n: int
    text: list[str]
    token_ids: list[list[int]]
    finish: list[list[str]]
    usage: dict[str, Any] | None
    problems: list[str]


def _delta_text(chat: bool, choice: dict[str, Any]) -> str:
    return (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")


async def _stream(client: httpx.AsyncClient, url: str, req: Req) -> Answer | None:
    """Run a streamed request, validating the SSE framing; None if the client left on purpose."""
    n = req.body["n"]
    ans = Answer(n, [""] * n, [[] for _ in range(n)], [[] for _ in range(n)], None, [])
    async with client.stream("POST", url + req.path, json=req.body) as r:
        if r.status_code != 200:
            await r.aread()
            ans.problems.append(f"status {r.status_code}: {r.text[:300]}")
            return ans
        if req.leave and req.leave[0] == "start":
            return None
        events, done, roles = 0, False, 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                ans.problems.append(f"not an SSE data line: {line[:100]!r}")
                continue
            if done:
                ans.problems.append(f"event after [DONE]: {line[:100]!r}")
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            events += 1
            if req.leave and req.leave[0] == "events" and events >= req.leave[1]:
                return None
            if "error" in obj:
                ans.problems.append(f"error event: {obj['error']}")
                continue
            if obj.get("usage") is not None:
                if ans.usage is not None or obj["choices"]:
                    ans.problems.append("usage chunk repeated or carrying choices")
                ans.usage = obj["usage"]
                continue
            if ans.usage is not None:
                ans.problems.append("a chunk after the usage chunk")
            for ch in obj["choices"]:
                i = ch["index"]
                if req.chat and ch.get("delta", {}).get("role") == "assistant":
                    roles += 1
                ans.text[i] += _delta_text(req.chat, ch)
                ans.token_ids[i] += ch.get("token_ids") or []
                if ch.get("finish_reason") is not None:
                    ans.finish[i].append(ch["finish_reason"])
        if not done:
            ans.problems.append("stream ended without data: [DONE]")
        if ans.usage is None:
            ans.problems.append("stream without a usage chunk (include_usage was set)")
        if req.chat and roles != n:
            ans.problems.append(f"{roles} role chunks for n = {n}")
    return ans


async def _full(client: httpx.AsyncClient, url: str, req: Req) -> Answer | None:
    """Run a non-streamed request; None if the client left on purpose (after its random delay)."""
    n = req.body["n"]
    ans = Answer(n, [""] * n, [[] for _ in range(n)], [[] for _ in range(n)], None, [])
    post = client.post(url + req.path, json=req.body)
    if req.leave:
        try:
            r = await asyncio.wait_for(post, req.leave[1])
        except TimeoutError:
            return None
    else:
        r = await post
    if r.status_code != 200:
        ans.problems.append(f"status {r.status_code}: {r.text[:300]}")
        return ans
    obj = r.json()
    for ch in obj["choices"]:
        i = ch["index"]
        ans.text[i] = ch["message"]["content"] if req.chat else ch["text"]
        ans.token_ids[i] = ch.get("token_ids") or []
        ans.finish[i].append(ch["finish_reason"])
    ans.usage = obj["usage"]
    return ans


def problems(req: Req, ans: Answer, references: dict[tuple[bool, int], Reference]) -> list[str]:
    """Everything wrong with a finished answer (empty list: complete and, if greedy, equal to its reference)."""
    if ans.problems:
        return [f"{req.path} {json.dumps(req.body)[:300]}: {p}" for p in ans.problems]
    out = []
    max_tokens = req.body["max_tokens"]
    for i in range(ans.n):
        if len(ans.finish[i]) != 1:
            out.append(f"choice {i}: finish reasons {ans.finish[i]} (want exactly one)")
            continue
        if req.stop is None and (ans.finish[i][0] != "length" or len(ans.token_ids[i]) != max_tokens):
            out.append(f"choice {i}: {ans.finish[i][0]} after {len(ans.token_ids[i])} tokens, want length after "
                       f"{max_tokens} (ignore_eos, no stop)")
    if ans.usage is not None:
        got = sum(map(len, ans.token_ids))
        if ans.usage.get("completion_tokens") != got:
            out.append(f"usage.completion_tokens {ans.usage.get('completion_tokens')} != {got} tokens received")
    else:
        out.append("no usage")
    ref = references.get(req.key)
    if req.greedy and ref is not None:
        for i in range(ans.n):
            if req.stop is None:  # (an abandoned request that finished anyway is longer than its reference)
                m = min(max_tokens, len(ref.token_ids))
                if ans.token_ids[i][:m] != ref.token_ids[:m]:
                    out.append(f"choice {i}: greedy tokens {ans.token_ids[i][:m]} != alone {ref.token_ids[:m]}")
            else:
                want = ref.text[: ref.text.find(req.stop)]
                if ans.text[i] != want or ans.finish[i] != ["stop"]:
                    out.append(f"choice {i}: stop {req.stop!r}: {ans.text[i]!r} ({ans.finish[i]}) != {want!r} (stop)")
    return [f"{req.path} {json.dumps(req.body)[:300]}: {p}" for p in out]


async def take_references(url: str, model: str, max_tokens: int, timeout: float) -> dict[tuple[bool, int], Reference]:
    """The greedy answer of every (endpoint, prompt) alone, one request at a time (streamed)."""
    refs: dict[tuple[bool, int], Reference] = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for chat in (True, False):
            for p in range(len(PROMPTS)):
                req = Req(chat, {"model": model, "max_tokens": max_tokens, "n": 1, "stream": True,
                                 "stream_options": {"include_usage": True}, "return_token_ids": True,
                                 "ignore_eos": True, "temperature": 0,
                                 **({"messages": [{"role": "user", "content": PROMPTS[p]}]} if chat
                                    else {"prompt": PROMPTS[p]})}, p, True, None, None)
                ids, text = [], ""
                async with client.stream("POST", url + req.path, json=req.body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                text += _delta_text(chat, ch)
                                ids += ch.get("token_ids") or []
                refs[(chat, p)] = Reference(ids, text)
    return refs


async def _metric(client: httpx.AsyncClient, url: str, name: str, label: str = "") -> float:
    """One sample of /metrics: the first line of `name` containing `label` (0 if none)."""
    text = (await client.get(url + "/metrics")).text
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def run_soak(server: ServerProcess, cfg: SoakConfig) -> SoakReport:
    """Warm up, take the references, run the load, wait for the server to settle; the report says it all."""
    report = SoakReport(cfg)
    url = server.url
    references = await take_references(url, server.model, cfg.max_tokens, cfg.request_timeout_s)
    limits = httpx.Limits(max_connections=cfg.clients * 2, max_keepalive_connections=cfg.clients)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        # warm-up: one concurrent wave (allocator caches, batch shapes), then the RSS baseline
        warm = random.Random(cfg.seed + 1)
        waves = [draw_request(warm, dataclasses.replace(cfg, disconnect_fraction=0.0), server.model, references)
                 for _ in range(cfg.clients)]
        await asyncio.gather(*[(_stream if q.body["stream"] else _full)(client, url, q) for q in waves])
        report.rss_start_kib = report.rss_peak_kib = server.rss_kib
        aborts0 = await _metric(client, url, "nextn_request_success_total", 'finished_reason="abort"')
        deadline = time.monotonic() + cfg.duration_s

        async def one_client(c: int) -> None:
            rng = random.Random(cfg.seed * 1_000_003 + c)
            done = 0
            while (done < cfg.requests) if cfg.requests is not None else (time.monotonic() < deadline):
                req = draw_request(rng, cfg, server.model, references)
                for kind in req.kinds():
                    report.kinds[kind] = report.kinds.get(kind, 0) + 1
                done += 1
                try:
                    ans = await (_stream if req.body["stream"] else _full)(client, url, req)
                except httpx.HTTPError as e:
                    report.failures.append(f"{req.path} {json.dumps(req.body)[:200]}: {type(e).__name__}: {e}")
                    continue
                if ans is None:
                    report.abandoned += 1
                    continue
                report.finished += 1
                report.tokens += sum(map(len, ans.token_ids))
                found = problems(req, ans, references)
                report.failures += found
                report.greedy_finished += int(req.greedy)
                report.greedy_equal += int(req.greedy and not found)
                report.rss_peak_kib = max(report.rss_peak_kib, server.rss_kib)  # (sampled per finished request)

        t0 = time.perf_counter()
        await asyncio.gather(*[one_client(c) for c in range(cfg.clients)])
        report.wall_s = time.perf_counter() - t0
        # settle: every abandoned request cancelled, nothing left running or waiting
        t1 = time.monotonic()
        while True:
            running = await _metric(client, url, "nextn_num_requests_running")
            waiting = await _metric(client, url, "nextn_num_requests_waiting")
            report.settle_s = time.monotonic() - t1
            if running == 0 and waiting == 0:
                break
            if report.settle_s > cfg.settle_timeout_s:
                report.failures.append(f"after the load: {running:g} running, {waiting:g} waiting "
                                       f"({cfg.settle_timeout_s:g} s later)")
                break
            await asyncio.sleep(0.05)
        aborts = await _metric(client, url, "nextn_request_success_total", 'finished_reason="abort"')
        report.server_aborts = int(aborts - aborts0)
        if (await client.get(url + "/health")).status_code != 200:
            report.failures.append("/health is not 200 after the load")
    report.rss_end_kib = server.rss_kib
    report.rss_peak_kib = max(report.rss_peak_kib, report.rss_end_kib)
    if report.rss_growth > cfg.max_rss_growth:
        report.failures.append(f"server RSS grew {100 * report.rss_growth:.1f}% (> {100 * cfg.max_rss_growth:g}%): "
                               f"{report.rss_start_kib} -> {report.rss_end_kib} KiB")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (ignored with --requests)")
    ap.add_argument("--requests", type=int, default=None, help="requests per client instead of a duration")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.1, help="fraction of requests abandoned mid-way")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=3, help="--num-speculative-tokens of the server")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    args = ap.parse_args()
    cfg = SoakConfig(clients=args.clients, requests=args.requests, duration_s=args.duration,
                     max_tokens=args.max_tokens, disconnect_fraction=args.disconnect, seed=args.seed)
    serve_args = ["--num-speculative-tokens", str(args.k), "--max-num-seqs", str(args.max_num_seqs),
                  "--max-queue", str(4 * args.clients), "--max-model-len", "1024"]
    with ServerProcess(args.model, *serve_args) as server:
        report = asyncio.run(run_soak(server, cfg))
    print(f"## {datetime.date.today().isoformat()} \N{EM DASH} soak, `nextn serve {args.model.name}` "
          f"({' '.join(serve_args)})\n")
    print("```\n.venv/bin/python bench/soak.py " + " ".join(sys.argv[1:]) + "\n```\n")
    print(report.markdown())
    if report.failures:
        print("\nFailures:\n" + "\n".join(f"- {f}" for f in report.failures[:50]))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
