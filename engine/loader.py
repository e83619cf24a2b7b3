"""HF checkpoint directory -> `Qwen35ForCausalLM`.

Accepts config.json with model_type qwen3_5 / qwen3_5_text / qwen3_5_moe / qwen3_5_moe_text (text_config nested or
flat), a single model.safetensors or a sharded model.safetensors.index.json, both key layouts
(`model.language_model.*` with `model.visual.*` skipped, and `model.*`), `mtp.*`, tied or untied embeddings,
fused or per-expert MoE tensors. Tensors go from safetensors straight to the target device, one at a time.

Quantization: an unquantized checkpoint, or Qwen's block-128 FP8 (`quantization_config` quant_method "fp8", fmt
e4m3, weight_block_size [128, 128], activation_scheme dynamic; engine/model/ops/matmul_fp8.py has the format). Which
tensors are FP8 is read from the checkpoint itself: a float8_e4m3fn weight with its `<name>_scale_inv` beside it;
the modules `modules_to_not_convert` names are stored unquantized and load as any other. Where the kernel path runs
(CUDA with triton), the weights of linear layers and MoE experts stay FP8 with their block scales (W8A16: the matmul
dequantizes tiles); anywhere else (CPU, CUDA without triton) and for the other tensors they are dequantized at load
to the model dtype (w = q * scale per block in fp32, then cast). Any other quantization_config is refused by name
(`quantization`), from `load_config` on, so `nextn serve` stops at startup with one line.
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
from .model.moe import Experts, Router
from .model.ops import dispatch as ops
from .model.ops import matmul_fp8 as fp8
from .model.qwen35 import Qwen35ForCausalLM
from .model.vision import VisionTower, VisionWeightsError
from .images import ImageConfig

log = logging.getLogger("nextn.loader")

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SCALE = "_scale_inv"  # `<weight name>_scale_inv`: an FP8 weight's block scales
_FP8_SERVED = "Qwen's block FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128], activation_scheme " \
              "'dynamic')"


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded; the message names the file or tensor at fault."""


def _raw_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found (is {model_dir} an HF checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def quantization(raw: dict) -> bool:
    """Whether the config.json dict `raw` declares Qwen's block-128 FP8 (True) or no quantization (False). Any other
    `quantization_config` (top level or in text_config) raises CheckpointError, one line naming it: another
    quant_method (awq, gptq, bitsandbytes, compressed-tensors, ...), or fp8 in another form (fmt, block size,
    per-tensor scales, a static activation scheme)."""
    tc = raw.get("text_config")
    qc = raw.get("quantization_config") or (tc.get("quantization_config") if isinstance(tc, dict) else None)
    if not qc:
        return False
    if not isinstance(qc, dict):
        raise CheckpointError(f"config field 'quantization_config' must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise CheckpointError(f"unsupported quantization_config: quant_method {qc.get('quant_method')!r}; nextn serves "
                              f"unquantized checkpoints and {_FP8_SERVED}")
    bad = [f"{k} {qc.get(k)!r}" for k, ok in (
        ("fmt", str(qc.get("fmt", "e4m3")).lower() == "e4m3"),
        ("weight_block_size", list(qc.get("weight_block_size") or []) == [fp8.BLOCK, fp8.BLOCK]),
        ("activation_scheme", str(qc.get("activation_scheme", "dynamic")).lower() == "dynamic"),
        ("scale_fmt", qc.get("scale_fmt", "float") in ("float", "ue8m0")),  # ue8m0: powers of two, stored as floats
    ) if not ok]
    if bad:
        raise CheckpointError(f"unsupported quantization_config: quant_method 'fp8' with {', '.join(bad)}; nextn "
                              f"serves unquantized checkpoints and {_FP8_SERVED}")
    return True


def load_config(model_dir: str | Path, dtype: str | torch.dtype | None = None) -> Qwen35Config:
    """Parse `model_dir/config.json` into a Qwen35Config (dtype override wins over the config's). Raises
    CheckpointError for a quantization nextn does not serve (`quantization`)."""
    raw = _raw_config(model_dir)
    quantization(raw)
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
               progress: bool = False, language_model_only: bool = False) -> Qwen35ForCausalLM:
    """Load an HF Qwen3.5 checkpoint dir onto `device` in `dtype` (default: the config's), in eval mode.

    The vision tower (`model.visual.*`) comes too, as `model.vision` (a VisionTower on `device` in the model's
    dtype) with `model.image_config` (engine/images.py ImageConfig); both None for a checkpoint without one (no
    vision_config, or a text-only export: a vision_config but no model.visual.* tensors) or with
    language_model_only (vLLM's --language-model-only: the tower is not read, its memory is saved).

    Raises ConfigError (bad/unsupported config) or CheckpointError (missing file, missing tensor by name,
    shape mismatch with name, want and got; a vision tower that cannot be loaded, naming --language-model-only).
    """
    model_dir = Path(model_dir)
    raw = _raw_config(model_dir)
    is_fp8 = quantization(raw)
    cfg = Qwen35Config.from_dict(raw, dtype=dtype)
    files = _weight_files(model_dir)
    # Where each canonical tensor lives (FP8 block scales apart, by the name of their weight).
    where: dict[str, tuple[Path, str]] = {}
    scale_at: dict[str, tuple[Path, str]] = {}
    experts: dict[str, dict[int, dict[str, tuple[Path, str]]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = _canonical(key)
                if name is None:
                    continue
                if name.endswith(_SCALE):
                    scale_at[name[: -len(_SCALE)]] = (f, key)
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

    if scale_at and not is_fp8:
        raise CheckpointError(f"checkpoint has FP8 block scales (e.g. {next(iter(scale_at))}{_SCALE}) but config.json "
                              "has no quantization_config")
    keep_fp8 = is_fp8 and ops.use_triton(torch.empty(0, device=device))  # the kernel path runs the W8A16 matmul

    def scale_of(name: str) -> torch.Tensor | None:
        return read(*scale_at[name]) if name in scale_at else None

    names = list(params)
    it = names
    if progress:
        from tqdm import tqdm

        it = tqdm(names, desc=f"loading {model_dir.name}", unit="tensor")
    used: set[str] = set()
    n_fp8 = 0
    for name in it:
        want = tuple(params[name].shape)
        if name in where:
            t, scale, srows = _weight(name, read(*where[name]), scale_of(name))
            used.add(name)
        else:
            got = _fused_expert(name, experts, read, scale_of, used)
            if got is None:
                raise CheckpointError(f"checkpoint is missing tensor {name!r}")
            t, scale, srows = got
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, want {want}")
        if scale is None:
            _assign(model, name, t.to(device=device, dtype=cfg.dtype))
            continue
        n_fp8 += 1
        scale = scale.to(device=device, dtype=torch.float32)
        srows = None if srows is None else srows.to(device)
        if keep_fp8 and _takes_fp8(model, name):
            fp8.mark(_assign(model, name, t.to(device)), scale, srows)
        else:
            _assign(model, name, fp8.dequantize(t.to(device), scale, srows, cfg.dtype))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        used.add("lm_head.weight")
    if is_fp8:
        log.info("FP8 checkpoint: %d block-128 weights %s", n_fp8,
                 "served as W8A16 (the Triton matmul dequantizes tiles)" if keep_fp8 else
                 f"dequantized to {str(cfg.dtype).removeprefix('torch.')} at load")
    unused = sorted(set(where) - used)
    if unused:
        log.warning("ignored %d checkpoint tensors not used by the text model (e.g. %s)", len(unused), unused[:3])
    model.eval()
    model.requires_grad_(False)
    model.fuse()
    if language_model_only:
        log.info("%s: language model only: the vision tower is not loaded", model_dir)
    else:
        model.attach_vision(*_vision(model_dir, cfg.dtype, device))
    return model


def _vision(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[VisionTower | None,
                                                                                      ImageConfig | None]:
    """The checkpoint's vision tower and image config (None, None without a tower). CheckpointError when it has
    one that cannot be served: a broken vision checkpoint is refused, never served as text silently."""
    try:
        tower = VisionTower.from_checkpoint(model_dir, dtype=dtype, device=device)
        icfg = ImageConfig.from_checkpoint(model_dir) if tower is not None else None
    except (ConfigError, VisionWeightsError, OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: the vision tower cannot be loaded: {e} (to serve the text model alone, "
                              "use --language-model-only)") from e
    if tower is not None:
        tower.requires_grad_(False)
    return tower, icfg


Loaded = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # (tensor, FP8 scale or None, scale rows)


def _weight(name: str, t: torch.Tensor, scale: torch.Tensor | None) -> Loaded:
    """A checkpoint tensor and its block scales, checked: an FP8 weight has scales of the block shape, nothing else
    has scales, and every tensor is floating point."""
    if t.dtype == fp8.FP8:
        if scale is None:
            raise CheckpointError(f"tensor {name!r} is float8_e4m3fn but has no {name}{_SCALE}")
        if tuple(scale.shape) != fp8.scale_shape(t.shape):
            raise CheckpointError(f"tensor {name}{_SCALE} has shape {tuple(scale.shape)}, want "
                                  f"{fp8.scale_shape(t.shape)} (128 x 128 blocks of {tuple(t.shape)})")
        return t, scale, None
    if scale is not None:
        raise CheckpointError(f"tensor {name!r} has block scales ({name}{_SCALE}) but is {t.dtype}, not float8_e4m3fn")
    if not t.is_floating_point():
        raise CheckpointError(f"tensor {name!r} is {t.dtype}: a quantized format nextn does not load "
                              f"(it serves unquantized checkpoints and {_FP8_SERVED})")
    return t, None, None


def _float(t: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor:
    """A loaded tensor in fp32 (an FP8 one dequantized)."""
    return t.float() if scale is None else fp8.dequantize(t, scale, rows, torch.float32)


def _cat_rows(parts: list[Loaded]) -> Loaded:
    """Weights [N_i, K] stacked by rows: FP8 pieces keep their own block scales (`matmul_fp8.fuse`); a mix of FP8 and
    unquantized pieces is dequantized to fp32 first."""
    if len(parts) == 1:
        return parts[0]
    if all(s is None for _, s, _ in parts):
        return torch.cat([t for t, _, _ in parts]), None, None
    if all(s is not None for _, s, _ in parts):
        w, _ = fp8.fuse([fp8.mark(t, s.float(), r) for t, s, r in parts])
        return (w, *fp8.scales(w))
    return torch.cat([_float(*p) for p in parts]), None, None


def _fused_expert(name: str, experts: dict, read, scale_of, used: set[str]) -> Loaded | None:
    """Build a fused `...experts.gate_up_proj` [E, 2Im, H] / `...experts.down_proj` [E, H, Im] from per-expert keys
    (FP8 experts: their scales [E, NB, KB] and the gate|up scale row map as `_cat_rows` builds it)."""
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
        keys = [f"{prefix}.{e}.{p}.weight" for p in parts]
        rows.append(_cat_rows([_weight(k, read(*per[e][p]), scale_of(k)) for k, p in zip(keys, parts)]))
    used.add(name)
    if all(s is None for _, s, _ in rows):
        return torch.stack([t for t, _, _ in rows]), None, None
    r0 = rows[0][2]
    same_map = all(r is None if r0 is None else r is not None and torch.equal(r, r0) for _, _, r in rows)
    if same_map and all(s is not None for _, s, _ in rows):
        return torch.stack([t for t, _, _ in rows]), torch.stack([s for _, s, _ in rows]), r0
    return torch.stack([_float(*p) for p in rows]), None, None


def _takes_fp8(model: nn.Module, name: str) -> bool:
    """Whether the parameter `name` may stay FP8 on the kernel path: the weight of a linear layer, the MoE router or
    the fused experts (each reaches the matmul through ops.linear / ops.grouped_linear); embeddings and the GDN
    conv do not."""
    mod = model.get_submodule(name.rpartition(".")[0])
    return isinstance(mod, (nn.Linear, Router, Experts))


def _assign(model: nn.Module, name: str, t: torch.Tensor) -> nn.Parameter:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    p = nn.Parameter(t, requires_grad=False)
    setattr(mod, leaf, p)
    return p
