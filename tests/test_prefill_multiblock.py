"""Several grid blocks of ONE session in one prefill forward, as one row (the kernel path; here the Triton interpreter
under `ops.force_kernels`, the C kernels off): the scheduler gives a session all the blocks it granted it in one
row (at most K+1 while the prefix cache writes), and what the prefill leaves (first token's logits, K/V rows, GDN and
conv states, MTP head rows and queued row, the prefix cache's blocks) is bitwise what one block per forward leaves.
A spy counts the forwards, so the test fails if the packing silently stops."""
from __future__ import annotations

import pytest
import torch

import engine.cache as cache_mod
import engine.scheduler as sched_mod
import engine.session as session_mod
from engine.cache import PREFILL_GRID, KVPool, block_keys
from engine.prefill import prefill_rows
from engine.scheduler import Scheduler
from tests.ops_util import needs_triton
from tests.test_kernel_path import V, _model
from tests.test_prefill_packed import _state, kernel_path  # noqa: F401 - a fixture
from tests.test_prefix import Rows

pytestmark = needs_triton

G = 16  # the test's grid (a divisor of PREFILL_GRID): blocks of 16 tokens keep the interpreter quick


@pytest.fixture
def grid(kernel_path, monkeypatch):
    """The kernel path on a CPU (`kernel_path`) with the grid G."""
    assert PREFILL_GRID % G == 0
    monkeypatch.setattr(session_mod, "PREFILL_GRID", G)
    monkeypatch.setattr(sched_mod, "PREFILL_GRID", G)
    monkeypatch.setattr(cache_mod, "PREFILL_GRID", G)  # the prefix cache's blocks too


def _run(m, prompts, k: int, packed: bool, cache: bool, monkeypatch, n_new: int = 4):
    """Every prompt joins one scheduler at once and prefills in one step (the budget takes every block); packed=False:
    one block per forward (the scheduler's waves). Returns the sessions, the scheduler and the blocks of each
    forward's rows."""
    sched = Scheduler(m, max_num_seqs=len(prompts) + 1, max_model_len=6 * G, k=k, max_num_batched_tokens=14 * G,
                      step_graphs=False, prefix_cache_bytes=(64 << 20) if cache else 0)
    assert sched.packs
    sched.packs = packed
    forwards: list[list[int]] = []

    def spy(model, rows, blocks=None, *a, **kw):
        forwards.append(list(blocks) if blocks is not None else [1] * len(rows))
        return prefill_rows(model, rows, blocks, *a, **kw)

    monkeypatch.setattr(sched_mod, "prefill_rows", spy)
    ss = [Rows(m, p, n_new, k=k, pool=sched.pool) for p in prompts]
    for s in ss:
        sched.add(s)
    sched.step()
    sched.settle()  # the prompts' MTP rows and block writes wait behind their first tokens
    assert not sched.joining and all(s.error is None and len(s.emitted) >= 1 for s in ss)
    return ss, sched, forwards


def _cached(sched: Scheduler, prompt: list[int]) -> list[torch.Tensor]:
    """The prefix cache's blocks of `prompt`, each chain 0..b restored into a spare slot of the pool (a restore
    copies the GDN state of its last block only, so every block's boundary state is read): the number of blocks,
    then per chain its carrier, K/V rows, GDN states and MTP rows."""
    pc, pool = sched.cache, sched.pool
    n = (len(prompt) - 1) // G
    keys = block_keys(prompt, n, pc.root)
    out = [torch.tensor(len(pc.lookup(prompt, keys)))]
    for b in range(1, n + 1):
        ids = pc.lookup(prompt[:b * G + 1], keys[:b])
        if len(ids) < b:
            break
        slot = pool.alloc()
        out.append(pc.restore(ids, slot, 0, slot if pool.mtp is not None else None))
        L = b * G
        for c in pool.layers:
            out += [c.k[slot, :L], c.v[slot, :L]] if isinstance(c, KVPool) else [c.conv[slot, 0], c.rec[slot, 0]]
        if pool.mtp is not None:
            out += [pool.mtp.k[slot, :L - 1], pool.mtp.v[slot, :L - 1]]
        out = [t.clone() for t in out]
        pool.free(slot)
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b)
    for j, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: tensor {j} differs packed vs one block per forward"


@pytest.mark.slow  # ~14 s under the interpreter; test_a_hit_on_blocks_cached_from_one_row_... is the quick guard
def test_a_sessions_blocks_in_one_forward_equal_one_block_per_forward(grid, monkeypatch):
    """Three sessions, two of them multi-block (4 blocks + 5 and 2 blocks + 3: prompt ends off the grid) and one
    short; K = 3. Packed without the prefix cache: one forward; with it a row takes at most 4 blocks, so the 5-block
    prompt needs two forwards. Both leave what one block per forward leaves (with the cache on: every block cached
    the same)."""
    m = _model(False, "float32", seed=41)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (4 * G + 5, 7, 2 * G + 3)]
    one, s1, f1 = _run(m, prompts, 3, False, True, monkeypatch)
    assert f1 == [[1]] * 9, f1  # one block per forward: 5 + 1 + 3
    for cache in (False, True):
        packed, s2, f2 = _run(m, prompts, 3, True, cache, monkeypatch)
        # packed: one forward for the three rows (padded 69 x 3 <= 224) ... with the cache, 4 blocks, then the fifth
        assert f2 == ([[4, 1, 3], [1]] if cache else [[5, 1, 3]]), f2
        for i, (a, b) in enumerate(zip(packed, one)):
            assert a.emitted == b.emitted and torch.equal(a.rows[0], b.rows[0]), f"prompt {i}: first token's logits"
            _same(_state(a), _state(b), f"prompt {i}, cache {cache}")
            if cache:
                got, want = _cached(s2, prompts[i]), _cached(s1, prompts[i])
                assert int(want[0]) == (len(prompts[i]) - 1) // G, "every full block of the prompt is cached"
                _same(got, want, f"prompt {i}'s prefix-cache blocks")


def test_a_hit_on_blocks_cached_from_one_row_gives_the_misses_bits(grid, monkeypatch):
    """A 4-block prompt prefills in one row, its 3 full blocks cached from the window slots that kept the inner
    boundaries' states; the same prompt again resumes from them and its first token's logits are the miss's."""
    m = _model(False, "float32", seed=42)
    g = torch.Generator().manual_seed(8)
    p = torch.randint(0, V, (3 * G + 2,), generator=g).tolist()
    ss, sched, f = _run(m, [p], 3, True, True, monkeypatch)
    assert f == [[4]], f
    again = Rows(m, p, 4, k=3, pool=sched.pool)
    sched.add(again)
    sched.step()
    assert again.error is None and again.cached_tokens == 3 * G
    assert again.emitted[:1] == ss[0].emitted[:1] and torch.equal(again.rows[0], ss[0].rows[0])


@pytest.mark.slow
def test_greedy_spec_equals_plain_after_a_multiblock_prefill(grid, monkeypatch):
    """Greedy decode after a multi-block prefill: spec (K = 3) == plain (K = 0), token for token."""
    m = _model(False, "float32", seed=43)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3 * G + 5, 2 * G)]
    outs = {}
    for k in (0, 3):
        ss, sched, f = _run(m, prompts, k, True, False, monkeypatch, n_new=5)
        assert f[0] == [4, 2], f
        while sched.num_sessions:
            sched.step()
        outs[k] = [s.emitted for s in ss]
    assert all(len(o) == 5 for o in outs[0]) and outs[3] == outs[0]
