"""Images in the engine (engine/session.py, prefill.py, scheduler.py, cache.py, encoder.py): M-RoPE positions in
prefill and cache index + rope delta after it, image embeddings in place of the pads for the trunk and the MTP
head, the encoder cache, and image hashes in the prefix cache's keys.

Checked on tiny random VL checkpoints (tests/vl_util.py, fp32): greedy continuations with one and with two images
equal transformers' `Qwen3_5(Moe)ForConditionalGeneration` (the prompt's last logits first), on the C path and the
torch path; spec == plain with images for K = 1..8, tokens and logit bits; a request's logits bitwise the same
alone, batched beside text-only rows and from the prefix cache (the same image in another conversation hits, a
different image of the same size does not); the encoder cache's hits; text-only requests unchanged bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import tests.hf_oracle  # noqa: F401  (blocks fla before transformers is imported)
from engine import images
from engine.cache import PREFILL_GRID as G
from engine.cache import TAIL_MARGIN
from engine.graphs import EAGER, GraphRunner
from engine.loader import CheckpointError, load_model
from engine.model.ops import cpu
from engine.model.ops import dispatch as ops
from engine.scheduler import Scheduler
from engine.spec import DraftedSession, SpecSession, spec_round
from tests.test_spec import forced_drafter
from tests.tiny import make_checkpoint
from tests.vl_util import IDS, make_vl_checkpoint

MIN_PX, MAX_PX = 32 * 32 * 4, 160 * 160  # small pictures: 4 .. 25 pads each
MB = 1 << 20
VS, VE, PAD = IDS["vision_start_token_id"], IDS["vision_end_token_id"], IDS["image_token_id"]


class Rows(SpecSession):
    """A session that keeps the raw logit row each emitted token was chosen from."""

    def _emit(self, toks, rows):
        self.rows = getattr(self, "rows", []) + [r.clone() for r in rows[:len(toks)]]
        super()._emit(toks, rows)


class DraftedRows(DraftedSession):
    def _emit(self, toks, rows):
        self.rows = getattr(self, "rows", []) + [r.clone() for r in rows[:len(toks)]]
        super()._emit(toks, rows)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (checkpoint dir, our model), each built once."""
    out = {}

    def get(kind: str):
        if kind not in out:
            d = make_vl_checkpoint(tmp_path_factory.mktemp(kind), moe=kind == "moe", seed=3 if kind == "moe" else 1,
                                   min_pixels=MIN_PX, max_pixels=MAX_PX)
            out[kind] = d, load_model(d)
        return out[kind]

    return get


@pytest.fixture(scope="module")
def dense(built):
    return built("dense")[1]


def _picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _img(model, h: int, w: int, seed: int) -> images.ImageInput:
    return images.prepare_input(_picture(h, w, seed), model.image_config)


def _text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 370, (n,), generator=g).tolist()  # below the vision ids and the EOS (383)


def _prompt(model, parts) -> tuple[list[int], list[images.ImageInput]]:
    """parts: token lists and ImageInputs, in order -> (expanded prompt ids, the images)."""
    ids, imgs = [], []
    for p in parts:
        if isinstance(p, images.ImageInput):
            ids += [VS, PAD, VE]
            imgs.append(p)
        else:
            ids += p
    return images.expand_image_pads(ids, [i.n_tokens for i in imgs], PAD), imgs


def _alone(model, prompt, n_new, **kw) -> Rows:
    s = Rows(model, prompt, n_new, **kw)
    s.run()
    return s


def _same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: logit row {i} differs by {(x - y).abs().max().item():.3g}"


def _one(model):
    """One image of 64 x 96 (6 pads) inside a short prompt."""
    return _prompt(model, [_text(20, 1), _img(model, 64, 96, 1), _text(9, 2)])


def _two(model):
    """Two images; the first (160 x 160: 25 pads) straddles the first grid boundary."""
    return _prompt(model, [_text(G - 12, 3), _img(model, 160, 160, 2), _text(7, 4), _img(model, 64, 64, 3),
                           _text(5, 5)])


def _sched(model, *, cache_mb=0, budget=512, **kw) -> Scheduler:
    return Scheduler(model, max_num_seqs=8, max_model_len=1024, k=3, max_num_batched_tokens=budget,
                     prefix_cache_bytes=cache_mb * MB, **kw)


def _run(sched: Scheduler, stop: int = 3000) -> None:
    for _ in range(stop):
        if not sched.num_sessions:
            return
        sched.step()
    raise AssertionError("scheduler did not drain")


# ------------------------------------------------------------------------------------------ against transformers

@pytest.mark.slow  # (transformers' import: ~5 s)
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("torch_ops", [False, True], ids=["c-path", "torch-path"])
def test_greedy_with_images_equals_transformers(built, kind, torch_ops):
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    d, model = built(kind)
    hf = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32).eval()
    n_new = 10
    prev = cpu.set_enabled(not torch_ops) if torch_ops else None
    try:
        for name, (ids, imgs) in (("one image", _one(model)), ("two images", _two(model))):
            cfg = model.image_config
            pix = torch.cat([images.input_rows(i, cfg) for i in imgs])
            grid = torch.tensor([i.grid_thw for i in imgs])
            x = torch.tensor([ids])
            kw = dict(pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=(x == PAD).long())
            with torch.no_grad():
                ref_logits = hf(input_ids=x, **kw).logits[0, -1].float()
                out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                                  min_new_tokens=n_new, do_sample=False, **kw)
            ref = out[0, len(ids):].tolist()
            s = Rows(model, ids, n_new, k=3, images=imgs)
            got = s.run()
            torch.testing.assert_close(s.rows[0], ref_logits, rtol=1e-4, atol=1e-4, msg=f"{kind} {name}")
            assert got == ref, f"{kind} {name}"
            assert s.rope_delta < 0  # the images advance positions by max(h, w), not by their pad count
    finally:
        if prev is not None:
            cpu.set_enabled(prev)


@pytest.mark.slow  # (transformers' import)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_head_sees_the_images(built, kind):
    """The first draft logits of a two-image request equal an independent reference: the MTP head run without a
    cache over every prompt row, its inputs the embeddings of tokens 1.. with the image embeddings (transformers'
    get_image_features) at the pads, the trunk's hiddens (transformers' last_hidden_state), and the prompt's 3-D
    positions (images.mrope_positions / mrope_cos_sin)."""
    from transformers import AutoModelForImageTextToText

    d, model = built(kind)
    hf = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32).eval()
    ids, imgs = _two(model)
    cfg, mcfg = model.image_config, model.config
    pix = torch.cat([images.input_rows(i, cfg) for i in imgs])
    grid = torch.tensor([i.grid_thw for i in imgs])
    x = torch.tensor([ids])

    class Spy:  # the eager runner, keeping the draft logits of the round's first head forward
        logits: list[torch.Tensor] = []

        def verify(self, *a, **kw):
            return EAGER.verify(*a, **kw)

        def draft(self, *a, **kw):
            h, lg = EAGER.draft(*a, **kw)
            self.logits.append(lg[0].clone())
            return h, lg

    s = SpecSession(model, ids, 3, k=1, images=imgs)
    s.step()  # prefill: the first token
    spy = Spy()
    spec_round(model, [s], spy)
    first = s.emitted[0]
    with torch.no_grad():
        out = hf.model(input_ids=x, pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=(x == PAD).long())
        hidden = out.last_hidden_state[0]  # [n, H] post-norm
        feats = hf.model.get_image_features(pixel_values=pix, image_grid_thw=grid)
        feats = torch.cat(list(feats.pooler_output if hasattr(feats, "pooler_output") else feats))  # [pads, H]
        nxt = torch.tensor(ids[1:] + [first])
        emb = model.model.embed_tokens(nxt).clone()  # [n, H]
        emb[nxt == PAD] = feats.to(emb.dtype)
        pos, _ = images.mrope_positions(ids, [i.grid_thw for i in imgs], cfg)
        cos, sin = images.mrope_cos_sin(pos, mcfg.rotary_dim, mcfg.rope_theta, cfg.mrope_section, torch.float32)
        h = model.mtp(emb[None], hidden[None], None, None, (cos[None], sin[None]))  # [1, n, H]
        ref = model.logits(h[0, -1])
    torch.testing.assert_close(spy.logits[0], ref, rtol=1e-4, atol=1e-4, msg=kind)


# ------------------------------------------------------------------------------------------ exactness

def test_spec_equals_plain_with_images_every_k(dense):
    model = dense
    ids, imgs = _two(model)
    n_new = 24
    ref = Rows(model, ids, n_new, k=0, images=imgs)
    ref_toks = ref.run()
    V = model.config.vocab_size
    for k in range(1, 9):
        s = DraftedRows(model, ids, n_new, k=k, capmax=8, images=imgs,
                        drafter=forced_drafter(ref_toks, len(ids), V, k, wrong_rate=0.4 / k ** 0.5))
        assert s.run() == ref_toks, f"k={k}"
        _same(s.rows, ref.rows, f"k={k}")
        assert s.telem.accepted > 0, f"k={k}: nothing accepted"


def test_torch_path_spec_equals_plain_with_images(dense):
    prev = cpu.set_enabled(False)
    try:
        ids, imgs = _one(dense)
        ref = Rows(dense, ids, 16, k=0, images=imgs).run()
        for k in (1, 4):
            assert Rows(dense, ids, 16, k=k, images=imgs).run() == ref, f"k={k}"
    finally:
        cpu.set_enabled(prev)


def test_alone_batched_and_cached_are_the_same_bits(dense):
    """The two-image request alone; batched beside decoding text rows; a second identical request (a prefix-cache
    hit); another conversation on the same image (hits its blocks); a different picture of the same size (same
    token ids) never shares a block with it."""
    model = dense
    ids, imgs = _two(model)
    n_new = 16
    alone = Rows(model, ids, n_new, k=3, images=imgs)
    alone.run()
    sched = _sched(model, cache_mb=64, budget=64)
    text = [Rows(model, _text(5 + 3 * i, 50 + i), 60, k=3, pool=sched.pool) for i in range(3)]
    for t in text:
        sched.add(t)
    while len(sched.running) < 3:
        sched.step()
    first = Rows(model, ids, n_new, k=3, images=imgs, pool=sched.pool)
    sched.add(first)
    _run(sched)
    _same(first.rows, alone.rows, "batched beside text rows")
    for t in text:  # the text rows are those of sessions alone without the images parameter
        _same(t.rows, _alone(model, t.prompt_ids, 60, k=3).rows, "text row")
    hit = Rows(model, ids, n_new, k=3, images=imgs, pool=sched.pool)
    sched.add(hit)
    tail = len(ids) - TAIL_MARGIN  # the first request's prompt tail (the C path)
    assert hit.cached_tokens == tail > G
    _run(sched)
    _same(hit.rows, alone.rows, "from the prefix cache")
    # another conversation: the same text and images, then a different question
    other_ids, other_imgs = _prompt(model, [_text(G - 12, 3), imgs[0], _text(7, 4), imgs[1], _text(30, 9)])
    other = Rows(model, other_ids, 8, k=3, images=other_imgs, pool=sched.pool)
    sched.add(other)
    common = next(i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b)
    assert other.cached_tokens == (tail if tail <= common else G)
    _run(sched)
    _same(other.rows, _alone(model, other_ids, 8, k=3, images=other_imgs).rows, "other conversation")
    # a different picture of the same size: the same token ids, but no block in common after the image starts
    swap = _img(model, 160, 160, 77)
    assert swap.n_tokens == imgs[0].n_tokens and swap.hash != imgs[0].hash
    sw_ids, sw_imgs = _prompt(model, [_text(G - 12, 3), swap, _text(7, 4), imgs[1], _text(5, 5)])
    assert sw_ids == ids
    sw = Rows(model, sw_ids, n_new, k=3, images=sw_imgs, pool=sched.pool)
    sched.add(sw)
    assert sw.cached_tokens == 0
    _run(sched)
    sw_alone = Rows(model, sw_ids, n_new, k=3, images=sw_imgs)
    sw_alone.run()
    _same(sw.rows, sw_alone.rows, "different image")
    assert not all(torch.equal(a, b) for a, b in zip(sw.rows, alone.rows))


def test_torch_path_prefill_bits_from_the_cache_with_images(dense):
    """Without the C kernels: the two-image prompt's first-token logits are the same bits on a prefix-cache hit as
    on the miss that filled the cache."""
    model = dense
    ids, imgs = _two(model)
    prev = cpu.set_enabled(False)
    try:
        sched = _sched(model, cache_mb=64)
        miss = Rows(model, ids, 1, k=3, images=imgs, pool=sched.pool)
        sched.add(miss)
        _run(sched)
        hit = Rows(model, ids, 1, k=3, images=imgs, pool=sched.pool)
        sched.add(hit)
        assert hit.cached_tokens == G
        _run(sched)
        _same(hit.rows, miss.rows, "torch path, from the cache")
    finally:
        cpu.set_enabled(prev)


def test_text_only_request_unchanged_beside_images(dense):
    """A text-only request on a VL model: its logits are the bits of a session built without the images
    parameter, alone and batched beside image requests."""
    model = dense
    prompt = _text(40, 8)
    ref = Rows(model, prompt, 20, k=3)
    ref.run()
    empty = Rows(model, prompt, 20, k=3, images=())
    empty.run()
    _same(empty.rows, ref.rows, "images=()")
    sched = _sched(model)
    ids, imgs = _one(model)
    sched.add(Rows(model, ids, 20, k=3, images=imgs, pool=sched.pool))
    t = Rows(model, prompt, 20, k=3, pool=sched.pool)
    sched.add(t)
    _run(sched)
    _same(t.rows, ref.rows, "beside an image request")


# ------------------------------------------------------------------------------------------ encoding

def test_encoder_cache_and_budget(dense):
    model = dense
    ids, imgs = _two(model)
    depth = model.vision.config.depth
    sched = _sched(model, encoder_patch_blocks_per_step=1)  # one vision block a step: the step's first always runs
    a = Rows(model, ids, 4, k=3, images=imgs, pool=sched.pool)
    sched.add(a)
    for i in range(2 * depth):  # image after image, a block a step
        assert a.prefill_tokens == 0
        sched.step()
        st = sched.vision_stats()
        assert (st.images_encoded, st.encoder_cache_hits) == ((i + 1) // depth, 0)
    assert a.prefill_tokens > 0
    _run(sched)
    b = Rows(model, ids, 4, k=3, images=imgs, pool=sched.pool)
    sched.add(b)
    _run(sched)
    st = sched.vision_stats()
    assert (st.images_encoded, st.encoder_cache_hits) == (2, 2) and st.encoder_seconds > 0
    _same(b.rows, a.rows, "encoder cache hit")
    small = _sched(model, encoder_cache_bytes=0)
    c = Rows(model, ids, 4, k=3, images=imgs, pool=small.pool)
    bad = Rows(model, ids, 4, k=3, images=[imgs[0]._replace(rgb=imgs[0].rgb[:32]), imgs[1]], pool=small.pool)
    small.add(bad)  # its picture disagrees with its grid: encoding it fails that request alone
    small.add(c)
    _run(small)
    assert bad.finish_reason == "error" and "grid" in str(bad.error) and small.pool.num_free == small.pool.slots
    _same(c.rows, a.rows, "no encoder cache, beside a failed image")
    assert small.vision_stats().encoder_cache_hits == 0


def test_bad_images_and_loading(dense, tmp_path):
    model = dense
    ids, imgs = _one(model)
    with pytest.raises(ValueError, match="image"):
        SpecSession(model, ids, 4, images=imgs + imgs)  # one pad run, two images
    text = load_model(make_checkpoint(tmp_path / "text", with_tokenizer=False))
    assert text.vision is None and text.image_config is None
    with pytest.raises(ValueError, match="vision"):
        SpecSession(text, ids, 4, images=imgs)
    assert _sched(text).vision_stats() is None
    lmo = load_model(make_vl_checkpoint(tmp_path / "lmo"), language_model_only=True)
    assert lmo.vision is None and lmo.image_config is None
    stub = make_checkpoint(tmp_path / "stub", layout="vlm", with_tokenizer=False, vision_stub=True)
    with pytest.raises(CheckpointError, match="language-model-only"):
        load_model(stub)
    assert load_model(stub, language_model_only=True).vision is None
    export = load_model(make_checkpoint(tmp_path / "export", layout="vlm", with_tokenizer=False))
    assert export.vision is None  # a vision_config without model.visual.* tensors: a text-only export


# ------------------------------------------------------------------------------------------ the kernel path

@pytest.mark.slow
def test_kernel_path_graph_runner_with_images(dense):
    """The kernel path (Triton kernels under the interpreter) through the scheduler's GraphRunner bodies, whose
    step contexts take the rope delta as a per-row device input: an image request batched beside a text request
    decodes the C path's greedy tokens, and spec (forced drafts, K = 2) equals plain."""
    model = dense
    ids, imgs = _one(model)
    text = _text(9, 12)
    n_new = 6
    ref = [_alone(model, ids, n_new, k=0, images=imgs).emitted, _alone(model, text, n_new, k=0).emitted]

    def run(k):
        sched = Scheduler(model, max_num_seqs=2, max_model_len=96, k=k, max_num_batched_tokens=128,
                          step_graphs=True)
        assert isinstance(sched.runner, GraphRunner)
        V = model.config.vocab_size
        ss = [DraftedRows(model, p, n_new, k=k, pool=sched.pool, drafter=forced_drafter(r, len(p), V, 1, 0.35),
                          **kw) for p, r, kw in ((ids, ref[0], {"images": imgs}), (text, ref[1], {}))]
        for s in ss:
            sched.add(s)
        _run(sched)
        return [s.emitted for s in ss], ss

    with ops.force_kernels():
        plain, _ = run(0)
        assert plain == ref
        spec, ss = run(2)
        assert spec == plain and sum(s.telem.accepted for s in ss) > 0


@pytest.mark.slow
def test_graph_bodies_take_the_rope_delta_as_a_row_input():
    """The static-buffer verify and draft bodies (what a CUDA graph captures) read each row's rope delta from their
    index buffer: loading other deltas into the same buffers changes the result, which equals the eager kernel
    path's with those deltas, and the body reads no host value."""
    from tests.test_kernel_path import _clone, _model, _no_host_reads, _prefilled

    m = _model(False, "float32", seed=7)
    base, cur = _prefilled(m, [6, 10, 3], seed=4)
    g = torch.Generator().manual_seed(8)
    slots, pos0, c = [2, 0, 1], [3, 6, 10], [cur[2], cur[0], cur[1]]
    tokens = torch.randint(0, m.config.vocab_size, (3, 2), generator=g)
    hid = torch.randn(3, 2, m.config.hidden_size, generator=g)
    with ops.force_kernels(), torch.inference_mode():
        outs = []
        for delta in ([0, 0, 0], [-2, 0, -5]):
            runner = GraphRunner(m, _clone(base), [1, 2, 4], scratch=[3])  # (a verify writes GDN window slots)
            want = EAGER.verify(m, _clone(base), tokens, slots, pos0, c, delta)[2]
            st = runner._load("verify", 4, tokens, None, slots, pos0, c, [0, 0, 0], delta)
            with _no_host_reads():
                got = runner._verify_body(st)[2][:3].clone()
            assert torch.equal(got, want), f"verify, delta {delta}"
            l_want = EAGER.draft(m, _clone(base), tokens, hid, slots, pos0, [1, 1, 1], delta)[1]
            st = runner._load("draft", 4, tokens, hid, slots, pos0, [0, 0, 0], [1, 1, 1], delta)
            with _no_host_reads():
                l_got = runner._draft_body(st)[1][:3].clone()
            assert torch.equal(l_got, l_want), f"draft, delta {delta}"
            outs.append((got, l_got))
        assert torch.equal(outs[0][0][1], outs[1][0][1])  # the row with delta 0 is unchanged
        assert not torch.equal(outs[0][0][0], outs[1][0][0]) and not torch.equal(outs[0][1][2], outs[1][1][2])
