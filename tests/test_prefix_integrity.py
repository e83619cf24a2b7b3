"""The prefix cache's integrity (engine/cache.py): a restored carrier is the session's own copy, a forced hash-key
collision never returns state computed from other tokens, and its memory is reported as both what its index holds
and what it has allocated."""
from __future__ import annotations

import pytest
import torch

from engine.cache import PREFILL_GRID as G
from engine.cache import TAIL_MARGIN, PrefixCache, StatePool, block_keys
from engine.loader import load_model
from engine.scheduler import Scheduler
from engine.spec import SpecSession
from metrics.prometheus import ServingMetrics
from tests.tiny import make_checkpoint

MB = 1 << 20


class Rows(SpecSession):
    """A session that keeps the raw logit row each emitted token was chosen from (test-only: a subclass)."""

    def _emit(self, toks, rows):
        self.rows = getattr(self, "rows", []) + [r.clone() for r in rows[:len(toks)]]
        super()._emit(toks, rows)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("integrity"), seed=17, with_tokenizer=False))


def _prompt(V: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 64, (n,), generator=g).tolist()


def _drain(sched: Scheduler) -> None:
    for _ in range(2000):
        if not sched.num_sessions:
            return
        sched.step()
    raise AssertionError("the batch never finished")


def _tiny_pool() -> StatePool:
    from engine.model.config import Qwen35Config
    from tests.tiny import hf_config

    return StatePool(Qwen35Config.from_dict(hf_config()), 2, 4 * G, 4, mtp=True)


@pytest.mark.parametrize("hidden_mode", ["post", "pre"])
def test_an_eviction_after_a_restore_leaves_the_sessions_carrier_alone(model, hidden_mode):
    """A one-block cache: B resumes from A's block, then (before B's next forward) another block is inserted, which
    evicts A's block and writes its slab row. B's carrier (and, with the pre-norm hidden as the MTP head's input,
    the MTP row it feeds) is B's own copy: unchanged, and B's logits, drafts and MTP rows are a cold run's bits.
    (B finishes before its slot could be reused, so its MTP rows are still there to compare.)"""
    V = model.config.vocab_size
    prompt = _prompt(V, G + TAIL_MARGIN, 3)  # its tail would be block 0 itself: the one block holds the prefix
    cold = Rows(model, prompt, 12, k=3, hidden_mode=hidden_mode)
    cold.run()
    probe = Scheduler(model, max_num_seqs=2, max_model_len=1024, k=3, max_num_batched_tokens=512,
                      prefix_cache_bytes=64 * MB)
    sched = Scheduler(model, max_num_seqs=2, max_model_len=1024, k=3, max_num_batched_tokens=512,
                      prefix_cache_bytes=probe.cache.block_bytes)
    del probe
    pc = sched.cache
    assert pc.capacity == 1
    sched.add(SpecSession(model, prompt, 1, k=3, pool=sched.pool, hidden_mode=hidden_mode))  # no generation tail
    _drain(sched)
    b = Rows(model, prompt, 12, k=3, pool=sched.pool, hidden_mode=hidden_mode)
    sched.add(b)
    assert b.cached_tokens == G
    carrier = b.last_pre.clone()
    other = _prompt(V, G, 4)
    H = model.config.hidden_size
    assert pc.insert(block_keys(other, 1, pc.root), other, 0, b.slot, b.slot, window_slot=b.cache.cur,
                     pre_last=torch.full((H,), 7.0))
    assert not pc.contains(block_keys(prompt, 1, pc.root)[0]), "the eviction took the block B resumed from"
    assert torch.equal(b.last_pre, carrier)
    _drain(sched)
    assert b.emitted == cold.emitted and len(b.rows) == len(cold.rows)
    assert all(torch.equal(x, y) for x, y in zip(b.rows, cold.rows)), "logit rows differ from a cold run"
    assert b.telem == cold.telem, "the drafts differ from a cold run's (the MTP carrier changed)"
    n = cold.scratch.length  # (B may hold the last round's rows too: written for the tail it left when it finished)
    assert b.scratch.length >= n and all(torch.equal(x, y) for x, y in zip(b.scratch.rows(n), cold.scratch.rows(n))), \
        "the MTP head's rows differ from a cold run's (its carrier changed)"


def test_restore_returns_a_copy():
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    toks = list(range(G + 1))
    keys = block_keys(toks, 1, pc.root)
    pre = torch.randn(pool.cfg.hidden_size)
    assert pc.insert(keys, toks, 0, 0, 0, window_slot=0, pre_last=pre)
    carrier = pc.restore(pc.lookup(toks, keys), 1, 1, 1)
    assert torch.equal(carrier, pre)
    pc.capture_state(pc.lookup(toks, keys)[0], 0, 0, torch.zeros_like(pre))  # the block's row is rewritten
    assert torch.equal(carrier, pre)


def test_a_forced_key_collision_never_returns_other_tokens_state():
    """R's first block differs from P's but is forced onto P's key (a collision), and R's second block is Q's. R's
    second block, computed after R's own first block, must not be cached under P's first block: a prompt Q = P's
    first block + that second block would then resume from state computed from R's first block."""
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    H = pool.cfg.hidden_size
    P = list(range(G + 1))
    Q = P[:G] + [t + 2 for t in range(G)] + [0]
    R = [t + 1 for t in P[:G]] + Q[G:]
    kp, kq = block_keys(P, 1, pc.root), block_keys(Q, 2, pc.root)
    kr = block_keys(R, 2, pc.root, kp[:1])  # forced: R's first block has P's key; its second chains from it
    assert kr == kq != block_keys(R, 2, pc.root)
    assert pc.insert(kp, P, 0, 0, 0, window_slot=0, pre_last=torch.zeros(H))
    assert not pc.insert(kr, R, 0, 1, 1, window_slot=0, pre_last=torch.ones(H)), "a taken key is not inserted"
    assert not pc.insert(kr, R, 1, 1, 1, window_slot=0, pre_last=torch.ones(H)), \
        "R's second block was cached under a first block that is not R's"
    assert len(pc.lookup(Q, kq)) == 1, "Q would resume from R's state"
    # the chain as it should be: Q's own second block goes in, and a hit walks both blocks
    assert pc.insert(kq, Q, 1, 0, 0, window_slot=0, pre_last=torch.zeros(H))
    assert len(pc.lookup(Q, kq)) == 2 and pc.stats.blocks == 2


def test_resident_and_indexed_bytes_are_both_reported():
    pool = _tiny_pool()
    pc = PrefixCache(pool, 64 * MB, "m")
    assert pc.stats.resident_bytes == 0 and pc.stats.bytes == 0
    toks = list(range(G + 1))
    assert pc.insert(block_keys(toks, 1, pc.root), toks, 0, 0, 0, window_slot=0,
                     pre_last=torch.zeros(pool.cfg.hidden_size))
    slab = min(PrefixCache.SLAB, pc.capacity)
    assert pc.stats.bytes == pc.block_bytes
    assert pc.stats.resident_bytes == slab * pc.block_bytes > pc.stats.bytes, "one slab is allocated, one block used"
    m = ServingMetrics("m", 0)
    m.set_prefix_cache(pc.stats)
    text = m.render()[0].decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("nextn_prefix_cache_")}
    assert values["nextn_prefix_cache_bytes"] == pc.block_bytes
    assert values["nextn_prefix_cache_resident_bytes"] == slab * pc.block_bytes



@pytest.mark.parametrize("captured", [False, True])
def test_an_insert_that_raises_gives_its_block_back(captured):
    """A copy that raises inside `insert` (a pool slot out of range here) must not leak the block it allocated or
    was handed reserved: afterwards every block of the cache can still be reserved, and the key is not indexed."""
    pool = _tiny_pool()
    probe = PrefixCache(pool, 64 * MB, "m")
    pc = PrefixCache(pool, 3 * probe.block_bytes, "m")
    toks = list(range(G + 1))
    keys = block_keys(toks, 1, pc.root)
    H = pool.cfg.hidden_size
    bid = None
    if captured:
        bid = pc.reserve()
        pc.capture_state(bid, 0, 0, torch.zeros(H))
    with pytest.raises(IndexError):
        pc.insert(keys, toks, 0, 99, 0, window_slot=0, pre_last=torch.zeros(H), bid=bid)  # slot 99: no such slot
    assert not pc.contains(keys[0]) and pc.stats.blocks == 0
    got = [pc.reserve() for _ in range(pc.capacity)]
    assert None not in got and len(set(got)) == pc.capacity == 3, "a block was lost by the failed insert"
