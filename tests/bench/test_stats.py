"""Statistics on data with known answers (hand-derivable, brute force, or SciPy 1.17's)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ddtree_cli.bench.stats import (
    NO_CLEAR_DIFFERENCE,
    RatioCI,
    bootstrap_mean_ci,
    bootstrap_ratio_ci,
    mcnemar_exact,
    percentiles,
    relative_mad,
    verdict,
    wilcoxon_signed_rank,
)


def _brute_force_p(d: np.ndarray) -> float:
    """Two-sided exact p by enumerating all 2^n sign assignments of the ranks."""
    n = d.size
    ranks = np.argsort(np.argsort(np.abs(d))) + 1
    observed = ranks[d > 0].sum()
    mean = n * (n + 1) / 4
    sums = [
        sum(r for r, s in zip(ranks, signs, strict=True) if s)
        for signs in itertools.product([0, 1], repeat=n)
    ]
    extreme = sum(1 for s in sums if abs(s - mean) >= abs(observed - mean))
    return extreme / 2**n


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_wilcoxon_exact_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.4, 1.0, 10)
    y = rng.normal(0.0, 1.0, 10)
    res = wilcoxon_signed_rank(x, y)
    assert res.method == "exact"
    assert res.p_value == pytest.approx(_brute_force_p(x - y), abs=1e-12)


def test_wilcoxon_known_answers_from_scipy():
    # scipy.stats.wilcoxon(x, y, method="exact") -> statistic 5.0, p 0.0390625
    # (statistic there is min(W+, W-); here W+ = 45 - 5 = 40).
    x = [1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30]
    y = [0.878, 0.647, 0.598, 2.05, 1.06, 1.29, 1.06, 3.14, 1.29]
    res = wilcoxon_signed_rank(x, y)
    assert res.p_value == pytest.approx(0.0390625, abs=1e-12)
    assert res.statistic == 40.0
    # Ties and a zero: scipy (correction=True, method="approx") gives p = 0.6352893188352069.
    x2 = [125, 115, 130, 140, 140, 115, 140, 125, 140, 135]
    y2 = [110, 122, 125, 120, 140, 124, 123, 137, 135, 145]
    res2 = wilcoxon_signed_rank(x2, y2)
    assert res2.method == "normal"
    assert res2.n == 9
    assert res2.p_value == pytest.approx(0.6352893188352069, rel=1e-9)


def test_wilcoxon_normal_approximation_for_many_pairs():
    # 40 pairs; scipy (correction=True, method="approx"): W+ = 314... as min(W+, W-) = 314,
    # p = 0.1992665843117385.
    rng = np.random.default_rng(1)
    a = np.round(rng.normal(10, 1, 40), 3)
    b = np.round(a + rng.normal(0.3, 1, 40), 3)
    res = wilcoxon_signed_rank(a, b)
    assert res.method == "normal"
    assert min(res.statistic, 40 * 41 / 2 - res.statistic) == 314.0
    assert res.p_value == pytest.approx(0.1992665843117385, rel=1e-9)


def test_wilcoxon_identical_samples_is_no_evidence():
    assert wilcoxon_signed_rank([1, 2, 3], [1, 2, 3]).p_value == 1.0


def test_mcnemar_exact_known_answer():
    # scipy.stats.binomtest(2, 12).pvalue == 0.03857421875
    assert mcnemar_exact(2, 10) == pytest.approx(0.03857421875)
    assert mcnemar_exact(10, 2) == pytest.approx(0.03857421875)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)


def test_paired_bootstrap_of_an_exact_ratio_has_no_width():
    a = [10.0, 20.0, 30.0, 50.0]
    b = [x / 2 for x in a]
    ci = bootstrap_ratio_ci(a, b, paired=True)
    assert ci.ratio == pytest.approx(2.0)
    assert ci.ci95 == pytest.approx((2.0, 2.0))


def test_bootstrap_interval_covers_the_true_ratio_most_of_the_time():
    # Normal data with means 12 and 10: the true ratio of means is 1.2.
    rng = np.random.default_rng(7)
    hits = 0
    reps = 200
    for rep in range(reps):
        a = rng.normal(12, 2, 40)
        b = rng.normal(10, 2, 40)
        ci = bootstrap_ratio_ci(a, b, paired=False, n_boot=1000, seed=rep)
        hits += ci.ci95[0] <= 1.2 <= ci.ci95[1]
    assert 0.88 <= hits / reps <= 0.99


def test_verdict_never_calls_a_straddling_interval_a_win():
    straddle = RatioCI(1.3, (0.9, 1.7), 5)
    assert verdict(straddle, higher_is_better=True, better="w", worse="l") == NO_CLEAR_DIFFERENCE
    assert verdict(RatioCI(1.3, (1.1, 1.5), 5), higher_is_better=True, better="w", worse="l") == "w"
    assert verdict(RatioCI(0.8, (0.7, 0.9), 5), higher_is_better=True, better="w", worse="l") == "l"
    # Lower is better (latency): a ratio below 1 is the better outcome.
    assert (
        verdict(RatioCI(0.8, (0.7, 0.9), 5), higher_is_better=False, better="w", worse="l") == "w"
    )
    nan = RatioCI(math.inf, (math.nan, math.nan), 1)
    assert verdict(nan, higher_is_better=True, better="w", worse="l") == NO_CLEAR_DIFFERENCE


def test_percentiles_mean_and_noise():
    p = percentiles(list(range(1, 101)), (50, 99))
    assert p["p50"] == pytest.approx(50.5)
    assert p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert percentiles([]) == {}
    assert relative_mad([10, 10, 12]) == pytest.approx(0.0)
    assert relative_mad([9, 10, 11]) == pytest.approx(0.1)
    assert bootstrap_mean_ci([5.0]) is None
    lo, hi = bootstrap_mean_ci([4.0, 6.0, 5.0, 5.0])
    assert 4.0 <= lo <= 5.0 <= hi <= 6.0
