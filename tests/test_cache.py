"""Cache contracts: incremental decode == one prefill; rollback(n) == never having decoded past n (bitwise)."""
from __future__ import annotations

import pytest
import torch

from engine.cache import ModelCache
from engine.loader import load_model
from engine.spec import decode_step_t, prefill
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp(request.param), seed=11, moe=request.param == "moe",
                        with_tokenizer=False)
    return load_model(d)


def _fresh(model, n=256):
    return ModelCache(model.config, n, dtype=model.config.dtype)


@torch.no_grad()
def test_token_by_token_decode_equals_prefill(model):
    ids = torch.randint(0, model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    c1 = _fresh(model)
    ref_last, _, _ = prefill(model, ids, c1)
    c2 = _fresh(model)
    prefill(model, ids[:5], c2)
    for i, t in enumerate(ids[5:]):
        logits, _, _ = decode_step_t(model, [t], 5 + i, c2, record=False)
    torch.testing.assert_close(logits[0], ref_last, rtol=1e-4, atol=1e-4)
    assert c1.length == c2.length == 90
    for a, b in zip(c1.state_tensors(), c2.state_tensors()):  # chunked GDN vs 85 recurrent fp32 steps
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("multi", [False, True])
def test_rollback_then_redecode_is_bitwise_never_decoded(model, multi):
    """Single-token steps: A decodes keep+junk, rolls back over junk; B never saw junk. multi: one T=7 recorded
    forward each, A over keep+junk and B over keep+other junk (same GEMM shapes), both rolled back to keep.
    Then both decode the same tokens: logits and every cache tensor must be bitwise equal. (MoE + multi: the
    experts' GEMM row counts depend on routing of the other rows, so only tight closeness is promised.)"""
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (20,), generator=g).tolist()
    junk_a = torch.randint(0, V, (5,), generator=g).tolist()
    junk_b = torch.randint(0, V, (5,), generator=g).tolist()
    keep = torch.randint(0, V, (2,), generator=g).tolist()
    after = torch.randint(0, V, (4,), generator=g).tolist()

    def run(junk):
        c = _fresh(model)
        prefill(model, prompt, c)
        c.snapshot()
        seq = keep + junk
        if multi:
            decode_step_t(model, seq, c.length, c, record=True)
        else:
            for t in seq:
                decode_step_t(model, [t], c.length, c, record=True)
        c.rollback(len(prompt) + len(keep))
        c.close_window()
        return c

    a = run(junk_a)
    b = run(junk_b) if multi else run([])
    if multi and model.config.is_moe:
        same = lambda x, y: torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # noqa: E731
    else:
        def same(x, y):
            assert torch.equal(x, y)
    for t in after:
        la, _, _ = decode_step_t(model, [t], a.length, a, record=False)
        lb, _, _ = decode_step_t(model, [t], b.length, b, record=False)
        same(la, lb)
    for x, y in zip(a.state_tensors(), b.state_tensors()):
        same(x, y)


def test_rollback_outside_window_is_refused(model):
    c = _fresh(model)
    prefill(model, [1, 2, 3], c)
    with pytest.raises(RuntimeError):
        c.rollback(1)


def test_capacity_is_checked(model):
    c = _fresh(model, n=8)
    with pytest.raises(ValueError, match="exceeds"):
        prefill(model, list(range(9)), c)
