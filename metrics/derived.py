"""Derived speculative-decoding statistics from one ``SpecTelemetry``-like value. Pure; no Prometheus.

Input: any object with integer attributes ``rounds``, ``drafted``, ``accepted`` and integer sequences
``pos_drafted``, ``pos_accepted`` (``engine.spec.SpecTelemetry``, a per-request delta, or a cumulative
total), or a mapping with those keys (e.g. a parsed ``usage.spec``). Counting rules (memra, see
``reference/memra-concepts.md`` §3): per verify round, after grammar truncation, ``rounds += 1``,
``drafted += k_round``, ``accepted += n_acc``, ``pos_drafted[j] += 1`` for ``j < k_round`` and
``pos_accepted[j] += 1`` for ``j < n_acc``; the bonus token is never counted as accepted.

Definitions (the same ones the PromQL in ``metrics/prometheus.py`` computes over time windows):

- ``acceptance_rate            = accepted / drafted``                      (vLLM "draft acceptance rate")
- ``mean_acceptance_length     = 1 + accepted / rounds``                   (vLLM AL, bonus token included)
- ``tokens_per_round           = (accepted + rounds) / rounds``            (memra; equal to the AL by definition)
- ``accept_rate_per_pos[j]     = pos_accepted[j] / pos_drafted[j]``        (memra: conditional on drafting j)
- ``accept_rate_per_pos_vllm[j] = pos_accepted[j] / rounds``               (vLLM/llama.cpp: P(A >= j+1))

The two per-position rates agree when every round drafts exactly K and diverge under p-min cuts or
grammar truncation. A ratio whose denominator is 0 is ``None`` (JSON ``null``): undefined, never 0 or NaN.
Per-position lists cover positions ``0..n-1`` where ``n`` is ``positions`` if given, else the deepest
position ever drafted (memra's trimming), so a value with no rounds yields empty lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["derived", "spec_fields"]


def _field(t: Any, name: str) -> Any:
    return t[name] if isinstance(t, Mapping) else getattr(t, name)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def spec_fields(t: Any) -> tuple[int, int, int, list[int], list[int]]:
    """``(rounds, drafted, accepted, pos_drafted, pos_accepted)`` as plain ints/lists of ints."""
    return (
        int(_field(t, "rounds")),
        int(_field(t, "drafted")),
        int(_field(t, "accepted")),
        [int(v) for v in _field(t, "pos_drafted")],
        [int(v) for v in _field(t, "pos_accepted")],
    )


def _trim(seq: Sequence[int], n: int) -> list[int]:
    out = list(seq[:n])
    return out + [0] * (n - len(out))


def derived(t: Any, positions: int | None = None) -> dict[str, Any]:
    """Counts plus derived rates of ``t`` (see the module docstring for every definition).

    Returns a JSON-ready dict with keys ``rounds, drafted, accepted, acceptance_rate,
    mean_acceptance_length, tokens_per_round, pos_drafted, pos_accepted, accept_rate_per_pos,
    accept_rate_per_pos_vllm``. ``positions`` fixes the per-position list length (e.g. K);
    by default the lists end at the deepest position with ``pos_drafted > 0``.
    """
    rounds, drafted, accepted, pos_drafted, pos_accepted = spec_fields(t)
    if positions is None:
        positions = max((j + 1 for j, v in enumerate(pos_drafted) if v > 0), default=0)
        positions = max(positions, max((j + 1 for j, v in enumerate(pos_accepted) if v > 0), default=0))
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    pd = _trim(pos_drafted, positions)
    pa = _trim(pos_accepted, positions)
    mal = None if rounds == 0 else 1.0 + accepted / rounds
    return {
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": _ratio(accepted, drafted),
        "mean_acceptance_length": mal,
        "tokens_per_round": _ratio(accepted + rounds, rounds),
        "pos_drafted": pd,
        "pos_accepted": pa,
        "accept_rate_per_pos": [_ratio(a, d) for a, d in zip(pa, pd)],
        "accept_rate_per_pos_vllm": [_ratio(a, rounds) for a in pa],
    }
