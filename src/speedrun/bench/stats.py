"""Statistics for repeated runs (scipy's t-distribution and t-tests).

Run-to-run spread of CIFAR-10 accuracy is about 0.13 points, so a claim about a mean needs
many runs and a test; these functions give the summaries that ``bench.json`` holds and the
tests that ``speedrun compare`` uses.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..report.bench_record import CI_METHOD


def describe(values: Sequence[float], confidence: float = 0.95, floor: float | None = None) -> dict:
    """Mean, sample std (ddof=1) and a t-based confidence interval for the mean. ``floor``:
    the least value the quantity can take (0 for times); the interval's lower end is cut
    there, which few runs with a wide spread would otherwise take below it (with 2 runs
    the t quantile is 12.7)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    mean = float(x.mean()) if n else math.nan
    method = CI_METHOD if floor is None else f"{CI_METHOD}, its lower end cut at {floor:g} (the least possible value)"
    if n < 2:
        return {"n": n, "mean": mean, "std": math.nan, "ci95": [math.nan, math.nan], "ci95_method": method}
    std = float(x.std(ddof=1))
    if std == 0:
        lo = hi = mean
    else:
        from scipy import stats          # (imported where needed: a process summarising one run never does)
        lo, hi = stats.t.interval(confidence, n - 1, loc=mean, scale=std / math.sqrt(n))
    if floor is not None:
        lo = max(float(lo), floor)
    return {"n": n, "mean": mean, "std": std, "ci95": [float(lo), float(hi)], "ci95_method": method}


def describe_times(values: Sequence[float], confidence: float = 0.95) -> dict:
    """:func:`describe` for durations in seconds: the interval never reaches below 0 s."""
    return describe(values, confidence, floor=0.0)


def p_value_text(p: float, alpha: float = 0.05) -> str:
    """A p-value of :func:`p_mean_at_least` with what it says at level ``alpha``."""
    if math.isnan(p):
        return "n/a (fewer than 2 runs)"
    if p < alpha:
        return f"{p:.3g} (below {alpha:g}: evidence that the mean is above the target)"
    return f"{p:.3g} (not below {alpha:g}: no evidence that the mean is above the target)"


def p_mean_at_least(values: Sequence[float], target: float) -> float:
    """The p-value of a one-sided one-sample t-test of H0: mean <= target against H1: mean >
    target. A small p-value is evidence that the mean is above the target; a large one (near
    1 for a mean far below it) is no evidence of anything, and never a chance of success."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return math.nan
    if x.std(ddof=1) == 0:
        return 0.0 if x.mean() > target else 1.0
    from scipy import stats
    return float(stats.ttest_1samp(x, target, alternative="greater").pvalue)


def welch(a: Sequence[float], b: Sequence[float]) -> dict:
    """Welch's two-sample t-test (unequal variances) of mean(b) - mean(a), two-sided."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = float(b.mean() - a.mean())
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "t": math.nan, "p": math.nan}
    if a.std(ddof=1) == 0 and b.std(ddof=1) == 0:
        return {"diff": diff, "t": math.inf if diff else 0.0, "p": 0.0 if diff else 1.0}
    from scipy import stats
    res = stats.ttest_ind(b, a, equal_var=False)
    return {"diff": diff, "t": float(res.statistic), "p": float(res.pvalue)}
