"""Engine-level CLI subcommands: `nextn generate`, `nextn bench spec` (the research ones are in research/commands.py).

`register(subparsers)` adds them to the `nextn` argparse tree; each parser gets `func(args) -> int`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_BENCH_PROMPTS = [
    "What is a list in Python?",
    "Explain the for statement.",
    "Answer in JSON: name and age of a user called Alice who is 31.",
    "Hello! Who are you?",
]


def _k_range(text: str) -> list[int]:
    """'1..4' -> [1, 2, 3, 4]; '1,3,5' -> [1, 3, 5]."""
    if ".." in text:
        a, b = text.split("..", 1)
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model arguments every model subcommand takes: MODEL_DIR, --device, --dtype."""
    p.add_argument("model_dir", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | float64 (default: the config's)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="cut a draft chain when p(draft) < P (0 = off)")
    p.add_argument("--spec-capmax", type=int, default=7, help="largest K allowed (default 7)")
    p.add_argument("--hidden-mode", choices=["post", "pre"], default="post",
                   help="trunk hidden fed to the MTP head: post-final-norm (default) or pre-norm")


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the engine subcommands to `subparsers`."""
    g = subparsers.add_parser("generate", help="generate from a model dir (plain or speculative)")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (raw, or a user message with --chat)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--chat", action="store_true", help="render --prompt as a user message with the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K draft tokens per round; 0 = plain (default 3 when the model has MTP weights)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--spec-stats", action="store_true", help="print the [spec-stats] line to stderr")
    _add_spec_args(g)
    g.set_defaults(func=cmd_generate)

    b = subparsers.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_kind", required=True)
    bs = bsub.add_parser("spec", help="self-consistency gate: spec vs plain greedy per K, with speed")
    add_model_args(bs)
    bs.add_argument("--k", default="1..4", help="K values, e.g. 1..8 or 1,3,5")
    bs.add_argument("--max-tokens", type=int, default=128)
    bs.add_argument("--prompts", default=None, help="file with one prompt per line (chat-rendered); default: built-in")
    bs.add_argument("--repeat", type=int, default=1, help="timed repetitions per K (best is reported)")
    bs.add_argument("--json", action="store_true")
    _add_spec_args(bs)
    bs.set_defaults(func=cmd_bench_spec)


def load_model_from_args(args):
    """The model `add_model_args`' arguments name (gradients off)."""
    import torch

    from .loader import load_model

    torch.set_grad_enabled(False)
    return load_model(args.model_dir, device=args.device, dtype=args.dtype)


def tokenizer_or_none(model_dir: str):
    """The model dir's tokenizer, or None when it has none."""
    from .tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir)
    except (ValueError, OSError):
        return None


def chat_ids(tok, text: str) -> list[int]:
    """`text` as one user message rendered with the chat template (thinking off), as token ids."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              enable_thinking=False))


def cmd_generate(args) -> int:
    """`nextn generate`: prints the text (or, with --json, prompt_token_ids, token_ids, text, spec)."""
    from .sampling import SpecSampling
    from .spec import SpecSession

    model = load_model_from_args(args)
    tok = tokenizer_or_none(args.model_dir)
    if args.prompt_ids is not None:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    else:
        if tok is None:
            print("error: --prompt needs a tokenizer.json in the model dir (or use --prompt-ids)", file=sys.stderr)
            return 2
        ids = chat_ids(tok, args.prompt) if args.chat else tok.encode(args.prompt)
    k = args.num_speculative_tokens
    if k is None:
        k = 3 if model.config.has_mtp else 0
    eos = [] if args.ignore_eos else (tok.eos_token_ids if tok is not None else list(model.config.eos_token_id))
    sess = SpecSession(model, ids, args.max_tokens, k=k, sampling=SpecSampling(temperature=args.temperature, seed=args.seed),
                       eos_ids=eos, p_min=args.spec_draft_p_min, capmax=args.spec_capmax,
                       hidden_mode=args.hidden_mode, stats_line=args.spec_stats)
    out = sess.run()
    text = tok.decode(out, skip_special_tokens=True) if tok is not None else None
    if args.json:
        obj = {"prompt_token_ids": ids, "token_ids": out, "text": text, "finish_reason": sess.finish_reason}
        if sess.k > 0:
            obj["spec"] = sess.telem.to_dict(k=sess.k)
        print(json.dumps(obj))
    else:
        print(text if text is not None else " ".join(map(str, out)))
    return 0


def bench_spec(model, prompts: list[list[int]], ks: list[int], max_tokens: int, eos: list[int], *, repeat: int = 1,
               p_min: float = 0.0, capmax: int = 7, hidden_mode: str = "post") -> dict:
    """Plain greedy vs spec at each K over `prompts`. Returns {"plain": {...}, "rows": [{k, tok_s, ratio,
    acceptance, tokens_per_round, identical}], "pass": bool}; timings are best-of-`repeat` wall clock."""
    from .spec import SpecSession, SpecTelemetry

    def run(k):
        best, outs, tel = None, None, SpecTelemetry()
        for _ in range(repeat):
            t0 = time.perf_counter()
            outs_i, tel_i = [], SpecTelemetry()
            for p in prompts:
                s = SpecSession(model, p, max_tokens, k=k, eos_ids=eos, p_min=p_min, capmax=max(capmax, k),
                                hidden_mode=hidden_mode)
                outs_i.append(s.run())
                tel_i.merge(s.telem)
            dt = time.perf_counter() - t0
            if best is None or dt < best:
                best, outs, tel = dt, outs_i, tel_i
        n = sum(len(o) for o in outs)
        return n / best, outs, tel, n

    run(0)  # warm-up (allocator, kernels)
    plain_tps, ref, _, n_plain = run(0)
    rows = []
    for k in ks:
        tps, outs, tel, n = run(k)
        rows.append({"k": k, "tok_s": round(tps, 2), "ratio": round(tps / plain_tps, 3),
                     "acceptance": round(tel.acceptance_rate, 4), "tokens_per_round": round(tel.tokens_per_round, 3),
                     "pos_rate": [round(a / d, 3) if d else 0.0 for a, d in zip(tel.pos_accepted[:k], tel.pos_drafted[:k])],
                     "tokens": n, "identical": outs == ref})
    return {"plain": {"tok_s": round(plain_tps, 2), "tokens": n_plain}, "rows": rows,
            "pass": all(r["identical"] for r in rows)}


def cmd_bench_spec(args) -> int:
    """`nextn bench spec`: prints the per-K table and PASS/FAIL; exit 1 when any K differs from plain."""
    import torch

    model = load_model_from_args(args)
    tok = tokenizer_or_none(args.model_dir)
    if args.prompts:
        texts = [ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    else:
        texts = DEFAULT_BENCH_PROMPTS
    if tok is not None:
        prompts = [chat_ids(tok, t) for t in texts]
        eos = tok.eos_token_ids
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size, (16,), generator=g).tolist() for _ in texts]
        eos = []
    if not model.config.has_mtp:
        print("error: the model has no MTP head (mtp.* weights); nothing to benchmark", file=sys.stderr)
        return 2
    res = bench_spec(model, prompts, _k_range(args.k), args.max_tokens, eos, repeat=args.repeat,
                     p_min=args.spec_draft_p_min, capmax=args.spec_capmax, hidden_mode=args.hidden_mode)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"plain greedy: {res['plain']['tok_s']:.2f} tok/s ({res['plain']['tokens']} tokens, {len(prompts)} prompts, "
              f"threads={torch.get_num_threads()})")
        print(f"{'K':>2} {'tok/s':>8} {'vs plain':>8} {'accept':>7} {'tok/round':>9}  per-position  self-consistency")
        for r in res["rows"]:
            print(f"{r['k']:>2} {r['tok_s']:>8.2f} {r['ratio']:>7.2f}x {r['acceptance']:>7.3f} {r['tokens_per_round']:>9.3f}  "
                  f"{'/'.join(f'{x:.2f}' for x in r['pos_rate']):<12}  {'PASS' if r['identical'] else 'FAIL'}")
        print("=== SELF-CONSISTENCY PASS ===" if res["pass"] else "=== SELF-CONSISTENCY FAIL ===")
    return 0 if res["pass"] else 1
