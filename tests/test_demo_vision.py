"""tools/demo_pictures.py (the demo's vision training pictures) and the VL layout tools/train_demo_vision.py writes:
the text tensors keep their bytes under HF's VL names, our loader and transformers read it, min/max pixels hold."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.hf_oracle  # noqa: F401  (blocks fla before transformers is imported)
from engine import images
from engine.loader import load_model
from engine.model.vision import VisionConfig, VisionTower
from tools import demo_pictures as pics
from tools import train_demo_vision as tdv

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def test_pictures_are_deterministic_and_answered():
    a, b = pics.picture(7), pics.picture(7)
    assert a.image.tobytes() == b.image.tobytes() and a.answer == b.answer
    assert pics.picture(8).image.tobytes() != a.image.tobytes()
    seen = set()
    for seed in range(60):
        p = pics.picture(seed)
        fields = pics.answer_fields(p.answer)
        assert fields == (pics.COUNTS[p.count - 1], p.colour, p.shape), p.answer
        assert (p.count == 1) == (not p.answer.rstrip(".").endswith("s")), p.answer
        assert pics.MIN_SIDE <= p.image.width <= pics.MAX_SIDE and pics.MIN_SIDE <= p.image.height <= pics.MAX_SIDE
        # the shapes' colour is there: enough pixels near it
        px = np.asarray(p.image.convert("RGB"), dtype=np.float64).reshape(-1, 3)
        near = int((np.linalg.norm(px - np.array(pics.COLOURS[p.colour]), axis=1) < 60).sum())
        assert near >= 12 * p.count, (seed, p.answer, near)
        seen.add(p.count)
    assert seen == {1, 2, 3, 4}
    assert pics.split("heldout", 3)[0] == pics.HELDOUT_SEED and pics.split("train", 3)[-1] < pics.HELDOUT_SEED
    with pytest.raises(ValueError):
        pics.split("train", 2, pics.HELDOUT_SEED - 1)


def test_pictures_label_space_and_separation():
    """3 shapes x 4 colours x counts 1..4, every combination drawn; the shapes of a picture stay apart: their pixels
    form exactly `count` separate blobs (8-neighbour components of >= 5 pixels; a thin tip may leave a stray pixel)."""
    assert len(pics.SHAPES) == 3 and len(pics.COLOURS) == 4 and len(pics.COUNTS) == 4
    seen = {(p.shape, p.colour) for p in map(pics.picture, range(200))}
    assert seen == {(s, c) for s in pics.SHAPES for c in pics.COLOURS}
    for seed in range(40):
        p = pics.picture(seed)
        px = np.asarray(p.image, dtype=np.float64)
        fg = np.linalg.norm(px - np.array(pics.COLOURS[p.colour]), axis=-1) < 60  # [H, W]
        seen_px = np.zeros_like(fg)
        comps = 0
        for y, x in zip(*np.nonzero(fg)):
            if seen_px[y, x]:
                continue
            stack, size = [(y, x)], 0
            seen_px[y, x] = True
            while stack:
                cy, cx = stack.pop()
                size += 1
                for ny in (cy - 1, cy, cy + 1):
                    for nx in (cx - 1, cx, cx + 1):
                        if 0 <= ny < fg.shape[0] and 0 <= nx < fg.shape[1] and fg[ny, nx] and not seen_px[ny, nx]:
                            seen_px[ny, nx] = True
                            stack.append((ny, nx))
            comps += size >= 5
        assert comps == p.count, (seed, p.answer, comps)


def test_score_tallies_each_attribute():
    hits = {"exact": 0, "count": 0, "colour": 0, "shape": 0}
    wrong: list = []
    p = next(q for q in map(pics.picture, range(100)) if q.count == 2)
    tdv._score(hits, wrong, 1, p, "\n</think>\n\n" + p.answer + "<|im_end|>")
    assert hits == {"exact": 1, "count": 1, "colour": 1, "shape": 1} and not wrong
    other = next(c for c in pics.COLOURS if c != p.colour)
    tdv._score(hits, wrong, 2, p, p.answer.replace(p.colour, other))
    tdv._score(hits, wrong, 3, p, "three " + " ".join(p.answer.split()[1:]))
    tdv._score(hits, wrong, 4, p, "no idea")
    assert hits == {"exact": 1, "count": 2, "colour": 2, "shape": 3} and [w[0] for w in wrong] == [2, 3, 4]


def test_answer_fields():
    assert pics.answer_fields("two red circles.") == ("two", "red", "circle")
    assert pics.answer_fields("one blue square") == ("one", "blue", "square")
    assert pics.answer_fields("The `json` module: JSON.") is None


@pytest.fixture(scope="module")
def vl_demo(tmp_path_factory):
    """The demo rewritten in the VL layout with a random vision tower (what train_demo_vision.py writes)."""
    out = tmp_path_factory.mktemp("demo_vl")
    text_sd = tdv.text_tensors(DEMO)
    vc = VisionConfig.from_dict(tdv.VISION_CONFIG, tdv.text_config(DEMO)["hidden_size"])
    torch.manual_seed(0)
    tower = VisionTower(vc)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tdv.write_checkpoint(DEMO, out, text_sd, tower.state_dict(), tdv.VISION_CONFIG)
    return out, text_sd, tower


def test_vl_layout_keeps_text_tensors_and_loads(vl_demo):
    out, text_sd, tower = vl_demo
    assert tdv.tensor_hashes(tdv.text_tensors(out)) == tdv.tensor_hashes(text_sd)
    ours = load_model(out).state_dict()
    ref = load_model(DEMO).state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    cfg = images.ImageConfig.from_checkpoint(out)
    assert (cfg.min_pixels, cfg.max_pixels) == (pics.MIN_SIDE ** 2, pics.MAX_SIDE ** 2)
    tok = tdv.Prompts(out).tok
    assert cfg.image_token_id == tok.token_to_id("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.token_to_id("<|vision_start|>")
    lo, hi = (pics.MIN_SIDE // 32) ** 2, (pics.MAX_SIDE // 32) ** 2  # 16..36 image tokens (32 px per token)
    for w, h in ((8, 6), (20, 30), (64, 64), (200, 150), (3000, 2000)):  # any picture of an ordinary aspect ratio
        assert lo <= images.preprocess(pics.picture(0).image.resize((w, h)), cfg).n_tokens <= hi


def test_vl_layout_embeddings_equal_transformers(vl_demo):
    from transformers import AutoModelForImageTextToText

    out, _, _ = vl_demo
    hf, info = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    data = tdv.Prompts(out)
    prep = [images.preprocess(pics.picture(s).image, data.icfg) for s in (1, 2)]
    rows = torch.cat([p.pixel_rows for p in prep])
    grid = torch.tensor([p.grid_thw for p in prep])
    with torch.no_grad():
        ref = torch.cat(hf.get_image_features(rows, grid).pooler_output)
    got = VisionTower.from_checkpoint(out).encode(rows, grid)
    assert got.shape == ref.shape == (sum(p.n_tokens for p in prep), 128)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    # the prompt as the server renders it: the image markup in place, one pad per image token
    ids = images.expand_image_pads(data.prompt("What is in this picture?", True, None), [prep[0].n_tokens],
                                   data.icfg.image_token_id)
    text = data.tok.decode(ids)
    assert "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * prep[0].n_tokens + "<|vision_end|>What is" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert json.loads((out / "config.json").read_text())["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]


def test_engine_eval_through_our_engine(vl_demo):
    """--engine-eval runs held-out pictures through engine.spec at K=3: its answers are our engine's greedy answers
    (plain decode gives the same text) and it reports MTP tokens per round."""
    from engine.spec import generate_spec

    out, _, _ = vl_demo
    res = tdv.engine_eval(out, 2)
    assert res["n"] == 2 and 1.0 <= res["mtp_tokens_per_round"] <= 4.0
    assert all(0.0 <= res[k] <= 1.0 for k in ("exact", "count", "colour", "shape"))
    model, data = load_model(out), tdv.Prompts(out)
    p = pics.picture(pics.HELDOUT_SEED)
    inp = images.prepare_input(p.image, model.image_config)
    ids = tdv._picture_prompt(data, inp.n_tokens, "What is in this picture?", None)
    plain, _ = generate_spec(model, ids, 16, k=0, eos_ids=data.tok.eos_token_ids, images=[inp])
    got = data.tok.decode(plain).split("</think>")[-1].replace("<|im_end|>", "").strip()
    assert res["exact"] == 0.0 and res["wrong"][0] == (pics.HELDOUT_SEED, p.answer, got)  # a random tower


def test_train_demo_mtp_passes_match_the_engine():
    """tools/train_demo.py's differentiable MTP chain equals the engine's drafting path (3 chained passes)."""
    from tools.train_demo import selfcheck_mtp

    model = load_model(DEMO)
    assert selfcheck_mtp(model, model.config.vocab_size, 3) < 1e-4


def test_mtp_refit_changes_only_the_head(vl_demo, tmp_path):
    out, text_sd, tower = vl_demo
    losses = tdv.mtp_refit(out, tmp_path, seed=0, minutes=5, max_steps=2, batch=2, lr=1e-3)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    after = tdv.text_tensors(tmp_path)
    assert after.keys() == text_sd.keys()
    changed = {k for k in text_sd if not torch.equal(after[k], text_sd[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    ours = load_model(tmp_path)
    assert all(torch.equal(ours.vision.state_dict()[k], v) for k, v in tower.state_dict().items())
