"""The statistics every report and study here uses, in one place: a mean with its Student-t
interval, paired differences (by seed) and Welch's unpaired difference, the paired t-test's
p-value with Holm's multiplicity adjustment, and a percentile bootstrap over problems.

    interval([0.26, 0.27, 0.28])            # {"n": 3, "mean": 0.27, "low": .., "high": ..}
    paired({0: 4.61, 1: 4.60}, {0: 4.65, 1: 4.66})   # mine - theirs over the seeds both have
    difference_interval(a, b)               # mean(a) - mean(b), Welch's t interval
    holm([0.01, 0.04, 0.03])                # [0.03, 0.06, 0.06]
    paired_ratios([2.1, 1.9], [1.0, 1.1])   # a speed-up: per-repeat ratios, median, interval
    bootstrap_ci(per_problem)               # (low, high) of the mean over problems

Every interval is at 95% unless told; results are plain floats and dicts (they go into JSON
records). scipy is imported only where a t quantile or a test needs it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

LEVEL = 0.95


def interval(values: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean and the Student-t interval of the mean (None below two values)."""
    n = len(values)
    mean = statistics.fmean(values) if values else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None}
    from scipy.stats import t

    half = float(t.ppf((1 + level) / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}  # plain floats: JSON


def log_interval(values: list[float], level: float = LEVEL) -> dict[str, Any]:
    """For a positive quantity whose logarithm is the natural scale (a perplexity: exp of a mean
    loss): the geometric mean and the Student-t interval of the mean log, exponentiated. Always
    positive, where interval() over two perplexities far apart can run below zero."""
    if any(not v > 0 for v in values):
        raise ValueError(f"log_interval needs positive values, got {values}")
    logs = interval([math.log(v) for v in values], level)
    return {"n": logs["n"], **{k: None if logs[k] is None else math.exp(logs[k])
                               for k in ("mean", "low", "high")}}


def paired(mine: dict[int, float], theirs: dict[int, float]) -> dict[str, Any]:
    """The mean difference over the seeds both have, its 95% interval, and whether the interval
    excludes zero. An interval of no width (every seed the same difference: an accuracy over a
    few hundred items can move by one item on each) measures nothing, and excludes nothing."""
    ci = interval([mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))])
    ci["distinguishable_from_zero"] = (ci["low"] is not None and ci["low"] < ci["high"]
                                       and (ci["low"] > 0 or ci["high"] < 0))
    return ci


def difference_interval(a: list[float], b: list[float], level: float = LEVEL) -> dict[str, Any]:
    """mean(a) - mean(b) and Welch's t interval of it (unpaired samples, unequal variances;
    None below two values in either)."""
    diff = statistics.fmean(a) - statistics.fmean(b) if a and b else math.nan
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "low": None, "high": None, "df": None}
    from scipy.stats import t

    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "low": diff, "high": diff, "df": None}
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(t.ppf((1 + level) / 2, df)) * se
    return {"diff": diff, "low": diff - half, "high": diff + half, "df": df}


def paired_p(diffs: list[float]) -> float | None:
    """Two-sided paired t-test p-value of the mean difference (None below two seeds, and where
    every seed has the same difference: no spread, no test, as `paired` treats it)."""
    if len(diffs) < 2 or max(diffs) - min(diffs) <= 1e-12 * max(1.0, *map(abs, diffs)):
        return None
    from scipy.stats import ttest_1samp

    return float(ttest_1samp(diffs, 0.0).pvalue)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in the given order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def paired_ratios(mine: list[float], theirs: list[float], level: float = LEVEL) -> dict[str, Any]:
    """A speed figure as the repeats measured it: mine[i] / theirs[i] for each repeat i (the
    two timed side by side), their median, and the Student-t interval of their mean (None below
    two repeats)."""
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"paired_ratios needs as many repeats of each, got {len(mine)} and "
                         f"{len(theirs)}")
    ratios = [a / b for a, b in zip(mine, theirs)]
    spread = interval(ratios, level)
    return {"ratios": ratios, "median": statistics.median(ratios), "n": len(ratios),
            "mean": spread["mean"], "low": spread["low"], "high": spread["high"]}


def bootstrap_ci(per_problem: np.ndarray, n_boot: int = 2000, seed: int = 0,
                 level: float = LEVEL) -> tuple[Any, Any]:
    """Percentile CI of the mean over problems (rows), resampling rows with replacement.

    Shape (P,) gives (low, high) floats; shape (P, M) gives two arrays of M, every column
    resampled with the same rows, so a difference column stays paired."""
    values = np.asarray(per_problem, dtype=float)
    if values.ndim not in (1, 2) or values.shape[0] == 0:
        raise ValueError(f"bootstrap_ci needs a non-empty (P,) or (P, M) array, got {values.shape}")
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"bootstrap_ci needs n_boot >= 1 and 0 < level < 1, got {n_boot}, {level}")
    rng = np.random.default_rng(seed)
    problems = values.shape[0]
    means = np.empty((n_boot, *values.shape[1:]))
    chunk = max(1, 2**22 // values.size)  # bounds the memory of values[rows]
    for start in range(0, n_boot, chunk):
        rows = rng.integers(0, problems, size=(min(chunk, n_boot - start), problems))
        means[start:start + len(rows)] = values[rows].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return (float(low), float(high)) if values.ndim == 1 else (low, high)
