"""Decoded pictures -> the vision tower's pixel rows, the prompt's image pads and its 3-D M-RoPE positions.

No HTTP and no transformers: the server decodes bytes to a PIL image (server/media.py), then
  `cfg = ImageConfig.from_checkpoint(model_dir)`            (None: the checkpoint has no vision tower)
  `img = preprocess(pil_image, cfg, min_pixels, max_pixels)` -> PreparedImage(pixel_rows, grid_thw, n_tokens, hash)
  `ids = expand_image_pads(prompt_ids, [img.n_tokens ...], cfg.image_token_id)`
and the engine runs `VisionTower.encode(cat(pixel_rows), [grid_thw ...])` (engine/model/vision.py), places row j of
the embeddings at the j-th `<|image_pad|>` of the prompt, and takes its positions from
  `positions, delta = mrope_positions(ids, [grid_thw ...], cfg)`            positions [3, n] (T, H, W rows)
  `cos, sin = mrope_cos_sin(positions, rotary_dim, theta, cfg.mrope_section, dtype)`
Decode positions after the prompt are `cache_len + delta` on all three rows (`decode_positions`).

Preprocessing is transformers' Qwen2-VL image processor as Qwen3.5's preprocessor_config.json configures it (the
PIL backend's numerics): RGB (transparency composited on white), `smart_resize` to multiples of patch * merge = 32
within [min_pixels, max_pixels], Pillow bicubic, x * (1/255) in float64 then float32, (x - mean) / std in float32,
the frame repeated to temporal_patch_size = 2, patches flattened (C, T, P, P) in 2 x 2 merge-block order.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from .model.config import ConfigError
from .model.qwen35 import rope_cos_sin

log = logging.getLogger("nextn.images")

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses longer/shorter > 200


class ImageError(ValueError):
    """An image the model cannot take (aspect ratio, size limits); the message says why (a 400 for the server)."""


@dataclass(frozen=True)
class ImageConfig:
    """Image preprocessing (preprocessor_config.json) and the prompt's vision ids and M-RoPE layout (config.json).
    Defaults are Qwen3.5's published values."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256  # size.shortest_edge
    max_pixels: int = 4096 * 4096  # size.longest_edge
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = Image.Resampling.BICUBIC
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: patch_size * merge_size (32)."""
        return self.patch_size * self.merge_size

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> "ImageConfig":
        """This config with min/max pixels overridden (None keeps the checkpoint's); ImageError if min > max."""
        lo = self.min_pixels if min_pixels is None else int(min_pixels)
        hi = self.max_pixels if max_pixels is None else int(max_pixels)
        if lo <= 0 or hi <= 0 or lo > hi:
            raise ImageError(f"min_pixels {lo} and max_pixels {hi} must be positive with min_pixels <= max_pixels")
        return replace(self, min_pixels=lo, max_pixels=hi)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ImageConfig | None":
        """The checkpoint's image config, or None when config.json has no vision_config. Reads
        preprocessor_config.json (fields as transformers reads them: `size.shortest_edge/longest_edge` or the older
        `min_pixels/max_pixels`, patch_size, temporal_patch_size, merge_size, image_mean/std, rescale_factor,
        do_rescale/do_normalize/do_convert_rgb, resample); without that file, Qwen3.5's defaults with the patch
        sizes of vision_config (logged). Raises ConfigError when the two disagree or a field is unusable."""
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            return None
        tc = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        kw: dict[str, Any] = {
            "mrope_section": tuple(int(s) for s in rope.get("mrope_section", cls.mrope_section)),
            **{k: int(raw[k]) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in raw},
        }
        pp_path = model_dir / "preprocessor_config.json"
        pp = json.loads(pp_path.read_text()) if pp_path.is_file() else None
        if pp is None:
            log.warning("%s has no preprocessor_config.json: Qwen3.5's image preprocessing defaults are used",
                        model_dir)
            pp = {"patch_size": vc.get("patch_size", cls.patch_size), "merge_size": vc.get("spatial_merge_size", 2),
                  "temporal_patch_size": vc.get("temporal_patch_size", cls.temporal_patch_size)}
        size = pp.get("size") or {}
        for ours, theirs in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            val = pp.get(ours) if pp.get(ours) is not None else size.get(theirs)
            if val is not None:
                kw[ours] = int(val)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if pp.get(name) is not None:
                kw[name] = int(pp[name])
        for name in ("image_mean", "image_std"):
            if pp.get(name) is not None:
                v = pp[name]
                kw[name] = tuple(float(x) for x in (v if isinstance(v, list) else [v] * 3))
        for name in ("do_rescale", "do_normalize", "do_convert_rgb"):
            if pp.get(name) is not None:
                kw[name] = bool(pp[name])
        if pp.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(pp["rescale_factor"])
        if pp.get("do_resize") is False:
            raise ConfigError(f"{pp_path}: do_resize false is not supported (patches need sides that are multiples "
                              "of patch_size * merge_size)")
        cfg = cls(**kw)
        want = {"patch_size": vc.get("patch_size", cfg.patch_size), "merge_size": vc.get("spatial_merge_size", 2),
                "temporal_patch_size": vc.get("temporal_patch_size", cfg.temporal_patch_size)}
        bad = [f"{k} {getattr(cfg, k)} vs {v}" for k, v in want.items() if getattr(cfg, k) != v]
        if bad:
            raise ConfigError(f"{pp_path} disagrees with config.json's vision_config: {', '.join(bad)}")
        cfg.with_pixels()  # validates min/max
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise ConfigError(f"{pp_path}: image_mean/image_std need 3 values")
        return cfg


class PreparedImage(NamedTuple):
    """One image ready for the engine: pixel_rows [t*h*w, C*T*P*P] float32 (CPU), grid_thw (t, h, w) in patches,
    n_tokens = t*h*w / merge**2 image pads in the prompt (= embedding rows), hash = `image_hash` of the resized RGB
    pixels the tower sees (so two requests with different min/max pixels never share a key)."""

    pixel_rows: torch.Tensor
    grid_thw: tuple[int, int, int]
    n_tokens: int
    hash: str


class ImageInput(NamedTuple):
    """One prompt image as the server hands it to the engine: the resized RGB picture the tower sees (uint8
    [H, W, 3], sides multiples of the config's factor: ~3 MB for 1024 x 1024, where its fp32 pixel rows are ~25 MB),
    its grid (t, h, w) in patches, its n_tokens image pads and its `image_hash`. `input_rows` turns it into the
    tower's pixel rows, bitwise those `preprocess` gives for the same image and config."""

    rgb: np.ndarray
    grid_thw: tuple[int, int, int]
    n_tokens: int
    hash: str


@dataclass
class VisionStats:
    """The engine's image counters since start (cumulative): images encoded by the tower, images served from the
    encoder cache instead, and seconds spent encoding. `metrics/` turns them into Prometheus objects."""

    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_seconds: float = 0.0


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 256 * 256,
                 max_pixels: int = 4096 * 4096) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: (height, width) rounded to multiples of `factor` with the pixel count
    in [min_pixels, max_pixels] and the aspect ratio kept as well as that allows. ImageError for an aspect ratio
    over 200 or an empty side."""
    if height <= 0 or width <= 0:
        raise ImageError(f"image has an empty side ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is over "
                         f"{MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers converts: an image with transparency is composited on white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, cfg: ImageConfig) -> Image.Image:
    """The RGB picture the tower sees: `to_rgb`, then Pillow's resample (bicubic) to `smart_resize`'s size under
    cfg's factor and min/max pixels. ImageError for an aspect ratio over 200."""
    rgb = to_rgb(image) if cfg.do_convert_rgb else image
    h, w = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return rgb.resize((w, h), resample=cfg.resample)


def pixel_rows(image: Image.Image, cfg: ImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An already resized RGB image (sides multiples of cfg.factor) -> (pixel rows [h*w, C*T*P*P] float32, grid
    (1, h, w) in patches). Rows are in 2 x 2 merge-block order (block row, block col, row in block, col in block),
    each flattened (C, T, P, P) with the frame repeated T times."""
    P, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if image.mode != "RGB":
        raise ValueError(f"pixel_rows takes an RGB image, got mode {image.mode!r} (see `resize`)")
    if image.width % cfg.factor or image.height % cfg.factor:
        raise ValueError(f"image {image.width}x{image.height} is not resized to multiples of {cfg.factor}")
    x = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)
        std = np.array(cfg.image_std, dtype=np.float32)
        x = ((x.astype(np.float32).T - mean) / std).T
    x = x.astype(np.float32)
    C, H, W = x.shape
    gh, gw = H // P, W // P
    x = x.reshape(C, gh // m, m, P, gw // m, m, P).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, P, P))  # [.., C, T, P, P]
    return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, C * T * P * P)), (1, gh, gw)


def image_hash(image: Image.Image) -> str:
    """Content hash of decoded pixels: sha256 over mode, size, palette (if any) and raw bytes (hex). Equal for the
    same pixels whatever the file format or name; the key of the prefix cache's image blocks and of the encoder
    cache (`preprocess` hashes the resized RGB picture the tower sees)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    if image.mode in ("P", "PA"):
        h.update(bytes(image.getpalette() or []))
    h.update(image.tobytes())
    return h.hexdigest()


def preprocess(image: Image.Image, cfg: ImageConfig, min_pixels: int | None = None,
               max_pixels: int | None = None) -> PreparedImage:
    """A decoded PIL image (EXIF orientation already applied by the caller) -> PreparedImage, with min/max pixels
    overriding the checkpoint's (per request, `mm_processor_kwargs`). Equals transformers' image processor's
    pixel_values and image_grid_thw for the same image and config. ImageError for an image it cannot take."""
    c = cfg.with_pixels(min_pixels, max_pixels)
    resized = resize(image, c)
    rows, grid = pixel_rows(resized, c)
    return PreparedImage(rows, grid, image_tokens(grid, c.merge_size), image_hash(resized))


def prepare_input(image: Image.Image, cfg: ImageConfig, min_pixels: int | None = None,
                  max_pixels: int | None = None) -> ImageInput:
    """As `preprocess`, but stops at the resized RGB picture (the engine makes the rows: `input_rows`)."""
    c = cfg.with_pixels(min_pixels, max_pixels)
    resized = resize(image, c)
    if resized.mode != "RGB":
        raise ImageError(f"image mode {resized.mode} after conversion; expected RGB")
    gh, gw = resized.height // c.patch_size, resized.width // c.patch_size
    grid = (1, gh, gw)
    return ImageInput(np.asarray(resized, dtype=np.uint8), grid, image_tokens(grid, c.merge_size),
                      image_hash(resized))


def input_rows(inp: ImageInput, cfg: ImageConfig) -> torch.Tensor:
    """An `ImageInput`'s pixel rows [t*h*w, C*T*P*P] float32 (`pixel_rows` of its picture)."""
    rows, grid = pixel_rows(Image.fromarray(inp.rgb, "RGB"), cfg)
    if tuple(grid) != tuple(inp.grid_thw):
        raise ValueError(f"image grid {grid} disagrees with the input's {inp.grid_thw}")
    return rows


def image_tokens(grid_thw: Sequence[int], merge_size: int = 2) -> int:
    """Image pad tokens (= embedding rows) for one image's grid (t, h, w): t*h*w / merge_size**2."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def expand_image_pads(token_ids: Sequence[int], n_tokens: Sequence[int], image_token_id: int) -> list[int]:
    """The prompt with its k-th `<|image_pad|>` repeated n_tokens[k] times (the chat template renders one pad per
    image). ValueError when the prompt's pad count differs from len(n_tokens)."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(n_tokens):
        raise ValueError(f"prompt has {found} image pad tokens for {len(n_tokens)} images")
    out: list[int] = []
    k = 0
    for t in token_ids:
        if t == image_token_id:
            out.extend([image_token_id] * int(n_tokens[k]))
            k += 1
        else:
            out.append(t)
    return out


def mrope_positions(token_ids: Sequence[int], grids: Sequence[Sequence[int]],
                    cfg: ImageConfig) -> tuple[torch.Tensor, int]:
    """3-D M-RoPE positions of an expanded prompt (transformers' Qwen3.5 `get_rope_index`): positions [3, n] int64
    (T, H, W rows) and the rope delta (max position + 1 - n) that decode positions add to the cache length.
    Text advances all three rows together; the k-th run of t*h*w/merge**2 image pads (grids[k] = (t, h, w) in
    patches) takes T = cur + frame, H = cur + row, W = cur + col on the merged grid, then cur += max(h, w)/merge.
    Text-only prompts give arange(n) on every row and delta 0. ValueError when the pads do not match grids."""
    m = cfg.merge_size
    n = len(token_ids)
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    pos = torch.empty(3, n, dtype=torch.int64)
    cur, i, k = 0, 0, 0
    is_pad = (ids == cfg.image_token_id).tolist()
    while i < n:
        if not is_pad[i]:
            j = i
            while j < n and not is_pad[j]:
                j += 1
            pos[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        if k >= len(grids):
            raise ValueError(f"prompt has more image pad runs than the {len(grids)} images given")
        t, h, w = (int(v) for v in grids[k])
        gt, gh, gw = t, h // m, w // m
        span = gt * gh * gw
        if i + span > n or not all(is_pad[i:i + span]) or (i + span < n and is_pad[i + span]):
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) needs exactly {span} consecutive image pads at {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, i:i + span] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(gh, gw)
        i += span
        k += 1
    if k != len(grids):
        raise ValueError(f"prompt has {k} image pad runs for {len(grids)} images")
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions [3, count] of tokens at cache indices start.. of a request with rope delta `delta` (all rows equal:
    start + delta + i)."""
    return (torch.arange(start, start + count, dtype=torch.int64) + delta).expand(3, -1)


def mrope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, mrope_section: Sequence[int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved M-RoPE tables for 3-D positions [3, ..., T] (T, H, W rows): cos, sin [..., T, rotary_dim].
    Frequency j of the rotary_dim/2 comes from the H row when j % 3 == 1 and j < 3 * sections[1], from the W row
    when j % 3 == 2 and j < 3 * sections[2], else from the T row (transformers' Qwen3_5TextRotaryEmbedding).
    Built from `rope_cos_sin` per row, so when the three rows are equal the tables are bitwise the 1-D ones."""
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, dtype)  # [3, ..., T, R]
    row = mrope_rows(rotary_dim, mrope_section).to(positions.device)  # [R]: the row feeding each column
    return _select(cos, row), _select(sin, row)


def mrope_table_rows(table: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                     mrope_section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`mrope_cos_sin`'s tables gathered from a 1-D table instead (the engine's `rope_table`: cos, sin [L, R] by
    position, L > every position): positions [3, T] -> cos, sin [T, R]. Column c of token t is the table's row
    positions[row(c), t], so a token whose three rows are equal gets exactly the table's row, the bits a text
    token rotates with."""
    row = mrope_rows(table[0].shape[-1], mrope_section).to(positions.device)  # [R]
    return _select(table[0][positions], row), _select(table[1][positions], row)  # [T, R] each


def _select(tab: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """tab [3, ..., R] -> [..., R]: column c from tab[row[c]]."""
    out = tab[0]
    for r in (1, 2):
        out = torch.where(row == r, tab[r], out)
    return out


def mrope_rows(rotary_dim: int, mrope_section: Sequence[int]) -> torch.Tensor:
    """For each of the rotary_dim columns of a cos/sin table, the position row (0 T, 1 H, 2 W) that feeds it."""
    half = rotary_dim // 2
    j = torch.arange(half)
    row = torch.zeros(half, dtype=torch.int64)
    for r in (1, 2):
        row[(j % 3 == r) & (j < 3 * int(mrope_section[r]))] = r
    return torch.cat([row, row])
