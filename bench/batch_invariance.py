"""Batch invariance of the CPU torch path, measured (issue: the batched round).

For one session A (a fixed prompt, prefilled alone) this compares A's verify forward
  (1) alone (N = 1, T = K+1) vs inside a batch with 3 other sessions (N = 4, same T), and
  (2) its K+1 tokens verified at once (T = K+1) vs fed one per forward (T = 1, the plain-decode shape),
and reports, per sub-module of the first layers and for the logits, the max |difference| of A's rows (0 =
bitwise equal). The first module whose output differs is where invariance breaks. Greedy outputs are checked
separately by the exactness tests; this says where and by how much the floats move.

    .venv/bin/python bench/batch_invariance.py [--model models/demo] [--dtype float32] [--k 3] [--unfused]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loader import load_model  # noqa: E402
from engine.model.ops import cpu  # noqa: E402
from engine.model.qwen35 import FwdCtx  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.spec import SpecSession, generate_spec  # noqa: E402


def _capture(model) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Forward hooks on every leaf module (and each decoder layer) that record its output, per call, in
    execution order."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, mod in model.named_modules():
        if name.startswith("mtp") or not name:
            continue
        if not list(mod.children()) or name.count(".") == 2 and name.startswith("model.layers."):
            def hook(_m, _inp, out, name=name):
                out = out[0] if isinstance(out, tuple) else out  # the MoE router returns (weights, ids)
                seen.setdefault(name, []).append(out.detach().clone())
            handles.append(mod.register_forward_hook(hook))
    return seen, handles


def _sessions(model, prompts, k, n_new):
    sched = Scheduler(model, max_num_seqs=len(prompts), max_model_len=256, k=k, max_num_batched_tokens=4096)
    ss = [SpecSession(model, p, n_new, k=k, pool=sched.pool) for p in prompts]
    for s in ss:
        while s.prefilling:
            s.prefill_chunk()
    return sched, ss


def _verify(model, sessions, tokens):
    """One recording forward of `tokens` [N, T] for `sessions` (as the round's verify does); logits [N, T, V]."""
    T = tokens.shape[1]
    ctx = FwdCtx.make(model.config, tokens.device, model.config.dtype, [s.slot for s in sessions],
                      [s.cache.length for s in sessions], [s.cache.cur for s in sessions], [0] * len(sessions), T,
                      True)
    with torch.inference_mode():
        return model.logits(model.model.norm(model.forward_step(tokens, ctx, sessions[0].pool), ctx), ctx=ctx)


def measure(model, k: int) -> list[tuple[str, float, float]]:
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (24, 9, 57, 33)]
    ref = generate_spec(model, prompts[0], k + 2, k=0)[0]  # A's own greedy continuation as its "drafts"
    toks_a = torch.tensor([ref[: k + 1]])  # [1, K+1]: last + K drafts
    seen, handles = _capture(model)

    def verify(sessions, tokens):  # the modules this forward ran (a fused C call runs none of its children)
        for v in seen.values():
            v.clear()
        out = _verify(model, sessions, tokens)
        return out, {n: v[-1][0] for n, v in seen.items() if v}

    try:
        # (1a) alone
        _, (a,) = _sessions(model, prompts[:1], k, 8)
        alone, rec_alone = verify([a], toks_a)
        alone = alone[0]
        # (1b) A first in a batch of 4 (the others verify their own greedy continuations)
        _, ss = _sessions(model, prompts, k, 8)
        others = [generate_spec(model, p, k + 1, k=0)[0][: k + 1] for p in prompts[1:]]
        batch, rec_batch = verify(ss, torch.tensor([ref[: k + 1]] + others))
        batch = batch[0]
        # (2) T = 1 steps over the same tokens
        _, (a1,) = _sessions(model, prompts[:1], k, 8)
        steps, rec_steps = [], {n: [] for n in rec_alone}
        for t in range(k + 1):
            out, rec = verify([a1], toks_a[:, t:t + 1])
            steps.append(out[0, 0])
            a1.cache.keep(a1.cache.length + 1, 0)
            for n in rec_steps:
                rec_steps[n].append(rec[n])
        stepped = torch.stack(steps)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name in sorted(rec_alone, key=lambda n: list(seen).index(n)):
        x = rec_alone[name]
        d_batch = (x.float() - rec_batch[name].float()).abs().max().item()
        st = torch.cat([s.reshape(1, *x.shape[1:]) if s.dim() == x.dim() else s[None] for s in rec_steps[name]], 0) \
            if x.dim() >= 2 else None
        d_t = (x.float() - st.reshape(x.shape).float()).abs().max().item() if st is not None and st.numel() == x.numel() \
            else float("nan")
        rows.append((name, d_batch, d_t))
    rows.append(("logits [K+1, V]", (alone - batch).abs().max().item(), (alone - stepped).abs().max().item()))
    margins = torch.topk(alone, 2, dim=-1).values
    rows.append(("(top-1 - top-2 logit gap, min over columns)", float((margins[:, 0] - margins[:, 1]).min()), float("nan")))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "demo"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="every module, not only the first ones that differ")
    ap.add_argument("--unfused", action="store_true",
                    help="run the separate projections (not the fused GEMMs) so each one is attributed on its own")
    ap.add_argument("--cpu-kernel-threads", type=int, default=1, choices=[1, 2],
                    help="threads of the C kernels (2: a batch's large jobs split, a lone row's do not)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu.set_threads(args.cpu_kernel_threads)
    model = load_model(args.model, dtype=args.dtype)
    if args.unfused:
        for m in model.modules():
            for attr in ("_w_in", "_w_qkv", "_w_gu"):
                if getattr(m, attr, None) is not None:
                    setattr(m, attr, None)
    rows = measure(model, args.k)
    f = lambda d: "nan" if d != d else ("0 (bitwise)" if d == 0 else f"{d:.3g}")  # noqa: E731
    print(f"model={Path(args.model).name} dtype={args.dtype} K={args.k} torch threads 1, C kernel threads "
          f"{cpu.threads()}"
          f"{' (unfused projections)' if args.unfused else ''}")
    for col, label in ((1, "batch of 4 vs alone"), (2, "T=1 steps vs T=K+1")):
        first = [r for r in rows[:-2] if r[col] > 0][:4]
        print(f"- {label}: bitwise equal through {len([r for r in rows[:-2] if r[col] == 0])} of {len(rows) - 2} "
              f"module outputs; first differences: " + ", ".join(f"{r[0]} {f(r[col])}" for r in first)
              + f"; logits max |diff| {f(rows[-2][col])}")
    print(f"- smallest top-1 vs top-2 logit gap among A's verify columns: {rows[-1][1]:.3g}")
    if args.full:
        print("| module (session A's rows) | batch of 4 vs alone | T=1 steps vs T=K+1 |\n|---|---|---|")
        for name, d1, d2 in rows:
            print(f"| {name} | {f(d1)} | {f(d2)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
