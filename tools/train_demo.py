"""Train the bundled demo model (`models/demo`): a tiny Qwen3.5 (Gated DeltaNet + gated attention, 3:1) with an
MTP head, on text that ships with Python, in about 20 minutes on a 2-core CPU.

    python tools/train_demo.py --out models/demo            # tokenizer + training + checkpoint + eval
    python tools/train_demo.py --out models/demo --eval-only  # re-measure an existing checkpoint

What it does:
  1. builds the corpus (`tools/demo_corpus.py`: pydoc topics, stdlib docstrings, the Zen of Python, synthetic
     chat turns rendered with `engine/chat_template.jinja`, enable_thinking=False style);
  2. trains a byte-level BPE tokenizer (`tools/make_tokenizer.py`) into the output directory;
  3. trains `engine.model.qwen35.Qwen35ForCausalLM` (our model class, built from an HF config dict) with
         loss = ce_main + sum_m w_m * ce_mtp_m
     where MTP pass 0 is the NextN pairing (row i: token x_{i+1}, trunk post-norm hidden h_i -> x_{i+2}) and
     passes m >= 1 are the chained drafts exactly as the engine runs them (row i: token x_{i+1+m}, the head's own
     output hidden of pass m-1 -> x_{i+2+m}, at RoPE position i+m, attending to the pass-0 K/V of rows <= i and
     to its own chain's K/V);
  4. writes config.json + model.safetensors (HF names: model.*, lm_head.weight, mtp.*) next to the tokenizer;
  5. loads the result with the generic `engine.loader.load_model` and measures greedy plain vs MTP speculative
     decoding (identical output, tokens per round, tokens/s) on chat prompts.

Deterministic for a given --seed and --steps (the --minutes cap only ends the run early on a slow machine; the
learning-rate schedule then follows elapsed time, and the report says so).
"""
from __future__ import annotations

import os

import sys

# Training on a shared 2-core machine: OpenMP threads must not spin-wait (a descheduled peer stalls every op).
# Decoding is the opposite (tiny ops, wake-up latency dominates), so the evaluation runs in a fresh process.
_SET_WAIT_POLICY = "OMP_WAIT_POLICY" not in os.environ and "--eval-only" not in sys.argv[1:]
if _SET_WAIT_POLICY:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import argparse
import json
import math
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.model.config import Qwen35Config  # noqa: E402
from engine.model.qwen35 import Qwen35ForCausalLM, apply_partial_rope, rope_cos_sin  # noqa: E402
from tools.demo_corpus import ANSWER, CONTEXT, build_corpus  # noqa: E402

# Chat prompts used for the acceptance / speed measurement (rendered with the chat template).
EVAL_PROMPTS = [
    [{"role": "user", "content": "What is the for statement in Python?"}],
    [{"role": "user", "content": "Explain the with statement."}],
    [{"role": "user", "content": "What does the json module do?"}],
    [{"role": "user", "content": "What does sorted do?"}],
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "user", "content": "Give me a JSON object for a person named Alice who is 30 years old and lives in Paris."}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "How do while loops work?"}],
    [{"role": "user", "content": "Tell me about exceptions."}],
    [{"role": "user", "content": "Write a haiku about speculation."}],
    [{"role": "user", "content": "Count to five."}],
]


# ----------------------------------------------------------------------------------------------- model config

def hf_config(args, vocab_size: int, eos: list[int], pad: int) -> dict:
    L = args.layers
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": L,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        "full_attention_interval": 4,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "linear_num_key_heads": args.lin_k_heads,
        "linear_num_value_heads": args.lin_v_heads,
        "linear_key_head_dim": args.lin_head_dim,
        "linear_value_head_dim": args.lin_head_dim,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": args.max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "mtp_num_hidden_layers": 1,
        "use_cache": True,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    }


@torch.no_grad()
def init_weights(model: Qwen35ForCausalLM, n_layers: int) -> None:
    """GPT-style init: N(0, 0.02) matrices, residual output projections scaled by 1/sqrt(2L); Mamba-style
    GDN decay parameters; zero-centred norms at 0 (scale 1), the GDN gated norm at 1."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
        elif name.endswith("dt_bias"):
            dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_()
        elif "conv1d" in name:
            continue  # PyTorch's default (kaiming-uniform over the 4 taps)
        elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            p.normal_(0.0, 0.02 / math.sqrt(2 * n_layers))
        else:
            p.normal_(0.0, 0.02)


# ----------------------------------------------------------------------------------------------- MTP passes

def mtp_passes(model: Qwen35ForCausalLM, ids: torch.Tensor, post: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Differentiable MTP head over `depth` passes, matching the engine's draft chain exactly.

    ids [B, T]; post [B, T, H] trunk post-norm hiddens. Uses R = T - 1 - depth rows i = 0..R-1 in every pass.
    Pass m row i: token ids[i+1+m], hidden = post[i] (m = 0) or the pass m-1 output of row i, RoPE position
    i + m; it attends to pass-0 K/V of rows c <= i and to the pass-1..m K/V of its own row (what the MTP
    scratch KV holds when the engine drafts step m from committed row i). Pass m predicts ids[i+2+m].
    Returns the head hiddens (after mtp.norm) [B, R, H] per pass.
    """
    mtp = model.mtp
    layer = mtp.layers[0]
    att = layer.self_attn
    B, T = ids.shape
    R = T - 1 - depth
    nh, nkv, hd = att.nh, att.nkv, att.hd
    emb = model.model.embed_tokens(ids)
    hidden = post[:, :R]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    causal = torch.ones(R, R, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(R, dtype=torch.bool, device=ids.device)
    for m in range(depth):
        e = emb[:, 1 + m:1 + m + R]
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        hn = layer.input_layernorm(x)
        qg = att.q_proj(hn).view(B, R, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, R, nh * hd)
        q = att.q_norm(q)
        k = att.k_norm(att.k_proj(hn).view(B, R, nkv, hd))
        v = att.v_proj(hn).view(B, R, nkv, hd)
        cos, sin = rope_cos_sin(torch.arange(m, m + R, device=ids.device)[None], att.rotary_dim, att.theta,
                                x.dtype)  # [1, R, rotary_dim] each
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        ks.append(k)
        vs.append(v)
        kk, vv = torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [B, (m+1)R, nkv, hd]
        if m == 0:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                               is_causal=True, scale=hd ** -0.5, enable_gqa=nh != nkv)
        else:
            mask = torch.cat([causal] + [eye] * m, dim=1)  # [R, (m+1)R]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                               attn_mask=mask, scale=hd ** -0.5, enable_gqa=nh != nkv)
        o = o.transpose(1, 2).reshape(B, R, nh * hd)
        x = x + att.o_proj(o * torch.sigmoid(gate))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        hm = mtp.norm(x)
        outs.append(hm)
        hidden = hm
    return outs


@torch.no_grad()
def selfcheck_mtp(model: Qwen35ForCausalLM, vocab: int, depth: int) -> float:
    """`mtp_passes` vs the engine's inference path (MtpScratch KV, mtp_head_forward chain). Returns max |diff|."""
    from engine.cache import MtpScratch
    from engine.spec import mtp_head_forward

    model.eval()
    g = torch.Generator().manual_seed(1)
    T = 24
    ids = torch.randint(0, vocab, (1, T), generator=g)
    post = model.model.norm(model.forward_hidden(ids))
    outs = mtp_passes(model, ids, post, depth)
    R = T - 1 - depth
    worst = 0.0
    for i in (0, R // 2, R - 1):  # draft chain from committed row i
        sc = MtpScratch(model.config, 64)
        _, hm = mtp_head_forward(model, ids[0, 1:i + 2].tolist(), post[0, :i + 1], 0, sc)
        worst = max(worst, (hm[-1] - outs[0][0, i]).abs().max().item())
        h = hm[-1:]
        for m in range(1, depth):
            _, h = mtp_head_forward(model, [int(ids[0, i + 1 + m])], h, i + m, sc)
            worst = max(worst, (h[0] - outs[m][0, i]).abs().max().item())
    model.train()
    return worst


# ----------------------------------------------------------------------------------------------- data

class RowStream:
    """Deterministic stream of training rows: documents packed into rows of T tokens, each row starting at a
    document start (as a served prompt starts at position 0); the document cut at the row end is dropped."""

    def __init__(self, corpus, tokenizer, T: int, seed: int, boost: float = 1.0, boost_tokens: int = 0):
        self.corpus, self.tok, self.T = corpus, tokenizer, T
        self.rng = random.Random(seed)
        self.boost, self.boost_tokens = boost, boost_tokens

    def row(self) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        mask: list[float] = []
        while len(ids) < self.T:
            for text, kind in self.corpus.sample(self.rng, self.tok):
                seg = self.tok.encode(text)
                ids += seg
                if kind == CONTEXT:
                    mask += [0.0] * len(seg)
                elif kind == ANSWER:
                    nb = min(self.boost_tokens, len(seg))
                    mask += [self.boost] * nb + [1.0] * (len(seg) - nb)
                else:
                    mask += [1.0] * len(seg)
        return ids[:self.T], mask[:self.T]

    def batch(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] and the loss weight of each token as a target [B, T] (0 for prompt tokens, `boost` for the
        first `boost_tokens` tokens of each answer)."""
        rows = [self.row() for _ in range(B)]
        return (torch.tensor([r[0] for r in rows], dtype=torch.long),
                torch.tensor([r[1] for r in rows], dtype=torch.float32))


# ----------------------------------------------------------------------------------------------- training

def masked_ce(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted mean cross-entropy (chat prompts have weight 0)."""
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    w = weight.flatten()
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def train(args) -> dict:
    from safetensors.torch import save_file

    from engine.tokenizer import Tokenizer
    from tools.make_tokenizer import build_tokenizer

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = build_corpus()
    build_tokenizer(corpus.tokenizer_texts(args.seed), args.vocab, out)
    tok = Tokenizer.from_dir(out)
    n_tok = tok.vocab_size
    vocab = (n_tok + 63) // 64 * 64
    gen = json.loads((out / "generation_config.json").read_text())
    eos, pad = gen["eos_token_id"], gen["pad_token_id"]
    raw = hf_config(args, vocab, eos, pad)
    cfg = Qwen35Config.from_dict(raw)
    model = Qwen35ForCausalLM(cfg)
    init_weights(model, args.layers)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    print(f"tokenizer: {n_tok} tokens (config vocab {vocab}); params {n_params / 1e6:.2f}M (MTP head {n_mtp / 1e6:.2f}M)",
          flush=True)
    diff = selfcheck_mtp(model, n_tok, args.mtp_depth)
    print(f"selfcheck: training MTP passes vs engine draft chain, max |diff| = {diff:.2e}", flush=True)
    assert diff < 1e-4, "training-time MTP chain does not match the engine's"

    weights = [float(w) for w in args.mtp_weights.split(",")][:args.mtp_depth]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n or n.endswith(("A_log", "dt_bias")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    stream = RowStream(corpus, tok, args.seq, args.seed, args.answer_boost, args.answer_boost_tokens)
    budget = args.minutes * 60.0
    t0 = time.perf_counter()
    hist: list[list[float]] = []
    step = 0
    progress = 0.0
    stopped_early = False  # set when the time budget, not --steps, drove the schedule
    while progress < 1.0:
        x, w = stream.batch(args.batch)
        lr_scale = min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for gidx in opt.param_groups:
            gidx["lr"] = args.lr * lr_scale
        h = model.forward_hidden(x)
        post = model.model.norm(h)
        ce_main = masked_ce(model.logits(post[:, :-1]), x[:, 1:], w[:, 1:])
        bm = max(1, round(args.batch * args.mtp_rows))  # the head learns from the first bm rows of the batch
        hm = mtp_passes(model, x[:bm], (post.detach() if args.detach_mtp else post)[:bm], args.mtp_depth)
        R = hm[0].shape[1]
        ces = [masked_ce(model.logits(hm[m]), x[:bm, 2 + m:2 + m + R], w[:bm, 2 + m:2 + m + R])
               for m in range(args.mtp_depth)]
        loss = ce_main + sum(w * c for w, c in zip(weights, ces))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        hist.append([ce_main.item()] + [c.item() for c in ces])
        elapsed = time.perf_counter() - t0
        progress = step / args.steps
        if elapsed / budget > progress:  # a busy machine: the schedule follows the clock instead (reported)
            progress, stopped_early = elapsed / budget, True
        if step % args.log_every == 0 or progress >= 1.0:
            avg = [statistics.fmean(col) for col in zip(*hist[-args.log_every:])]
            print(f"step {step:5d} {elapsed:7.1f}s lr {args.lr * lr_scale:.2e} main {avg[0]:.3f} "
                  + " ".join(f"mtp{m} {a:.3f}" for m, a in enumerate(avg[1:])), flush=True)
    train_s = time.perf_counter() - t0
    tail = max(1, min(50, len(hist) // 10))
    final = [statistics.fmean(col) for col in zip(*hist[-tail:])]

    model.eval()
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    total_s = time.perf_counter() - t_start
    report = {
        "command": " ".join(["python", "tools/train_demo.py"] + sys.argv[1:]),
        "seed": args.seed, "steps": step, "schedule_followed_clock": stopped_early, "train_seconds": round(train_s, 1),
        "total_seconds": round(total_s, 1), "tokens_seen": step * args.batch * args.seq,
        "params": n_params, "mtp_params": n_mtp, "vocab_tokenizer": n_tok, "vocab_config": vocab,
        "final_loss_main": round(final[0], 4), "final_loss_mtp": [round(v, 4) for v in final[1:]],
        "args": vars(args),
    }
    print(json.dumps(report), flush=True)
    return report


# ----------------------------------------------------------------------------------------------- evaluation

def evaluate(model_dir: str, ks=(1, 2, 3, 4), max_new_tokens: int = 128, repeats: int = 2, threads: int | None = None) -> dict:
    """Greedy plain (k=0) vs speculative decoding on EVAL_PROMPTS with the generic loader; checks exactness."""
    from engine.loader import load_model
    from engine.spec import SpecTelemetry, generate_spec
    from engine.tokenizer import Tokenizer

    if threads:
        torch.set_num_threads(threads)
    model = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    # even prompts: enable_thinking=False (closed think block); odd: the template's default (open `<think>\n`)
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True,
                                                  enable_thinking=False if i % 2 == 0 else None))
               for i, m in enumerate(EVAL_PROMPTS)]
    eos = tok.eos_token_ids
    res: dict = {"samples": [], "per_k": {}}
    ref = []
    for p, msgs in zip(prompts, EVAL_PROMPTS):
        toks, _ = generate_spec(model, p, max_new_tokens, k=0, eos_ids=eos)
        ref.append(toks)
        res["samples"].append({"prompt": msgs[-1]["content"], "answer": tok.decode(toks, skip_special_tokens=True)})
    times = {k: [] for k in (0, *ks)}
    telem = {k: SpecTelemetry() for k in ks}
    n_tokens = sum(len(r) for r in ref)
    for rep in range(repeats):  # interleaved, so a busy machine slows every K alike
        for k in (0, *ks):
            t0 = time.perf_counter()
            for p, r in zip(prompts, ref):
                toks, tel = generate_spec(model, p, max_new_tokens, k=k, eos_ids=eos)
                if toks != r:
                    raise AssertionError(f"k={k}: speculative output differs from plain greedy")
                if k and rep == 0:
                    telem[k].merge(tel)
            times[k].append(time.perf_counter() - t0)
    plain_tps = n_tokens / min(times[0])
    res["plain_tok_s"] = round(plain_tps, 1)
    res["tokens"] = n_tokens
    for k in ks:
        t = telem[k]
        tps = n_tokens / min(times[k])
        res["per_k"][k] = {
            "tokens_per_round": round(t.tokens_per_round, 3), "acceptance_rate": round(t.acceptance_rate, 3),
            "per_pos": [round(a / d, 3) if d else 0.0 for a, d in zip(t.pos_accepted[:k], t.pos_drafted[:k])],
            "tok_s": round(tps, 1), "speedup": round(tps / plain_tps, 3), "exact": True,
        }
    return res


def print_eval(res: dict) -> None:
    for s in res["samples"]:
        print(f"\n>>> {s['prompt']}\n{s['answer']}")
    print(f"\nplain: {res['plain_tok_s']} tok/s over {res['tokens']} tokens")
    for k, r in res["per_k"].items():
        print(f"K={k}: tokens/round {r['tokens_per_round']:.3f} acceptance {r['acceptance_rate']:.3f} "
              f"per-pos {r['per_pos']} {r['tok_s']} tok/s speedup x{r['speedup']:.2f} exact={r['exact']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "models" / "demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048, help="learned BPE vocabulary (33 special tokens are added)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--lin-k-heads", type=int, default=2)
    ap.add_argument("--lin-v-heads", type=int, default=4)
    ap.add_argument("--lin-head-dim", type=int, default=32)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1050)
    ap.add_argument("--minutes", type=float, default=23.0, help="wall-clock cap on the training loop")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--mtp-depth", type=int, default=3, help="MTP passes trained (1 = NextN step only, +chained)")
    ap.add_argument("--mtp-weights", default="0.5,0.35,0.25")
    ap.add_argument("--mtp-rows", type=float, default=0.5, help="fraction of each batch the MTP head trains on")
    ap.add_argument("--detach-mtp", action="store_true", help="stop MTP gradients at the trunk hidden")
    ap.add_argument("--answer-boost", type=float, default=4.0, help="loss weight of the first answer tokens")
    ap.add_argument("--answer-boost-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--eval-threads", type=int, default=1,
                    help="torch threads for the decode measurement (1: batch-1 decode of a tiny model is fastest)")
    args = ap.parse_args(argv)
    if args.eval_only:
        res = evaluate(args.out, threads=args.eval_threads)
        print_eval(res)
        print(json.dumps({"eval": res}), flush=True)
        return
    train(args)
    if not args.no_eval:
        env = dict(os.environ)
        if _SET_WAIT_POLICY:
            env.pop("OMP_WAIT_POLICY", None)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", args.out, "--eval-only"]
        if args.eval_threads:
            cmd += ["--eval-threads", str(args.eval_threads)]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
