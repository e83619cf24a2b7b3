"""Qwen3.5 text-model configuration, parsed from an HF `config.json` (nested `text_config` or flat)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class ConfigError(ValueError):
    """A config.json that cannot describe a supported Qwen3.5 model; the message names the field."""


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """Map a dtype name ("bfloat16", "float32", ...) to a torch dtype; None passes through."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r} (want one of {sorted(_DTYPES)})") from None


@dataclass(frozen=True)
class Qwen35Config:
    """Everything the text decoder + MTP head need. Field names follow HF's `text_config`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense MLP width
    num_experts: int = 0  # > 0 -> MoE
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def replace(self, **kw: Any) -> "Qwen35Config":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: str | torch.dtype | None = None) -> "Qwen35Config":
        """Parse an HF config dict. Raises ConfigError naming the bad or missing field."""
        top_type = raw.get("model_type")
        if top_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {top_type!r}; nextn serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        tc = raw.get("text_config")
        if tc is None:
            tc = raw
        elif not isinstance(tc, dict):
            raise ConfigError("config field 'text_config' must be an object")
        text_type = tc.get("model_type", top_type)
        if text_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported text_config.model_type {text_type!r}")
        is_moe = "moe" in top_type or "moe" in text_type

        def req(name: str, kind: type = int) -> Any:
            if name not in tc:
                raise ConfigError(f"config is missing required field {name!r}")
            val = tc[name]
            if kind is int and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                raise ConfigError(f"config field {name!r} must be a positive integer, got {val!r}")
            return val

        def opt(name: str, default: Any) -> Any:
            val = tc.get(name, raw.get(name, default))
            return default if val is None else val

        L = req("num_hidden_layers")
        layer_types = tc.get("layer_types")
        if layer_types is None:
            interval = opt("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
        if len(layer_types) != L or any(t not in ("full_attention", "linear_attention") for t in layer_types):
            raise ConfigError(f"config field 'layer_types' must list {L} entries of full_attention/linear_attention")
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", opt("rope_theta", 10_000_000.0)))
        partial = float(rope.get("partial_rotary_factor", opt("partial_rotary_factor", 0.25)))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"config field 'rope_parameters.rope_type' {rope.get('rope_type')!r} is not supported")
        hidden = req("hidden_size")
        nh = req("num_attention_heads")
        nkv = req("num_key_value_heads")
        if nh % nkv:
            raise ConfigError(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
        nk = req("linear_num_key_heads")
        nv = req("linear_num_value_heads")
        if nv % nk:
            raise ConfigError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
        eos = tc.get("eos_token_id", raw.get("eos_token_id"))
        eos_t = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
        want = parse_dtype(dtype) or parse_dtype(tc.get("dtype") or tc.get("torch_dtype") or raw.get("dtype")
                                                  or raw.get("torch_dtype") or "float32")
        kw: dict[str, Any] = dict(
            model_type=text_type, vocab_size=req("vocab_size"), hidden_size=hidden, num_hidden_layers=L,
            layer_types=tuple(layer_types), num_attention_heads=nh, num_key_value_heads=nkv,
            head_dim=int(opt("head_dim", hidden // nh)), linear_num_key_heads=nk,
            linear_key_head_dim=req("linear_key_head_dim"), linear_num_value_heads=nv,
            linear_value_head_dim=req("linear_value_head_dim"),
            linear_conv_kernel_dim=int(opt("linear_conv_kernel_dim", 4)), rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta, partial_rotary_factor=partial,
            max_position_embeddings=int(opt("max_position_embeddings", 262144)), tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=int(opt("mtp_num_hidden_layers", opt("num_nextn_predict_layers", 0))),
            eos_token_id=eos_t, dtype=want,
        )
        if is_moe:
            kw.update(num_experts=req("num_experts"), num_experts_per_tok=req("num_experts_per_tok"),
                      moe_intermediate_size=req("moe_intermediate_size"),
                      shared_expert_intermediate_size=int(opt("shared_expert_intermediate_size", 0)))
        else:
            kw.update(intermediate_size=req("intermediate_size"))
        if kw["mtp_num_hidden_layers"] > 1:
            raise ConfigError("mtp_num_hidden_layers > 1 is not supported (official Qwen3.5 checkpoints use 1)")
        return cls(**kw)
