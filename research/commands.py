"""Research CLI subcommands: `nextn dspark-extract` (DSpark anchor records) and `nextn optipipe-gate` (the forced
OPTIPIPE harness). `register(subparsers)` adds them to the `nextn` argparse tree; each parser gets `func(args) -> int`.
The research modules (and torch) load only when one of them runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.commands import DEFAULT_BENCH_PROMPTS, add_model_args, chat_ids, load_model_from_args, tokenizer_or_none


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the research subcommands to `subparsers`."""
    d = subparsers.add_parser("dspark-extract", help="write DSpark anchor records from prompts + greedy responses")
    add_model_args(d)
    d.add_argument("--prompts", required=True, help="file with one prompt per line (chat-rendered)")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--gamma", type=int, default=5)
    d.add_argument("--top-k", type=int, default=64)
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--anchors-per-pair", type=int, default=4)
    d.add_argument("--seed", type=int, default=20260811)
    d.add_argument("--split", choices=["train", "heldout"], default="train")
    d.set_defaults(func=cmd_dspark_extract)

    o = subparsers.add_parser("optipipe-gate", help="OPTIPIPE research harness: forced OptiFork verdicts vs serial")
    add_model_args(o)
    o.add_argument("--mode", required=True, choices=["off", "hit", "miss", "alternate", "abort", "controller"],
                   help="forced verdict (hit, miss, alternate, abort), the increment-2 controller, or off")
    o.add_argument("--q", type=float, default=0.7, help="controller threshold on p(d1) * p(d2) (default 0.7)")
    o.add_argument("--max-tokens", type=int, default=48)
    o.add_argument("--prompts", default=None, help="file with one prompt per line (chat-rendered); default: built-in")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.set_defaults(func=cmd_optipipe_gate)


def cmd_dspark_extract(args) -> int:
    """`nextn dspark-extract`: greedy responses to the prompts, then anchor records (see research/dspark.py)."""
    from research.dspark import extract_corpus

    model = load_model_from_args(args)
    tok = tokenizer_or_none(args.model_dir)
    if tok is None:
        print("error: dspark-extract needs a tokenizer in the model dir", file=sys.stderr)
        return 2
    texts = [ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    n = extract_corpus(model, [chat_ids(tok, t) for t in texts], Path(args.out), max_new_tokens=args.max_tokens,
                       eos_ids=tok.eos_token_ids, gamma=args.gamma, top_k=args.top_k, temperature=args.temperature,
                       anchors_per_pair=args.anchors_per_pair, seed=args.seed, split=args.split)
    print(f"wrote {n} records to {args.out}")
    return 0


def cmd_optipipe_gate(args) -> int:
    """`nextn optipipe-gate`: run the forced OptiFork harness (research/optipipe.py `run_gate`), print the invariant
    checks; exit 1 when any fails."""
    import torch

    from research.optipipe import OptiForkGateMode, run_gate

    model = load_model_from_args(args)
    tok = tokenizer_or_none(args.model_dir)
    texts = ([ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()] if args.prompts
             else DEFAULT_BENCH_PROMPTS[:2])
    if tok is not None:
        prompts = [chat_ids(tok, t) for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size, (16,), generator=g).tolist() for _ in texts]
    try:
        report = run_gate(model, OptiForkGateMode.parse(args.mode), prompts, max_new_tokens=args.max_tokens,
                          threshold=args.q)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()) if args.json else "\n".join(report.lines()))
    return 0 if report.passed else 1
