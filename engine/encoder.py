"""Image embeddings for the engine: the vision tower run one image at a time, through a bounded LRU cache keyed by
the image's content hash, with the engine's image counters (`engine.images.VisionStats`).

An image is always encoded alone (`encode_image`), so its embedding rows never depend on what else is encoded, on
the batch or on whether it came from the cache: a prompt's bits are the same for a hit and a miss."""
from __future__ import annotations

import collections
import time

import torch

from .images import ImageConfig, ImageInput, VisionStats, input_rows
from .model.vision import VisionTower

__all__ = ["EncoderCache", "ImageEncoder", "encode_image", "image_patches"]


def image_patches(inp: ImageInput) -> int:
    """Patches the tower runs for one image (t * h * w of its grid): the unit of the scheduler's encoder budget."""
    t, h, w = inp.grid_thw
    return int(t) * int(h) * int(w)


@torch.inference_mode()
def encode_image(tower: VisionTower, cfg: ImageConfig, inp: ImageInput, dtype: torch.dtype) -> torch.Tensor:
    """One image's embeddings [n_tokens, out_hidden] in `dtype` on the tower's device: row j is the embedding of
    the image's j-th `<|image_pad|>`. The image is encoded alone."""
    emb = tower.encode(input_rows(inp, cfg), [inp.grid_thw])  # [n_tokens, H]
    if emb.shape[0] != inp.n_tokens:
        raise ValueError(f"image encoded to {emb.shape[0]} rows, its prompt has {inp.n_tokens} pads")
    return emb.to(dtype)


class EncoderCache:
    """Image embeddings by `ImageInput.hash`, least recently used evicted first, at most `capacity_bytes` held
    (an embedding larger than the whole budget is not kept; 0 keeps nothing)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = max(0, int(capacity_bytes))
        self.bytes = 0
        self._entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embedding (now the most recently used), or None."""
        emb = self._entries.get(key)
        if emb is not None:
            self._entries.move_to_end(key)
        return emb

    def put(self, key: str, emb: torch.Tensor) -> None:
        """Keep `emb` under `key`, evicting the least recently used entries until it fits."""
        size = emb.numel() * emb.element_size()
        if size > self.capacity_bytes or key in self._entries:
            return
        while self.bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = emb
        self.bytes += size


class ImageEncoder:
    """The scheduler's image encoding: the model's tower and image config, an `EncoderCache` of
    `cache_bytes`, and cumulative `VisionStats` (images encoded, cache hits, seconds encoding)."""

    def __init__(self, tower: VisionTower, cfg: ImageConfig, dtype: torch.dtype, cache_bytes: int):
        self.tower, self.cfg, self.dtype = tower, cfg, dtype
        self.cache = EncoderCache(cache_bytes)
        self.stats = VisionStats()

    def cached(self, inp: ImageInput) -> torch.Tensor | None:
        """The image's embedding from the cache (counted as a hit), or None."""
        emb = self.cache.get(inp.hash)
        if emb is not None and emb.shape[0] == inp.n_tokens:
            self.stats.encoder_cache_hits += 1
            return emb
        return None

    def encode(self, inp: ImageInput) -> torch.Tensor:
        """Encode the image now (`encode_image`), count it and its time, and cache it."""
        t0 = time.perf_counter()
        emb = encode_image(self.tower, self.cfg, inp, self.dtype)
        if emb.device.type == "cuda":
            torch.cuda.synchronize(emb.device)
        self.stats.encoder_seconds += time.perf_counter() - t0
        self.stats.images_encoded += 1
        self.cache.put(inp.hash, emb)
        return emb
