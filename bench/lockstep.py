"""The speculation controller against fixed K in the engine alone, in lockstep: one `Scheduler` per configuration
on the same model, their steps interleaved one by one, so a slow spell of the box (its speed moves 20-60% within
minutes) hits every configuration alike, step for step. Each scheduler reads a clock of its own that runs only
during its own steps (the controller times a round from its start to its next step's, which here would otherwise
include the other schedulers' steps).

Closed batches (default): each configuration runs `--batches` batches of the workload's prompts back to back (the
first a warm-up); the figure is the median batch's tokens/s, which its slowest row sets. `--seconds S`: steady state,
each finished request replaced at once by its client's next, the tokens of S seconds of the configuration's own
time (after a 2 s warm-up). Workloads as bench/adaptive.py's (`demo`: chat prompts; `mixed`: half chat, half random
ids; `random`: random ids; `--model` another checkpoint, e.g. bench/adaptive.py's random weights for zero acceptance).
`--prefix-cache`: the prefix cache on, as `nextn serve` has it. Ratios against the best fixed K of the same run.

    .venv/bin/python bench/lockstep.py --workload mixed --clients 8 --batches 16
    .venv/bin/python bench/lockstep.py --workload mixed --clients 8 --seconds 40
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from adaptive import prompts  # noqa: E402
from runtime import DEMO  # noqa: E402

import engine.scheduler as scheduler_module  # noqa: E402
from engine.kpolicy import KPolicySpec  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.spec import SpecSession  # noqa: E402


class _OwnClocks:
    """`time` for engine.scheduler: perf_counter is the running scheduler's own clock (its steps' time so far)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.who, self.since = "", 0.0

    def enter(self, who: str) -> None:
        self.who, self.since = who, time.perf_counter()

    def leave(self) -> float:
        dt = time.perf_counter() - self.since
        self.spent[self.who] += dt
        return dt

    def perf_counter(self) -> float:
        return self.spent[self.who] + time.perf_counter() - self.since

    def __getattr__(self, name: str):
        return getattr(time, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed", choices=["demo", "mixed", "random"])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,3", help="fixed K values compared")
    ap.add_argument("--kmax", type=int, default=3, help="the controller's K_max (nextn serve's default K)")
    ap.add_argument("--batches", type=int, default=16, help="closed batches per configuration (the first: warm-up)")
    ap.add_argument("--seconds", type=float, default=0.0, help="steady state: seconds of each configuration's time")
    ap.add_argument("--model", default=str(DEMO), help="checkpoint (the demo; bench/adaptive.py's random-weight ones)")
    ap.add_argument("--prefix-cache", action="store_true", help="the prefix cache at the server's default budget")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as `bench/adaptive.py`'s servers (--cpu-threads 1)
    clocks = _OwnClocks()
    scheduler_module.time = clocks  # type: ignore[assignment]
    model = load_model(args.model)
    ps = prompts({"demo": "chat"}.get(args.workload, args.workload), args.clients, model.config.vocab_size)
    cfgs = {"controller": (args.kmax, True), **{f"K={k}": (k, False) for k in map(int, args.ks.split(","))}}
    sched: dict[str, Scheduler] = {}
    for n, (k, adaptive) in cfgs.items():
        clocks.enter(n)
        sched[n] = Scheduler(model, max_num_seqs=args.clients, max_model_len=1024, k=k, max_num_batched_tokens=512,
                             prefix_cache_bytes=None if args.prefix_cache else 0, spec_policy=KPolicySpec(k, adaptive))
        clocks.leave()
    prompt_of: dict[SpecSession, list[int]] = {}

    def join(n: str, p: list[int]) -> None:
        s = sched[n]
        x = SpecSession(model, p, args.tokens, k=s.k, pool=s.pool)
        prompt_of[x] = p
        s.add(x)

    done = {n: 0 for n in cfgs}
    spans: dict[str, list[float]] = {n: [] for n in cfgs}
    own = {n: 0.0 for n in cfgs}  # steady state: measured time, tokens
    toks = {n: 0 for n in cfgs}
    widths = {n: collections.Counter() for n in cfgs}
    began = {n: 0.0 for n in cfgs}
    goal = 1 if args.seconds else args.batches
    with torch.inference_mode():
        for n in cfgs:
            for p in ps:
                join(n, p)
        while min(done.values()) < goal:
            for n, s in sched.items():
                if done[n] >= goal:
                    continue
                ran = bool(s.running)
                clocks.enter(n)
                res = s.step()
                dt = clocks.leave()
                warm = clocks.spent[n] < 2.0 if args.seconds else done[n] == 0
                if not warm:
                    own[n] += dt
                    toks[n] += sum(len(e) for _, e in res.emitted)
                    if ran and s.policy is not None:
                        widths[n][s.policy.last_t] += 1
                if args.seconds:
                    for x in res.finished:
                        join(n, prompt_of.pop(x))
                    if own[n] >= args.seconds:
                        done[n] = 1
                elif not s.running and not s.joining:
                    if done[n]:
                        spans[n].append(clocks.spent[n] - began[n])
                    done[n] += 1
                    began[n] = clocks.spent[n]
                    if done[n] < goal:
                        for p in ps:
                            join(n, p)
    rate = {n: toks[n] / own[n] if args.seconds else args.clients * args.tokens / statistics.median(spans[n])
            for n in cfgs}
    best = max((n for n in cfgs if n != "controller"), key=rate.get)
    mode = f"steady {args.seconds:.0f} s" if args.seconds else f"closed, {args.batches - 1} batches"
    for n in cfgs:
        print(f"{args.workload} x {args.clients} ({mode}) {n}: {rate[n]:.0f} tok/s, {rate[n] / rate[best]:.3f}x "
              f"{best}; rounds by T {dict(sorted(widths[n].items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
