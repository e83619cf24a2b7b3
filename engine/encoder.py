"""Image embeddings for the engine: the vision tower run one image at a time, through a bounded LRU cache keyed by
the image's content hash, with the engine's image counters (`engine.images.VisionStats`). An encode can run in
slices across engine steps (`ImageEncoder.advance`: a few vision blocks at a time), bitwise the one-shot encode.

An image is always encoded alone (`encode_image`), so its embedding rows never depend on what else is encoded, on
the batch or on whether it came from the cache: a prompt's bits are the same for a hit and a miss."""
from __future__ import annotations

import collections
import time

import torch

from .images import ImageConfig, ImageInput, VisionStats, input_rows
from .model.vision import VisionState, VisionTower

__all__ = ["EncoderCache", "ImageEncoder", "encode_image", "image_patches"]


def image_patches(inp: ImageInput) -> int:
    """Patches the tower runs for one image (t * h * w of its grid): the unit of the scheduler's encoder budget."""
    t, h, w = inp.grid_thw
    return int(t) * int(h) * int(w)


def _check_rows(emb: torch.Tensor, inp: ImageInput, dtype: torch.dtype) -> torch.Tensor:
    """`emb` in `dtype`; ValueError when its rows are not the image's pad count."""
    if emb.shape[0] != inp.n_tokens:
        raise ValueError(f"image encoded to {emb.shape[0]} rows, its prompt has {inp.n_tokens} pads")
    return emb.to(dtype)


@torch.inference_mode()
def encode_image(tower: VisionTower, cfg: ImageConfig, inp: ImageInput, dtype: torch.dtype) -> torch.Tensor:
    """One image's embeddings [n_tokens, out_hidden] in `dtype` on the tower's device: row j is the embedding of
    the image's j-th `<|image_pad|>`. The image is encoded alone."""
    emb = tower.encode(input_rows(inp, cfg), [inp.grid_thw])  # [n_tokens, H]
    return _check_rows(emb, inp, dtype)


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
    `cache_bytes`, cumulative `VisionStats` (images encoded, cache hits, seconds encoding), and the partial
    encodes of images encoded in slices (`advance`)."""

    def __init__(self, tower: VisionTower, cfg: ImageConfig, dtype: torch.dtype, cache_bytes: int):
        self.tower, self.cfg, self.dtype = tower, cfg, dtype
        self.cache = EncoderCache(cache_bytes)
        self.stats = VisionStats()
        self._pending: dict[str, VisionState] = {}  # partial encodes by image hash

    def cached(self, inp: ImageInput) -> torch.Tensor | None:
        """The image's embedding from the cache (counted as a hit), or None."""
        emb = self.cache.get(inp.hash)
        if emb is not None and emb.shape[0] == inp.n_tokens:
            self.stats.encoder_cache_hits += 1
            return emb
        return None

    def encode(self, inp: ImageInput) -> torch.Tensor:
        """Encode the image now, whole (`advance` without a bound), count it and its time, and cache it."""
        emb, _ = self.advance(inp, None)
        assert emb is not None
        return emb

    def pending(self) -> int:
        """Images whose encode has started and not finished."""
        return len(self._pending)

    def keep_pending(self, keys: set[str]) -> None:
        """Drop the partial encodes of images not in `keys` (their sessions left: finished, failed or cancelled)."""
        for k in [k for k in self._pending if k not in keys]:
            del self._pending[k]

    @torch.inference_mode()
    def advance(self, inp: ImageInput, budget: int | None) -> tuple[torch.Tensor | None, int]:
        """One slice of the image's encode: start it (`VisionTower.begin`) unless it is pending, run as many vision
        blocks as `budget` patch-blocks (patches x blocks) allow, at least one (None: all), and when no block is
        left the merger. Returns (the embedding [n_tokens, out_hidden] in the engine dtype, cached and counted as
        an image encoded, or None while blocks are left; the patch-blocks spent). The slices' seconds count as
        encoder time. An image that fails to encode raises, its partial encode dropped."""
        t0 = time.perf_counter()
        try:
            state = self._pending.pop(inp.hash, None)
            if state is None:
                state = self.tower.begin(input_rows(inp, self.cfg), [inp.grid_thw])
            n = self.tower.config.depth if budget is None else max(1, budget // max(1, state.patches))
            ran = self.tower.run_blocks(state, n)
            if state.block < self.tower.config.depth:
                self._pending[inp.hash] = state
                emb = None
            else:
                emb = _check_rows(self.tower.finish(state), inp, self.dtype)
            if state.x.device.type == "cuda":
                torch.cuda.synchronize(state.x.device)
        finally:
            self.stats.encoder_seconds += time.perf_counter() - t0
        if emb is not None:
            self.stats.images_encoded += 1
            self.cache.put(inp.hash, emb)
        return emb, ran * state.patches
