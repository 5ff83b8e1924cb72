"""Statistics for the A/B: percentiles, bootstrap ratio intervals, paired tests, verdicts.

Pure numpy. The verdict rule is deliberately conservative: a ratio whose 95% interval
contains 1 is "no clear difference", whatever the point estimate says.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NO_CLEAR_DIFFERENCE = "no clear difference"


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": …, "p99": …, "mean": …}``; NaN-free; empty input gives an empty dict."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return {}
    out = {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}
    out["mean"] = float(arr.mean())
    return out


@dataclass(frozen=True)
class RatioCI:
    ratio: float
    ci95: tuple[float, float]
    n: int

    def straddles_one(self) -> bool:
        return self.ci95[0] <= 1.0 <= self.ci95[1]


def bootstrap_ratio_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    paired: bool,
    n_boot: int = 10_000,
    seed: int = 0,
    stat: str = "mean",
) -> RatioCI:
    """Ratio ``stat(a) / stat(b)`` with a percentile-bootstrap 95% interval.

    Paired: ``a[i]`` and ``b[i]`` were measured together (same prompt, or the same trial
    slot of an interleaved ABAB run) and are resampled together, which removes the
    shared variation. Unpaired: each side is resampled on its own.
    """
    xa = np.asarray(a, dtype=float)
    xb = np.asarray(b, dtype=float)
    if xa.size == 0 or xb.size == 0:
        raise ValueError("bootstrap needs at least one value on each side")
    if paired and xa.size != xb.size:
        raise ValueError("paired bootstrap needs equal lengths")
    reduce = np.mean if stat == "mean" else np.median
    denom = reduce(xb)
    ratio = float(reduce(xa) / denom) if denom != 0 else math.inf
    rng = np.random.default_rng(seed)
    if paired:
        idx = rng.integers(0, xa.size, size=(n_boot, xa.size))
        ra, rb = reduce(xa[idx], axis=1), reduce(xb[idx], axis=1)
    else:
        ra = reduce(xa[rng.integers(0, xa.size, size=(n_boot, xa.size))], axis=1)
        rb = reduce(xb[rng.integers(0, xb.size, size=(n_boot, xb.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = ra / rb
    boots = boots[np.isfinite(boots)]
    if boots.size == 0:
        return RatioCI(ratio, (math.nan, math.nan), int(xa.size))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return RatioCI(ratio, (float(lo), float(hi)), int(xa.size))


@dataclass(frozen=True)
class WilcoxonResult:
    statistic: float  # W+, the sum of the ranks of the positive differences
    p_value: float  # two-sided
    n: int  # pairs with a non-zero difference
    method: str  # "exact" or "normal"


def wilcoxon_signed_rank(x: Sequence[float], y: Sequence[float]) -> WilcoxonResult:
    """Two-sided Wilcoxon signed-rank test of paired samples (zero differences dropped).

    Exact null distribution for up to 25 untied pairs, otherwise the normal approximation
    with tie and continuity corrections (``scipy.stats.wilcoxon(..., correction=True)``
    computes the same p-values, which the tests use as known answers).
    """
    d = np.asarray(x, dtype=float) - np.asarray(y, dtype=float)
    d = d[d != 0]
    n = int(d.size)
    if n == 0:
        return WilcoxonResult(0.0, 1.0, 0, "exact")
    ranks = _average_ranks(np.abs(d))
    w_plus = float(ranks[d > 0].sum())
    has_ties = np.unique(np.abs(d)).size < n
    if n <= 25 and not has_ties:
        return WilcoxonResult(w_plus, _exact_two_sided(w_plus, n), n, "exact")
    mean = n * (n + 1) / 4.0
    _, counts = np.unique(np.abs(d), return_counts=True)
    var = n * (n + 1) * (2 * n + 1) / 24.0 - float((counts**3 - counts).sum()) / 48.0
    if var <= 0:
        return WilcoxonResult(w_plus, 1.0, n, "normal")
    z = (abs(w_plus - mean) - 0.5) / math.sqrt(var)
    p = math.erfc(max(z, 0.0) / math.sqrt(2.0))
    return WilcoxonResult(w_plus, min(1.0, p), n, "normal")


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(values.size, dtype=float)
    sorted_vals = values[order]
    i = 0
    while i < values.size:
        j = i
        while j + 1 < values.size and sorted_vals[j + 1] == sorted_vals[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def _exact_two_sided(w_plus: float, n: int) -> float:
    # Number of sign assignments giving each rank sum: a subset-sum count over 1..n.
    top = n * (n + 1) // 2
    counts = np.zeros(top + 1, dtype=np.float64)
    counts[0] = 1.0
    for k in range(1, n + 1):
        counts[k:] = counts[k:] + counts[: top + 1 - k]
    total = 2.0**n
    w = int(round(w_plus))
    lower = counts[: min(w, top - w) + 1].sum() / total
    return float(min(1.0, 2.0 * lower))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pair counts.

    ``only_a``: items where only arm A diverged (from the reference); ``only_b``: only B.
    """
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return float(min(1.0, 2.0 * tail))


def verdict(ci: RatioCI, *, higher_is_better: bool, better: str, worse: str) -> str:
    """Word the result from the interval, never from the point estimate alone."""
    lo, hi = ci.ci95
    if math.isnan(lo) or math.isnan(hi) or ci.straddles_one():
        return NO_CLEAR_DIFFERENCE
    above = lo > 1.0
    return better if above == higher_is_better else worse


def bootstrap_mean_ci(
    values: Sequence[float], *, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile-bootstrap 95% interval of the mean; None for fewer than two values."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def relative_mad(values: Sequence[float]) -> float | None:
    """Median absolute deviation over the median: the trial-to-trial noise of a metric."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < 2:
        return None
    med = float(np.median(arr))
    if med == 0:
        return None
    return float(np.median(np.abs(arr - med)) / abs(med))
