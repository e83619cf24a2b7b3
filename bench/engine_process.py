"""The engine process vs the in-process worker thread (`nextn serve --engine-process` / `--no-engine-process`), CPU.

Four servers from this checkout (demo K=3 and the hidden-256 random checkpoint K=0, each in both modes) stay up
for the whole run; each repetition takes, in turn and for both modes, one streaming client on the demo (K=3),
8 concurrent streaming clients on the demo (K=3) and one streaming client on the hidden-256 checkpoint (plain
greedy: one SSE chunk per token, where the per-chunk work weighs most). Figures are the best of the repetitions;
prints a markdown table for bench/RESULTS.md.

    .venv/bin/python bench/engine_process.py [--tokens 128] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import runtime  # bench/runtime.py: the server wrapper, the clients and the checkpoint recipe
from runtime import DEFAULT_BENCH_PROMPTS, DEMO, Server, Tokenizer, _clients_once

MODES = ("--engine-process", "--no-engine-process")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.tokens
    tok = Tokenizer.from_dir(DEMO)
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], enable_thinking=False))
             for t in DEFAULT_BENCH_PROMPTS]
    eight = [chats[i % len(chats)] for i in range(8)]
    ckpt = runtime.hidden256_checkpoint(Path(tempfile.mkdtemp()) / "hf256")
    prompt = list(range(10, 42))
    load0 = os.getloadavg()
    servers = {(mode, name): Server(model, k=k, extra=[mode]) for mode in MODES
               for name, model, k in (("demo", DEMO, 3), ("hf256", ckpt, 0))}
    best: dict[tuple[str, str], float] = {}
    try:
        ids = {key: srv.model_id() for key, srv in servers.items()}
        for key, srv in servers.items():  # warm-up
            _clients_once(srv.url, ids[key], [prompt] if key[1] == "hf256" else chats[:1], n)
        for _ in range(args.repeat):
            for mode in MODES:
                demo, hf = servers[(mode, "demo")], servers[(mode, "hf256")]
                for fig, value in (("one", _clients_once(demo.url, ids[(mode, "demo")], chats[:1], n)),
                                   ("eight", _clients_once(demo.url, ids[(mode, "demo")], eight, n)),
                                   ("plain", _clients_once(hf.url, ids[(mode, "hf256")], [prompt], n))):
                    best[(mode, fig)] = max(best.get((mode, fig), 0.0), value)
    finally:
        for srv in servers.values():
            srv.close()
    load1 = os.getloadavg()
    on, off = MODES
    rows = [("1 streaming client, demo, K=3", "one"), ("8 concurrent streaming clients, demo, K=3 (aggregate)", "eight"),
            ("1 streaming client, hidden-256 checkpoint, plain greedy", "plain")]
    out = [f"`.venv/bin/python bench/engine_process.py --tokens {n} --repeat {args.repeat}` (interleaved, best of "
           f"{args.repeat}, one torch thread; load average {load0[0]:.2f} before, {load1[0]:.2f} after)", "",
           "| tokens/s | engine process | worker thread | ratio |", "|---|---|---|---|"]
    out += [f"| {label} | {best[(on, f)]:.1f} | {best[(off, f)]:.1f} | {best[(on, f)] / best[(off, f)]:.2f}x |"
            for label, f in rows]
    out.append(f"| 8 clients vs 1 | {best[(on, 'eight')] / best[(on, 'one')]:.2f}x | "
               f"{best[(off, 'eight')] / best[(off, 'one')]:.2f}x | |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
