"""MTP (NextN) speculative decoding, exact for greedy: the emitted stream equals plain greedy decode.

One round (`SpecSession._spec_round`):
  1. draft: the MTP head first writes its pending committed rows (exact trunk hiddens) and its last row
     yields d0; chained steps feed the head's own hidden and yield d1..d_{k-1} (p-min may cut the chain:
     the failing token is discarded and counted nowhere);
  2. verify: one trunk forward over [last, d0..d_{k-1}] (T = k+1, all columns), keeping per-position GDN states;
  3. accept: n_acc = longest prefix with argmax(col j) == d_j, bonus = argmax(col n_acc); an optional
     SpecConstraint then truncates at the first illegal accepted token and replaces an illegal bonus by the
     masked argmax of the target's own column (exact: a legal unmasked argmax IS the masked argmax);
  4. commit last + d[:n_acc], emit d[:n_acc] + [bonus], roll every cache back to the committed length in
     O(state) (attention KV by length, GDN from the recorded per-position state).
Sampling (temperature > 0) replaces 3 by Leviathan/Chen rejection sampling (equal in distribution).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch

from .cache import ModelCache, MtpScratch
from .model.qwen35 import Qwen35ForCausalLM
from .sampling import PenaltyState, SpecSampling, probs_from_logits, sample

__all__ = [
    "SPEC_TELEM_POS", "SpecTelemetry", "SpecSampling", "SpecConstraint", "SpecSession", "TokenLogprob",
    "decode_step_t", "mtp_head_forward", "generate_spec", "prefill",
]

SPEC_TELEM_POS = 8  # tracked draft positions (serve K defaults to 3; gates sweep K = 1..8)
DEFAULT_CAPMAX = 7
PREFILL_CHUNK = 512


@dataclass
class SpecTelemetry:
    """Per-draft-position acceptance counters (vLLM / llama.cpp schema), updated once per verify round after
    grammar truncation. p-min-discarded draft tokens count in neither drafted nor accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_drafted: list[int] = field(default_factory=lambda: [0] * SPEC_TELEM_POS)
    pos_accepted: list[int] = field(default_factory=lambda: [0] * SPEC_TELEM_POS)

    def record_round(self, k_round: int, n_acc: int) -> None:
        """Count one verify round that drafted k_round tokens of which n_acc were accepted."""
        self.rounds += 1
        self.drafted += k_round
        self.accepted += n_acc
        for j in range(min(k_round, SPEC_TELEM_POS)):
            self.pos_drafted[j] += 1
        for j in range(min(n_acc, SPEC_TELEM_POS)):
            self.pos_accepted[j] += 1

    def delta_since(self, prev: "SpecTelemetry") -> "SpecTelemetry":
        """Fieldwise saturating self - prev (never negative)."""
        sub = lambda a, b: max(a - b, 0)  # noqa: E731
        return SpecTelemetry(sub(self.rounds, prev.rounds), sub(self.drafted, prev.drafted),
                             sub(self.accepted, prev.accepted),
                             [sub(a, b) for a, b in zip(self.pos_drafted, prev.pos_drafted)],
                             [sub(a, b) for a, b in zip(self.pos_accepted, prev.pos_accepted)])

    def merge(self, d: "SpecTelemetry") -> None:
        """Fieldwise += d."""
        self.rounds += d.rounds
        self.drafted += d.drafted
        self.accepted += d.accepted
        self.pos_drafted = [a + b for a, b in zip(self.pos_drafted, d.pos_drafted)]
        self.pos_accepted = [a + b for a, b in zip(self.pos_accepted, d.pos_accepted)]

    def copy(self) -> "SpecTelemetry":
        return SpecTelemetry(self.rounds, self.drafted, self.accepted, list(self.pos_drafted), list(self.pos_accepted))

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """(accepted + rounds) / rounds: mean tokens emitted per verify round (bonus included)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def to_dict(self, k: int | None = None) -> dict:
        """JSON form; positions trimmed to k (default: the deepest position ever drafted)."""
        n = k if k is not None else max((j + 1 for j, c in enumerate(self.pos_drafted) if c), default=0)
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 6),
                "pos_drafted": self.pos_drafted[:n], "pos_accepted": self.pos_accepted[:n]}


@runtime_checkable
class SpecConstraint(Protocol):
    """Grammar hook; the engine never imports a grammar library. Contract (verify-side truncation rule):
    the exactness walk runs unmasked; accepted drafts are checked in order with `is_allowed` and `consume`d
    until the first illegal one (acceptance is truncated there); a cut or an illegal bonus is replaced by the
    masked argmax of the target's own column; every emitted token is `consume`d in order. EOS handling is
    the implementor's job. Optional draft-side hooks: `draft_begin()`, `draft_allowed(tok) -> bool`
    (False stops the draft chain before that token)."""

    def is_allowed(self, tok: int) -> bool: ...

    def mask_logits(self, row: torch.Tensor) -> torch.Tensor: ...

    def consume(self, tok: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of an emitted token under the target model's raw distribution, plus top alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def prefill(model: Qwen35ForCausalLM, ids: list[int], cache: ModelCache, chunk: int = PREFILL_CHUNK,
            want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run `ids` into `cache` at cache.length in chunks. Returns (fp32 logits of the last row [V],
    post-norm hiddens [T, H] and pre-norm hiddens [T, H] of every row when want_hidden, else None)."""
    dev = model.lm_head.weight.device
    cache.check_room(len(ids))
    pres, last = [], None
    for c0 in range(0, len(ids), chunk):
        x = torch.tensor([ids[c0:c0 + chunk]], device=dev)
        h = model.forward_hidden(x, cache.length, cache)[0]  # [t, H]
        cache.length += x.shape[1]
        if want_hidden:
            pres.append(h)
        last = h[-1]
    hpost_last = model.model.norm(last)
    logits = model.logits(hpost_last)
    if not want_hidden:
        return logits, None, None
    pre = torch.cat(pres)
    return logits, model.model.norm(pre), pre


def decode_step_t(model: Qwen35ForCausalLM, tokens: list[int], pos0: int, cache: ModelCache,
                  record: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward over T tokens at positions pos0.. (cache.length must equal pos0); advances the cache by T.

    Returns (fp32 logits [T, V] for every column, post-norm hidden [T, H], pre-norm hidden [T, H]).
    record=True keeps per-position GDN states (the caller must have called cache.snapshot())."""
    assert cache.length == pos0, (cache.length, pos0)
    cache.check_room(len(tokens))
    x = torch.tensor([tokens], device=model.lm_head.weight.device)
    pre = model.forward_hidden(x, pos0, cache, record=record)[0]  # [T, H]
    cache.length += len(tokens)
    post = model.model.norm(pre)
    return model.logits(post), post, pre


def mtp_head_forward(model: Qwen35ForCausalLM, tokens: list[int], hidden: torch.Tensor, pos: int,
                     scratch: MtpScratch, chunk: int = PREFILL_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """NextN step(s): rows (token i+1, trunk/head hidden of row i) at positions pos.. write the head's K/V into
    `scratch`; returns (fp32 draft logits of the LAST row [V], head hidden after mtp.norm of the last row [1, H]).
    T = 1 for a chained draft; after a prefill T is the prompt length, run in chunks of `chunk` rows, and only the
    last row (the one whose draft is used) ever gets logits, so memory stays O(chunk * context + V)."""
    hm = hidden[:0]
    for c0 in range(0, len(tokens), chunk):
        x = torch.tensor([tokens[c0:c0 + chunk]], device=hidden.device)
        hm = model.mtp_forward(x, hidden[None, c0:c0 + chunk], pos + c0, scratch.kv)[0]  # [t, H]
    last = hm[-1:]  # [1, H]
    return model.logits(last[0]), last


class SpecSession:
    """Per-request decode state: trunk cache, MTP scratch, committed tokens, telemetry.

    k = 0 (or a model without MTP) is plain decode. `step(max_rounds)` is the worker's unit of work: the first
    call runs prefill and emits the first token; later calls run up to max_rounds rounds (verify rounds for
    k > 0, single-token steps for k = 0) and return the newly emitted token ids. Greedy output is identical
    for every k; `max_new_tokens` is never exceeded (the last rounds draft fewer tokens instead).
    """

    def __init__(self, model: Qwen35ForCausalLM, prompt_ids: list[int], max_new_tokens: int, *, k: int = 3,
                 sampling: SpecSampling = SpecSampling(), constraint: SpecConstraint | None = None,
                 eos_ids: list[int] | tuple[int, ...] | set[int] = (), p_min: float = 0.0,
                 capmax: int = DEFAULT_CAPMAX, logprobs: int | None = None, hidden_mode: str = "post",
                 max_len: int | None = None, draft_override: Callable[[int, int, int], int] | None = None,
                 stats_line: bool = False):
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if k < 0 or k > capmax:
            raise ValueError(f"k must be in [0, capmax={capmax}], got {k}")
        if hidden_mode not in ("post", "pre"):
            raise ValueError("hidden_mode must be 'post' or 'pre'")
        cfg = model.config
        self.model, self.cfg = model, cfg
        # no MTP head -> plain; sampled + constrained -> plain (the truncation rule is a greedy-exactness rule)
        self.k = k if cfg.has_mtp and (constraint is None or sampling.greedy) else 0
        self.sampling, self.constraint = sampling, constraint
        self.eos = set(eos_ids)
        self.p_min, self.capmax, self.hidden_mode = p_min, capmax, hidden_mode
        self.want_logprobs = logprobs
        self.draft_override = draft_override
        self.stats_line = stats_line
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        dev, dt = model.lm_head.weight.device, cfg.dtype
        need = len(prompt_ids) + max_new_tokens + capmax + 1
        self.max_len = max(max_len or 0, need)
        self.cache = ModelCache(cfg, self.max_len, dev, dt, window=capmax + 1)
        self.scratch = MtpScratch(cfg, self.max_len, dev, dt) if self.k > 0 else None
        self.committed: list[int] = []  # tokens whose K/V + state are in the trunk cache
        self.pending: int | None = None  # last emitted token, not yet in the trunk cache
        self.emitted: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.telem = SpecTelemetry()
        self.full_accept = 0
        self.len_hist = [0] * (capmax + 1)  # rounds by drafted length
        self.acc_hist = [0] * (capmax + 1)  # rounds by accepted length
        self.constraint_cuts = 0  # rounds where the constraint truncated acceptance
        self.finished = False
        self.finish_reason: str | None = None
        self._started = False
        self._pen = PenaltyState(self.prompt_ids)
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        # MTP rows waiting to be written: row i = (token i+1, carrier hidden h_i), rows scratch.length..
        self._mtp_tokens: list[int] = []
        self._mtp_hidden: torch.Tensor | None = None
        self.prefill_tokens = 0  # tokens run through prefill (multi-turn reuse prefills only the new suffix)
        self._constraint_consumed = 0  # drafts already consumed by the constraint walk of this round
        self._closed = False

    # ------------------------------------------------------------------ public
    def step(self, max_rounds: int = 1) -> list[int]:
        """Advance the session; returns the newly emitted token ids (empty only once finished)."""
        if self.finished or self._closed:
            return []
        start = len(self.emitted)
        if not self._started:
            self._started = True
            self._prefill()
            return self.emitted[start:]
        for _ in range(max_rounds):
            if self.finished:
                break
            remaining = self.max_new_tokens - len(self.emitted)
            k_round = min(self.k, remaining - 1)
            if k_round > 0:
                self._spec_round(k_round)
            else:
                self._plain_step()
        return self.emitted[start:]

    def run(self) -> list[int]:
        """Step until finished; returns all emitted tokens."""
        while not self.finished:
            self.step(max_rounds=64)
        return list(self.emitted)

    def close(self) -> None:
        """Free the caches (idempotent). The session cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        self.finished = True
        self.finish_reason = self.finish_reason or "abort"
        self.cache = None  # type: ignore[assignment]
        self.scratch = None
        self._mtp_hidden = None

    def continue_turn(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Multi-turn reuse: `prompt_ids` must start with this session's whole sequence (prompt + emitted);
        only the new suffix is prefilled. The session then generates up to max_new_tokens more tokens."""
        if self._closed or not self._started:
            raise RuntimeError("continue_turn needs a started, open session")
        if self.constraint is not None:
            raise ValueError("continue_turn is not supported with a constraint")
        seq = self.committed + [self.pending]
        if len(prompt_ids) <= len(seq) or prompt_ids[:len(seq)] != seq:
            raise ValueError("new prompt does not extend the committed sequence")
        if len(prompt_ids) + max_new_tokens + self.capmax + 1 > self.max_len:
            raise ValueError("continued turn does not fit in the session's max_len")
        suffix = prompt_ids[len(self.committed):]
        self.prompt_ids = list(prompt_ids)
        self._pen = PenaltyState(self.prompt_ids)
        self.emitted, self.logprobs = [], []
        self.max_new_tokens = max_new_tokens
        self.finished, self.finish_reason = False, None
        self._start_from(suffix)

    # ------------------------------------------------------------------ internals
    def _prefill(self) -> None:
        self._start_from(self.prompt_ids)

    @torch.inference_mode()
    def _start_from(self, ids: list[int]) -> None:
        logits, post, pre = prefill(self.model, ids, self.cache, want_hidden=self.k > 0)
        self.prefill_tokens += len(ids)
        first = self._choose(logits, [])
        self.committed += ids
        if self.k > 0:
            # rows for positions of `ids`: row i = (token i+1, h_i); the last one pairs with `first`
            self._queue_mtp_rows(ids[1:] + [first], post if self.hidden_mode == "post" else pre)
        self._emit([first], [logits])

    def _choose(self, logits: torch.Tensor, extra: list[int]) -> int:
        """Plain-decode choice for one fp32 logit row (penalties, constraint mask, greedy or sampled)."""
        row = self._pen.apply(logits, self.sampling, extra)
        if self.constraint is not None:
            row = self.constraint.mask_logits(row)
        if self.sampling.greedy:
            return int(torch.argmax(row).item())
        return sample(probs_from_logits(row, self.sampling), self._gen)

    @torch.inference_mode()
    def _plain_step(self) -> None:
        tok = self.pending
        assert tok is not None
        pos0 = self.cache.length
        logits, post, pre = decode_step_t(self.model, [tok], pos0, self.cache, record=False)
        self.committed.append(tok)
        self.pending = None
        nxt = self._choose(logits[0], [])
        if self.k > 0:
            carrier = post if self.hidden_mode == "post" else pre
            self._queue_mtp_rows([nxt], carrier)
        self._emit([nxt], [logits[0]])

    def _queue_mtp_rows(self, tokens: list[int], hidden: torch.Tensor) -> None:
        self._mtp_tokens = self._mtp_tokens + tokens
        self._mtp_hidden = hidden if self._mtp_hidden is None else torch.cat([self._mtp_hidden, hidden])

    def _draft(self, k_round: int) -> tuple[list[int], list[torch.Tensor]]:
        """Write the queued MTP rows, then chain drafts. Returns (drafts, draft fp32 logit rows)."""
        model, sc = self.model, self.scratch
        assert sc is not None and self._mtp_hidden is not None
        n = len(self.committed)  # rows 0..n-1 become final once the queue is written
        row, h = mtp_head_forward(model, self._mtp_tokens, self._mtp_hidden, sc.length, sc)  # [V], [1, H]
        sc.set_len(n)
        self._mtp_tokens, self._mtp_hidden = [], None
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        cons = self.constraint
        if cons is not None and hasattr(cons, "draft_begin"):
            cons.draft_begin()
        for j in range(k_round):
            if j > 0:
                row, h = mtp_head_forward(model, [drafts[-1]], h, n - 1 + j, sc)
            proc = self._pen.apply(row, self.sampling, drafts)
            q = None if self.sampling.greedy else probs_from_logits(proc, self.sampling)
            # p-min tests the drafter's TOP probability before a token is chosen: whether position j is drafted
            # never depends on which token is drawn, so rejection sampling against q stays exact
            if self.p_min > 0.0 and j > 0:
                if float((torch.softmax(proc, -1) if q is None else q).max().item()) < self.p_min:
                    break  # discarded: counted in neither drafted nor accepted
            d = int(torch.argmax(proc).item()) if q is None else sample(q, self._gen)
            if self.draft_override is not None:
                d = self.draft_override(n + 1 + j, j, d)
            if cons is not None and hasattr(cons, "draft_allowed") and not cons.draft_allowed(d):
                break
            drafts.append(d)
            rows.append(row if q is None else q)
        return drafts, rows

    @torch.inference_mode()
    def _spec_round(self, k_round: int) -> None:
        cache = self.cache
        last = self.pending
        assert last is not None
        drafts, qrows = self._draft(k_round)
        k = len(drafts)
        n = cache.length
        cache.snapshot()
        logits, post, pre = decode_step_t(self.model, [last] + drafts, n, cache, record=True)  # [k+1, V]
        if self.sampling.greedy:
            n_acc, bonus = self._accept_greedy(logits, drafts)
        else:
            n_acc, bonus = self._accept_sampled(logits, drafts, qrows)
        if self.constraint is not None:
            n_acc, bonus = self._apply_constraint(logits, drafts, n_acc, bonus)
        out = drafts[:n_acc] + [bonus]
        eos_at = next((i for i, t in enumerate(out) if t in self.eos), None)
        if eos_at is not None and eos_at < n_acc:  # EOS among accepted drafts: nothing after it is emitted
            n_acc = eos_at + 1
            out = drafts[:n_acc]
        # commit last + out[:-1] (out[-1] becomes pending); roll the trunk back in O(state)
        cache.rollback(n + len(out))
        cache.close_window()
        self.committed += [last] + out[:-1]
        carrier = post if self.hidden_mode == "post" else pre
        self._queue_mtp_rows(out, carrier[: len(out)])  # rows n.. = (out[j], h_{n+j})
        if k > 0:
            self.telem.record_round(k, n_acc)
            self.len_hist[k] += 1
            self.acc_hist[n_acc] += 1
            self.full_accept += int(n_acc == k)
        self._emit(out, [logits[j] for j in range(len(out))])

    def _accept_greedy(self, logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
        if self.sampling.has_penalties:
            am = [int(torch.argmax(self._pen.apply(logits[j], self.sampling, drafts[:j])).item())
                  for j in range(len(drafts) + 1)]
        else:
            am = logits.argmax(dim=-1).tolist()  # the one host sync of the round
        n_acc = 0
        while n_acc < len(drafts) and am[n_acc] == drafts[n_acc]:
            n_acc += 1
        return n_acc, am[n_acc]

    def _accept_sampled(self, logits: torch.Tensor, drafts: list[int], qrows: list[torch.Tensor]) -> tuple[int, int]:
        """Leviathan/Chen: accept d_j w.p. min(1, p/q); on reject draw from norm(max(0, p - q)); else bonus ~ p_k."""
        s = self.sampling
        for j, d in enumerate(drafts):
            p = probs_from_logits(self._pen.apply(logits[j], s, drafts[:j]), s)
            q = qrows[j]
            u = float(torch.rand(1, generator=self._gen, dtype=torch.float64).item())
            if u * float(q[d]) < float(p[d]):  # u < p/q without dividing by q
                continue
            resid = torch.clamp(p - q, min=0.0)
            tot = float(resid.sum())
            return j, sample(resid / tot if tot > 0 else p, self._gen)
        k = len(drafts)
        return k, sample(probs_from_logits(self._pen.apply(logits[k], s, drafts), s), self._gen)

    def _apply_constraint(self, logits: torch.Tensor, drafts: list[int], n_acc: int, bonus: int) -> tuple[int, int]:
        """Verify-side truncation rule; consumes every emitted token (drafts here, the bonus in `_emit`)."""
        cons = self.constraint
        assert cons is not None
        cut = False
        for j in range(n_acc):
            if not cons.is_allowed(drafts[j]):
                n_acc, cut = j, True
                self.constraint_cuts += 1
                break
            cons.consume(drafts[j])
        if cut or not cons.is_allowed(bonus):
            row = self._pen.apply(logits[n_acc], self.sampling, drafts[:n_acc])
            masked = cons.mask_logits(row)
            if self.sampling.greedy:
                bonus = int(torch.argmax(masked).item())
            else:
                bonus = sample(probs_from_logits(masked, self.sampling), self._gen)
        self._constraint_consumed = n_acc
        return n_acc, bonus

    def _emit(self, toks: list[int], rows: list[torch.Tensor]) -> None:
        """Append emitted tokens (the last one becomes pending), feed penalties/constraint, check stops."""
        cons = self.constraint
        pre_consumed, self._constraint_consumed = self._constraint_consumed, 0
        for i, (t, row) in enumerate(zip(toks, rows)):
            if cons is not None and i >= pre_consumed:
                cons.consume(t)
            self._pen.push(t)
            self.emitted.append(t)
            if self.want_logprobs is not None:
                lp = torch.log_softmax(row.float(), dim=-1)
                top = []
                if self.want_logprobs > 0:
                    v, ix = torch.topk(lp, min(self.want_logprobs, lp.numel()))
                    top = list(zip(ix.tolist(), v.tolist()))
                self.logprobs.append(TokenLogprob(t, float(lp[t]), top))
            if t in self.eos:
                self._finish("stop")
                break
        self.pending = self.emitted[-1]
        if not self.finished and len(self.emitted) >= self.max_new_tokens:
            self._finish("length")

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        if self.stats_line and self.k > 0:
            print(self.stats_text(), file=sys.stderr)

    def stats_text(self) -> str:
        """The `[spec-stats]` line: rounds, full accepts, draft-length histogram, per-slot rates, total."""
        t = self.telem
        n = max((j + 1 for j, c in enumerate(t.pos_drafted) if c), default=0)
        slots = " ".join(f"{a}/{d}={a / d:.3f}" for a, d in zip(t.pos_accepted[:n], t.pos_drafted[:n]) if d)
        return (f"[spec-stats] rounds={t.rounds} full_accept={self.full_accept} len_hist={self.len_hist[:self.k + 1]} "
                f"per_slot=[{slots}] total={t.accepted}/{t.drafted}={t.acceptance_rate:.3f} "
                f"tok_per_round={t.tokens_per_round:.3f}")


def generate_spec(model: Qwen35ForCausalLM, prompt_ids: list[int], max_new_tokens: int, k: int = 3,
                  **kw) -> tuple[list[int], SpecTelemetry]:
    """Generate with speculation (k = 0: plain); returns (emitted tokens, telemetry)."""
    sess = SpecSession(model, prompt_ids, max_new_tokens, k=k, **kw)
    toks = sess.run()
    return toks, sess.telem
