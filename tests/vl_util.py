"""Tiny random Qwen3.5 vision-language checkpoints (`Qwen3_5ForConditionalGeneration` layout) for tests.

The text model, its MTP head and the vision tower are our own classes with random weights, written under HF's
names (`model.language_model.*`, `mtp.*`, `model.visual.*`) beside a nested config.json and a
preprocessor_config.json in Qwen3.5's form, so transformers and nextn load the same files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.model.vision import VisionConfig, VisionTower
from tests.tiny import make_checkpoint

# In-vocab stand-ins for Qwen3.5's 248053/248054/248056/248057 (the tiny vocab has 384 rows).
IDS = {"vision_start_token_id": 378, "vision_end_token_id": 379, "image_token_id": 380, "video_token_id": 381}
HIDDEN = 64  # tests/tiny.py's text hidden size


def vision_config(**kw) -> dict:
    """A tiny `vision_config` (HF field names): depth 2, hidden 32, 2 heads, patch 16, temporal patch 2, merge 2,
    a 48 x 48 position table as in Qwen3.5, out_hidden = the text hidden size."""
    vc = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
          "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "out_hidden_size": HIDDEN, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
          "initializer_range": 0.02}
    vc.update(kw)
    return vc


def preprocessor_config(min_pixels: int = 256 * 256, max_pixels: int = 4096 * 4096) -> dict:
    """Qwen3.5's preprocessor_config.json (pixel limits overridable)."""
    return {"size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}


def random_tower(vc: dict, seed: int = 0) -> VisionTower:
    """Our vision tower with random weights of a useful spread (LayerNorm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    tower = VisionTower(VisionConfig.from_dict(vc))
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "pos_embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    return tower.eval()


def make_vl_checkpoint(out_dir: str | Path, *, moe: bool = False, seed: int = 0, vision: bool = True,
                       min_pixels: int = 256 * 256, max_pixels: int = 4096 * 4096, vision_kw: dict | None = None,
                       **text_kw) -> Path:
    """Write a tiny VL checkpoint dir (dense or MoE): config.json (nested text_config with mrope_section, vision
    ids from IDS), model.safetensors with text + MTP + (vision=True) `model.visual.*` weights, and
    preprocessor_config.json. vision=False keeps the vision_config but drops the tensors (a text-only export);
    vision_kw overrides vision_config fields (e.g. the 0.8B shape: depth 12, hidden_size 768, num_heads 12,
    intermediate_size 3072)."""
    out = make_checkpoint(out_dir, seed=seed, moe=moe, layout="vlm", with_tokenizer=False, per_expert=moe,
                          **text_kw)
    raw = json.loads((out / "config.json").read_text())
    raw["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    vc = vision_config(out_hidden_size=raw["text_config"]["hidden_size"], **(vision_kw or {}))
    raw.update(vision_config=vc, **IDS)
    sd = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if not k.startswith("model.visual.")}
    if vision:
        sd.update({"model.visual." + k: v.contiguous() for k, v in random_tower(vc, seed + 1).state_dict().items()})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(min_pixels, max_pixels), indent=2))
    return out


def shard(model_dir: str | Path) -> Path:
    """Rewrite model_dir's model.safetensors as two shards + model.safetensors.index.json, the vision tensors split
    across both."""
    model_dir = Path(model_dir)
    sd = load_file(str(model_dir / "model.safetensors"))
    keys = sorted(sd)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for fname in sorted(set(weight_map.values())):
        save_file({k: sd[k] for k in keys if weight_map[k] == fname}, str(model_dir / fname), metadata={"format": "pt"})
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir
