"""bench/runtime.py's confidence interval for a median of pairs: the order statistics the binomial tails give,
and at least the promised coverage (exact, by the binomial sum, and on samples)."""
import math
import random

from bench.runtime import median_ci


def test_interval_is_the_binomial_order_statistics():
    # n = 20 at 90%: P(Bin(20, 1/2) <= 5) = 0.0207 <= 0.05 < P(<= 6) = 0.0577, so x_(6) and x_(15)
    assert median_ci([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_ci(list(range(1, 61))) == (24, 37)  # n = 60: j = 24
    assert median_ci([1.0, 2.0, 3.0]) == (1.0, 3.0)  # too few pairs for any j: the whole range
    assert median_ci([0.9] * 7) == (0.9, 0.9)


def test_coverage_is_at_least_the_level():
    for n in (5, 10, 20, 40, 60, 100):
        s = sorted(median_ci(list(range(n))))
        j = s[0] + 1  # x_(j) is the j-th smallest of 0..n-1
        tail = sum(math.comb(n, i) for i in range(j)) / 2 ** n
        assert 1 - 2 * tail >= 0.90 or j == 1, n
        if j > 1:  # and the next order statistic in would not be: the interval is the tightest such
            assert 1 - 2 * (tail + math.comb(n, j) / 2 ** n) < 0.90, n
    rng = random.Random(7)
    hits = sum(lo <= math.log(2) <= hi for lo, hi in
               (median_ci([rng.expovariate(1.0) for _ in range(25)]) for _ in range(2000)))
    assert hits / 2000 >= 0.88  # the exact coverage at n = 25 is 0.957; 2000 draws keep it well above 0.88
