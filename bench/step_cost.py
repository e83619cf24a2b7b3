"""What one engine step costs on the CPU torch path, in two machine-independent-ish figures and one timing:

  1. aten ops per step (counted with a TorchDispatchMode: deterministic, the same on every box) for plain greedy
     on the hidden-256 checkpoint, the demo model at K=3 alone and a batch of 8 at K=3;
  2. the trunk's forward (`forward_step`, 4 layers of the hidden-256 checkpoint) for N rows x T tokens, best of 5
     x 200 calls;
  3. `--hashes FILE` / `--check FILE`: a digest of every logits tensor the engine computes on fixed workloads
     (four checkpoints: the demo, hidden-256, a tiny dense fp32 and a tiny MoE in fp64; each alone at K = 0, 1, 3
     and as a batch at K = 0, 3 with a sampled row and rows joining mid-decode). `--check` says whether a change
     kept every logit bit (then every greedy token and every exactness figure is unchanged by construction).

    .venv/bin/python bench/step_cost.py                      # 1 and 2
    .venv/bin/python bench/step_cost.py --hashes /tmp/ref.pkl  # before a change
    .venv/bin/python bench/step_cost.py --check /tmp/ref.pkl   # after it: "bitwise same" or where it differs
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.runtime import DEMO, hidden256_checkpoint  # noqa: E402
from engine.cache import StatePool  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model.qwen35 import FwdCtx, Qwen35ForCausalLM  # noqa: E402
from engine.sampling import SpecSampling  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.spec import SpecSession, generate_spec  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(model: Qwen35ForCausalLM, batch: int, k: int, steps: int = 5) -> float:
    """Mean aten ops per scheduler step, `batch` sessions decoding at K=k (after their prefill and a warm-up)."""
    sched = Scheduler(model, max_num_seqs=batch, max_model_len=1024, k=k, max_num_batched_tokens=512)
    ss = [SpecSession(model, list(range(10, 42)), 64, k=k, pool=sched.pool) for _ in range(batch)]
    for s in ss:
        sched.add(s)
    for _ in range(4):
        sched.step()
    with _Count() as c:
        for _ in range(steps):
            sched.step()
    return c.n / steps


@torch.inference_mode()
def forward_us(model: Qwen35ForCausalLM, N: int, T: int) -> float:
    """Best-of-5 microseconds of one recording trunk forward of N rows x T tokens at position 40."""
    cfg = model.config
    pool = StatePool(cfg, N, 256, 4, "cpu", cfg.dtype, mtp=False)
    slots = [pool.alloc() for _ in range(N)]
    ctx = FwdCtx.make(cfg, "cpu", cfg.dtype, slots, [40] * N, [0] * N, [0] * N, T, True)
    ids = torch.zeros(N, T, dtype=torch.long)
    for _ in range(20):
        model.forward_step(ids, ctx, pool)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            model.forward_step(ids, ctx, pool)
        best = min(best, (time.perf_counter() - t0) / 200)
    return best * 1e6


def logit_hashes(tmp: Path) -> dict:
    """{checkpoint: {workload: (emitted tokens, [digest of each logits tensor, in order])}}."""
    from tests.tiny import make_checkpoint

    seen: list[str] = []
    orig = Qwen35ForCausalLM.logits

    def logits(self, h, out=None, ctx=None):
        y = orig(self, h, out, ctx)
        seen.append(hashlib.sha1(y.detach().contiguous().numpy().tobytes()).hexdigest()[:16])
        return y

    ckpts = {"demo": (DEMO, None), "hidden256": (hidden256_checkpoint(tmp / "h256"), None),
             "dense-fp32": (make_checkpoint(tmp / "dense", seed=4), None),
             "moe-fp64": (make_checkpoint(tmp / "moe", seed=3, moe=True), "float64")}
    res: dict = {}
    Qwen35ForCausalLM.logits = logits
    try:
        for name, (ck, dt) in ckpts.items():
            m = load_model(ck, dtype=dt)
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist() for n in (7, 23, 40, 3)]
            out = {}
            for k in (0, 1, 3):
                seen.clear()
                toks, _ = generate_spec(m, prompts[1], 24, k=k)
                out[f"alone K={k}"] = (toks, list(seen))
            for k in (0, 3):
                seen.clear()
                sched = Scheduler(m, max_num_seqs=4, max_model_len=256, k=k, max_num_batched_tokens=64)
                ss = [SpecSession(m, p, 20 + 3 * i, k=k, pool=sched.pool,
                                  sampling=SpecSampling(temperature=0.8, seed=5) if i == 2 else SpecSampling())
                      for i, p in enumerate(prompts)]
                sched.add(ss[0])
                sched.add(ss[1])
                steps = 0
                while sched.num_sessions:
                    sched.step()
                    steps += 1
                    if steps == 3:  # two rows join mid-decode
                        sched.add(ss[2])
                        sched.add(ss[3])
                out[f"batch K={k}"] = ([s.emitted for s in ss], list(seen))
            res[name] = out
    finally:
        Qwen35ForCausalLM.logits = orig
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hashes", type=Path, help="write the logits digests here")
    ap.add_argument("--check", type=Path, help="compare the logits digests with this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    if args.hashes or args.check:
        res = logit_hashes(tmp)
        if args.hashes:
            args.hashes.write_bytes(pickle.dumps(res))
            print(f"wrote {sum(len(v[1]) for w in res.values() for v in w.values())} logits digests to {args.hashes}")
            return 0
        ref = pickle.loads(args.check.read_bytes())
        bad = [f"{c} {w}: " + ("tokens differ" if ref[c][w][0] != res[c][w][0] else "logits differ")
               for c in res for w in res[c] if ref[c][w] != res[c][w]]
        print("\n".join(bad) if bad else "bitwise same: every logits tensor and token of every workload")
        return 1 if bad else 0
    h256 = load_model(hidden256_checkpoint(tmp / "h256"))
    demo = load_model(DEMO)
    print(f"aten ops per step: hidden-256 plain {ops_per_step(h256, 1, 0):.0f}, demo K=3 alone "
          f"{ops_per_step(demo, 1, 3):.0f}, demo K=3 batch of 8 {ops_per_step(demo, 8, 3):.0f}")
    print("trunk forward (hidden-256, 4 layers), best of 5 x 200: " + ", ".join(
        f"N={N} T={T} {forward_us(h256, N, T):.0f} us" for N, T in ((1, 1), (1, 4), (8, 4))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
