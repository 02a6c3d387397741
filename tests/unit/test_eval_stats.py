"""`lcap eval`'s statistics: the unbiased pass@k against counting every draw, and the Wilson interval against
published values."""

from __future__ import annotations

import itertools
import math

import pytest

from lcap.loop.evaluate import normal_interval, pass_at_k, wilson


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (6, 3), (6, 6), (7, 0)])
def test_pass_at_k_is_the_share_of_k_draws_holding_a_right_one(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws)), (n, c, k)


def test_pass_at_k_refuses_what_it_cannot_estimate():
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_wilson_interval():
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81/263 -> 0.2553 to 0.3662; 0/10 -> 0 to 0.2775.
    low, high = wilson(81, 263)
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    low, high = wilson(0, 10)
    assert low == 0 and round(high, 4) == 0.2775
    low, high = wilson(10, 10)
    assert round(low, 4) == 0.7225 and high == pytest.approx(1)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_normal_interval_of_a_mean():
    low, high = normal_interval([0.2, 0.4, 0.6, 0.8])
    half = 1.959963984540054 * math.sqrt(sum((v - 0.5) ** 2 for v in (0.2, 0.4, 0.6, 0.8)) / 3) / 2
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))
