"""The request fields that change token choice, in the engine's per-row logits processing (engine/sampling.py):
logit_bias, min_tokens and stop ids. Greedy spec with each of them == plain greedy (K = 3 and others vs K = 0),
alone and in a mixed batch; prompt logprobs computed chunk by chunk during prefill equal a full forward's."""
from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.scheduler import Scheduler
from engine.spec import DraftedSession, SpecSampling, SpecSession, generate_spec
from tests.test_batch import _run
from tests.test_spec import forced_drafter
from tests.tiny import make_checkpoint

N_NEW = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("fields"), seed=31, with_tokenizer=False))


def _prompt(V: int, n: int = 11, seed: int = 3) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _spec_equals_plain(model, prompt, n, sampling, eos=(), ks=(1, 3, 7)) -> list[int]:
    V = model.config.vocab_size
    ref, _ = generate_spec(model, prompt, n, k=0, sampling=sampling, eos_ids=eos)
    for k in ks:  # the forced drafter proposes the reference most of the time, so long windows are accepted
        s = DraftedSession(model, prompt, n, k=k, capmax=8, sampling=sampling, eos_ids=eos,
                           drafter=forced_drafter(ref, len(prompt), V, k, 0.2))
        out = s.run()
        assert out == ref, f"k={k}"
        assert s.telem.accepted > 0
    return ref


def test_logit_bias_greedy_spec_is_exact(model):
    V = model.config.vocab_size
    prompt = _prompt(V)
    free, _ = generate_spec(model, prompt, N_NEW, k=0)
    banned = set(free)
    s = SpecSampling(logit_bias=tuple((t, 2.0) for t in range(0, V, 9)) + tuple((t, -100.0) for t in banned))
    ref = _spec_equals_plain(model, prompt, N_NEW, s)
    assert not banned & set(ref)
    alone = SpecSession(model, prompt, N_NEW, k=0, sampling=s, logprobs=1)
    assert alone.run() == ref
    # the bias decides most positions: there the raw argmax (logprobs read the raw rows) is another token
    assert sum(x.top[0][0] != t for x, t in zip(alone.logprobs, ref)) > N_NEW // 2


def test_min_tokens_masks_stop_ids_until_n_and_spec_is_exact(model):
    V = model.config.vocab_size
    prompt = _prompt(V, seed=4)
    free, _ = generate_spec(model, prompt, N_NEW, k=0)
    stop = free[2]  # a token greedy emits third: as a stop id it ends the output at 3 tokens
    ended, _ = generate_spec(model, prompt, N_NEW, k=0, eos_ids=[stop])
    assert ended == free[:3]
    ref = _spec_equals_plain(model, prompt, N_NEW, SpecSampling(min_tokens=12), eos=[stop])
    assert len(ref) >= 12 and stop not in ref[:12]
    assert ref[-1] == stop or len(ref) == N_NEW  # afterwards the stop id ends the choice like EOS


def test_stop_ids_end_the_choice_like_eos_under_spec(model):
    V = model.config.vocab_size
    prompt = _prompt(V, seed=6)
    free, _ = generate_spec(model, prompt, N_NEW, k=0)
    stops = [free[9], free[20]]
    ref = _spec_equals_plain(model, prompt, N_NEW, SpecSampling(), eos=stops)
    first = min(free.index(t) for t in stops)
    assert ref == free[:first + 1]


def test_sampled_with_bias_and_min_tokens_repeats_per_seed(model):
    V = model.config.vocab_size
    prompt = _prompt(V, seed=7)
    s = SpecSampling(temperature=0.9, seed=5, logit_bias=((1, 3.0), (2, -100.0)), min_tokens=8)
    a, _ = generate_spec(model, prompt, 24, k=3, sampling=s, eos_ids=[0])
    b, _ = generate_spec(model, prompt, 24, k=3, sampling=s, eos_ids=[0])
    assert a == b and 2 not in a and 0 not in a[:8]


def test_mixed_batch_with_fields_equals_alone(model):
    """Rows with different processing (bias, min_tokens, none) verified together == each alone at K = 0."""
    V = model.config.vocab_size
    free, _ = generate_spec(model, _prompt(V, seed=8), N_NEW, k=0)
    rows = [(_prompt(V, seed=8), SpecSampling(logit_bias=((free[1], -100.0),)), ()),
            (_prompt(V, seed=9), SpecSampling(min_tokens=10), (free[0], free[3])),
            (_prompt(V, seed=10), SpecSampling(), ())]
    refs = [generate_spec(model, p, N_NEW, k=0, sampling=s, eos_ids=e)[0] for p, s, e in rows]
    sched = Scheduler(model, max_num_seqs=3, max_model_len=128, k=3, max_num_batched_tokens=64)
    sess = [SpecSession(model, p, N_NEW, k=3, sampling=s, eos_ids=e, pool=sched.pool) for p, s, e in rows]
    _run(sched, {0: sess})
    assert [s.emitted for s in sess] == refs


@pytest.mark.parametrize("c_kernels", [True, False])
def test_prompt_logprobs_chunked_equal_a_full_forward(model, c_kernels):
    """Prompt logprobs over a grid border equal the cache-free forward's: bit-close on the torch path (its twin);
    within 1e-3 on the C kernels, whose token-by-token recurrence rounds differently from the chunked form (this
    random model's most ill-conditioned position, 227, is 1.7e-4 off an fp64 forward in fp32 torch, 7e-4 in C)."""
    from engine.model.ops import cpu

    V = model.config.vocab_size
    prompt = _prompt(V, n=300, seed=12)
    prev = cpu.set_enabled(c_kernels)
    try:
        s = SpecSession(model, prompt, 4, k=3, prompt_logprobs=3)
        while s.prefilling:
            s.prefill_chunk()  # a grid border inside the prompt
    finally:
        cpu.set_enabled(prev)
    lps = s.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)  # [T, V]
    tol = 1e-3 if c_kernels else 1e-5
    for i in range(1, len(prompt)):
        x, row = lps[i], full[i - 1]
        assert x.token == prompt[i]
        assert x.logprob == pytest.approx(float(row[prompt[i]]), abs=tol)
        ties = ((row - row[prompt[i]]).abs() <= 2 * tol).sum() > 1  # a near-tie may rank either way
        assert ties or x.rank == int((row > row[prompt[i]]).sum()) + 1
        assert ties or [t for t, _ in x.top] == torch.topk(row, 3).indices.tolist()
    plain = SpecSession(model, prompt, 4, k=3)
    plain.run()
    assert plain.prompt_logprobs == [] and plain.emitted == s.run()  # off by default; never changes the output
