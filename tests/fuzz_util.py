"""Hypothesis settings shared by the fuzz tests (tests/test_fuzz_*.py).

CI runs a short, derandomized form: the same examples every run, so a red CI is a regression and never a
lucky draw. Set NEXTN_FUZZ_EXAMPLES=N for the long form: N random examples per test (scaled per test by
`weight`), as `bench/soak.py --fuzz` does.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: Examples per test in the long form (0 = the short CI form).
LONG_EXAMPLES = int(os.environ.get("NEXTN_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int, weight: float = 1.0) -> settings:
    """`ci_examples` derandomized examples in CI; `LONG_EXAMPLES * weight` random ones in the long form.
    No deadline (a shared 2-core box is noisy), no example database written into the checkout."""
    long_form = LONG_EXAMPLES > 0
    return settings(max_examples=max(1, int(LONG_EXAMPLES * weight)) if long_form else ci_examples,
                    derandomize=not long_form, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example, HealthCheck.function_scoped_fixture])
