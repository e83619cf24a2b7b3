"""DSpark supervision records: anchor-bounded blocks of the target's sparse (top-k + tail) distributions.

A `DsparkAnchorRecord` at anchor p holds tokens seq[p : p+gamma+1] (tokens[0] is the anchor), the carrier
hidden h[p-1] (the same trunk hidden the live MTP head pairs with the anchor token), and for target rows
j = 0..gamma-1 (teacher-forced logits at position p+j, scoring tokens[j+1]) the top-k ids / raw logits /
probabilities plus the probability mass outside the top-k (`tail`). Top-k rule: rank by raw logit,
ties to the lower id; probabilities are exp((l - max)/T) / sum over the FULL vocabulary, in float64.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.cache import ModelCache
from engine.model.qwen35 import Qwen35ForCausalLM
from engine.spec import SpecSession, prefill

FORMAT = "nextn-dspark-anchors-v1"
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class DsparkAnchorRecord:
    """One anchor block. Flattened target arrays are [gamma, top_k] row-major."""

    pair_id: int
    position: int
    prompt_len: int
    hidden: np.ndarray  # float32 [H], written as bf16 (round to nearest even)
    tokens: np.ndarray  # uint32 [gamma + 1]
    target_top_ids: np.ndarray  # uint32 [gamma * top_k]
    target_top_logits: np.ndarray  # float32 [gamma * top_k]
    target_top_probs: np.ndarray  # float32 [gamma * top_k]
    target_tail_probs: np.ndarray  # float32 [gamma]


def sparse_softmax_topk(logits: torch.Tensor, top_k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One logit row [V] -> (top ids [k], raw top logits [k], top probs [k] f64, tail mass f64 in [0, 1])."""
    if logits.numel() == 0:
        raise ValueError("empty logits")
    if top_k <= 0 or top_k > logits.numel():
        raise ValueError(f"top_k must be in [1, {logits.numel()}], got {top_k}")
    if not temperature > 0:
        raise ValueError("temperature must be > 0")
    if not torch.isfinite(logits).all():
        raise ValueError("non-finite logit")
    l64 = logits.double()
    _, order = torch.sort(l64, descending=True, stable=True)  # ties keep ascending id order
    ids = order[:top_k]
    p = torch.softmax((l64 - l64.max()) / temperature, dim=-1)
    top_p = p[ids]
    tail = min(max(1.0 - float(top_p.sum()), 0.0), 1.0)
    return ids, logits[ids].float(), top_p, tail


def splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def sample_anchors(prompt_len: int, total_len: int, gamma: int, take: int, seed: int, pair_id: int) -> list[int]:
    """Stratified anchors in [max(prompt_len-1, 1), total_len-gamma-1]: one per bucket, sorted, unique."""
    first, last = max(prompt_len - 1, 1), total_len - gamma - 1
    if last < first or take <= 0:
        return []
    span = last - first + 1
    take = min(take, span)
    state = (seed ^ pair_id) & _M64
    out = set()
    for i in range(take):
        lo, hi = first + i * span // take, first + (i + 1) * span // take - 1
        state, r = splitmix64(state)
        out.add(lo + r % (hi - lo + 1))
    return sorted(out)


@torch.no_grad()
def extract_pair(model: Qwen35ForCausalLM, prompt: list[int], response: list[int], pair_id: int, *, gamma: int,
                 top_k: int, temperature: float, anchors: int, seed: int, hidden_mode: str = "post") -> list[DsparkAnchorRecord]:
    """Records for one (prompt, response) pair; [] when the response is shorter than gamma."""
    if len(response) < gamma:
        return []
    seq = prompt + response
    cache = ModelCache(model.config, len(seq) + 1, device=model.lm_head.weight.device, dtype=model.config.dtype)
    _, post, pre = prefill(model, seq, cache, want_hidden=True)
    carrier = post if hidden_mode == "post" else pre
    recs = []
    for p in sample_anchors(len(prompt), len(seq), gamma, anchors, seed, pair_id):
        ids, lg, pr, tails = [], [], [], []
        rows = model.logits(post[p:p + gamma])  # [gamma, V]: row j scores seq[p+j+1]
        for j in range(gamma):
            i, l_, p_, t = sparse_softmax_topk(rows[j], top_k, temperature)
            ids.append(i)
            lg.append(l_)
            pr.append(p_)
            tails.append(t)
        recs.append(DsparkAnchorRecord(
            pair_id=pair_id, position=p, prompt_len=len(prompt), hidden=carrier[p - 1].float().cpu().numpy(),
            tokens=np.asarray(seq[p:p + gamma + 1], dtype=np.uint32),
            target_top_ids=torch.cat(ids).cpu().numpy().astype(np.uint32),
            target_top_logits=torch.cat(lg).cpu().numpy().astype(np.float32),
            target_top_probs=torch.cat(pr).cpu().numpy().astype(np.float32),
            target_tail_probs=np.asarray(tails, dtype=np.float32)))
    return recs


def extract_corpus(model: Qwen35ForCausalLM, prompts: list[list[int]], out: Path, *, max_new_tokens: int,
                   eos_ids: list[int], gamma: int = 5, top_k: int = 64, temperature: float = 0.7,
                   anchors_per_pair: int = 4, seed: int = 20260811, split: str = "train", mode: str = "nothink",
                   category: str = "chat") -> int:
    """Greedy-answer each prompt with the model itself, then write all records to `out`. Returns the count."""
    out.mkdir(parents=True, exist_ok=True)
    recs: list[DsparkAnchorRecord] = []
    for pid, prompt in enumerate(prompts):
        resp = SpecSession(model, prompt, max_new_tokens, k=3 if model.config.has_mtp else 0, eos_ids=eos_ids).run()
        recs += extract_pair(model, prompt, resp, pid, gamma=gamma, top_k=top_k, temperature=temperature,
                             anchors=anchors_per_pair, seed=seed)
    write_records(recs, out, gamma=gamma, top_k=top_k, temperature=temperature, seed=seed, split=split, mode=mode,
                  category=category, vocab_size=model.config.vocab_size, hidden_size=model.config.hidden_size)
    return len(recs)


def write_records(recs: list[DsparkAnchorRecord], out: Path, *, gamma: int, top_k: int, temperature: float, seed: int,
                  split: str, mode: str, category: str, vocab_size: int, hidden_size: int) -> None:
    """Write the flat record files, index.tsv and extraction.meta.json."""
    def dump(name: str, arrays: list[np.ndarray], dtype) -> None:
        data = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
        (out / name).write_bytes(data.tobytes())

    hid = [torch.from_numpy(r.hidden).to(torch.bfloat16).view(torch.int16).numpy() for r in recs]  # RNE to bf16
    dump("hiddens.bf16", hid, np.int16)
    dump("tokens.u32", [r.tokens for r in recs], np.uint32)
    dump("top_ids.u32", [r.target_top_ids for r in recs], np.uint32)
    dump("top_logits.f32", [r.target_top_logits for r in recs], np.float32)
    dump("top_probs.f32", [r.target_top_probs for r in recs], np.float32)
    dump("tail_probs.f32", [r.target_tail_probs for r in recs], np.float32)
    lines = ["record\tpair_id\tanchor_pos\tprompt_len\tsplit\tmode\tcategory"]
    lines += [f"{i}\t{r.pair_id}\t{r.position}\t{r.prompt_len}\t{split}\t{mode}\t{category}" for i, r in enumerate(recs)]
    (out / "index.tsv").write_text("\n".join(lines) + "\n")
    meta = {"format": FORMAT, "records": len(recs), "gamma": gamma, "top_k": top_k, "temperature": temperature,
            "seed": seed, "vocab_size": vocab_size, "hidden_size": hidden_size, "hidden_dtype": "bf16",
            "hidden": "h[p-1] post-final-norm trunk hidden (the live MTP carrier)"}
    (out / "extraction.meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def validate_corpus(out: Path, vocab_size: int | None = None) -> list[str]:
    """Check a written corpus against the validator rules; returns the list of problems ([] = valid)."""
    meta = json.loads((out / "extraction.meta.json").read_text())
    n, g, k, T = meta["records"], meta["gamma"], meta["top_k"], meta["temperature"]
    V = vocab_size if vocab_size is not None else meta["vocab_size"]
    errs: list[str] = []
    ids = np.fromfile(out / "top_ids.u32", dtype=np.uint32).reshape(n, g, k)
    lg = np.fromfile(out / "top_logits.f32", dtype=np.float32).reshape(n, g, k).astype(np.float64)
    pr = np.fromfile(out / "top_probs.f32", dtype=np.float32).reshape(n, g, k).astype(np.float64)
    tail = np.fromfile(out / "tail_probs.f32", dtype=np.float32).reshape(n, g).astype(np.float64)
    toks = np.fromfile(out / "tokens.u32", dtype=np.uint32).reshape(n, g + 1)
    hid = np.fromfile(out / "hiddens.bf16", dtype=np.int16)
    if hid.size != n * meta["hidden_size"]:
        errs.append("hiddens.bf16 has the wrong size")
    if meta["vocab_size"] != V:
        errs.append(f"vocab size {meta['vocab_size']} != expected {V}")
    if (ids >= V).any() or (toks >= V).any():
        errs.append("token id out of vocabulary")
    s = pr.sum(-1) + tail
    if (np.abs(s - 1.0) > 2e-5).any():
        errs.append(f"top + tail != 1 (max error {np.abs(s - 1).max():.2e})")
    if (np.diff(lg, axis=-1) > 0).any() or (np.diff(pr, axis=-1) > 1e-12).any():
        errs.append("logits/probs not non-increasing along a row")
    if any(len(set(row.tolist())) != k for row in ids.reshape(-1, k)):
        errs.append("duplicate id in a row")
    if (pr <= 0).any():
        errs.append("non-positive top probability")
    if ((tail < 0) | (tail > 1)).any():
        errs.append("tail outside [0, 1]")
    with np.errstate(divide="ignore"):
        lhs = np.log(pr[..., :1] / pr)
    rhs = (lg[..., :1] - lg) / T
    if (np.abs(lhs - rhs) > 3e-4).any():
        errs.append(f"log(p0/pk) != (l0-lk)/T (max error {np.abs(lhs - rhs).max():.2e})")
    rows = (out / "index.tsv").read_text().splitlines()[1:]
    if len(rows) != n:
        errs.append("index.tsv row count != records")
    for r in rows:
        f = r.split("\t")
        if f[4] not in ("train", "heldout") or f[5] not in ("think", "nothink"):
            errs.append(f"bad split/mode in index row {f[0]}")
            break
    return errs


def read_hidden_bf16(out: Path, hidden_size: int) -> np.ndarray:
    """hiddens.bf16 -> float32 [N, H]."""
    raw = np.fromfile(out / "hiddens.bf16", dtype=np.int16)
    return torch.from_numpy(raw.copy()).view(torch.bfloat16).float().numpy().reshape(-1, hidden_size)


def log_ratio_ok(p0: float, pk: float, l0: float, lk: float, T: float) -> bool:
    """The validator's |log(p0/pk) - (l0-lk)/T| <= 3e-4 rule for one pair of entries."""
    return abs(math.log(p0 / pk) - (l0 - lk) / T) <= 3e-4
