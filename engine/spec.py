"""MTP (NextN) speculative decoding, exact for greedy: the emitted stream equals plain greedy decode, and a
round runs every active session of a batch at once.

One round (`spec_round`, over the N running sessions of one state pool):
  1. draft: one MTP head forward per depth for all rows. Depth 0 writes each row's queued committed rows
     (exact trunk hiddens) and its last row yields d0; chained depths feed the head's own hidden and yield
     d1..d_{k-1}. Greedy and sampled drafts, penalties and the p-min cut are decided on the device;
  2. verify: one trunk forward over [last, d0..d_{k-1}] for every row (N x T tokens, rows with fewer drafts
     padded to T = max k + 1), writing the GDN state after every token to its own window slot;
  3. accept on the device: n_acc = longest prefix with argmax(col j) == d_j, bonus = argmax(col n_acc) (greedy)
     or Leviathan/Chen rejection sampling (sampled rows, equal in distribution);
  4. ONE host copy of (n_acc, drafted, tokens) for all rows; per row on the host: an optional SpecConstraint
     truncates at the first illegal accepted token and replaces an illegal bonus by the masked argmax of the
     target's own column (exact: a legal unmasked argmax IS the masked argmax); EOS among accepted drafts ends
     the row; commit last + d[:n_acc], emit d[:n_acc] + [bonus], and roll back in O(1): attention KV by length,
     GDN by making the recorded slot of the last kept token live.
A row whose own hook (grammar, penalties, sampler) raises at any step fails alone; the other rows go on as if it
had never been in the batch.
`SpecSession` holds one request's state; `engine.scheduler.Scheduler` batches sessions (continuous batching,
chunked prefill). A session built without a scheduler runs alone on a private one-slot pool (`generate_spec`).

This module keeps the public names and the round; the rest lives beside it: the session's state, prefill and
commit in `engine.session`, the draft and accept steps in `engine.draft`, the single-sequence forwards in
`engine.forward`, prefill forwards in `engine.prefill`. `ROUND_HOOK` is the one door for research code
(research/optipipe.py arms it); it is None unless armed.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .draft import _accept, _draft, rope_deltas
from .forward import MTP_CHUNK, decode_step_t, mtp_head_forward
from .graphs import EAGER, StepRunner
from .model.qwen35 import Qwen35ForCausalLM
from .prefill import prefill
from .sampling import SpecSampling
from .session import (DEFAULT_CAPMAX, PROMPT_LOGPROB_ROWS, SPEC_TELEM_POS, SessionState, SpecConstraint,
                      SpecTelemetry, TokenLogprob)

__all__ = [
    "SPEC_TELEM_POS", "SpecTelemetry", "SpecSampling", "SpecConstraint", "SpecSession", "TokenLogprob",
    "decode_step_t", "mtp_head_forward", "generate_spec", "prefill", "spec_round", "DraftedSession", "ROUND_HOOK",
    "DEFAULT_CAPMAX", "MTP_CHUNK", "PROMPT_LOGPROB_ROWS",
]

#: The research door: None unless armed (research/optipipe.py sets it). Armed, `spec_round` calls
#: ROUND_HOOK(rows, ks) before drafting; what it returns (None, or an object with `resolve(model, drafts, host)`)
#: is resolved after the round's commits. The round's drafts, verify, acceptance and commits never depend on it.
ROUND_HOOK: Callable[[list[Any], list[int]], Any] | None = None


class SpecSession(SessionState):
    """Per-request decode state (`engine.session.SessionState`) that can also run alone.

    k = 0 (or a model without MTP) is plain decode. Alone (no scheduler): `step(max_rounds)` runs prefill and
    emits the first token on the first call, then up to max_rounds rounds, and returns the newly emitted token
    ids. Inside a `Scheduler` the scheduler drives `prefill_chunk` / `spec_round` instead. Greedy output is
    identical for every k and every batch; `max_new_tokens` is never exceeded (the last rounds draft fewer
    tokens instead).
    """

    def step(self, max_rounds: int = 1) -> list[int]:
        """Alone: advance the session; returns the newly emitted token ids (empty only once finished). A hook that
        raises in a round (its grammar, ...) fails the session and the exception propagates."""
        if self.finished or self._closed:
            return []
        start = len(self.emitted)
        if not self.started:
            while self.prefilling:
                self.prefill_chunk()
            return self.emitted[start:]
        for _ in range(max_rounds):
            if self.finished:
                break
            spec_round(self.model, [self])
            if self.error is not None:  # alone, a failure is the caller's exception
                raise self.error
        return self.emitted[start:]

    def run(self) -> list[int]:
        """Step until finished; returns all emitted tokens."""
        while not self.finished:
            self.step(max_rounds=64)
        return list(self.emitted)


class DraftedSession(SpecSession):
    """A SpecSession whose drafts a host function chooses: `drafter(pos, j, d)` gets the MTP head's draft d for
    sequence position pos (draft j of the round) and returns the token to draft instead; a constraint still
    checks it after. For tests, benchmarks and the research harness that need known drafts (wrong ones to reach
    every acceptance length, an oracle's); serving never builds one. Drafts never change the output."""

    def __init__(self, *args: Any, drafter: Callable[[int, int, int], int], **kw: Any):
        self.drafter = drafter
        super().__init__(*args, **kw)

    @property
    def drafts_on_host(self) -> bool:
        """Always: every draft goes through `drafter`."""
        return True

    def host_draft(self, pos: int, j: int, d: int) -> int | None:
        """`drafter`'s token, then the constraint's decision on it (if the constraint checks drafts)."""
        d = self.drafter(pos, j, d)
        return super().host_draft(pos, j, d) if super().drafts_on_host else d


@torch.inference_mode()
def spec_round(model: Qwen35ForCausalLM, rows: list[SpecSession], runner: StepRunner = EAGER) -> None:
    """One speculative round for every session in `rows` (all started, unfinished, in one pool): draft, one
    verify forward of N x T tokens, acceptance on the device, ONE host copy, then each row's commit.
    `runner` runs the forwards (engine/graphs.py: eagerly, or the scheduler's CUDA graphs). A row whose own hook
    (grammar, penalties, sampler) raises fails alone (`SpecSession.fail`): while drafting, it leaves the round before
    the verify; in acceptance or commit, its result is dropped. Every op is row-wise, so the other rows' tokens and
    logits are bit for bit those of a round without it. A batched forward that fails raises: every row is in doubt."""
    ks = [r.k_round() for r in rows]
    for r, k in zip(rows, ks):
        r.telem.k_rounds, r.telem.k_sum = r.telem.k_rounds + 1, r.telem.k_sum + k
    hook = ROUND_HOOK  # the research door: None unless armed
    fork = hook(rows, ks) if hook is not None else None
    drafts, qs = _draft(model, rows, ks, runner)  # [N, K]
    if any(r.error is not None for r in rows):  # rows a hook failed while drafting leave before the verify
        keep = [i for i, r in enumerate(rows) if r.error is None]
        rows, ks, qs, fork = [rows[i] for i in keep], [ks[i] for i in keep], [qs[i] for i in keep], None
        if not rows:
            return
        drafts = drafts[keep, :max(ks)]  # [N', K'] as if the failed rows had never drafted
    tokens = torch.cat([torch.tensor([[r.pending] for r in rows], device=drafts.device), drafts.clamp_min(0)], 1)
    pre, post, logits = runner.verify(model, rows[0].pool, tokens, [r.slot for r in rows],
                                      [r.cache.length for r in rows], [r.cache.cur for r in rows],
                                      **rope_deltas(rows))  # [N, T, *]
    n_acc, out = _accept(rows, logits, drafts, qs, ks)
    host = torch.cat([n_acc[:, None], (drafts >= 0).sum(1, keepdim=True), out], 1).tolist()  # the one host sync
    for i, r in enumerate(rows):
        if r.error is not None:  # a hook failed in acceptance
            continue
        na, kd, *toks = host[i]
        try:
            r.commit_round(kd, na, toks[:na + 1], logits[i], (post if r.hidden_mode == "post" else pre)[i], pre[i])
        except Exception as e:  # noqa: BLE001 - one row's failure (e.g. its grammar) fails that row only
            r.fail(e)
    if fork is not None:  # research: shadow check and resolution; never changes a token or the committed state
        fork.resolve(model, drafts, host)


def generate_spec(model: Qwen35ForCausalLM, prompt_ids: list[int], max_new_tokens: int, k: int = 3,
                  **kw) -> tuple[list[int], SpecTelemetry]:
    """Generate with speculation (k = 0: plain) for one session alone; returns (emitted tokens, telemetry)."""
    sess = SpecSession(model, prompt_ids, max_new_tokens, k=k, **kw)
    toks = sess.run()
    return toks, sess.telem
