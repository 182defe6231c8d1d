"""Small-sample statistics over seeds: Student-t confidence intervals, paired or not.

A sweep has two to a dozen seeds per setting, so every interval here is a Student-t
interval (a normal one would be far too narrow at n = 3); the distributions are scipy's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (scipy.stats)."""
    return float(stats.t.ppf(p, df))


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided 95% Student-t interval; `n` observations (seeds). With
    fewer than two observations the bounds are NaN: one seed says nothing about spread."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    @property
    def known(self) -> bool:
        return self.n >= 2 and math.isfinite(self.low) and math.isfinite(self.high)

    def scaled(self, factor: float) -> "Interval":
        bounds = sorted([self.low * factor, self.high * factor])
        return Interval(self.mean * factor, bounds[0], bounds[1], self.n)

    def mapped(self, function) -> "Interval":
        """The interval of a monotone increasing function of the quantity (exp of a log)."""
        return Interval(function(self.mean), function(self.low), function(self.high), self.n)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean +- t_{(1+c)/2, n-1} * s / sqrt(n) of the finite values."""
    array = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    n = len(array)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(array.mean())
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    half = t_quantile((1 + confidence) / 2, n - 1) * float(array.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def welch_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Interval of mean(a) - mean(b) for independent samples (Welch-Satterthwaite df);
    n is the smaller sample size."""
    a = np.asarray([v for v in a if np.isfinite(v)], dtype=float)
    b = np.asarray([v for v in b if np.isfinite(v)], dtype=float)
    if len(a) == 0 or len(b) == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    diff = float(a.mean() - b.mean())
    n = min(len(a), len(b))
    if n < 2:
        return Interval(diff, math.nan, math.nan, n)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(diff, diff, diff, n)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile((1 + confidence) / 2, df) * se
    return Interval(diff, diff - half, diff + half, n)


def paired(first: Mapping[int, float], second: Mapping[int, float]) -> list[int]:
    """Seeds with a finite value on both sides, sorted."""
    return sorted(s for s in first if s in second and np.isfinite(first[s]) and np.isfinite(second[s]))


def difference_ci(treated: Mapping[int, float], baseline: Mapping[int, float],
                  confidence: float = CONFIDENCE) -> tuple[Interval, str]:
    """Interval of treated - baseline over seeds, and how it was formed.

    Paired by seed (the interval of the per-seed differences) when at least two seeds have
    both runs: the seed fixes the prompts and the initial sampling, so pairing removes the
    variation the two runs share. Otherwise Welch's unpaired interval of the difference of
    means, which is wider.
    """
    seeds = paired(treated, baseline)
    if len(seeds) >= 2:
        return mean_ci([treated[s] - baseline[s] for s in seeds], confidence), f"paired over {len(seeds)} seeds"
    interval = welch_ci(list(treated.values()), list(baseline.values()), confidence)
    return interval, f"unpaired ({len(treated)} vs {len(baseline)} seeds)"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family's p-values (family-wise error control, any
    dependence): the k-th smallest becomes max over j <= k of (m - j + 1) p_(j), capped at 1; a
    test is significant at level alpha when its adjusted p-value is below alpha. Returned in
    the input's order. NaN (a registered test that could not be computed) stays NaN and counts
    in the family's size m as a p of 1, so a test the data could not run never loosens the
    others' adjustment below the registered family's."""
    indexed = [(p, i) for i, p in enumerate(p_values) if not math.isnan(p)]
    m = len(p_values)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(indexed)):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def fisher_floor(n1: int, n2: int) -> float:
    """The smallest two-sided p Fisher's exact test can give two groups of these sizes, whatever
    the data: a complete split (every member of one group has the outcome, none of the other).
    NaN for an empty group."""
    return float(stats.fisher_exact([[n1, 0], [0, n2]])[1]) if n1 and n2 else math.nan


def holm_floor(floors: Sequence[float]) -> float:
    """The smallest Holm-adjusted p any test of a family can reach, from each test's smallest raw
    p (NaN: a test not computed, still counted in the family's size, as in `holm`): Holm's first
    step on the smallest floor, capped at 1. Every adjusted p is at least the first step's."""
    finite = [p for p in floors if not math.isnan(p)]
    return min(1.0, len(floors) * min(finite)) if finite else math.nan
