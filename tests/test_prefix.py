"""Prefill on the fixed grid and the exact prefix cache (engine/prefill.py, engine/scheduler.py, engine/cache.py).

The contract: a request's logits are bitwise the same alone, under any load, at any K, and with or without a
prefix-cache hit. Checked here on the C path (fp32 CPU, every op row-wise: every logit row the request's tokens
were chosen from, prompt logprobs included) for the demo model and a random tiny model, with prompts from 1 token to
3 grid blocks plus a tail and past 2,000 tokens, prefixes ending on and off the grid, budgets that leave 1..G tokens
next to 7 rows decoding at K = 3, and K = 0..8. On the torch path (the C kernels off) a decode step's GEMM rounds
with the batch (bench/RESULTS.md), so there the promise is the prefill's: the state the prompt leaves and the first
token's logits, alone, under load and from the cache. Then the cache itself: keys, eviction, cancellation, two
sessions on one new prefix, and the cache off.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache import PREFILL_GRID as G
from engine.cache import TAIL_MARGIN
from engine.cache import GdnPool, KVPool, PrefixCache, StatePool, block_keys
from engine.loader import load_model
from engine.model.ops import cpu
from engine.prefill import packs_rows
from engine.scheduler import Scheduler
from engine.spec import SpecSession
from tests.tiny import make_checkpoint

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
MB = 1 << 20


class Rows(SpecSession):
    """A session that keeps the raw logit row each emitted token was chosen from (test-only: a subclass)."""

    def _emit(self, toks, rows):
        self.rows = getattr(self, "rows", []) + [r.clone() for r in rows[:len(toks)]]
        super()._emit(toks, rows)


@pytest.fixture(scope="module", params=["demo", "tiny"])
def model(request, tmp_path_factory):
    if request.param == "demo":
        return load_model(DEMO)
    return load_model(make_checkpoint(tmp_path_factory.mktemp("prefix"), seed=7, with_tokenizer=False,
                                      max_position_embeddings=4096))


def _prompt(V: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 64, (n,), generator=g).tolist()


def _run(sched: Scheduler, joins: dict[int, list[SpecSession]], stop: int = 5000) -> None:
    step = 0
    while joins or sched.num_sessions:
        for s in joins.pop(step, []):
            sched.add(s)
        sched.step()
        step += 1
        assert step < stop


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: logit row {i} differs by {(x - y).abs().max().item():.3g}"


def _alone(model, prompt, n_new, k=3, **kw) -> Rows:
    s = Rows(model, prompt, n_new, k=k, **kw)
    s.run()
    return s


def _sched(model, *, budget=512, cache_mb=0, seqs=8, max_len=2600, k=3) -> Scheduler:
    return Scheduler(model, max_num_seqs=seqs, max_model_len=max_len, k=k, max_num_batched_tokens=budget,
                     prefix_cache_bytes=cache_mb * MB)


def _under_load(model, sched: Scheduler, target: SpecSession, n: int = 7, until_prefilled: bool = False) -> None:
    """Run `target` after n rows (K = 3) have started decoding; they keep decoding while it prefills."""
    V = model.config.vocab_size
    for i in range(n):
        sched.add(SpecSession(model, _prompt(V, 5 + 3 * i, 100 + i), 80, k=3, pool=sched.pool))
    while len(sched.running) < n:
        sched.step()
    sched.add(target)
    while target.prefilling:
        sched.step()
    assert len(sched.running) == n + 1 or target.finished
    if not until_prefilled:
        _run(sched, {})


def test_the_c_path_packs_rows(model):
    assert packs_rows(model)


def test_a_prompt_prefills_in_grid_blocks_whatever_the_budget(model):
    """Each forward of a joining prompt starts where its cache ends and stops on the grid (or at the prompt's end),
    and a step runs whole blocks: the budget only says how many."""
    V = model.config.vocab_size
    prompt = _prompt(V, 3 * G + 70, 1)
    for budget in (1, 40, G + 5, 3 * G):
        sched = _sched(model, budget=budget)
        s = SpecSession(model, prompt, 2, k=3, pool=sched.pool)
        sched.add(s)
        ends = []
        while s.prefilling:
            sched.step()
            ends.append(s.cache.length)
        per_step = max(1, budget // G)
        expect = [min(len(prompt), G * per_step * (i + 1)) for i in range(len(ends))]
        assert ends == expect, (budget, ends)


@pytest.mark.parametrize("n", [1, 2, G - 1, G, G + 1, 2 * G + 37, 3 * G + 101])
def test_logits_alone_at_any_k_and_under_load_are_the_same_bits(model, n):
    """One request's logit rows (prompt logprobs' rows included) alone at K = 3 == alone at K = 0..8 == joining 7
    rows that decode at K = 3 with a budget that leaves it 1..G tokens."""
    V = model.config.vocab_size
    prompt = _prompt(V, n, n)
    ref = _alone(model, prompt, 12, prompt_logprobs=2)
    for k in (0, 1, 5, 8):
        s = _alone(model, prompt, 12, k=k, capmax=8, prompt_logprobs=2)
        _same(s.rows, ref.rows, f"K={k}")
        assert s.prompt_logprobs == ref.prompt_logprobs
    for left in (1, 37, G - 1, G):
        sched = _sched(model, budget=7 * 4 + left)  # 7 rows x (K + 1) verify tokens, then `left` for the prompt
        s = Rows(model, prompt, 12, k=3, pool=sched.pool, prompt_logprobs=2)
        _under_load(model, sched, s)
        _same(s.rows, ref.rows, f"under load, {left} tokens left")
        assert s.prompt_logprobs == ref.prompt_logprobs


def test_every_k_from_0_to_8_and_a_cache_hit_at_each(model):
    """K = 0..8: the same logit rows alone, and resumed from a cache that a K = 3 session filled."""
    V = model.config.vocab_size
    prompt = _prompt(V, 2 * G + 37, 77)
    ref = _alone(model, prompt, 12, k=0)
    sched = Scheduler(model, max_num_seqs=2, max_model_len=1024, k=8, max_num_batched_tokens=512,
                      prefix_cache_bytes=64 * MB)
    _run(sched, {0: [SpecSession(model, prompt, 2, k=3, capmax=8, pool=sched.pool)]})
    for k in range(9):
        _same(_alone(model, prompt, 12, k=k, capmax=8).rows, ref.rows, f"K={k} alone")
        hit = Rows(model, prompt, 12, k=k, capmax=8, pool=sched.pool)
        _run(sched, {0: [hit]})
        assert hit.cached_tokens == len(prompt) - TAIL_MARGIN > 2 * G  # the prompt's tail
        _same(hit.rows, ref.rows, f"K={k} from the cache")


def test_a_long_prompt_past_2000_tokens(model):
    V = model.config.vocab_size
    prompt = _prompt(V, 2031, 5)
    ref = _alone(model, prompt, 6)
    sched = _sched(model, budget=300, cache_mb=64)
    s = Rows(model, prompt, 6, k=3, pool=sched.pool)
    _under_load(model, sched, s, n=3)
    _same(s.rows, ref.rows, "2031 tokens under load")
    hit = Rows(model, prompt, 6, k=3, pool=sched.pool)
    _run(sched, {0: [hit]})
    assert hit.cached_tokens == 2031 - TAIL_MARGIN > 7 * G  # the prompt's tail
    _same(hit.rows, ref.rows, "2031 tokens from the cache")


@pytest.mark.parametrize("shared", [G, 2 * G, 2 * G + 37, 3 * G - 1])
def test_a_prefix_cache_hit_gives_a_miss_bits(model, shared):
    """A prompt sharing `shared` tokens with an earlier one resumes from the last grid boundary inside them (and
    never past its own last token); its logits and prompt-free state equal a cold run's, at K = 0 and 3."""
    V = model.config.vocab_size
    first = _prompt(V, shared + 50, 11)
    second = first[:shared] + _prompt(V, 90, 12)
    for k in (0, 3):
        ref = _alone(model, second, 10, k=k)
        sched = _sched(model, cache_mb=64, k=k)
        a = SpecSession(model, first, 4, k=k, pool=sched.pool)
        _run(sched, {0: [a]})
        b = Rows(model, second, 10, k=k, pool=sched.pool)
        _run(sched, {0: [b]})
        assert b.cached_tokens == (shared // G) * G and b.prefill_tokens == len(second) - b.cached_tokens
        _same(b.rows, ref.rows, f"hit at {b.cached_tokens}, K={k}")
        assert b.telem == ref.telem, "the MTP head's cached rows are a miss's too (same drafts)"


def test_a_conversation_hits_through_the_previous_answer(model):
    """Turn 2's prompt = turn 1's prompt + its answer + new tokens: it resumes past the answer's grid boundaries
    (blocks that decode steps completed, kept because the C path's decode reaches a prefill's states) with the
    bits of a cold prefill of the whole turn."""
    V = model.config.vocab_size
    sched = _sched(model, cache_mb=64)
    turn1 = _prompt(V, G + 100, 21)
    a = SpecSession(model, turn1, 300, k=3, pool=sched.pool)
    _run(sched, {0: [a]})
    seq = turn1 + a.emitted
    turn2 = seq + _prompt(V, 40, 22)
    ref = _alone(model, turn2, 10)
    b = Rows(model, turn2, 10, k=3, pool=sched.pool)
    _run(sched, {0: [b]})
    # the tail at the answer's end (all but its last token: off the grid here), past its last whole block
    assert b.cached_tokens == len(seq) - 1 and b.cached_tokens % G and b.cached_tokens > len(turn1)
    _same(b.rows, ref.rows, "turn 2 from the cache")
    assert b.telem == ref.telem


@pytest.mark.parametrize("k2", [3, 0, 8])
def test_the_next_turn_resumes_at_the_prompts_tail(model, k2):
    """A prompt keeps its state TAIL_MARGIN tokens before its end (its last block stops there first): a next turn
    that shares the prompt, or only the prompt up to there (as a chat template's next turn does), resumes there, at
    any K, with a cold run's bits; one that differs before it resumes at the last whole block (a tail's tokens are
    compared)."""
    V = model.config.vocab_size
    sched = _sched(model, cache_mb=64, k=8)
    turn1 = _prompt(V, G + 100, 23)  # the last block [G, G + 100) stops first at its tail
    tail = len(turn1) - TAIL_MARGIN
    a = SpecSession(model, turn1, 6, k=3, pool=sched.pool)
    _run(sched, {0: [a]})
    assert a.prefill_tokens == len(turn1)
    assert G < tail < G + 100
    for turn2, at in ((turn1 + _prompt(V, 40, 24), tail),
                      (turn1[:tail] + _prompt(V, 50, 28), tail),  # parts exactly at the tail
                      (turn1[:G + 30] + _prompt(V, 80, 25), G)):  # differs at G + 30, inside the tail
        ref = _alone(model, turn2, 10, k=k2, capmax=8)
        b = Rows(model, turn2, 10, k=k2, capmax=8, pool=sched.pool)
        _run(sched, {0: [b]})
        assert b.cached_tokens == at and b.prefill_tokens == len(turn2) - at
        _same(b.rows, ref.rows, f"turn 2 resumed at {at}, K={k2}")
        assert b.telem == ref.telem


def test_a_prompts_blocks_and_tail_cut_share_one_row_of_one_forward(model, monkeypatch):
    """On the C path, with the prefix cache writing, a session's granted blocks run as one row of one forward: a full
    block, the block cut at the prompt's tail and the prompt's last TAIL_MARGIN tokens (each inner boundary's state
    kept in a window slot), beside another prompt's cut and rest; so does a next turn that resumes at the tail and
    crosses a grid boundary (one forward, not one per block). Every one has a cold run's bits, and the blocks and
    tails they leave are exact."""
    import engine.scheduler as scheduler_mod
    V = model.config.vocab_size
    forwards: list[list[int]] = []
    real = scheduler_mod.prefill_rows

    def spy(m, rows, blocks=None, *a, **kw):
        forwards.append(list(blocks) if blocks is not None else [1] * len(rows))
        return real(m, rows, blocks, *a, **kw)

    monkeypatch.setattr(scheduler_mod, "prefill_rows", spy)
    sched = _sched(model, budget=1024, cache_mb=64)
    p1, p2 = _prompt(V, G + 40, 91), _prompt(V, 30, 92)
    a, b = (Rows(model, p, 6, k=3, pool=sched.pool) for p in (p1, p2))
    _run(sched, {0: [a, b]})
    assert forwards == [[3, 2]]  # p1: block 0, the cut and the rest; p2: the cut and the rest
    for s, p in ((a, p1), (b, p2)):
        _same(s.rows, _alone(model, p, 6).rows, "a prompt whose blocks share one row")
    turn2 = p1 + _prompt(V, G - 10, 94)  # resumes at p1's tail cut (G + 36) and crosses 2G
    forwards.clear()
    c = Rows(model, turn2, 6, k=3, pool=sched.pool)
    _run(sched, {0: [c]})
    assert c.cached_tokens == len(p1) - TAIL_MARGIN and forwards == [[3]]
    _same(c.rows, _alone(model, turn2, 6).rows, "a next turn across a grid boundary in one row")
    monkeypatch.undo()
    for p in (p1, p2, turn2):
        hit = Rows(model, p + _prompt(V, 5, 93), 6, k=3, pool=sched.pool)
        _run(sched, {0: [hit]})
        assert hit.cached_tokens == len(p) - TAIL_MARGIN
        _same(hit.rows, _alone(model, p + _prompt(V, 5, 93), 6).rows, "from blocks and a tail kept in window slots")


def test_a_first_token_leaves_before_its_prompts_mtp_rows_and_block_writes(model, monkeypatch):
    """The step whose forward ends a prompt emits the first token without running the prompt's MTP head forwards or
    writing its prefix-cache blocks: those wait for the next step's start (`Scheduler.settle`) and leave what running
    them at once leaves: the request's bits, and a tail the next turn resumes from with a cold run's bits."""
    V = model.config.vocab_size
    sched = _sched(model, cache_mb=64)
    turn1 = _prompt(V, G + 100, 94)
    _run(sched, {0: [SpecSession(model, turn1, 4, k=3, pool=sched.pool)]})
    heads: list[int] = []
    real = type(model).mtp_forward
    monkeypatch.setattr(type(model), "mtp_forward", lambda self, *a, **kw: (heads.append(1), real(self, *a, **kw))[1])
    turn2 = turn1 + _prompt(V, 70, 95)
    b = Rows(model, turn2, 6, k=3, pool=sched.pool)
    sched.add(b)
    assert b.cached_tokens == len(turn1) - TAIL_MARGIN
    sched.step()
    assert b.emitted and not heads, "the first token waited for the prompt's MTP head forwards"
    assert b.scratch.length == b.cached_tokens - 1  # none of the new prompt rows written yet
    sched.settle()
    assert heads and b.scratch.length == len(turn2) - 1, "the deferred head forwards wrote every prompt row"
    _run(sched, {})
    _same(b.rows, _alone(model, turn2, 6).rows, "a turn whose first token left before its MTP rows")
    turn3 = turn2 + _prompt(V, 30, 96)
    c = Rows(model, turn3, 6, k=3, pool=sched.pool)
    _run(sched, {0: [c]})
    assert c.cached_tokens == len(turn2) - TAIL_MARGIN, "the deferred write cached the prompt's tail"
    _same(c.rows, _alone(model, turn3, 6).rows, "from a tail written after the first token")


def test_a_finished_request_whose_rows_are_cached_flushes_no_mtp_rows_for_them(model, monkeypatch):
    """A request's last MTP rows are flushed at its end only for the prefix cache (its decoded blocks and the tail at
    its end). When the cache holds those already (the same request again: greedy, the same answer), they are given
    back unwritten and no head forward runs for them; the entries stay, and a next turn resumes from the tail
    with a cold run's bits."""
    import engine.scheduler as scheduler_mod
    V = model.config.vocab_size
    sched = _sched(model, cache_mb=64)
    turn1 = _prompt(V, G + 100, 97)
    flushed: list[list[SpecSession]] = []
    real = scheduler_mod.flush_mtp_rows
    monkeypatch.setattr(scheduler_mod, "flush_mtp_rows", lambda m, rows, *a: (flushed.append(rows), real(m, rows, *a)))
    a = SpecSession(model, turn1, 300, k=3, pool=sched.pool)
    _run(sched, {0: [a]})
    assert [a] in flushed, "the first request's end flushed its last MTP rows"
    blocks = sched.cache.stats.blocks
    b = SpecSession(model, turn1, 300, k=3, pool=sched.pool)
    _run(sched, {0: [b]})
    assert b.emitted == a.emitted and len(turn1) + len(b.emitted) > 2 * G  # a decoded block and a tail past it
    assert not any(b in rows for rows in flushed), "rows the cache held were flushed again"
    assert sched.cache.stats.blocks == blocks
    turn2 = turn1 + a.emitted + _prompt(V, 40, 98)
    c = Rows(model, turn2, 6, k=3, pool=sched.pool)
    _run(sched, {0: [c]})
    assert c.cached_tokens == len(turn1) + len(a.emitted) - 1
    _same(c.rows, _alone(model, turn2, 6).rows, "a next turn from a tail its repeat did not write again")


def test_tails_are_leaves_of_their_chain(model):
    """A tail hangs under its chain's last block: eviction takes the tail before that block, lookup_tail verifies
    its tokens and parent, and insert_tail refuses a tail whose chain is not cached."""
    V = model.config.vocab_size
    sched = _sched(model, cache_mb=64)
    t = 37
    prompt = _prompt(V, G + t + TAIL_MARGIN, 26)  # its tail: the first t positions of block 1
    a = SpecSession(model, prompt, 1, k=3, pool=sched.pool)  # one token: no generation tail
    _run(sched, {0: [a]})
    pc = sched.cache
    keys = block_keys(prompt, 1, pc.root)
    ids = pc.lookup(prompt, keys)
    assert len(ids) == 1 and pc.lookup_tail(prompt, keys, ids) == (pc.lookup_tail(prompt, keys, ids)[0], t)
    assert pc.lookup_tail(prompt[:G + t] + [prompt[G + t] ^ 1] + prompt[G + t + 1:], keys, ids) \
        is not None  # the tokens after the tail do not matter
    assert pc.lookup_tail(prompt[:G + t], keys, ids) is None  # at least one token is left to prefill
    changed = prompt[:G + t - 1] + [(prompt[G + t - 1] + 1) % V] + prompt[G + t:]
    assert pc.lookup_tail(changed, keys, ids) is None  # its last token counts
    changed = prompt[:G + 5] + [(prompt[G + 5] + 1) % V] + prompt[G + 6:]
    assert pc.lookup_tail(changed, keys, ids) is None
    assert pc.lookup_tail(prompt, keys, []) is None  # not under another chain
    blocks = pc.stats.blocks
    pc._evict_one()  # noqa: SLF001 - the eviction order is the contract tested
    assert pc.stats.blocks == blocks - 1 and pc.lookup(prompt, keys) == ids
    assert pc.lookup_tail(prompt, keys, ids) is None
    bid = pc.reserve()
    other = _prompt(V, G + 17, 27)
    assert not pc.insert_tail(block_keys(other, 1, pc.root), other, 1, 16, 0, 0 if pc.mtp else None, bid)
    assert bid in pc._free  # noqa: SLF001 - released, not lost


def test_cancelled_mid_prefill_leaves_the_cache_consistent(model):
    V = model.config.vocab_size
    prompt = _prompt(V, 3 * G + 20, 31)
    ref = _alone(model, prompt, 8)
    sched = _sched(model, budget=G, cache_mb=64)
    s = SpecSession(model, prompt, 8, k=3, pool=sched.pool)
    sched.add(s)
    sched.step()
    sched.step()
    assert s.prefilling and s.cache.length == 2 * G
    sched.remove(s)
    assert sched.pool.num_free == sched.pool.slots and sched.cache.stats.blocks == 2
    again = Rows(model, prompt, 8, k=3, pool=sched.pool)
    _run(sched, {0: [again]})
    assert again.cached_tokens == 2 * G
    _same(again.rows, ref.rows, "after a cancelled prefill")


def test_sessions_on_one_new_prefix_compute_it_once_and_agree(model):
    """Three sessions join at once with one new 2-block prefix (and tails of their own): the first computes the
    blocks, the others wait for them instead of computing them again, then resume from the cache; all three have a
    cold run's bits. A fourth with the same prompt later resumes from the cache."""
    V = model.config.vocab_size
    base = _prompt(V, 2 * G + 9, 41)
    prompts = [base, base[:2 * G] + _prompt(V, 30, 42), base]
    refs = [_alone(model, p, 8) for p in prompts]
    sched = _sched(model, budget=G, cache_mb=64)
    ss = [Rows(model, p, 8, k=3, pool=sched.pool) for p in prompts]
    _run(sched, {0: ss})
    assert [s.cached_tokens for s in ss] == [0, 2 * G, 2 * G]
    assert [s.prefill_tokens for s in ss] == [2 * G + 9, 30, 9]
    later = Rows(model, base, 8, k=3, pool=sched.pool)
    _run(sched, {0: [later]})
    assert later.cached_tokens == len(base) - TAIL_MARGIN  # the first one's prompt tail
    for s, ref in zip(ss + [later], refs + refs[:1]):
        _same(s.rows, ref.rows, "same prefix at once")
    st = sched.prefix_stats()
    assert st.queries == sum(map(len, prompts)) + len(base) and st.hits == 2 * 2 * G + later.cached_tokens


def test_eviction_under_a_tiny_budget_keeps_hits_exact(model):
    V = model.config.vocab_size
    sched0 = _sched(model, cache_mb=64)
    block = sched0.cache.block_bytes
    sched = Scheduler(model, max_num_seqs=2, max_model_len=2600, k=3, max_num_batched_tokens=512,
                      prefix_cache_bytes=3 * block)
    pc = sched.cache
    assert pc.capacity == 3
    prompts = [_prompt(V, 2 * G + 5, 50 + i) for i in range(3)]
    for p in prompts:
        _run(sched, {0: [SpecSession(model, p, 1, k=3, pool=sched.pool)]})  # no generation tail
        assert pc.stats.blocks <= 3 and pc.stats.bytes == pc.stats.blocks * block
    # the oldest chain went first, leaf before root; the newest chain is whole (its two blocks and its tail)
    last = Rows(model, prompts[-1], 6, k=3, pool=sched.pool)
    _run(sched, {0: [last]})
    assert last.cached_tokens == len(prompts[-1]) - TAIL_MARGIN
    _same(last.rows, _alone(model, prompts[-1], 6).rows, "after evictions")
    first = Rows(model, prompts[0], 6, k=3, pool=sched.pool)
    _run(sched, {0: [first]})
    assert first.cached_tokens < 2 * G
    _same(first.rows, _alone(model, prompts[0], 6).rows, "an evicted prefix, recomputed")


def test_cache_off_is_a_miss(model):
    V = model.config.vocab_size
    prompt = _prompt(V, 2 * G + 3, 61)
    off = _sched(model, cache_mb=0)
    assert off.cache is None and off.prefix_stats() is None
    runs = []
    for _ in range(2):
        s = Rows(model, prompt, 8, k=3, pool=off.pool)
        _run(off, {0: [s]})
        assert s.cached_tokens == 0
        runs.append(s)
    on = _sched(model, cache_mb=64)
    s = Rows(model, prompt, 8, k=3, pool=on.pool)
    _run(on, {0: [s]})
    _same(runs[0].rows, runs[1].rows, "cache off, twice")
    _same(runs[0].rows, s.rows, "cache off vs a miss")


def test_prompt_logprobs_requests_prefill_everything(model):
    V = model.config.vocab_size
    prompt = _prompt(V, 2 * G + 3, 71)
    sched = _sched(model, cache_mb=64)
    _run(sched, {0: [SpecSession(model, prompt, 2, k=3, pool=sched.pool)]})
    s = Rows(model, prompt, 4, k=3, pool=sched.pool, prompt_logprobs=1)
    _run(sched, {0: [s]})
    assert s.cached_tokens == 0 and len(s.prompt_logprobs) == len(prompt)
    assert s.prompt_logprobs == _alone(model, prompt, 4, prompt_logprobs=1).prompt_logprobs


def test_stats_count_queried_and_hit_tokens(model):
    V = model.config.vocab_size
    prompt = _prompt(V, G + 10, 81)
    sched = _sched(model, cache_mb=64)
    for _ in range(2):
        _run(sched, {0: [SpecSession(model, prompt, 2, k=3, pool=sched.pool)]})
    st = sched.prefix_stats()
    assert (st.queries, st.hits) == (2 * len(prompt), len(prompt) - TAIL_MARGIN)  # the second hits the tail
    assert st.blocks >= 1 and st.bytes == st.blocks * sched.cache.block_bytes and st.capacity_bytes >= st.bytes


def test_a_moe_model_is_row_wise_on_the_c_path_too(tmp_path):
    """MoE on the C kernels: the router's GEMM, each expert's rows, the shared expert and its gate row by row, each
    token's experts summed in slot order. So a MoE model packs rows too, and a request's logits are the same bits
    alone, at K = 0 and 3, under load, and from the cache (blocks its decode completed included)."""
    model = load_model(make_checkpoint(tmp_path / "moe", seed=43, moe=True, with_tokenizer=False))
    assert packs_rows(model)
    V = model.config.vocab_size
    prompt = _prompt(V, G + 40, 44)
    ref = _alone(model, prompt, 260, k=3)
    _same(_alone(model, prompt, 260, k=0).rows, ref.rows, "MoE, K=0")
    sched = _sched(model, budget=7 * 4 + 60, cache_mb=64)
    s = Rows(model, prompt, 260, k=3, pool=sched.pool)
    _under_load(model, sched, s)
    _same(s.rows, ref.rows, "MoE under load")
    turn2 = prompt + s.emitted + _prompt(V, 9, 45)
    hit = Rows(model, turn2, 6, k=3, pool=sched.pool)
    _run(sched, {0: [hit]})
    assert hit.cached_tokens == len(prompt) + len(s.emitted) - 1 > 2 * G  # the answer's
    _same(hit.rows, _alone(model, turn2, 6, k=3).rows, "MoE from the cache")


# ------------------------------------------------------------------------------------------ the torch path
def _state(s: SpecSession) -> list[torch.Tensor]:
    out = []
    for c in s.pool.layers:
        if isinstance(c, KVPool):
            out += [c.k[s.slot, :s.cache.length].clone(), c.v[s.slot, :s.cache.length].clone()]
        else:
            out += [c.conv[s.slot, s.cache.cur].clone(), c.rec[s.slot, s.cache.cur].clone()]
    return out


def test_torch_path_prefill_bits_alone_under_load_and_from_the_cache(model):
    """Without the C kernels a forward carries one block of one session; the state a prompt leaves and its first
    token's logits are the same bits alone, next to decoding rows, and on a cache hit."""
    V = model.config.vocab_size
    prev = cpu.set_enabled(False)
    try:
        assert not packs_rows(model)
        prompt = _prompt(V, 2 * G + 45, 91)
        sched = _sched(model, cache_mb=64, max_len=1200)
        ref = Rows(model, prompt, 1, k=3, pool=sched.pool)
        sched.add(ref)
        while ref.prefilling:
            sched.step()
        ref_state = _state(ref)
        sched.remove(ref)
        sched2 = _sched(model, budget=7 * 4 + 100, max_len=1200)
        loaded = Rows(model, prompt, 1, k=3, pool=sched2.pool)
        _under_load(model, sched2, loaded, until_prefilled=True)
        _same(loaded.rows, ref.rows, "torch path, under load")
        _same(_state(loaded), ref_state, "torch path state, under load")
        hit = Rows(model, prompt, 1, k=3, pool=sched.pool)
        sched.add(hit)
        assert hit.cached_tokens == 2 * G
        while hit.prefilling:
            sched.step()
        _same(hit.rows, ref.rows, "torch path, from the cache")
        _same(_state(hit), ref_state, "torch path state, from the cache")
    finally:
        cpu.set_enabled(prev)


# ------------------------------------------------------------------------------------------ the cache itself
def _tiny_pool():
    from engine.model.config import Qwen35Config
    from tests.tiny import hf_config

    cfg = Qwen35Config.from_dict(hf_config())
    return StatePool(cfg, 2, 4 * G, 4, mtp=True)


def test_block_keys_chain_and_tokens_are_checked():
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    toks = list(range(3 * G + 1))
    keys = block_keys(toks, 3, pc.root)
    assert len(set(keys)) == 3 and block_keys(toks, 3, pc.root, keys[:1]) == keys
    other = block_keys([1] + toks[1:], 3, pc.root)
    assert all(a != b for a, b in zip(keys, other)), "a change in block 0 changes every later key"
    assert block_keys(toks, 1, PrefixCache(pool, MB, "another model").root) != keys[:1]
    for c in pool.layers:
        (c.k if isinstance(c, KVPool) else c.rec)[0].normal_()
    for b in range(2):
        assert pc.insert(keys, toks, b, 0, 0, window_slot=0, pre_last=torch.randn(pool.cfg.hidden_size))
    assert not pc.insert(keys, toks, 1, 0, 0, window_slot=0, pre_last=torch.zeros(pool.cfg.hidden_size))
    assert len(pc.lookup(toks, keys)) == 2
    assert len(pc.lookup(toks[:2 * G], keys)) == 1, "a lookup leaves at least one token to prefill"
    e = pc._index[keys[1]]
    e.tokens = (7,) + e.tokens[1:]  # a collision: same key, other tokens
    assert len(pc.lookup(toks, keys)) == 1
    with pytest.raises(ValueError):
        pc.insert(keys, toks, 2, 0, 0)


@pytest.mark.parametrize("slab", [16, 1], ids=["one-slab", "a-slab-a-block"])
def test_restore_copies_what_insert_kept(slab, monkeypatch):
    """A chain's blocks come back as they were written, gathered from one slab or from several; with `first` the
    rows the slot holds already are left alone."""
    monkeypatch.setattr(PrefixCache, "SLAB", slab)
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    toks = list(range(3 * G + 3))
    keys = block_keys(toks, 3, pc.root)
    for t in [*(x for c in pool.layers for x in ((c.k, c.v) if isinstance(c, KVPool) else (c.conv, c.rec))),
              pool.mtp.k, pool.mtp.v]:
        t.normal_()
    pres = [torch.randn(pool.cfg.hidden_size) for _ in range(3)]
    for b in range(3):
        pc.insert(keys, toks, b, 0, 0, window_slot=1, pre_last=pres[b])  # (the live state changes in between)
    ids = pc.lookup(toks, keys)
    assert len(ids) == 3
    kv = [x for c in pool.layers if isinstance(c, KVPool) for x in (c.k, c.v)] + [pool.mtp.k, pool.mtp.v]
    held = [t[1, :G].clone() for t in kv]  # what slot 1 holds before: `first` = 1 keeps it
    carrier = pc.restore(ids, 1, 2, 1, first=1)
    assert torch.equal(carrier, pres[2])
    for t, h in zip(kv, held):
        assert torch.equal(t[1, :G - 1], h[:G - 1]), "first = 1: block 0's rows are not copied"
    carrier = pc.restore(ids, 1, 2, 1)
    assert torch.equal(carrier, pres[2])
    for c in pool.layers:
        if isinstance(c, KVPool):
            assert torch.equal(c.k[1, :3 * G], c.k[0, :3 * G]) and torch.equal(c.v[1, :3 * G], c.v[0, :3 * G])
        else:
            assert torch.equal(c.rec[1, 2], c.rec[0, 1]) and torch.equal(c.conv[1, 2], c.conv[0, 1])
    assert torch.equal(pool.mtp.k[1, :3 * G - 1], pool.mtp.k[0, :3 * G - 1])
    assert torch.equal(pool.mtp.v[1, :3 * G - 1], pool.mtp.v[0, :3 * G - 1])


def test_eviction_takes_the_oldest_leaf_first():
    pool = _tiny_pool()
    probe = PrefixCache(pool, 64 * MB, "m")
    pc = PrefixCache(pool, 3 * probe.block_bytes, "m")
    h = pool.cfg.hidden_size
    a, b = list(range(3 * G)), [5] + list(range(1, 3 * G))
    ka, kb = block_keys(a, 3, pc.root), block_keys(b, 3, pc.root)
    for i in range(3):
        pc.insert(ka, a, i, 0, 0, window_slot=0, pre_last=torch.zeros(h))
    assert pc.stats.blocks == 3
    pc.insert(kb, b, 0, 0, 0, window_slot=0, pre_last=torch.zeros(h))  # evicts a's leaf, not its root
    assert pc.contains(ka[0]) and pc.contains(ka[1]) and not pc.contains(ka[2]) and pc.contains(kb[0])
    assert len(pc.lookup(a + [0], ka)) == 2  # touches a's chain: b's block is now the oldest leaf
    pc.insert(ka, a, 2, 0, 0, window_slot=0, pre_last=torch.zeros(h))
    assert not pc.contains(kb[0]) and all(pc.contains(k) for k in ka)
    bid = pc.reserve()
    assert bid is not None and pc.stats.blocks == 2, "a reservation takes room (an evicted leaf's)"
    pc.release(bid)
    assert not pc.insert(kb, b, 1, 0, 0, window_slot=0, pre_last=torch.zeros(h)), "no parent: not inserted"


def test_a_cache_that_cannot_grow_keeps_what_it_has(monkeypatch):
    """A slab that fails to allocate (the device is full) caps the cache at what it holds, logged, and evicts
    from then on: never an out-of-memory crash."""
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    toks = list(range(2 * G + 1))
    keys = block_keys(toks, 2, pc.root)
    h = pool.cfg.hidden_size
    assert pc.insert(keys, toks, 0, 0, 0, window_slot=0, pre_last=torch.zeros(h))
    pc._free.clear()  # the first slab is full
    monkeypatch.setattr(pc, "_slab", lambda n: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    assert not pc.insert(keys, toks, 1, 0, 0, window_slot=0, pre_last=torch.zeros(h)), "no room made for it"
    assert pc.capacity == PrefixCache.SLAB and pc.stats.capacity_bytes == pc.capacity * pc.block_bytes
