"""engine/model/vision.py and engine/images.py against transformers' Qwen3.5 on tiny random VL checkpoints:
pixel rows (the PIL backend of the Qwen2-VL image processor), image embeddings (`get_image_features`), M-RoPE
positions (`get_rope_index`) and cos/sin (Qwen3_5TextRotaryEmbedding), plus the loader's None for text-only."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import tests.hf_oracle  # noqa: F401  (blocks fla before transformers is imported)
from engine import images
from engine.model.config import ConfigError
from engine.model.qwen35 import rope_cos_sin
from engine.model.vision import VisionTower, VisionWeightsError, split_sizes
from tests.tiny import make_checkpoint
from tests.vl_util import IDS, make_vl_checkpoint, shard

MIN_PX, MAX_PX = 32 * 32 * 4, 160 * 160  # small limits keep the tiny models' images small


def _noise(h: int, w: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if bands == 1 else a, mode)


def _palette_with_transparency() -> Image.Image:
    im = _noise(70, 90, seed=3).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    im.info["transparency"] = 5
    return im


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """kind ("dense" / "moe") -> (checkpoint dir, transformers' Qwen3_5(Moe)ForConditionalGeneration, our tower,
    our ImageConfig), each built once per module."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    built = {}

    def get(kind: str):
        if kind not in built:
            d = make_vl_checkpoint(tmp_path_factory.mktemp(kind), moe=kind == "moe", seed=2 * (kind == "moe"),
                                   min_pixels=MIN_PX,
                                   max_pixels=MAX_PX)
            hf, info = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                                   output_loading_info=True)
            assert not [k for k in info["missing_keys"] if "visual" in k], info["missing_keys"]
            built[kind] = d, hf.eval(), VisionTower.from_checkpoint(d), images.ImageConfig.from_checkpoint(d)
        return built[kind]

    return get


@pytest.fixture(scope="module", params=["dense", "moe"])
def vl(request, load):
    return load(request.param)


@pytest.fixture(scope="module")
def dense(load):
    """For what does not depend on the text model (preprocessing, positions, loading)."""
    return load("dense")


@pytest.fixture(scope="module")
def hf_processor(dense):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(dense[0]), backend="pil")


# (a) preprocessing ---------------------------------------------------------------------------------------------

PICTURES = {
    "resize_down": lambda: _noise(300, 500),  # over max_pixels
    "odd_aspect": lambda: _noise(37, 300, seed=1),  # rounds both sides, aspect 8
    "tiny_min_pixels": lambda: _noise(9, 13, seed=2),  # under min_pixels: scaled up
    "exact_grid": lambda: _noise(64, 96, seed=4),  # already multiples of 32
    "rgba": lambda: _noise(50, 70, "RGBA", seed=5),  # composited on white
    "gray": lambda: _noise(80, 41, "L", seed=6),
    "palette_transparency": _palette_with_transparency,
}


@pytest.mark.parametrize("name", sorted(PICTURES))
def test_pixel_rows_equal_transformers(dense, hf_processor, name):
    d, hf, tower, cfg = dense
    assert type(hf_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision here: the PIL backend
    im = PICTURES[name]()
    ref = hf_processor(images=[im], return_tensors="pt")
    ours = images.preprocess(im, cfg)
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.n_tokens == ref["image_grid_thw"][0].prod().item() // 4
    assert ours.pixel_rows.dtype == torch.float32
    assert torch.equal(ours.pixel_rows, ref["pixel_values"]), name
    inp = images.prepare_input(im, cfg)  # the engine's transport: the resized picture, rows made engine-side
    assert (inp.grid_thw, inp.n_tokens, inp.hash) == (ours.grid_thw, ours.n_tokens, ours.hash)
    assert inp.rgb.dtype == np.uint8 and torch.equal(images.input_rows(inp, cfg), ours.pixel_rows), name


def test_pixel_overrides_and_qwen35_defaults(dense, hf_processor):
    d, hf, tower, cfg = dense
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    im = _noise(120, 200, seed=7)
    ref = hf_processor(images=[im], size={"shortest_edge": 64 * 64, "longest_edge": 96 * 96}, return_tensors="pt")
    ours = images.preprocess(im, cfg, min_pixels=64 * 64, max_pixels=96 * 96)
    assert torch.equal(ours.pixel_rows, ref["pixel_values"]) and ours.grid_thw == (1, 4, 6)
    # Qwen3.5's published limits (256^2 .. 4096^2): a 120x200 picture is scaled up to >= 65536 pixels
    q35 = images.ImageConfig()
    real = Qwen2VLImageProcessorPil(size={"shortest_edge": q35.min_pixels, "longest_edge": q35.max_pixels},
                                    patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ref = real(images=[im], return_tensors="pt")
    ours = images.preprocess(im, q35)
    assert torch.equal(ours.pixel_rows, ref["pixel_values"])
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert images.smart_resize(1024, 1024) == (1024, 1024) and images.image_tokens((1, 64, 64)) == 1024
    with pytest.raises(images.ImageError, match="aspect ratio"):
        images.preprocess(_noise(2, 500), cfg)
    with pytest.raises(images.ImageError, match="min_pixels"):
        cfg.with_pixels(min_pixels=10_000, max_pixels=5_000)


def test_image_hash_is_of_the_pixels(dense):
    d, hf, tower, cfg = dense
    im = _noise(100, 120, seed=8)
    png, bmp = io.BytesIO(), io.BytesIO()
    im.save(png, "PNG")
    im.save(bmp, "BMP")
    a, b = (images.preprocess(Image.open(io.BytesIO(f.getvalue())), cfg) for f in (png, bmp))
    assert a.hash == b.hash == images.preprocess(im, cfg).hash  # same pixels, other file format
    other = _noise(100, 120, seed=9)  # same size, other pixels
    assert images.preprocess(other, cfg).hash != a.hash
    assert images.preprocess(im, cfg, max_pixels=64 * 64).hash != a.hash  # other resize, other rows
    assert images.image_hash(im) != images.image_hash(im.convert("L"))
    p = im.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    q = p.copy()
    q.putpalette([255 - v for v in p.getpalette()])  # same indices, other colours
    assert images.image_hash(p) != images.image_hash(q)


# (b) embeddings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pictures", [("odd_aspect",), ("resize_down", "tiny_min_pixels")])
def test_embeddings_equal_transformers(vl, pictures):
    d, hf, tower, cfg = vl
    prepared = [images.preprocess(PICTURES[p](), cfg) for p in pictures]
    rows = torch.cat([p.pixel_rows for p in prepared])
    grid = torch.tensor([p.grid_thw for p in prepared])
    with torch.no_grad():
        ref = hf.get_image_features(rows, grid).pooler_output  # tuple, one tensor per image
    out = tower.encode(rows, grid)
    sizes = split_sizes(grid)
    assert out.shape == (sum(p.n_tokens for p in prepared), hf.config.text_config.hidden_size)
    assert sizes == [p.n_tokens for p in prepared] == [r.shape[0] for r in ref]
    diff = (out - torch.cat(ref)).abs().max().item()
    assert diff < 2e-5, diff  # measured ~2e-6 on values of magnitude ~2 (the patch embed is a linear, not a Conv3d)
    for one, part in zip(prepared, out.split(sizes)):  # per image: encoding alone gives the same rows
        torch.testing.assert_close(tower.encode(one.pixel_rows, [one.grid_thw]), part, rtol=0, atol=1e-5)


def test_encode_checks_its_input(dense):
    d, hf, tower, cfg = dense
    p = images.preprocess(PICTURES["exact_grid"](), cfg)
    with pytest.raises(ValueError, match="do not match"):
        tower.encode(p.pixel_rows[:-1], [p.grid_thw])
    assert tower.encode(p.pixel_rows.double(), [p.grid_thw]).dtype == torch.float32


# (c) positions -------------------------------------------------------------------------------------------------

def _prompt(n_images: int) -> list[int]:
    vs, ve, pad = IDS["vision_start_token_id"], IDS["vision_end_token_id"], IDS["image_token_id"]
    ids = [5, 6, 7]
    for k in range(n_images):
        ids += [vs, pad, ve] + list(range(10, 14 + 3 * k))
    return ids


@pytest.mark.parametrize("pictures", [("odd_aspect",), ("resize_down", "gray"), ()])
def test_positions_equal_get_rope_index(dense, pictures):
    d, hf, tower, cfg = dense
    prepared = [images.preprocess(PICTURES[p](), cfg) for p in pictures]
    ids = images.expand_image_pads(_prompt(len(pictures)), [p.n_tokens for p in prepared], cfg.image_token_id)
    assert ids.count(cfg.image_token_id) == sum(p.n_tokens for p in prepared)
    grids = [p.grid_thw for p in prepared]
    pos, delta = images.mrope_positions(ids, grids, cfg)
    t = torch.tensor([ids])
    ref_pos, ref_delta = hf.model.get_rope_index(t, (t == cfg.image_token_id).int(),
                                                 image_grid_thw=torch.tensor(grids) if grids else None)
    assert torch.equal(pos, ref_pos[:, 0]) and delta == ref_delta.item()
    if not pictures:
        assert delta == 0 and torch.equal(pos, torch.arange(len(ids)).expand(3, -1))
    # each image advances positions by max(h, w)/2 over h*w/4 tokens
    assert delta == sum(max(h, w) // 2 - h * w // 4 for _, h, w in grids)
    # decode continues all three rows at cache length + delta
    assert torch.equal(images.decode_positions(len(ids), 2, delta)[:, 0], (pos.max() + 1).expand(3))


def test_pad_expansion_and_position_errors():
    cfg = images.ImageConfig(image_token_id=IDS["image_token_id"])
    pad = cfg.image_token_id
    assert images.expand_image_pads([1, pad, 2, pad], [2, 3], pad) == [1, pad, pad, 2, pad, pad, pad]
    with pytest.raises(ValueError, match="2 image pad tokens for 1 images"):
        images.expand_image_pads([pad, pad], [4], pad)
    with pytest.raises(ValueError, match="consecutive image pads"):
        images.mrope_positions([1, pad, pad, 2], [(1, 4, 4)], cfg)  # a 4 x 4 patch grid needs 4 pads
    with pytest.raises(ValueError, match="1 image pad runs for 2 images"):
        images.mrope_positions([1, pad, pad, 2], [(1, 2, 4), (1, 2, 4)], cfg)
    pos, delta = images.mrope_positions([1, pad, pad, 2], [(1, 2, 4)], cfg)  # merged grid 1 x 2
    assert pos.tolist() == [[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]] and delta == 0


# (d) M-RoPE cos/sin --------------------------------------------------------------------------------------------

ROTARY, THETA = 64, 10_000_000.0  # Qwen3.5: head_dim 256, partial_rotary_factor 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_equal_rows_is_bitwise_the_1d_rope(dtype):
    p = torch.cat([torch.arange(0, 300), torch.randint(0, 262_144, (200,), generator=torch.Generator().manual_seed(0))])
    c1, s1 = rope_cos_sin(p, ROTARY, THETA, dtype)
    c3, s3 = images.mrope_cos_sin(p.expand(3, -1), ROTARY, THETA, (11, 11, 10), dtype)
    assert torch.equal(c1, c3) and torch.equal(s1, s3)
    c1b, s1b = rope_cos_sin(p.view(2, -1), ROTARY, THETA, dtype)  # batched [B, T]
    c3b, s3b = images.mrope_cos_sin(p.view(2, -1).expand(3, -1, -1), ROTARY, THETA, (11, 11, 10), dtype)
    assert torch.equal(c1b, c3b) and torch.equal(s1b, s3b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_equals_transformers_rotary(dtype):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    tc = Qwen3_5TextConfig(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True})
    rot = Qwen3_5TextRotaryEmbedding(tc)
    cfg = images.ImageConfig(image_token_id=IDS["image_token_id"])
    pad = cfg.image_token_id
    ids = images.expand_image_pads([1, 2, pad, 3, pad, 4, 5], [15 * 9, 4 * 30], pad)
    pos, _ = images.mrope_positions(ids, [(1, 30, 18), (1, 8, 60)], cfg)
    pos = pos + 1000  # a later turn: large positions too
    assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[1], pos[2])
    ref_c, ref_s = rot(torch.zeros(1, dtype=dtype), pos[:, None, :])  # [1, n, 64]
    c, s = images.mrope_cos_sin(pos, ROTARY, THETA, cfg.mrope_section, dtype)
    assert torch.equal(c, ref_c[0]) and torch.equal(s, ref_s[0])
    row = images.mrope_rows(ROTARY, (11, 11, 10))[:32]
    assert row.tolist().count(1) == 11 and row.tolist().count(2) == 10 and row[:6].tolist() == [0, 1, 2, 0, 1, 2]


# (e) loading ---------------------------------------------------------------------------------------------------

def test_no_vision_tower_gives_none(tmp_path):
    text_only = make_checkpoint(tmp_path / "text", with_tokenizer=False)
    assert VisionTower.from_checkpoint(text_only) is None
    assert images.ImageConfig.from_checkpoint(text_only) is None
    stripped = make_vl_checkpoint(tmp_path / "stripped", vision=False)  # vision_config but no model.visual.*
    assert VisionTower.from_checkpoint(stripped) is None
    assert images.ImageConfig.from_checkpoint(stripped).image_token_id == IDS["image_token_id"]
    dummy = make_checkpoint(tmp_path / "dummy", layout="vlm", with_tokenizer=False,
                            vision_stub=True)  # vision_config {"depth": 1}
    with pytest.raises(ConfigError, match="hidden_size"):
        VisionTower.from_checkpoint(dummy)


def test_sharded_and_dtype(dense, tmp_path):
    d, hf, tower, cfg = dense
    sharded = shard(make_vl_checkpoint(tmp_path / "sharded"))
    t2 = VisionTower.from_checkpoint(sharded)
    ref = dict(tower.state_dict())
    assert all(torch.equal(v, ref[k]) for k, v in t2.state_dict().items()) and len(ref) == len(t2.state_dict())
    from safetensors.torch import load_file, save_file
    old_names = make_vl_checkpoint(tmp_path / "old_names")  # Qwen2-VL-era keys: visual.* without model.
    sd = load_file(str(old_names / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in sd.items()}, str(old_names / "model.safetensors"))
    t3 = VisionTower.from_checkpoint(old_names)
    assert all(torch.equal(v, ref[k]) for k, v in t3.state_dict().items())
    bf = VisionTower.from_checkpoint(d, dtype=torch.bfloat16)
    p = images.preprocess(PICTURES["exact_grid"](), cfg)
    out, out_bf = tower.encode(p.pixel_rows, [p.grid_thw]), bf.encode(p.pixel_rows, [p.grid_thw])
    assert out_bf.dtype == torch.bfloat16 and (out_bf.float() - out).abs().max() < 0.1 * out.abs().max()
    broken = make_vl_checkpoint(tmp_path / "broken")
    raw = json.loads((broken / "config.json").read_text())
    raw["vision_config"]["depth"] = 3
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(VisionWeightsError, match="blocks.2"):
        VisionTower.from_checkpoint(broken)
    raw["vision_config"].update(depth=2, deepstack_visual_indexes=[0])
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="deepstack"):
        VisionTower.from_checkpoint(broken)
