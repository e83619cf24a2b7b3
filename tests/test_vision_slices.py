"""An image encoded in slices across engine steps (VisionTower.begin / run_blocks / finish, ImageEncoder.advance,
the scheduler's patch-block budget): bitwise the one-shot `VisionTower.encode` (a tiny tower and a depth-12 one),
a text row beside it decoding every step while the image takes several, the image request's output the same as
under an unlimited budget, and a cancelled request's partial encode dropped."""
from __future__ import annotations

import pytest
import torch

from engine import images
from engine.model.vision import VisionConfig, VisionTower
from tests.test_vision_engine import Rows, _img, _one, _run, _same, _sched, _text, built, dense  # noqa: F401
from tests.vl_util import vision_config


@pytest.mark.parametrize("depth", [2, 12])
def test_sliced_encode_is_the_one_shot_encode_bitwise(depth):
    torch.manual_seed(depth)
    tower = VisionTower(VisionConfig.from_dict(vision_config(depth=depth, out_hidden_size=48))).eval()
    grid = [(1, 6, 8)]
    rows = torch.randn(48, tower.config.patch_dim)  # [t*h*w, C*T*P*P]
    want = tower.encode(rows, grid)
    for n in (1, 5, depth):
        with torch.inference_mode():
            st = tower.begin(rows, grid)
            steps = 0
            while st.block < depth:
                left = depth - st.block
                assert tower.run_blocks(st, n) == min(n, left) and st.block == depth - left + min(n, left)
                steps += 1
            got = tower.finish(st)
        assert steps == -(-depth // n) and torch.equal(got, want), n
    with torch.inference_mode(), pytest.raises(ValueError, match="finish"):
        tower.finish(tower.begin(rows, grid))


def test_text_row_decodes_every_step_while_an_image_is_encoded(dense):
    model = dense
    depth = model.vision.config.depth
    ids, imgs = _one(model)
    ref = _sched(model)  # unlimited tower budget
    r = Rows(model, ids, 6, k=3, images=imgs, pool=ref.pool)
    ref.add(r)
    _run(ref)
    sched = _sched(model, encoder_patch_blocks_per_step=1)  # one block a step
    t = Rows(model, _text(30, 9), 200, k=3, pool=sched.pool)
    sched.add(t)
    while not t.emitted:
        sched.step()
    a = Rows(model, ids, 6, k=3, images=imgs, pool=sched.pool)
    sched.add(a)
    steps = 0
    while sched.vision_stats().images_encoded == 0:
        n = len(t.emitted)
        sched.step()
        steps += 1
        assert len(t.emitted) > n and not t.finished  # the text row decodes every step
        assert (a.prefill_tokens > 0) == (sched.vision_stats().images_encoded == 1)  # prefill waits for the image
    assert steps == depth and sched.encoder.pending() == 0
    _run(sched)
    assert a.finish_reason != "error" and a.emitted == r.emitted
    _same(a.rows, r.rows, "sliced encode vs unlimited budget")


def test_cancelled_request_drops_its_partial_encode(dense):
    model = dense
    ids, imgs = _one(model)
    sched = _sched(model, encoder_patch_blocks_per_step=1)
    a = Rows(model, ids, 4, k=3, images=imgs, pool=sched.pool)
    sched.add(a)
    sched.step()
    assert sched.encoder.pending() == 1 and sched.vision_stats().images_encoded == 0
    sched.remove(a)
    _run(sched)
    sched.step()
    assert sched.encoder.pending() == 0 and sched.vision_stats().images_encoded == 0
