"""Give the bundled demo model (models/demo) a vision tower: train `model.visual.*` on generated pictures.

Pictures come from tools/demo_pictures.py (shapes x colours x counts); prompts are the chat template's rendering
with the image part as `<|vision_start|><|image_pad|><|vision_end|>` before the question, the pad expanded to the
image's token count, and the answer, e.g. "two red circles.", then <|im_end|>. With the text model frozen the tower
alone cannot make the tiny demo say that (--soft-bound), so the demo's recipe trains the text model too
(--unfreeze-lm) while --distill holds it to its own text behaviour (the KL from the starting text model on corpus
rows), then refits the MTP head to the moved trunk (--mtp-only); models/demo/README.md has the exact run:

    python tools/train_demo_vision.py --out /tmp/demo-vl-lm --minutes 42 --unfreeze-lm 1e-3 --aux 0.5 --distill \
        --threads 2                                                               # tower + text model
    python tools/train_demo_vision.py --mtp-only /tmp/demo-vl-lm --out /tmp/demo-vl --mtp-minutes 8 --batch 12 \
        --mtp-text-rows 8 --threads 2                                              # MTP head refit
    python tools/train_demo_vision.py --engine-eval /tmp/demo-vl --n-eval 200    # held-out accuracy, MTP, our engine
    python tools/train_demo_vision.py --text-cost models/demo /tmp/demo-vl      # text answers/MTP before vs after
    python tools/train_demo_vision.py --out /tmp/demo-vl --minutes 22            # the tower alone (text frozen)
    python tools/train_demo_vision.py --eval-only /tmp/demo-vl --n-eval 400      # held-out accuracy (transformers)
    python tools/train_demo_vision.py --soft-bound 225      # the most any tower could do with the text model frozen

transformers' `Qwen3_5ForConditionalGeneration` is the training model (test/tool dependency); --engine-eval runs
held-out pictures through our engine (engine.spec, K=3). fla is blocked before transformers is imported.

Writes into --out: config.json in the VL layout (model_type qwen3_5, text_config = the text fields, vision_config,
the vision token ids, M-RoPE sections), model.safetensors (text tensors under HF's VL names
`model.language_model.*`, `lm_head.*`, `mtp.*`, plus `model.visual.*`), preprocessor_config.json, tokenizer and
generation config copied. Prints a sha256 per text tensor before and after; with the text model frozen it fails if
any differs.
"""
from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)  # fla-core + triton on a CPU box breaks transformers' Qwen3.5

import argparse  # noqa: E402
import copy  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import images  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tools import demo_pictures as pics  # noqa: E402

IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"  # how Qwen3.5's template renders an image part
_SLOT = "\ue000"  # where the image part goes in the rendered prompt (a private-use character)
VISION_CONFIG = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 128, "intermediate_size": 256,
                 "num_heads": 4, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
                 "spatial_merge_size": 2, "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                 "initializer_range": 0.02}
MROPE_SECTION = [2, 1, 1]  # sums to rotary_dim / 2 = 32 * 0.25 / 2 = 4; interleaved (T H W T) as Qwen3.5's
AUX_WEIGHTS = (2.0, 1.0, 1.0)  # the probe loss' weights on count, colour, shape: counting is the hardest to learn
TEXT_PREFIX, VL_PREFIX = "model.", "model.language_model."
TEXT_DEPTH_WEIGHTS = (1.0, 0.7, 0.5)  # the MTP refit's loss weights on the corpus' chained draft passes 1, 2, 3


# --- checkpoint layout -------------------------------------------------------------------------------------------


def text_config(src: Path) -> dict:
    """The demo's text fields: config.json's text_config (VL layout) or the whole flat config (text layout)."""
    raw = json.loads((src / "config.json").read_text())
    return dict(raw["text_config"]) if isinstance(raw.get("text_config"), dict) else raw


def vl_config(tc: dict, tok: Tokenizer, vision: dict) -> dict:
    """config.json of the VL layout: the text fields nested (model_type qwen3_5_text, M-RoPE sections added),
    vision_config, and the vision token ids of the demo tokenizer."""
    tc = {k: v for k, v in tc.items() if k not in ("architectures", "text_config", "vision_config")}
    tc["model_type"] = "qwen3_5_text"
    tc["rope_parameters"] = {**tc["rope_parameters"], "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    ids = {name: tok.token_to_id(f"<|{tok_name}|>") for name, tok_name in (
        ("image_token_id", "image_pad"), ("video_token_id", "video_pad"), ("vision_start_token_id", "vision_start"),
        ("vision_end_token_id", "vision_end"))}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", **ids,
            "tie_word_embeddings": tc.get("tie_word_embeddings", False), "dtype": tc.get("dtype", "float32"),
            "text_config": tc, "vision_config": {**vision, "out_hidden_size": tc["hidden_size"]}}


def preprocessor_config() -> dict:
    """preprocessor_config.json: Qwen3.5's image processor with min/max pixels = demo_pictures' MIN_SIDE^2 ..
    MAX_SIDE^2 (any image is resized into 16..36 image tokens)."""
    return {"size": {"shortest_edge": pics.MIN_SIDE ** 2, "longest_edge": pics.MAX_SIDE ** 2},
            "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 3, "do_resize": True,
            "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
            "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}


def text_tensors(src: Path) -> dict[str, torch.Tensor]:
    """The demo's text + MTP tensors under their text-layout names (`model.*`, `lm_head.*`, `mtp.*`)."""
    sd = load_file(str(src / "model.safetensors"))
    return {("model." + k[len(VL_PREFIX):] if k.startswith(VL_PREFIX) else k): v for k, v in sd.items()
            if not k.startswith("model.visual.")}


def vl_name(name: str) -> str:
    """HF's VL name of a text-layout tensor name (`model.x` -> `model.language_model.x`; lm_head, mtp unchanged)."""
    return VL_PREFIX + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def tensor_hashes(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes."""
    out = {}
    for k, v in sd.items():
        h = hashlib.sha256(f"{v.dtype}:{tuple(v.shape)}:".encode())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
        out[k] = h.hexdigest()
    return out


def write_checkpoint(src: Path, out: Path, text_sd: dict[str, torch.Tensor], visual: dict[str, torch.Tensor] | None,
                     vision: dict) -> None:
    """Write the VL-layout demo into `out` (text tensors renamed, never changed; `visual` keys without prefix)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_dir(src)
    cfg = vl_config(text_config(src), tok, vision)
    sd = {vl_name(k): v.contiguous() for k, v in text_sd.items()}
    if visual is not None:
        sd.update({"model.visual." + k: v.detach().contiguous().clone() for k, v in visual.items()})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        if (src / name).is_file() and src.resolve() != out.resolve():
            shutil.copy(src / name, out / name)
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")


# --- data --------------------------------------------------------------------------------------------------------


class Prompts:
    """Token ids of the demo's chat prompts with one image, as the server renders them."""

    def __init__(self, model_dir: Path) -> None:
        self.tok = Tokenizer.from_dir(model_dir)
        self.icfg = images.ImageConfig.from_checkpoint(model_dir)
        if self.icfg is None:
            raise SystemExit(f"{model_dir} has no vision_config")
        self.end = self.tok.encode("<|im_end|>")

    def prompt(self, question: str, image_first: bool, thinking: bool | None) -> list[int]:
        """The generation prompt (default template: thinking on, ending `<think>\\n`) with one image pad."""
        content = _SLOT + question if image_first else question + _SLOT
        text = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            enable_thinking=thinking)
        return self.tok.encode(text.replace(_SLOT, IMAGE_MARKUP))

    def completion(self, answer: str, thinking: bool | None) -> list[int]:
        """What the model must generate: after the default prompt the empty think block closes first."""
        head = "" if thinking is False else "\n</think>\n\n"
        return self.tok.encode(head + answer) + self.end

    def example(self, seed: int, rng: random.Random) -> dict:
        """One training example for picture `seed`: ids, labels (-100 on the prompt), pixel rows and grid."""
        p = pics.picture(seed)
        prep = images.preprocess(p.image, self.icfg)
        thinking = None if rng.random() < 0.75 else False
        q = rng.choice(pics.QUESTIONS)
        prompt = images.expand_image_pads(self.prompt(q, rng.random() < 0.85, thinking), [prep.n_tokens],
                                          self.icfg.image_token_id)
        comp = self.completion(p.answer, thinking)
        return {"ids": prompt + comp, "labels": [-100] * len(prompt) + comp, "rows": prep.pixel_rows,
                "grid": prep.grid_thw, "attrs": (p.count - 1, list(pics.COLOURS).index(p.colour),
                                                 pics.SHAPES.index(p.shape))}


def collate(batch: list[dict], pad_id: int, image_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch (causal: padding after a row never changes its earlier positions, no mask needed)."""
    n = max(len(b["ids"]) for b in batch)
    ids = torch.tensor([b["ids"] + [pad_id] * (n - len(b["ids"])) for b in batch])  # [B, n]
    labels = torch.tensor([b["labels"] + [-100] * (n - len(b["labels"])) for b in batch])  # [B, n]
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == image_id).int(),
            "pixel_values": torch.cat([b["rows"] for b in batch]),  # [sum patches, 1536]
            "image_grid_thw": torch.tensor([b["grid"] for b in batch])}  # [B, 3]


# --- training and evaluation -------------------------------------------------------------------------------------


def load_hf(model_dir: Path):
    """transformers' Qwen3_5ForConditionalGeneration from a VL-layout dir, float32."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)


def _apply(opt: torch.optim.Optimizer, loss: torch.Tensor, clip: list[torch.Tensor], losses: list[float], what: str,
           note: str) -> None:
    """One optimiser step on `loss` (the gradient of `clip` clipped to norm 1.0), its value appended to `losses`;
    every 25th prints `what`, the mean of the last 25 losses and `note`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(clip, 1.0)
    opt.step()
    losses.append(loss.item())
    if len(losses) % 25 == 0:
        print(f"{what} loss {sum(losses[-25:]) / 25:.4f} {note}", flush=True)


def train(model, data: Prompts, *, seed: int, minutes: float, max_steps: int, batch: int, lr: float,
          lm_lr: float = 0.0, text_rows: int = 4, aux: float = 0.0, distill: bool = False) -> list[float]:
    """AdamW on model.visual (the language model frozen unless lm_lr > 0), cosine schedule over the wall-clock
    budget. lm_lr > 0 (it changes the text weights) also trains the language model, each step
    adding the demo corpus' text loss on `text_rows` rows of 128 tokens so the text skills are kept. aux > 0 adds
    a probe loss (weight aux, times AUX_WEIGHTS per attribute): linear heads on each image's mean and max embedding
    predict count, colour and shape (the probe is discarded; it only speeds up the tower's learning). distill (with
    lm_lr > 0) makes the text loss the KL divergence from the starting model's next-token distribution at every
    position of the corpus rows instead of their cross-entropy: the text model keeps its function, not only its
    skills, so its greedy answers and the MTP head trained on it stay as they were."""
    teacher = copy.deepcopy(model).eval() if distill and lm_lr > 0 else None
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.model.visual.parameters())
    for p in params:
        p.requires_grad_(True)
    groups = [{"params": params, "lr": lr, "base": lr}]
    text = None
    if lm_lr > 0:
        from tools.demo_corpus import build_corpus
        from tools.train_demo import RowStream, masked_ce

        lm = [p for n, p in model.named_parameters() if not n.startswith("model.visual.")]
        for p in lm:
            p.requires_grad_(True)
        groups.append({"params": lm, "lr": lm_lr, "base": lm_lr})
        text = RowStream(build_corpus(), data.tok, 128, seed + 1)
    hidden = model.config.text_config.hidden_size
    probe = torch.nn.Linear(2 * hidden, len(pics.COUNTS) + len(pics.COLOURS) + len(pics.SHAPES))
    if aux > 0:
        groups.append({"params": list(probe.parameters()), "lr": lr, "base": lr})
    opt = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    model.train()
    t0, losses, step, warm = time.time(), [], 0, 30
    budget = minutes * 60
    while step < max_steps:
        frac = max(step / max_steps, (time.time() - t0) / budget)
        if frac >= 1:
            break
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = g["base"] * scale
        seeds = [rng.randrange(pics.HELDOUT_SEED) for _ in range(batch)]
        exs = [data.example(s, rng) for s in seeds]
        b = collate(exs, data.tok.pad_token_id or 0, data.icfg.image_token_id)
        loss = model(**b).loss
        if aux > 0:
            feats = model.model.get_image_features(b["pixel_values"], b["image_grid_thw"]).pooler_output
            pooled = torch.stack([torch.cat([f.mean(0), f.amax(0)]) for f in feats])  # [B, 2 * hidden]
            logits = probe(pooled).split([len(pics.COUNTS), len(pics.COLOURS), len(pics.SHAPES)], dim=-1)
            want = torch.tensor([e["attrs"] for e in exs])  # [B, 3]
            loss = loss + aux * sum(wt * F.cross_entropy(lg, want[:, i])
                                    for i, (wt, lg) in enumerate(zip(AUX_WEIGHTS, logits)))
        if text is not None:
            ids, w = text.batch(text_rows)  # [R, 128] each
            logits = model(input_ids=ids[:, :-1]).logits  # [R, 127, V]
            if teacher is None:
                loss = loss + masked_ce(logits, ids[:, 1:], w[:, 1:])
            else:
                with torch.no_grad():
                    want = F.log_softmax(teacher(input_ids=ids[:, :-1]).logits, dim=-1)  # [R, 127, V]
                kl = F.kl_div(F.log_softmax(logits, dim=-1), want, log_target=True, reduction="none")  # [R, 127, V]
                loss = loss + kl.sum(-1).mean()
        _apply(opt, loss, params, losses, f"step {step + 1}", f"lr {lr * scale:.2e} {time.time() - t0:.0f}s")
        step += 1
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model, data: Prompts, n: int, question: str = "What is in this picture?",
             thinking: bool | None = None) -> dict:
    """Greedy answers (transformers' generate) for n held-out pictures: exact-match and per-attribute accuracy."""
    model.eval()
    hits = {"exact": 0, "count": 0, "colour": 0, "shape": 0}
    wrong: list = []
    for seed in pics.split("heldout", n):
        p = pics.picture(seed)
        prep = images.preprocess(p.image, data.icfg)
        ids = _picture_prompt(data, prep.n_tokens, question, thinking)
        t = torch.tensor([ids])
        out = model.generate(input_ids=t, mm_token_type_ids=(t == data.icfg.image_token_id).int(),
                             pixel_values=prep.pixel_rows, image_grid_thw=torch.tensor([prep.grid_thw]),
                             max_new_tokens=16, do_sample=False, eos_token_id=data.end[0], pad_token_id=data.end[0])
        _score(hits, wrong, seed, p, data.tok.decode(out[0, len(ids):].tolist()))
    return {"n": n, **{k: v / n for k, v in hits.items()}, "wrong": wrong}


def _picture_prompt(data: Prompts, n_tokens: int, question: str, thinking: bool | None) -> list[int]:
    """An evaluation prompt: the image (n_tokens pads) first, then the question."""
    return images.expand_image_pads(data.prompt(question, True, thinking), [n_tokens], data.icfg.image_token_id)


def _score(hits: dict, wrong: list, seed: int, p: pics.Picture, text: str) -> None:
    """Add one answer to the exact/count/colour/shape tallies (and to `wrong`, the first 8 misses)."""
    got = text.split("</think>")[-1].replace("<|im_end|>", "").strip()
    want = pics.answer_fields(p.answer)
    have = pics.answer_fields(got) or ("", "", "")
    hits["exact"] += got == p.answer
    for i, key in enumerate(("count", "colour", "shape")):
        hits[key] += have[i] == want[i]
    if got != p.answer and len(wrong) < 8:
        wrong.append((seed, p.answer, got))


def engine_eval(model_dir: Path, n: int, k: int = 3, question: str = "What is in this picture?") -> dict:
    """n held-out pictures through OUR engine: `engine.spec.generate_spec` at K=k, greedy, the image as the server
    hands it (`images.prepare_input`). Returns exact-match and per-attribute accuracy and the MTP tokens per verify
    round over all the image prompts (accepted + rounds) / rounds."""
    from engine.loader import load_model
    from engine.session import SpecTelemetry
    from engine.spec import generate_spec

    model, data = load_model(model_dir), Prompts(model_dir)
    hits = {"exact": 0, "count": 0, "colour": 0, "shape": 0}
    wrong: list = []
    telem = SpecTelemetry()
    for seed in pics.split("heldout", n):
        p = pics.picture(seed)
        inp = images.prepare_input(p.image, model.image_config)
        ids = _picture_prompt(data, inp.n_tokens, question, None)
        out, tel = generate_spec(model, ids, 16, k=k, eos_ids=data.tok.eos_token_ids, images=[inp])
        telem.merge(tel)
        _score(hits, wrong, seed, p, data.tok.decode(out))
    tpr = (telem.accepted + telem.rounds) / max(1, telem.rounds)
    return {"n": n, **{key: v / n for key, v in hits.items()}, "mtp_tokens_per_round": round(tpr, 3),
            "wrong": wrong}


def mtp_refit(src: Path, out: Path, *, seed: int, minutes: float, max_steps: int, batch: int, lr: float,
              text_rows: int = 4) -> list[float]:
    """Refit the MTP head (`mtp.*` only; trunk and tower frozen) to the trunk of `src`: each step, `batch` picture
    chats and `text_rows` demo-corpus rows of 128 tokens; the trunk (transformers) gives its post-norm hiddens and
    its greedy tokens, and the head (our engine's `model.mtp`, fed as the engine feeds it: embedding of token i+1,
    image embeddings at the pads, trunk hidden of row i, M-RoPE rows of the prompt) learns to predict the trunk's
    greedy token at i+2 on the rows that decode (completion rows of the pictures, answer rows of the corpus; on the
    corpus also the chained draft passes 2 and 3 as tools/train_demo.py trains them, so the text drafts stay deep). AdamW,
    cosine over the wall-clock budget. Writes `src` with the new `mtp.*` tensors into `out`; returns the losses."""
    from engine.loader import load_model
    from tools.demo_corpus import build_corpus
    from tools.train_demo import RowStream, mtp_passes

    hf, data, ours = load_hf(src), Prompts(src), load_model(src)
    hf.eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    params = [p for n, p in ours.named_parameters() if n.startswith("mtp.")]
    for n_, p in ours.named_parameters():
        p.requires_grad_(n_.startswith("mtp."))
    ours.train()
    cfg, icfg = ours.config, data.icfg
    text = RowStream(build_corpus(), data.tok, 128, seed + 1)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    t0, losses, step, warm = time.time(), [], 0, 20
    while step < max_steps:
        frac = max(step / max_steps, (time.time() - t0) / (minutes * 60))
        if frac >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        exs = [data.example(rng.randrange(pics.HELDOUT_SEED), rng) for _ in range(batch)]
        b = collate(exs, data.tok.pad_token_id or 0, icfg.image_token_id)
        ids, labels = b["input_ids"], b["labels"]  # [B, T] each
        tids, tw = text.batch(text_rows)  # [R, 128] each
        with torch.no_grad():
            post = hf.model(input_ids=ids, pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                            mm_token_type_ids=b["mm_token_type_ids"]).last_hidden_state  # [B, T, H]
            feats = torch.cat(list(hf.model.get_image_features(b["pixel_values"], b["image_grid_thw"]).pooler_output))
            greedy = hf.lm_head(post).argmax(-1)  # [B, T]
            tpost = hf.model(input_ids=tids).last_hidden_state  # [R, 128, H]
            tgreedy = hf.lm_head(tpost).argmax(-1)  # [R, 128]
        emb = ours.model.embed_tokens(ids).detach().clone()  # [B, T, H]
        emb[ids == icfg.image_token_id] = feats
        rows = []
        for r in range(ids.shape[0]):
            pos, _ = images.mrope_positions(ids[r].tolist(), [exs[r]["grid"]], icfg)  # [3, T]
            rows.append(images.mrope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, icfg.mrope_section, emb.dtype))
        cos, sin = torch.stack([c for c, _ in rows]), torch.stack([s_ for _, s_ in rows])  # [B, T, R] each
        h = ours.mtp(emb[:, 1:], post[:, :-1], None, None, (cos[:, :-1], sin[:, :-1]))  # [B, T-1, H]
        keep = labels[:, 1:] != -100  # [B, T-1]: row i drafts token i+2 after completion token i+1
        loss = F.cross_entropy(ours.logits(h[keep]), greedy[:, 1:][keep])
        for m, hm in enumerate(mtp_passes(ours, tids, tpost, len(TEXT_DEPTH_WEIGHTS))):  # [R, n, H] each
            n = hm.shape[1]  # pass m, row i: drafts token i+2+m, the trunk's greedy token at i+1+m
            tkeep = tw[:, 2 + m:2 + m + n] > 0  # [R, n]
            loss = loss + TEXT_DEPTH_WEIGHTS[m] * F.cross_entropy(ours.logits(hm[tkeep]),
                                                                  tgreedy[:, 1 + m:1 + m + n][tkeep])
        _apply(opt, loss, params, losses, f"mtp step {step + 1}", f"{time.time() - t0:.0f}s")
        step += 1
    sd = load_file(str(src / "model.safetensors"))
    new = {n_: p.detach().contiguous().clone() for n_, p in ours.named_parameters() if n_.startswith("mtp.")}
    if not set(new) <= set(sd):
        raise SystemExit(f"MTP tensors the checkpoint lacks: {sorted(set(new) - set(sd))[:4]}")
    sd.update(new)
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, out / f.name)
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    return losses


def soft_bound(model, data: Prompts, steps: int, n: int = 8, tokens: int = 16, lr: float = 0.03) -> dict:
    """What any vision tower could reach with the language model frozen: free image embeddings (`tokens` per
    picture, one set per example, no tower at all) optimised by Adam to make the frozen model say n fixed answers;
    returns the last loss and the share of examples whose answer teacher-forced greedy gets exactly right."""
    for p in model.parameters():
        p.requires_grad_(False)
    img = data.icfg.image_token_id
    rng = random.Random(0)
    rows = []
    for i in range(n):
        answer = pics.picture(i).answer
        prompt = images.expand_image_pads(data.prompt(pics.QUESTIONS[0], True, None), [tokens], img)
        comp = data.completion(answer, None)
        rows.append({"ids": prompt + comp, "labels": [-100] * len(prompt) + comp,
                     "rows": torch.zeros(1, 1), "grid": (1, 4, tokens)})  # no pixels: the embeddings are free
    b = collate(rows, data.tok.pad_token_id or 0, img)
    ids, labels = b["input_ids"], b["labels"]
    mask = ids == img  # [n, L]
    pos, _ = model.model.get_rope_index(ids, image_grid_thw=b["image_grid_thw"], mm_token_type_ids=b["mm_token_type_ids"])
    soft = torch.nn.Parameter(0.05 * torch.randn(int(mask.sum()), model.config.text_config.hidden_size,
                                                 generator=torch.Generator().manual_seed(rng.randrange(2 ** 31))))
    opt = torch.optim.Adam([soft], lr=lr)
    emb_layer = model.get_input_embeddings()
    for step in range(steps):
        out = model(inputs_embeds=emb_layer(ids).masked_scatter(mask[..., None], soft), position_ids=pos,
                    labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        if (step + 1) % 25 == 0 or step + 1 == steps:
            pred, want = out.logits[:, :-1].argmax(-1), labels[:, 1:]  # [n, L-1] each
            exact = ((pred == want) | (want == -100)).all(-1).float().mean().item()
            print(f"soft-bound step {step + 1} loss {out.loss.item():.3f} teacher-forced exact {exact:.2f}",
                  flush=True)
    return {"steps": steps, "loss": round(out.loss.item(), 3), "exact": exact}


def text_cost(before: Path, after: Path, max_new: int = 96, k: int = 3) -> dict:
    """What changed text weights cost, through the engine: greedy answers to tools/train_demo.py's EVAL_PROMPTS
    (even ones thinking off, odd ones the default) identical before/after, and MTP tokens per round at K=k."""
    from engine.loader import load_model
    from engine.spec import generate_spec
    from tools.train_demo import EVAL_PROMPTS

    answers, rounds = [], []
    for d in (before, after):
        model, tok = load_model(d), Tokenizer.from_dir(d)
        outs, tpr = [], []
        for i, msgs in enumerate(EVAL_PROMPTS):
            ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                     enable_thinking=False if i % 2 == 0 else None))
            out, tel = generate_spec(model, ids, max_new, k=k, eos_ids=tok.eos_token_ids)
            outs.append(out)
            tpr.append(tel.tokens_per_round)
        answers.append(outs)
        rounds.append(round(sum(tpr) / len(tpr), 3))
    same = sum(a == b for a, b in zip(*answers))
    return {"identical_answers": f"{same}/{len(EVAL_PROMPTS)}", "tokens_per_round_before_after": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(ROOT / "models" / "demo"), help="the demo checkpoint (text or VL layout)")
    ap.add_argument("--out", help="where to write the VL demo (may be --src)")
    ap.add_argument("--eval-only", help="evaluate this VL checkpoint and exit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=22.0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--n-eval", type=int, default=240)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--aux", type=float, default=0.0, help="weight of the attribute probe loss on the tower")
    ap.add_argument("--text-cost", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="compare two demo checkpoints' text answers and MTP tokens/round, and exit")
    ap.add_argument("--soft-bound", type=int, default=0, metavar="STEPS",
                    help="measure the frozen-LM upper bound (free image embeddings, no tower) for STEPS and exit")
    ap.add_argument("--engine-eval", metavar="DIR",
                    help="held-out accuracy and MTP tokens/round on image prompts through our engine (K=3), and exit")
    ap.add_argument("--mtp-only", metavar="SRC",
                    help="refit SRC's MTP head to its trunk for --mtp-minutes, write the result to --out, and exit")
    ap.add_argument("--mtp-minutes", type=float, default=8.0)
    ap.add_argument("--mtp-lr", type=float, default=1e-3)
    ap.add_argument("--mtp-text-rows", type=int, default=4, help="demo-corpus rows of 128 tokens per refit step")
    ap.add_argument("--distill", action="store_true",
                    help="with --unfreeze-lm: the text loss is the KL from the starting text model, not the corpus")
    ap.add_argument("--unfreeze-lm", type=float, default=0.0, metavar="LR",
                    help="also train the language model at this learning rate (changes text weights)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.eval_only:
        d = Path(args.eval_only)
        print(json.dumps(evaluate(load_hf(d), Prompts(d), args.n_eval)))
        return
    if args.engine_eval:
        print(json.dumps(engine_eval(Path(args.engine_eval), args.n_eval)))
        return
    if args.mtp_only:
        if not args.out:
            ap.error("--mtp-only needs --out")
        torch.manual_seed(args.seed)
        losses = mtp_refit(Path(args.mtp_only), Path(args.out), seed=args.seed, minutes=args.mtp_minutes,
                           max_steps=args.max_steps, batch=args.batch, lr=args.mtp_lr, text_rows=args.mtp_text_rows)
        tail = losses[-25:]
        print(json.dumps({"mtp_steps": len(losses), "final_loss": round(sum(tail) / max(1, len(tail)), 4)}))
        return
    if args.text_cost:
        print(json.dumps(text_cost(Path(args.text_cost[0]), Path(args.text_cost[1]))))
        return
    if args.soft_bound:
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(Path(args.src), Path(tmp), text_tensors(Path(args.src)), None, VISION_CONFIG)
            print(json.dumps(soft_bound(load_hf(Path(tmp)), Prompts(Path(tmp)), args.soft_bound)))
        return
    if not args.out:
        ap.error("--out is required unless --eval-only")
    src, out = Path(args.src), Path(args.out)
    text_sd = text_tensors(src)
    before = tensor_hashes(text_sd)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_checkpoint(src, work, text_sd, None, VISION_CONFIG)  # transformers initialises the tower
        model = load_hf(work)
        data = Prompts(work)
        t0 = time.time()
        losses = train(model, data, seed=args.seed, minutes=args.minutes, max_steps=args.max_steps,
                       batch=args.batch, lr=args.lr, lm_lr=args.unfreeze_lm, aux=args.aux, distill=args.distill)
        train_s = time.time() - t0
        visual = {k: v for k, v in model.model.visual.state_dict().items()}
        if args.unfreeze_lm > 0:
            trained = model.state_dict()
            text_sd = {k: trained[vl_name(k)].detach().clone() if vl_name(k) in trained else v  # mtp.*: as before
                       for k, v in text_sd.items()}
        staged = work / "out"
        write_checkpoint(src, staged, text_sd, visual, VISION_CONFIG)
        after = tensor_hashes(text_tensors(staged))
        changed = sorted(k for k in before if before[k] != after.get(k))
        for k in sorted(before):
            print(f"sha256 {k} {before[k][:16]} -> {after.get(k, 'MISSING')[:16]}")
        if args.unfreeze_lm > 0:
            print(f"language model trained: {len(changed)} of {len(before)} text tensors changed")
        elif changed or set(before) != set(after):
            raise SystemExit(f"text tensors changed: {changed or sorted(set(before) ^ set(after))}")
        else:
            print(f"text tensors bit-identical: {len(before)} of {len(before)}")
        result = evaluate(load_hf(staged), Prompts(staged), args.n_eval)
        print(json.dumps({"steps": len(losses), "train_s": round(train_s), "final_loss":
                          round(sum(losses[-25:]) / max(1, len(losses[-25:])), 4), **result}))
        if out.resolve() == src.resolve():
            for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
                shutil.copy(staged / name, out / name)
        else:
            shutil.copytree(staged, out, dirs_exist_ok=True)


if __name__ == "__main__":
    main()
