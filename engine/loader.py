"""HF checkpoint directory -> `Qwen35ForCausalLM`.

Accepts config.json with model_type qwen3_5 / qwen3_5_text / qwen3_5_moe / qwen3_5_moe_text (text_config nested or
flat), a single model.safetensors or a sharded model.safetensors.index.json, both key layouts
(`model.language_model.*` with `model.visual.*` skipped, and `model.*`), `mtp.*`, tied or untied embeddings,
fused or per-expert MoE tensors. Tensors go from safetensors straight to the target device, one at a time.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .model.config import ConfigError, Qwen35Config
from .model.qwen35 import Qwen35ForCausalLM

log = logging.getLogger("nextn.loader")

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded; the message names the file or tensor at fault."""


def load_config(model_dir: str | Path, dtype: str | torch.dtype | None = None) -> Qwen35Config:
    """Parse `model_dir/config.json` into a Qwen35Config (dtype override wins over the config's)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found (is {model_dir} an HF checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return Qwen35Config.from_dict(raw, dtype=dtype)


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {index.name} is missing")
        return files
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _canonical(key: str) -> str | None:
    """Checkpoint key -> our parameter name, or None for tensors a text model does not use."""
    if key.startswith("model.visual.") or key.startswith("visual."):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("language_model.model."):
        return "model." + key[len("language_model.model."):]
    if key.startswith("language_model.lm_head."):
        return key[len("language_model."):]
    return key


def load_model(model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               progress: bool = False) -> Qwen35ForCausalLM:
    """Load an HF Qwen3.5 checkpoint dir onto `device` in `dtype` (default: the config's), in eval mode.

    Raises ConfigError (bad/unsupported config) or CheckpointError (missing file, missing tensor by name,
    shape mismatch with name, want and got).
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir, dtype)
    files = _weight_files(model_dir)
    # Where each canonical tensor lives.
    where: dict[str, tuple[Path, str]] = {}
    experts: dict[str, dict[int, dict[str, tuple[Path, str]]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = _canonical(key)
                if name is None:
                    continue
                m = _EXPERT.match(name)
                if m:
                    experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = (f, key)
                else:
                    where[name] = (f, key)
    has_mtp_weights = any(n.startswith("mtp.") for n in where) or any(p.startswith("mtp.") for p in experts)
    if cfg.has_mtp and not has_mtp_weights:
        log.warning("config declares an MTP head but the checkpoint has no mtp.* tensors: speculation disabled")
        cfg = cfg.replace(mtp_num_hidden_layers=0)
    with torch.device("meta"):
        model = Qwen35ForCausalLM(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    handles: dict[Path, object] = {}

    def read(f: Path, key: str) -> torch.Tensor:
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt", device=str(device))
        return handles[f].get_tensor(key)  # type: ignore[attr-defined]

    names = list(params)
    it = names
    if progress:
        from tqdm import tqdm

        it = tqdm(names, desc=f"loading {model_dir.name}", unit="tensor")
    used: set[str] = set()
    for name in it:
        want = tuple(params[name].shape)
        if name in where:
            t = read(*where[name])
            used.add(name)
        else:
            t = _fused_expert(name, experts, read, used)
            if t is None:
                raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, want {want}")
        _assign(model, name, t.to(device=device, dtype=cfg.dtype))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        used.add("lm_head.weight")
    unused = sorted(set(where) - used)
    if unused:
        log.warning("ignored %d checkpoint tensors not used by the text model (e.g. %s)", len(unused), unused[:3])
    model.eval()
    model.requires_grad_(False)
    model.fuse()
    return model


def _fused_expert(name: str, experts: dict, read, used: set[str]) -> torch.Tensor | None:
    """Build a fused `...experts.gate_up_proj` [E, 2Im, H] / `...experts.down_proj` [E, H, Im] from per-expert keys."""
    prefix, _, leaf = name.rpartition(".")
    if prefix not in experts or leaf not in ("gate_up_proj", "down_proj"):
        return None
    per = experts[prefix]
    ids = sorted(per)
    if ids != list(range(len(ids))):
        raise CheckpointError(f"per-expert tensors under {prefix!r} are not numbered 0..E-1")
    rows = []
    for e in ids:
        parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        for p in parts:
            if p not in per[e]:
                raise CheckpointError(f"checkpoint is missing tensor '{prefix}.{e}.{p}.weight'")
        rows.append(torch.cat([read(*per[e][p]) for p in parts], dim=0))
    used.add(name)
    return torch.stack(rows)


def _assign(model: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, leaf, nn.Parameter(t, requires_grad=False))
