"""Robust statistics over seeds, after Agarwal et al. (2021), "Deep Reinforcement Learning
at the Edge of the Statistical Precipice" (NeurIPS; the rliable library), written with
numpy and scipy.stats, because rliable 1.2.0 cannot import under the suite's pandas 3 (its
arch < 8 pin); rliable runs beside it in the `rliable` extra's environment, where
tests/test_against_rliable.py checks every statistic here against rliable's own:

- interquartile mean (IQM): the mean of the middle 50% of the values
  (`scipy.stats.trim_mean` with 25% cut from each end, as rliable does): one outlying seed
  moves it less than the mean, and it is less noisy than the median;
- probability of improvement P(X > Y): the chance that a run of X beats a run of Y, over
  every pair of runs (the Mann-Whitney U statistic divided by n m; ties count 1/2); over
  several cells (the paper's tasks) the mean of the cells' values;
- stratified bootstrap: a percentile interval from resampling with replacement within each
  stratum (a cell's seeds), never across strata, so every resample keeps each cell's number
  of seeds (`scipy.stats.bootstrap`, which resamples each of several samples on its own).

With 2 to 10 seeds a bootstrap interval is narrower than it should be (it cannot see
beyond the values drawn); the Student-t interval stays the verdict's (analysis.claims.rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats

from analysis.stats import CONFIDENCE, Interval

BOOTSTRAP_REPS = 10_000
BOOTSTRAP_SEED = 0  # a fixed generator: the report is the same every time it is regenerated


def iqm(values, axis: int = -1):
    """The interquartile mean along `axis`: scipy.stats.trim_mean(values, 0.25)."""
    return stats.trim_mean(np.asarray(values, dtype=float), 0.25, axis=axis)


def probability_of_improvement(x, y):
    """P(X > Y) + P(X = Y) / 2 over every pair (x_i, y_j), along the last axis of each
    (leading axes are batches, as the bootstrap passes them)."""
    x = np.asarray(x, dtype=float)[..., :, None]
    y = np.asarray(y, dtype=float)[..., None, :]
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-2, -1))


def stratified_bootstrap(strata: Sequence[Sequence[float]], statistic: Callable[..., float],
                         confidence: float = CONFIDENCE, reps: int = BOOTSTRAP_REPS,
                         seed: int = BOOTSTRAP_SEED) -> Interval:
    """`statistic(*strata)` and its percentile interval over `reps` resamples, each stratum
    resampled on its own. `statistic` takes one array per stratum and works along the last
    axis (leading axes are resamples). No interval when a stratum has fewer than 2 values;
    `n` is the smallest stratum's size."""
    arrays = [np.asarray(stratum, dtype=float) for stratum in strata]
    n = min(len(array) for array in arrays) if arrays else 0
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    point = float(statistic(*arrays))
    if n < 2:
        return Interval(point, math.nan, math.nan, n)
    result = stats.bootstrap(arrays, lambda *samples, axis=-1: statistic(*samples), n_resamples=reps,
                             vectorized=True, paired=False, axis=-1, confidence_level=confidence,
                             method="percentile", rng=np.random.default_rng(seed))
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return Interval(point, low, high, n)  # a percentile interval need not contain the point


def pooled_iqm(*strata):
    """The IQM of every stratum's values together (rliable's aggregate over tasks)."""
    return iqm(np.concatenate(strata, axis=-1))


def mean_probability_of_improvement(*strata):
    """The mean over cells of P(X > Y), strata given as x_1, y_1, x_2, y_2, ..."""
    pairs = [probability_of_improvement(strata[i], strata[i + 1]) for i in range(0, len(strata), 2)]
    return np.mean(pairs, axis=0)
