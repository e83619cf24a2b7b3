"""The batched runtime's figures (CPU), as ratios from one run; prints markdown for bench/RESULTS.md.

  1. concurrency: aggregate tokens/s of 8 concurrent streaming clients vs 1 client, `nextn serve` on the demo
     model, K = 3 (greedy, ignore_eos, fixed max_tokens);
  2. spec vs plain, one client, through the server (demo, K = 3 vs K = 0) and in the engine alone;
  3. server vs engine: one streaming client's tokens/s over the engine's own (same model, K, tokens);
  4. plain greedy through the server vs transformers `generate` on the same random checkpoint (4 layers,
     hidden 256, vocab 2048, no MTP);
  5. where a round's time goes (cProfile of the engine alone, K = 3, one session and a batch of 8).

The clients are lean asyncio HTTP/1.1 readers (`_Conn`; they share the box's CPUs with the server), each with
its connection open before the clock starts, as an SDK client's pool keeps it. Server and engine both run with
one torch thread (OMP_NUM_THREADS=1; the client gets the other core) and, like
`nextn serve`'s default, min(2, usable cores) threads for nextn's C kernels (--cpu-kernel-threads: the demo's
servers and the engine alone; the transformers comparison keeps one thread on both sides). The
measurements are interleaved: every server stays up for the whole run and each repetition takes every figure
once, in turn, so load from other processes hits numerator and denominator alike; each figure is the best of the
repetitions, and each ratio is given twice: the ratio of the bests, and the median (with the range) of the
repetitions' own ratios, whose two terms were measured a minute apart (the steadier reading on a noisy box), with a
90% confidence interval for that median (distribution-free: two order statistics of the pairs, `median_ci`), so a
figure that straddles its goal reads as one. The load average is printed with the figures; --raw writes every
repetition's tokens/s as JSON (runs can then be pooled).

    .venv/bin/python bench/runtime.py [--tokens 128] [--repeat 3] [--device cpu|cuda] [--cpu-kernel-threads 1|2]
                                      [--raw runs.json]

--device cuda runs the servers, the engine and the transformers peer on the GPU (the servers need nextn's
serving dependencies there: fastapi, uvicorn, pydantic, prometheus-client, llguidance, jinja2, httpx).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import math
import os
import pstats
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.settings import usable_cores  # noqa: E402
from engine.commands import DEFAULT_BENCH_PROMPTS  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model.ops import cpu  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.spec import SpecSession  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

DEMO = ROOT / "models" / "demo"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`nextn serve MODEL` in a subprocess (one torch thread) on a free port."""

    def __init__(self, model: Path, k: int, max_num_seqs: int = 8, device: str = "cpu", extra: list[str] | None = None):
        self.port = _port()
        env = {**{k_: v for k_, v in os.environ.items() if not k_.startswith("NEXTN_")}, "OMP_NUM_THREADS": "1"}
        # `nextn serve` from this checkout (no installed entry point needed, e.g. on the device machine)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        nextn = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())"]
        self.proc = subprocess.Popen([*nextn, "serve", str(model), "--port", str(self.port), "--device", device,
                                      "--num-speculative-tokens", str(k), "--max-num-seqs", str(max_num_seqs),
                                      "--max-model-len", "1024", "--log-level", "warning", *(extra or [])], env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def model_id(self) -> str:
        return httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def hidden256_checkpoint(path: Path) -> Path:
    """The random checkpoint of the transformers comparison: 4 layers (3 GDN, 1 attention), hidden 256, vocab
    2048, no MTP."""
    from tests.tiny import make_checkpoint

    return make_checkpoint(path, seed=5, mtp=False, vocab_size=2048, hidden_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


class _Conn(asyncio.Protocol):
    """The load generator's HTTP/1.1 keep-alive connection, a bare `asyncio.Protocol`. On this box the clients
    share the two vCPUs with the server, so what a client spends per chunk is taken from the server (the C kernels'
    helper thread and the HTTP process run on the second vCPU): httpx spent ~80 ms of CPU per run of 8 streams of
    128 tokens (h11, anyio, async generators per chunk), ~25% of that vCPU; a reader on asyncio streams that parsed
    each event as it came ~20 ms (bench/RESULTS.md). This one only keeps each chunk's bytes as they arrive and
    parses the response after it has ended (`_tokens`: the same checks of status, coding and token count)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.host = ""
        self.buf = bytearray()
        self.ended: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        # a chunked response ends with the last chunk's CRLF and the zero-size chunk; any other answer is an error,
        # complete enough once its status line is in (`_tokens` reports it)
        if self.ended is not None and not self.ended.done() and (
                self.buf.endswith(b"\r\n0\r\n\r\n")
                or (len(self.buf) >= 12 and not self.buf.startswith(b"HTTP/1.1 200"))):
            self.ended.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(exc or ConnectionError("the server closed the connection"))

    @classmethod
    async def open(cls, url: str) -> _Conn:
        u = httpx.URL(url)
        _, conn = await asyncio.get_running_loop().create_connection(cls, u.host, u.port)
        conn.host = u.host
        return conn

    async def stream(self, model: str, prompt: list[int], n: int) -> bytes:
        """POST a streamed greedy completion of exactly n tokens (ignore_eos); returns the raw response once it
        has ended."""
        assert self.transport is not None
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                           "stream": True, "return_token_ids": True}).encode()
        self.buf, self.ended = bytearray(), asyncio.get_running_loop().create_future()
        self.transport.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(body), body))
        await asyncio.wait_for(self.ended, 600)  # (a 200 that is not a chunked stream would never end)
        return bytes(self.buf)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _tokens(raw: bytes) -> int:
    """The number of token ids a streamed completion response carries (HTTP/1.1 200, chunked, SSE events)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *headers = head.split(b"\r\n")
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {status!r}")
    if not any(h.lower().startswith(b"transfer-encoding:") and b"chunked" in h.lower() for h in headers):
        raise RuntimeError("expected a chunked stream")
    data, pos = bytearray(), 0
    while size := int(body[pos:(eol := body.index(b"\r\n", pos))].split(b";")[0], 16):  # chunked transfer coding
        data += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2
    got = 0
    for ev in bytes(data).split(b"\n\n"):
        if ev.startswith(b"data: {"):
            got += len(json.loads(ev[6:])["choices"][0].get("token_ids") or [])
    return got


def _on_clients(url: str, clients: int, work: Callable[[list[_Conn]], Awaitable[float]]) -> float:
    """Run `work` on `clients` keep-alive connections to url, opened before it starts (as an SDK client's pool keeps
    them: a figure is the streams', not TCP set-up's, ~1 ms a connection on the CPU box) and closed after it."""
    async def once() -> float:
        conns = await asyncio.gather(*[_Conn.open(url) for _ in range(clients)])
        try:
            return await work(conns)
        finally:
            for c in conns:
                c.close()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(once())


def _counted(raws: list[bytes], n: int) -> list[int]:
    """Each streamed response's token count, every one n (else a stream ended early)."""
    toks = [_tokens(r) for r in raws]
    if any(t != n for t in toks):
        raise RuntimeError(f"a stream ended early: {toks} tokens of {n}")
    return toks


def _clients_once(url: str, model: str, prompts: list[list[int]], n: int, requests: int = 1) -> float:
    """Aggregate tokens/s of len(prompts) concurrent streaming clients, once, each sending `requests` requests back
    to back (a closed loop, as guidellm's concurrent profile: with 1, the figure ends with the slowest stream), each
    client's connection open before the clock starts (`_on_clients`)."""
    async def client(c: _Conn, p: list[int]) -> list[bytes]:
        return [await c.stream(model, p, n) for _ in range(requests)]

    async def work(conns: list[_Conn]) -> float:
        t0 = time.perf_counter()
        raws = [r for rs in await asyncio.gather(*[client(c, p) for c, p in zip(conns, prompts)]) for r in rs]
        dt = time.perf_counter() - t0
        return sum(_counted(raws, n)) / dt
    return _on_clients(url, len(prompts), work)


def _in_window(spans: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Tokens inside [lo, hi] of requests (start, end, tokens), each request's tokens spread evenly over its time."""
    return sum(t * max(0.0, min(b, hi) - max(a, lo)) / (b - a) for a, b, t in spans if b > a)


def _clients_for(url: str, model: str, prompts: list[list[int]], n: int, seconds: float,
                 warm: float | None = None) -> float:
    """Steady-state aggregate tokens/s of len(prompts) streaming clients, each sending requests back to back
    (guidellm's concurrent profile): the tokens of a window of `seconds` that opens `warm` seconds (default: a
    quarter of the window) after the clients start, so the first requests' burst of prefill stays out. A request
    counts its tokens in proportion to its time inside the window; clients send no request after it closes, and
    those in flight then finish uncounted past it: no stream's tail sets the figure, as it does `_clients_once`'s."""
    warm = seconds / 4 if warm is None else warm
    spans: list[tuple[float, float, bytes]] = []

    async def client(c: _Conn, p: list[int], until: float) -> None:
        while (t := time.perf_counter()) < until:
            raw = await c.stream(model, p, n)
            spans.append((t, time.perf_counter(), raw))

    async def work(conns: list[_Conn]) -> float:
        lo = time.perf_counter() + warm
        hi = lo + seconds
        await asyncio.gather(*[client(c, p, hi) for c, p in zip(conns, prompts)])
        toks = _counted([raw for _, _, raw in spans], n)
        return _in_window([(a, b, t) for (a, b, _), t in zip(spans, toks)], lo, hi) / seconds
    return _on_clients(url, len(prompts), work)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The clients' event loop: uvloop, as the server's (a dependency of nextn; less CPU per chunk than asyncio's),
    else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _sync(model) -> None:
    if model.lm_head.weight.is_cuda:
        torch.cuda.synchronize()


def engine_tok_s(model, prompts: list[list[int]], n: int, k: int, repeat: int) -> float:
    """Best-of-`repeat` tokens/s of the engine alone: the prompts as one batch through a Scheduler."""
    def once() -> float:
        sched = Scheduler(model, max_num_seqs=len(prompts), max_model_len=1024, k=k, max_num_batched_tokens=512)
        _sync(model)
        t0 = time.perf_counter()
        ss = [SpecSession(model, p, n, k=k, pool=sched.pool) for p in prompts]
        for s in ss:
            sched.add(s)
        while sched.num_sessions:
            sched.step()
        _sync(model)
        return sum(len(s.emitted) for s in ss) / (time.perf_counter() - t0)
    once()
    return max(once() for _ in range(repeat))


class HfPeer:
    """transformers `generate` on a checkpoint, run as fairly as we can: fp32 (the checkpoint's dtype), the
    process's one torch thread, its default KV cache (use_cache=True), greedy, exactly n new tokens with no EOS
    stop (eos_token_id=None rather than a min-length logits processor), under inference_mode, warmed up."""

    def __init__(self, ckpt: Path, prompt: list[int], n: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()
        self.x, self.n = torch.tensor([prompt], device=device), n
        self.kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
        self.once()  # warm-up

    def describe(self) -> str:
        with torch.inference_mode():  # which KV cache `generate` builds
            out = self.model.generate(self.x[:, :4], return_dict_in_generate=True, **{**self.kw, "max_new_tokens": 1})
        cache = type(getattr(out, "past_key_values", None))
        return (f"transformers {transformers_version()}, {type(self.model).__name__}, dtype {self.model.dtype}, "
                f"torch threads {torch.get_num_threads()}, use_cache=True ({cache.__name__}), greedy, "
                f"max_new_tokens={self.n} with no EOS stop, warmed up")

    def once(self) -> float:
        cuda = self.x.is_cuda
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(self.x, **self.kw)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        assert out.shape[1] - self.x.shape[1] == self.n, out.shape
        return self.n / dt


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def profile_round(model, prompts: list[list[int]], n: int, k: int) -> str:
    """cProfile of the engine alone; the share of the round's parts (cumulative time)."""
    sched = Scheduler(model, max_num_seqs=len(prompts), max_model_len=1024, k=k, max_num_batched_tokens=4096)
    ss = [SpecSession(model, p, n, k=k, pool=sched.pool) for p in prompts]
    for s in ss:
        sched.add(s)
    sched.step()  # prefill outside the profile
    prof = cProfile.Profile()
    prof.enable()
    while sched.num_sessions:
        sched.step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[3] for k_, v in st.stats.items() if k_[2] == "spec_round")
    parts = {"_draft": "draft (MTP head, all depths)", "forward_step": "verify forward (trunk)",
             "_accept": "acceptance on the device", "commit_round": "per-row commit (host)"}
    rows = []
    for fn, label in parts.items():
        t = sum(v[3] for k_, v in st.stats.items() if k_[2] == fn)
        if fn == "forward_step":  # the verify only: forward_step is also what prefill calls
            t = sum(v[3] for k_, v in st.stats.items() if k_[2] == fn and "spec.py" not in k_[0])
        rows.append(f"{label} {100 * t / total:.0f}%")
    ops = {"linear": "F.linear / matmul", "scaled_dot_product_attention": "attention (SDPA)"}
    for fn, label in ops.items():
        t = sum(v[3] for k_, v in st.stats.items() if k_[2] == fn or fn in k_[2])
        rows.append(f"{label} {100 * t / total:.0f}%")
    return f"{total:.2f} s in spec_round: " + ", ".join(rows)


def median_ci(xs: list[float], level: float = 0.90) -> tuple[float, float]:
    """A confidence interval for the median of the distribution `xs` was drawn from, at least `level`, assuming
    nothing of its shape: the order statistics x_(j) and x_(n+1-j) for the largest j with
    P(Binomial(n, 1/2) < j) <= (1 - level) / 2. With too few samples for any such j, the whole range."""
    s, n = sorted(xs), len(xs)
    tail, j = 0.0, 0
    while j < n and tail + math.comb(n, j) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, j) / 2 ** n
        j += 1
    return (s[j - 1], s[n - j]) if j else (s[0], s[-1])


def _ratio(runs: dict[str, list[float]], num: str, den: str) -> str:
    """num / den as the ratio of the bests, and the median (its 90% interval, the range) of the per-repetition
    ratios: one repetition measures both within a minute or so, so a pair shares the box's state of the moment."""
    pairs = sorted(a / b for a, b in zip(runs[num], runs[den]))
    lo, hi = median_ci(pairs)
    return (f"{max(runs[num]) / max(runs[den]):.2f}x (bests); median of {len(pairs)} pairs "
            f"{statistics.median(pairs):.2f}x (90% CI {lo:.2f}-{hi:.2f}; range {pairs[0]:.2f}-{pairs[-1]:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-cpu-kernel", action="store_true", help="torch ops for the GDN step (servers and engine)")
    ap.add_argument("--cpu-kernel-threads", type=int, default=min(2, usable_cores()), choices=[1, 2],
                    help="the C kernels' threads in the demo's servers and the engine alone (default: as nextn "
                         "serve's, min(2, usable cores))")
    ap.add_argument("--raw", type=Path, help="write every repetition's tokens/s here (JSON: figure -> list)")
    args = ap.parse_args()
    dev = args.device
    torch.set_num_threads(1)
    cpu.set_enabled(not args.no_cpu_kernel)
    extra = ["--no-cpu-kernel"] if args.no_cpu_kernel else []
    cpu.set_threads(args.cpu_kernel_threads)  # the engine alone; the demo's servers get the same below
    demo_extra = [*extra, "--cpu-threads", "1", "--cpu-kernel-threads", str(args.cpu_kernel_threads)]
    n, rep = args.tokens, args.repeat
    tok = Tokenizer.from_dir(DEMO)
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], enable_thinking=False))
             for t in DEFAULT_BENCH_PROMPTS]
    eight = [chats[i % len(chats)] for i in range(8)]
    demo = load_model(DEMO, device=dev)
    ckpt = hidden256_checkpoint(Path(tempfile.mkdtemp()) / "hf256")
    prompt = list(range(10, 42))
    hf = HfPeer(ckpt, prompt, n, dev)
    load0 = os.getloadavg()
    servers = {"k3": Server(DEMO, k=3, device=dev, extra=demo_extra),
               "k0": Server(DEMO, k=0, device=dev, extra=demo_extra),
               "hf256": Server(ckpt, k=0, device=dev, extra=[*extra, "--cpu-kernel-threads", "1"])}
    runs: dict[str, list[float]] = {}
    try:
        models = {name: srv.model_id() for name, srv in servers.items()}
        for name, srv in servers.items():  # warm-up (the hf256 checkpoint's vocabulary is smaller than the demo's)
            _clients_once(srv.url, models[name], [prompt] if name == "hf256" else chats[:1], n)
        _clients_once(servers["k3"].url, models["k3"], eight, n)
        for _ in range(rep):  # interleaved: each repetition takes every figure once
            runs.setdefault("one_k3", []).append(_clients_once(servers["k3"].url, models["k3"], chats[:1], n))
            runs.setdefault("eng_k3", []).append(engine_tok_s(demo, chats[:1], n, 3, 1))
            runs.setdefault("eight_k3", []).append(_clients_once(servers["k3"].url, models["k3"], eight, n))
            runs.setdefault("eng8_k3", []).append(engine_tok_s(demo, eight, n, 3, 1))
            runs.setdefault("one_k0", []).append(_clients_once(servers["k0"].url, models["k0"], chats[:1], n))
            runs.setdefault("eng_k0", []).append(engine_tok_s(demo, chats[:1], n, 0, 1))
            runs.setdefault("hf", []).append(hf.once())
            runs.setdefault("ours", []).append(_clients_once(servers["hf256"].url, models["hf256"], [prompt], n))
    finally:
        for srv in servers.values():
            srv.close()
    load1 = os.getloadavg()
    if args.raw is not None:
        args.raw.write_text(json.dumps({"tokens": n, "repeat": rep, "device": dev, "runs": runs}, indent=1))
    f = {key: max(v) for key, v in runs.items()}
    flag = (" --no-cpu-kernel" if args.no_cpu_kernel else "") + f" --cpu-kernel-threads {args.cpu_kernel_threads}"
    out = [f"`.venv/bin/python bench/runtime.py --tokens {n} --repeat {rep} --device {dev}{flag}` (demo model, "
           f"greedy, ignore_eos, {n} tokens per client, interleaved, best of {rep}, one torch thread; "
           f"{cpu.describe(dev, demo.config.dtype) or 'GPU'}; load average {load0[0]:.2f} before, {load1[0]:.2f} "
           f"after)", "",
           "| measurement | tokens/s | ratio | goal |", "|---|---|---|---|",
           f"| server, 1 streaming client, K=3 | {f['one_k3']:.1f} | | |",
           f"| server, 8 concurrent streaming clients, K=3 (aggregate) | {f['eight_k3']:.1f} | "
           f"{_ratio(runs, 'eight_k3', 'one_k3')} one client | >= 4x |",
           f"| server, 1 client, K=0 (plain) | {f['one_k0']:.1f} | | |",
           f"| server spec (K=3) vs plain (K=0), 1 client | | {_ratio(runs, 'one_k3', 'one_k0')} | >= 1.8x |",
           f"| engine alone, 1 session, K=3 | {f['eng_k3']:.1f} | | |",
           f"| engine alone, 1 session, K=0 | {f['eng_k0']:.1f} | spec/plain {_ratio(runs, 'eng_k3', 'eng_k0')} "
           "| |",
           f"| engine alone, batch of 8, K=3 | {f['eng8_k3']:.1f} | {_ratio(runs, 'eng8_k3', 'eng_k3')} one "
           "session | |",
           f"| server streaming vs engine alone (1 client, K=3) | | {_ratio(runs, 'one_k3', 'eng_k3')} | >= 0.9x |",
           f"| transformers `generate`, random 4-layer hidden-256 vocab-2048 checkpoint | {f['hf']:.1f} | | |",
           f"| nextn server plain greedy, same checkpoint, 1 client | {f['ours']:.1f} | {_ratio(runs, 'ours', 'hf')} "
           f"transformers | >= 2x |", "", f"transformers peer: {hf.describe()}.", ""]
    if dev == "cpu":
        cpu.set_threads(1)  # cProfile of the single-thread round
        out.append("Round profile (cProfile, engine alone, K=3): one session: "
                   + profile_round(demo, chats[:1], n, 3) + "; batch of 8: " + profile_round(demo, eight, n, 3))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
