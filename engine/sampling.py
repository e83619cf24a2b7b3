"""Logit processing shared by plain and speculative decoding: logit bias, penalties, min_tokens, temperature,
top-k/top-p/min-p.

`SpecSampling` is the per-request value; `PenaltyState.apply` is the per-row logits processing that every token
choice goes through (plain choice, drafts, every verify column), in one order: logit bias, penalties, then the
min_tokens mask of the stop ids; `probs_from_logits` turns the processed rows into the distribution that both
plain sampling and spec rejection sampling use, so the two are equal in distribution (and greedy spec is exact
with every field). Everything runs on the logits' device without reading values back to the host: penalty
history and the bias live in device tensors, the min_tokens mask depends only on host counts, and draws use a
per-session generator on that device (same seed -> same tokens on the same device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecSampling:
    """Sampling parameters. temperature 0 is the exact greedy path; > 0 samples (spec: Leviathan/Chen
    rejection sampling). top_k 0, top_p 1, min_p 0, repetition_penalty 1 and the 0 penalties mean off.
    logit_bias: (token id, bias) pairs added to the logits (OpenAI's field; -100 effectively bans a token).
    min_tokens: the session's stop ids (EOS and stop_token_ids) are masked until this many tokens were emitted."""

    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be in [0, 1]")
        if not (self.repetition_penalty > 0.0):
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def processes(self) -> bool:
        """Some per-row logits processing applies (`PenaltyState.apply` is not the identity)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


class PenaltyState:
    """Per-session logits processing state, on the device: `seen` [V] (prompt + output, repetition penalty),
    `counts` [V] (output only, frequency / presence penalties), the dense logit bias [V] (None when empty) and
    the stop ids min_tokens masks. Given a `sampling` without penalties, `seen` and `counts` stay empty (`apply`
    with that sampling never reads them): a long prompt's ids are not scattered for nothing."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device | str,
                 sampling: SpecSampling | None = None, stop_ids: list[int] | tuple[int, ...] | set[int] = ()):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.tracks = sampling is None or sampling.has_penalties
        if prompt_ids and self.tracks:
            self.seen[torch.tensor(prompt_ids, device=device)] = True
        self.bias: torch.Tensor | None = None
        if sampling is not None and sampling.logit_bias:
            ids, vals = zip(*sampling.logit_bias)
            if not all(0 <= i < vocab_size for i in ids):
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(vals, dtype=torch.float32, device=device)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

    def push(self, toks: list[int]) -> None:
        """Record emitted tokens (nothing to record without penalties: `tracks`)."""
        if not self.tracks:
            return
        idx = torch.tensor(toks, device=self.seen.device)
        self.seen[idx] = True
        self.counts.index_add_(0, idx, torch.ones(len(toks), device=idx.device))

    def apply(self, rows: torch.Tensor, s: SpecSampling, extra: torch.Tensor | None = None,
              n_out: int = 0) -> torch.Tensor:
        """Processed copy of fp32 logits `rows` ([V], or [T, V] for T consecutive positions): logit bias, then
        penalties as if each row's `extra` tokens [..., E] (long, -1 = none) had been pushed too, then the
        min_tokens mask: row t chooses output token n_out + t, and while that is below s.min_tokens every stop
        id is -inf. Returns `rows` itself when the request has no processing."""
        if not s.processes:
            return rows
        if self.bias is not None:
            rows = rows + self.bias
        if s.has_penalties:
            rows = self._penalise(rows, s, extra)
        under = s.min_tokens - n_out  # rows (positions) still below min_tokens: a host int, no sync
        if under > 0 and self.stop_ids.numel():
            if rows.dim() == 1:
                rows = rows.index_fill(-1, self.stop_ids, float("-inf"))
            else:
                rows = torch.cat([rows[:under].index_fill(-1, self.stop_ids, float("-inf")), rows[under:]])
        return rows

    def _penalise(self, rows: torch.Tensor, s: SpecSampling, extra: torch.Tensor | None) -> torch.Tensor:
        counts = self.counts.expand(rows.shape).to(rows.dtype)
        seen = self.seen.expand(rows.shape)
        if extra is not None and extra.numel():
            add = torch.zeros_like(rows).scatter_add_(-1, extra.clamp_min(0), (extra >= 0).to(rows.dtype))
            counts, seen = counts + add, seen | (add > 0)
        if s.repetition_penalty != 1.0:
            # A request may send any rp > 0, 5e-324 included: below the dtype's smallest normal it would round to
            # 0 (-inf * 0 = nan), and rows / rp overflows, so it is floored there and the quotient capped.
            info = torch.finfo(rows.dtype)
            rp = max(s.repetition_penalty, info.tiny)
            rows = torch.where(seen, torch.where(rows > 0, (rows / rp).clamp_max(info.max), rows * rp), rows)
        if s.frequency_penalty or s.presence_penalty:
            rows = rows - (s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(rows.dtype))
        return rows


def probs_from_logits(rows: torch.Tensor, s: SpecSampling) -> torch.Tensor:
    """fp32 logits [..., V] (already penalised) -> sampling distribution [..., V] (float64) after temperature,
    top-k, top-p, min-p. Any temperature > 0 gives a distribution, down to subnormal ones (the row's maximum is
    subtracted before dividing, so the largest scaled logit is 0, never inf / inf)."""
    z = rows.double()
    p = torch.softmax((z - z.amax(dim=-1, keepdim=True)) / s.temperature, dim=-1)
    if s.top_k > 0 and s.top_k < p.shape[-1]:
        kth = torch.topk(p, s.top_k, dim=-1).values[..., -1:]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
    if s.min_p > 0.0:
        p = torch.where(p >= s.min_p * p.amax(dim=-1, keepdim=True), p, torch.zeros_like(p))
    if s.top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        csum = torch.cumsum(sp, dim=-1)
        keep = (csum - sp) < s.top_p * csum[..., -1:]  # smallest prefix reaching top_p of the mass
        keep[..., 0] = True  # never empty: a subnormal top_p times the mass can round to 0
        p = torch.where(torch.zeros_like(keep).scatter(-1, idx, keep), p, torch.zeros_like(p))
    return p / p.sum(dim=-1, keepdim=True)


def sample(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token id per row of distribution p [..., V] (float64), drawn with `gen` (a generator on p's
    device); returns a long tensor [...] on p's device (no host sync)."""
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=gen).reshape(p.shape[:-1])
