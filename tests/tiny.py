"""Tiny random Qwen3.5 checkpoints for tests, written in HF layout by our own model class (no downloads)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import Qwen35Config
from engine.model.qwen35 import Qwen35ForCausalLM

TOKENIZER_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    '{"name": "Bob", "age": 42, "tags": ["a", "b"]}',
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and caf\u00e9, na\u00efve, \u4e2d\u6587, \U0001F600.",
    "def add(a, b):\n    return a + b\n",
] * 4


def hf_config(*, vocab_size: int = 384, hidden_size: int = 64, num_hidden_layers: int = 4, moe: bool = False,
              num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
              linear_num_key_heads: int = 2, linear_num_value_heads: int = 4, linear_key_head_dim: int = 16,
              linear_value_head_dim: int = 16, tie: bool = False, mtp: bool = True,
              layer_types: list[str] | None = None, eos: list[int] | None = None,
              max_position_embeddings: int = 4096, dtype: str = "float32", intermediate_size: int = 128,
              num_experts: int = 8, moe_intermediate_size: int = 32, shared_expert_intermediate_size: int = 48) -> dict:
    """An HF-style flat `qwen3_5_text` / `qwen3_5_moe_text` config dict."""
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
        "linear_num_key_heads": linear_num_key_heads, "linear_num_value_heads": linear_num_value_heads,
        "linear_key_head_dim": linear_key_head_dim, "linear_value_head_dim": linear_value_head_dim,
        "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "layer_types": layer_types or [("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                       for i in range(num_hidden_layers)],
        "attention_bias": False, "dtype": dtype,
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "eos_token_id": eos if eos is not None else [vocab_size - 1],
    }
    if moe:
        cfg.update(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=moe_intermediate_size,
                   shared_expert_intermediate_size=shared_expert_intermediate_size, router_aux_loss_coef=0.001,
                   output_router_logits=False)
    else:
        cfg["intermediate_size"] = intermediate_size
    return cfg


def random_model(cfg: Qwen35Config, seed: int = 0) -> Qwen35ForCausalLM:
    """Our model with random weights scaled so logits are well spread (few near-ties)."""
    g = torch.Generator().manual_seed(seed)
    model = Qwen35ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(fan_in)))
    return model.to(cfg.dtype).eval()


def make_checkpoint(out_dir: str | Path, *, seed: int = 0, moe: bool = False, tie: bool = False, mtp: bool = True,
                    layout: str = "causal", sharded: bool = False, per_expert: bool = False,
                    with_tokenizer: bool = True, vision_stub: bool = False, **cfg_kw) -> Path:
    """Write a random tiny checkpoint dir: config.json, model.safetensors (or 2 shards + index), optional
    tokenizer files. layout "causal" -> `model.*` keys; "vlm" -> nested text_config, `model.language_model.*`
    keys and a placeholder vision_config without vision tensors (a text-only export: it loads text only);
    vision_stub=True adds a dummy `model.visual.*` tensor (a vision tower that cannot load). per_expert -> MoE
    experts as `experts.{e}.{gate,up,down}_proj`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = None
    if with_tokenizer:
        from tools.make_tokenizer import build_tokenizer

        build_tokenizer(TOKENIZER_TEXTS, vocab_size=300, out_dir=out)
        tj = json.loads((out / "generation_config.json").read_text())
        eos = tj["eos_token_id"] if isinstance(tj["eos_token_id"], list) else [tj["eos_token_id"]]
    raw = hf_config(moe=moe, tie=tie, mtp=mtp, eos=eos, **cfg_kw)
    cfg = Qwen35Config.from_dict(raw)
    model = random_model(cfg, seed)
    sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight")
    if per_expert:
        for key in [k for k in sd if k.endswith("experts.gate_up_proj")]:
            gu = sd.pop(key)
            base = key[: -len("gate_up_proj")]
            im = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = gu[e, :im].clone()
                sd[f"{base}{e}.up_proj.weight"] = gu[e, im:].clone()
            down = sd.pop(base + "down_proj")
            for e in range(down.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = down[e].clone()
    if layout == "vlm":
        sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
        if vision_stub:
            sd["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
        text = dict(raw)
        text.pop("architectures")
        raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
               "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text,
               "vision_config": {"depth": 1}, "tie_word_embeddings": tie}
    if sharded:
        keys = sorted(sd)
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        weight_map = {}
        for fname, ks in shards.items():
            save_file({k: sd[k] for k in ks}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in ks})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
