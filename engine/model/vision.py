"""The Qwen3.5 vision tower (`model.visual.*`): pixel rows of patches -> merged image embeddings for the text model.

Math (transformers 5.x `Qwen3_5VisionModel`, the same module in dense and MoE checkpoints):
- patch embedding: a Conv3d with kernel = stride = (T, P, P) = (2, 16, 16) over one patch row is a linear map of the
  flattened (C, T, P, P) row; it runs here as `F.linear` with the Conv3d weight viewed [D, C*T*P*P].
- a learned square position table (`pos_embed`, num_position_embeddings = 48 * 48 rows) resampled to each image's
  patch grid bilinearly with align_corners=True (4 taps per patch, weights in fp32), added to the patch embedding.
- 2-D axial rotary over the whole head: head_dim/4 frequencies (theta 10000) for the row and for the column,
  [h-freqs | w-freqs] repeated twice, NeoX rotate_half, applied in fp32.
- `depth` pre-LayerNorm blocks (eps 1e-6): bidirectional attention inside each image (frame) only, scale
  head_dim^-0.5; MLP fc1 -> gelu (tanh) -> fc2, both with bias.
- merger: LayerNorm over each patch, the 2 x 2 neighbouring patches concatenated (pixel rows arrive in that merge
  order, see engine/images.py), fc1 -> GELU (erf) -> fc2 to `out_hidden_size` (the text hidden size).
No deepstack. Parameter names are HF's under `model.visual.` so checkpoints load unchanged.

Integrator's contract: `VisionTower.from_checkpoint(dir, dtype, device)` (None without a tower), then
`tower.encode(pixel_rows, grid_thw)` -> one embedding row per image pad token, image after image
(`split_sizes(grid_thw)` splits it per image).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .config import ConfigError, parse_dtype

log = logging.getLogger("nextn.vision")

PREFIXES = ("model.visual.", "visual.")  # transformers 5.x checkpoints, then Qwen2-VL-era ones
_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's `approximate`


class VisionWeightsError(ValueError):
    """The checkpoint's `model.visual.*` tensors do not fit its vision_config; the message names the tensor."""


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape, from config.json's `vision_config` (HF field names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one pixel row: C * T * P * P (1536 for Qwen3.5)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per output token (spatial_merge_size ** 2)."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the learned square position table (48 for 2304 rows)."""
        return int(self.num_position_embeddings ** 0.5)

    @classmethod
    def from_dict(cls, vc: dict[str, Any], text_hidden: int | None = None) -> "VisionConfig":
        """Parse a `vision_config` dict; `text_hidden` is the default for out_hidden_size. Raises ConfigError."""
        def get(name: str, default: Any = None, *alts: str) -> Any:
            for n in (name, *alts):
                if vc.get(n) is not None:
                    return vc[n]
            if default is None:
                raise ConfigError(f"vision_config is missing required field {name!r}")
            return default

        def one(name: str, default: int) -> int:
            v = get(name, default)
            if isinstance(v, (list, tuple)):  # HF allows [p, p]; Qwen3.5 only square patches
                if len(set(v)) != 1:
                    raise ConfigError(f"vision_config field {name!r} {v!r}: only square patches are supported")
                v = v[0]
            return int(v)

        rope = vc.get("rope_parameters") or {}
        cfg = cls(depth=int(get("depth", None, "num_hidden_layers")), hidden_size=int(get("hidden_size")),
                  intermediate_size=int(get("intermediate_size")),
                  num_heads=int(get("num_heads", None, "num_attention_heads")),
                  out_hidden_size=int(get("out_hidden_size", text_hidden)), in_channels=int(get("in_channels", 3)),
                  patch_size=one("patch_size", 16), temporal_patch_size=one("temporal_patch_size", 2),
                  spatial_merge_size=int(get("spatial_merge_size", 2)),
                  num_position_embeddings=int(get("num_position_embeddings", 2304)),
                  hidden_act=str(get("hidden_act", "gelu_pytorch_tanh")),
                  rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", 10_000.0))))
        if cfg.hidden_act not in _ACTS:
            raise ConfigError(f"vision_config field 'hidden_act' {cfg.hidden_act!r} is not supported ({sorted(_ACTS)})")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ConfigError(f"vision head_dim (hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads}) must be a "
                              "multiple of 4")
        if cfg.grid_side ** 2 != cfg.num_position_embeddings:
            raise ConfigError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square")
        if vc.get("deepstack_visual_indexes"):
            raise ConfigError(f"vision_config deepstack_visual_indexes {vc['deepstack_visual_indexes']!r}: deepstack "
                              "(Qwen3-VL) is not supported; Qwen3.5 has none")
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision rope_type {rope.get('rope_type')!r} is not supported (axial only)")
        return cfg


def split_sizes(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge: int = 2) -> list[int]:
    """Embedding rows per image for `encode`'s output: t * h * w / merge**2 for each (t, h, w) of grid_thw."""
    return [int(t) * int(h) * int(w) // (merge * merge) for t, h, w in _grids(grid_thw)]


def _grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def patch_coords(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch in pixel-row order (per frame, 2x2 merge blocks row-major, then inside the block):
    [N, 2] int64, N = sum t*h*w."""
    out = []
    for t, h, w in _grids(grid_thw):
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)  # [h*w, 2]
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def _pos_taps(coords: torch.Tensor, grid_thw, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps into the side x side position table for each patch: indices [N, 4] int64
    and weights [N, 4] fp32, in transformers' order (h0w0, h0w1, h1w0, h1w1)."""
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in _grids(grid_thw)])  # [N, 2]
    src = coords.float() * (side - 1) / torch.clamp(sizes - 1, min=1)  # [N, 2] fp32
    floor = torch.floor(src)
    taps = (floor.long()[..., None] + torch.arange(2)).clamp(0, side - 1)  # [N, 2, 2]: axis, tap
    weights = (1 - (src[..., None] - floor[..., None] - torch.arange(2)).abs()).clamp(min=0)  # [N, 2, 2]
    idx = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    wts = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)
    return idx, wts


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        """x [N, D]; cos/sin [N, head_dim] fp32; seqlens: patches per attention segment (one per frame), sum N."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # each [N, heads, hd]
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None])[0].transpose(0, 1)  # [n, heads, hd]
                for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))]
        return self.proj(torch.cat(outs).reshape(N, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Conv3d(C, D, kernel = stride = (T, P, P)) on one patch row == a linear map of the flattened row."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel)  # holds weight [D, C, T, P, P]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(rows.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)  # [N, D]


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)  # [N / merge_unit, D * merge_unit]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class VisionState:
    """A resumable encode (`VisionTower.begin`): the hidden rows x [N, D] after `block` of the tower's blocks, the
    rotary tables cos, sin [N, head_dim] and the per-frame sequence lengths of the images."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    seqlens: list[int]
    block: int = 0

    @property
    def patches(self) -> int:
        """Patch rows of the encode (the tower's work per block)."""
        return int(self.x.shape[0])


class VisionTower(nn.Module):
    """Qwen3.5's ViT and patch merger; `state_dict()` keys are the checkpoint's without the `model.visual.` prefix."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def _rope(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Axial rotary tables for patch (row, col) coords [N, 2]: cos, sin [N, head_dim] fp32."""
        half = self.config.head_dim // 2  # inv_freq is computed on the CPU, as transformers does
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        freqs = coords.float()[..., None] * inv_freq.to(coords.device)  # [N, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # [N, head_dim / 2]: row freqs, then column freqs
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim]
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def encode(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Image embeddings for the text model: pixel_rows [N, C*T*P*P] (engine/images.py's rows of all images,
        image after image, any float dtype; cast to the tower's), grid_thw [n_images, 3] (t, h, w in patches; a
        tensor or lists) with N = sum t*h*w -> [sum t*h*w / merge**2, out_hidden_size] in the tower's dtype, on its
        device: row j of image i is the embedding of that image's j-th `<|image_pad|>` token. Images never attend
        to each other, so encoding images together or one at a time gives the same rows up to kernel rounding;
        `split_sizes(grid_thw)` splits the result per image. ValueError when rows and grid disagree. Runs under
        inference_mode; `forward` is the same map with autograd (training)."""
        return self(pixel_rows, grid_thw)

    def forward(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """`encode` without inference_mode: pixel_rows [N, C*T*P*P], grid_thw [n_images, 3] -> [N / 4, out_hidden]."""
        state = self.begin(pixel_rows, grid_thw)
        self.run_blocks(state, self.config.depth)
        return self.finish(state)

    def begin(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> "VisionState":
        """The first slice of a resumable encode: patch embedding, position embedding and rotary tables of
        pixel_rows [N, C*T*P*P] for grid_thw (as `encode`) -> a `VisionState` at block 0. `begin`, `run_blocks`
        until `done`, then `finish` run exactly `forward`'s ops in its order, so the result is bitwise `encode`'s.
        ValueError when rows and grid disagree. Call under inference_mode for inference."""
        cfg = self.config
        grids = _grids(grid_thw)
        n = sum(t * h * w for t, h, w in grids)
        if pixel_rows.dim() != 2 or pixel_rows.shape != (n, cfg.patch_dim):
            raise ValueError(f"pixel_rows {tuple(pixel_rows.shape)} do not match grid_thw {grids}: want ({n}, "
                             f"{cfg.patch_dim})")
        if any(h % cfg.spatial_merge_size or w % cfg.spatial_merge_size for _, h, w in grids):
            raise ValueError(f"grid_thw {grids}: h and w must be multiples of {cfg.spatial_merge_size}")
        dev = self.pos_embed.weight.device
        coords = patch_coords(grids, cfg.spatial_merge_size)  # [N, 2]
        idx, wts = _pos_taps(coords, grids, cfg.grid_side)
        cos, sin = self._rope(coords.to(dev))
        seqlens = [h * w for t, h, w in grids for _ in range(t)]
        x = self.patch_embed(pixel_rows.to(dev))  # [N, D]
        pos = (self.pos_embed(idx.to(dev)) * wts.to(dev)[:, :, None]).sum(1)  # [N, D] fp32
        x = x + pos.to(x.dtype)
        return VisionState(x, cos, sin, seqlens)

    def run_blocks(self, state: "VisionState", n: int) -> int:
        """Run the next min(n, blocks left) vision blocks on `state` (in place); returns how many ran."""
        k = max(0, min(int(n), self.config.depth - state.block))
        x = state.x
        for blk in self.blocks[state.block:state.block + k]:
            x = blk(x, state.cos, state.sin, state.seqlens)
        state.x, state.block = x, state.block + k
        return k

    def finish(self, state: "VisionState") -> torch.Tensor:
        """The patch merger on a state whose blocks all ran -> [N / merge_unit, out_hidden] (`encode`'s rows).
        ValueError when blocks are left."""
        if state.block != self.config.depth:
            raise ValueError(f"finish at block {state.block} of {self.config.depth}")
        return self.merger(state.x)  # [N / merge_unit, out_hidden]

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, dtype: str | torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "VisionTower | None":
        """The vision tower of an HF Qwen3.5 checkpoint dir (dense or MoE; model.safetensors or a sharded
        model.safetensors.index.json; keys `model.visual.*` or `visual.*`), in eval mode on `device`, in `dtype`
        (default: the config's `dtype`/`torch_dtype`, else float32). Returns None when config.json has no
        vision_config or the weights hold no vision tensors (a text-only checkpoint). Raises ConfigError for a
        vision_config it cannot serve and VisionWeightsError for missing, extra or misshapen tensors."""
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            return None
        where = _vision_keys(model_dir)
        if not where:
            log.info("%s: config has a vision_config but the weights hold no model.visual.* tensors: no vision tower",
                     model_dir)
            return None
        tc = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        cfg = VisionConfig.from_dict(vc, text_hidden=tc.get("hidden_size"))
        want = parse_dtype(dtype) or parse_dtype(vc.get("dtype") or tc.get("dtype") or tc.get("torch_dtype")
                                                  or raw.get("dtype") or raw.get("torch_dtype") or "float32")
        with torch.device("meta"):
            tower = cls(cfg)
        shapes = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
        missing, extra = sorted(set(shapes) - set(where)), sorted(set(where) - set(shapes))
        if missing or extra:
            raise VisionWeightsError(f"{model_dir}: vision tensors do not match vision_config (missing "
                                     f"{missing[:4]}, unexpected {extra[:4]})")
        sd = {}
        handles: dict[Path, Any] = {}
        for name, (f, key) in where.items():
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt", device=str(device))
            t = handles[f].get_tensor(key)
            if tuple(t.shape) != shapes[name]:
                raise VisionWeightsError(f"{model_dir}: tensor {key} has shape {tuple(t.shape)}, vision_config wants "
                                         f"{shapes[name]}")
            sd[name] = t.to(want)
        tower.load_state_dict(sd, assign=True)
        return tower.eval()


def _vision_keys(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Vision tower parameter name (prefix stripped) -> (safetensors file, checkpoint key), for the checkpoint's
    single file or its index's shards."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for k, f in weight_map.items() if k.startswith(PREFIXES)})
    else:
        files = [model_dir / "model.safetensors"] if (model_dir / "model.safetensors").is_file() else []
    out: dict[str, tuple[Path, str]] = {}
    for f in files:
        if not f.is_file():
            raise VisionWeightsError(f"shard {f.name} listed in {index.name} is missing")
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                for p in PREFIXES:
                    if key.startswith(p):
                        out[key[len(p):]] = (f, key)
    return out
