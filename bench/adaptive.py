"""The speculation length controller against fixed K, through `nextn serve`: aggregate streaming tokens/s of 1 and 8
greedy clients on servers at their defaults (the controller on, the engine in its own process; on a CPU one torch
thread, the default of a 2-core box) and with --no-spec-adaptive at fixed K in --ks, interleaved round by round in one
run (the box's load hits every server alike; the servers' order rotates every repeat, so none is always first), as
ratios: of the medians, and paired (the median of each repeat's ratio, the servers a few seconds apart: a slow spell of
the box cancels) with its 90% confidence interval. Two identical servers on the 2-vCPU box differ by up to ~5% (where
each one's memory landed): `--instances N` splits the repeats into N blocks, each on freshly started servers, so that
bias averages out too.

Workloads: `zero-demo` and `zero-0.8b`: random weights (zero acceptance) at the demo shape and at the Qwen3.5-0.8B
shape (built once under ~/.cache/nextn/bench); `demo`: the demo model (models/demo) on chat prompts (high
acceptance); `mixed`: the demo model, half the clients on chat prompts, half on random token ids (which draft
badly). Targets (issue 41): zero >= 0.97x plain (K = 0), demo >= 0.97x the best fixed K and >= 1.8x plain, mixed >=
the best fixed K.

    python bench/adaptive.py --tokens 64 --repeat 3
    python bench/adaptive.py --workloads demo --ks 3 --repeat 150   # against one K (no K=0: no ratio to plain),
                                                                     # many pairs: a narrow interval
    python bench/adaptive.py --workloads mixed --clients 8 --requests 4   # each client 4 requests back to back: a
                                                                          # batch kept full, not one batch's tail
    python bench/adaptive.py --workloads mixed --clients 8 --seconds 8   # steady state (guidellm's concurrent
                                                                         # profile): the tokens of an 8 s window

With one request a client (or --requests N), a repeat ends with its slowest stream: a closed batch, whose figure is
its slowest rows' pace (a batch's T that speeds its fast rows at the slow ones' expense loses there, whatever it
gains per round). --seconds measures the server's throughput with every client's next request sent at once, as the
controller's objective (the batch's tokens per second) has it.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from runtime import (DEFAULT_BENCH_PROMPTS, DEMO, Server, Tokenizer, _clients_for, _clients_once,  # noqa: E402
                     median_ci)

from bench.prefix import CACHE, qwen08b_checkpoint  # noqa: E402


def demo_shape_random() -> Path:
    """Random weights at the demo's shape (zero acceptance), built once."""
    d = CACHE / "demo-shape-random"
    if not (d / "tokenizer.json").is_file():
        from tests.tiny import make_checkpoint

        d.mkdir(parents=True, exist_ok=True)
        make_checkpoint(d, seed=3, with_tokenizer=False, vocab_size=2112, hidden_size=128, num_hidden_layers=12,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                        intermediate_size=384)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # the demo's vocabulary (2112 ids)
            shutil.copy(DEMO / f, d / f)
    return d


def prompts(kind: str, clients: int, vocab: int) -> list[list[int]]:
    """Each client's prompt: chat prompts of the demo (drafts well), random ids (drafts badly), or half of each."""
    rng = random.Random(clients)
    rand = [[rng.randrange(10, min(vocab, 2000)) for _ in range(24)] for _ in range(clients)]  # no special ids
    if kind == "random":
        return rand
    tok = Tokenizer.from_dir(DEMO)
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], enable_thinking=False))
             for t in DEFAULT_BENCH_PROMPTS]
    chat = [chats[i % len(chats)] for i in range(clients)]
    return chat if kind == "chat" else [chat[i] if i % 2 == 0 else rand[i] for i in range(clients)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ks", default="0,1,2,3", help="fixed K values compared (0 = plain)")
    ap.add_argument("--workloads", default="zero-demo,zero-0.8b,demo,mixed")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=1, help="requests each client sends back to back in a repeat")
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="steady state instead: each client sends requests back to back; the tokens of a window this "
                         "long (after a quarter of it)")
    ap.add_argument("--instances", type=int, default=1,
                    help="blocks of repeats, each on freshly started servers (two identical servers can differ by "
                         "~5%%)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    kmax = max(3, max(ks))
    extra = ["--cpu-threads", "1"] if args.device == "cpu" else []  # 2 cores' default, on any box
    work = {"zero-demo": (demo_shape_random, "random", 2112), "zero-0.8b": (qwen08b_checkpoint, "random", 248000),
            "demo": (lambda: DEMO, "chat", 2112), "mixed": (lambda: DEMO, "mixed", 2112)}
    for name in args.workloads.split(","):
        mk, kind, vocab = work[name]
        ckpt = mk()
        tokens = args.tokens if name != "zero-0.8b" else max(8, args.tokens // 4)
        cfgs = {"adaptive": (kmax, extra), **{f"K={k}": (k, [*extra, "--no-spec-adaptive"]) for k in ks}}
        names = list(cfgs)
        for c in (int(x) for x in args.clients.split(",")):
            ps = prompts(kind, c, vocab)
            runs: dict[str, list[float]] = {n: [] for n in names}
            t0 = time.monotonic()
            for b in range(args.instances):  # fresh servers for each block of repeats
                servers = {n: Server(ckpt, k=k, device=args.device, extra=x) for n, (k, x) in cfgs.items()}
                try:
                    models = {n: s.model_id() for n, s in servers.items()}
                    for n, s in servers.items():  # warm-up: the controller learns, the caches settle
                        _clients_once(s.url, models[n], ps, tokens)
                    for i in range(b * args.repeat // args.instances, (b + 1) * args.repeat // args.instances):
                        for n in names[i % len(names):] + names[:i % len(names)]:  # rotated: each leads in turn
                            runs[n].append(_clients_for(servers[n].url, models[n], ps, tokens, args.seconds)
                                           if args.seconds else
                                           _clients_once(servers[n].url, models[n], ps, tokens, args.requests))
                finally:
                    for s in servers.values():
                        s.close()
            med = {n: statistics.median(v) for n, v in runs.items()}
            fixed = {n: v for n, v in med.items() if n.startswith("K=")}
            best = max(fixed, key=fixed.get)
            a = med["adaptive"]

            def paired(other: str) -> str:  # the median of the repeats' ratios (servers side by side in time), CI
                rs = [x / y for x, y in zip(runs["adaptive"], runs[other])]
                lo, hi = median_ci(rs)
                return f"{statistics.median(rs):.2f}x, 90% CI {lo:.2f}-{hi:.2f}"

            print(f"| {name} | {c} | {a:.1f} | " + " | ".join(f"{n} {v:.1f}" for n, v in fixed.items())
                  + (f" | {a / med['K=0']:.2f}x plain (paired {paired('K=0')})" if "K=0" in med else " | -")
                  + f" | {a / fixed[best]:.2f}x best "
                  f"({best}; paired {paired(best)}) | {time.monotonic() - t0:.0f} s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
