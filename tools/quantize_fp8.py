"""Write a checkpoint in Qwen's block-128 FP8 format from an unquantized one, and back (the dequantized reference).

The format, from its definition (Qwen's "-FP8" releases): each converted weight W [..., N, K] is stored as
float8_e4m3fn q with `<name>_scale_inv` [..., ceil(N/128), ceil(K/128)] beside it, one scale per 128 x 128 block
(edge blocks partial), and stands for q * scale in fp32; config.json gets `quantization_config` = {"quant_method":
"fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
[...]}. Here a block's scale is its largest |W| / 448 (e4m3's largest finite value; 1 for an all-zero block) and q
is W / scale rounded to nearest e4m3, so the block's largest element maps to +-448.

`quantize_checkpoint` converts every 2-D `*.weight` (and fused 3-D `experts.gate_up_proj` / `experts.down_proj`)
whose module `modules_to_not_convert` does not name; `dequantize_checkpoint` writes the ordinary checkpoint an FP8
one stands for (each block multiplied out on its own, a reference independent of the engine's loader). Tests build
tiny FP8 checkpoints with them; nothing in the serving path imports this file.

Script use::

    python tools/quantize_fp8.py SRC_DIR DST_DIR                 # unquantized -> FP8
    python tools/quantize_fp8.py --dequantize FP8_DIR DST_DIR    # FP8 -> the bf16 checkpoint it stands for
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
#: What Qwen's releases keep unquantized (reported for Qwen3.5 / Qwen3-Next; each release's config.json lists its
#: own): the embeddings and LM head, the GDN a / b projections and conv, the MoE router and shared-expert gate, and
#: the MTP head's input projection.
NOT_CONVERTED = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.conv1d",
                 "mlp.gate", "mlp.shared_expert_gate", "mtp.fc")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def quantize(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (q float8_e4m3fn [..., N, K], scale [..., ceil(N/128), ceil(K/128)] in scale_dtype): per
    128 x 128 block, scale = max|W| / 448 (1 for an all-zero block), q = W / scale rounded to nearest e4m3. A bf16
    scale is rounded before q is computed, so q * scale is what the stored scale gives."""
    *lead, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    pad = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    pad[..., :N, :K] = w.float()
    blocks = pad.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / scale.float()[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K].contiguous(), scale


def dequantize_block_by_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 tensor stands for, block by block from the format's definition: each 128 x 128 block of q
    (edge blocks partial) times its own scale, in fp32, cast to `dtype`."""
    out = torch.empty(q.shape, dtype=dtype)
    flat_q, flat_s = q.reshape(-1, *q.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
    flat_o = out.view(-1, *q.shape[-2:])
    for e in range(flat_q.shape[0]):
        for i in range(flat_s.shape[1]):
            for j in range(flat_s.shape[2]):
                rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
                flat_o[e, rows, cols] = (flat_q[e, rows, cols].float() * flat_s[e, i, j].float()).to(dtype)
    return out


def module_listed(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether a pattern names `module` (or a module above it) as whole dotted components: "mlp.gate" names
    `model.layers.0.mlp.gate`, not `model.layers.0.mlp.gate_proj`."""
    m = f".{module}."
    return any(f".{p.strip('.')}." in m for p in patterns)


def converted(name: str, t: torch.Tensor, not_convert: tuple[str, ...] | list[str]) -> bool:
    """Whether the tensor `name` is stored in FP8: a 2-D `*.weight` or a fused 3-D expert tensor, of a module
    `not_convert` does not name."""
    if name.endswith(".weight") and t.dim() == 2:
        module = name[: -len(".weight")]
    elif name.endswith(_FUSED_EXPERTS) and t.dim() == 3:
        module = name
    else:
        return False
    return t.is_floating_point() and not module_listed(module, not_convert)


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)


def quantize_checkpoint(src: str | Path, dst: str | Path, not_convert: tuple[str, ...] | list[str] = NOT_CONVERTED,
                        scale_dtype: torch.dtype = torch.float32) -> Path:
    """Write the FP8 block-128 form of the unquantized checkpoint `src` to `dst` (one model.safetensors; tokenizer
    and other side files copied; config.json with `quantization_config`). Returns dst."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    sd: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if converted(k, t, not_convert):
            sd[k], sd[k + SCALE_SUFFIX] = quantize(t, scale_dtype)
        else:
            sd[k] = t.contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {**QUANTIZATION_CONFIG, "modules_to_not_convert": list(not_convert)}
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the ordinary checkpoint the FP8 checkpoint `src` stands for: every FP8 tensor multiplied out block by
    block (`dequantize_block_by_block`) in `dtype`, the scales dropped, the rest unchanged, config.json without
    `quantization_config`. Returns dst."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tensors = _tensors(src)
    sd = {k: dequantize_block_by_block(t, tensors[k + SCALE_SUFFIX], dtype) if t.dtype == FP8 else t
          for k, t in tensors.items() if not k.endswith(SCALE_SUFFIX)}
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--dequantize", action="store_true", help="FP8 -> the unquantized checkpoint it stands for")
    ap.add_argument("--keep", nargs="*", default=list(NOT_CONVERTED), help="modules_to_not_convert")
    ap.add_argument("--scale-dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args()
    if a.dequantize:
        dequantize_checkpoint(a.src, a.dst)
    else:
        quantize_checkpoint(a.src, a.dst, a.keep, getattr(torch, a.scale_dtype))


if __name__ == "__main__":
    main()
