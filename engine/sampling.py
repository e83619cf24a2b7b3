"""Logit processing shared by plain and speculative decoding: penalties, temperature, top-k/top-p/min-p.

`SpecSampling` is the per-request value; `process` turns one fp32 logit row into the distribution that
both plain sampling and spec rejection sampling use, so the two are equal in distribution.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecSampling:
    """Sampling parameters. temperature 0 is the exact greedy path; > 0 samples (spec: Leviathan/Chen
    rejection sampling). top_k 0, top_p 1, min_p 0, repetition_penalty 1 and the 0 penalties mean off."""

    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class PenaltyState:
    """Token history for penalties: repetition over prompt + output, frequency/presence over output only."""

    def __init__(self, prompt_ids: list[int]):
        self.seen: set[int] = set(prompt_ids)
        self.out_counts: Counter[int] = Counter()

    def push(self, tok: int) -> None:
        self.seen.add(tok)
        self.out_counts[tok] += 1

    def apply(self, row: torch.Tensor, s: SpecSampling, extra: list[int] = ()) -> torch.Tensor:
        """Penalised copy of fp32 logits `row` [V], as if `extra` tokens had been pushed too."""
        if not s.has_penalties:
            return row
        row = row.clone()
        counts = self.out_counts.copy()
        counts.update(extra)
        if s.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(self.seen.union(extra)), dtype=torch.long, device=row.device)
            if ids.numel():
                v = row[ids]
                row[ids] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
        if counts and (s.frequency_penalty or s.presence_penalty):
            ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
            c = torch.tensor([counts[i] for i in counts], dtype=row.dtype, device=row.device)
            row[ids] -= s.frequency_penalty * c + s.presence_penalty
        return row


def probs_from_logits(row: torch.Tensor, s: SpecSampling) -> torch.Tensor:
    """fp32 logits [V] (already penalised) -> sampling distribution [V] after temperature, top-k, top-p, min-p."""
    p = torch.softmax(row.double() / s.temperature, dim=-1)
    if s.top_k > 0 and s.top_k < p.numel():
        kth = torch.topk(p, s.top_k).values[-1]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
    if s.min_p > 0.0:
        p = torch.where(p >= s.min_p * p.max(), p, torch.zeros_like(p))
    if s.top_p < 1.0:
        sp, idx = torch.sort(p, descending=True)
        csum = torch.cumsum(sp, dim=0)
        keep = (csum - sp) < s.top_p * csum[-1]  # smallest prefix reaching top_p of the mass
        mask = torch.zeros_like(p, dtype=torch.bool)
        mask[idx[keep]] = True
        p = torch.where(mask, p, torch.zeros_like(p))
    return p / p.sum()


def sample(p: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one token id from distribution p [V] (float64) with the CPU generator `gen` (same seed -> same draw
    on any device)."""
    return int(torch.multinomial(p.cpu(), 1, generator=gen).item())
