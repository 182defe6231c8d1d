"""analysis.stats and analysis.robust (rliable's statistics, written with numpy/scipy)
against closed forms, hand computations and simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from analysis.robust import (iqm, mean_probability_of_improvement, pooled_iqm, probability_of_improvement,
                             stratified_bootstrap)
from analysis.stats import mean_ci, t_quantile, welch_ci


def MEAN(x):
    return np.mean(x, axis=-1)  # a bootstrap statistic works along the last axis

# --- Student-t intervals -----------------------------------------------------------------------

def test_t_quantile_matches_closed_forms():
    # df = 1 is the Cauchy distribution; df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)
    t2 = t_quantile(0.975, 2)
    assert 0.5 + t2 / (2 * math.sqrt(2 + t2 * t2)) == pytest.approx(0.975, abs=1e-12)
    assert t_quantile(0.975, 30) == pytest.approx(2.042272456, abs=1e-8)


def test_mean_ci_and_welch():
    interval = mean_ci([1.0, 2.0, 3.0])
    half = t_quantile(0.975, 2) * 1.0 / math.sqrt(3)
    assert (interval.mean, interval.low, interval.high, interval.n) == pytest.approx((2.0, 2 - half, 2 + half, 3))
    single = mean_ci([5.0])
    assert single.mean == 5.0 and not single.known
    diff = welch_ci([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert diff.mean == 0.0 and diff.low < 0 < diff.high




# --- robust statistics (Agarwal et al. 2021) -----------------------------------------------

def test_iqm_is_the_mean_of_the_middle_half():
    assert iqm(np.arange(1, 9)) == pytest.approx(4.5)  # mean of 3, 4, 5, 6
    assert iqm([1, 2, 3, 4, 5, 6, 7, 1000]) == pytest.approx(4.5)  # one wild seed does not move it
    assert iqm([2.0, 2.0, 2.0, 2.0]) == 2.0
    assert np.allclose(iqm(np.array([[1, 2, 3, 4], [10, 20, 30, 40]])), [2.5, 25.0])  # along the last axis


def test_probability_of_improvement():
    assert probability_of_improvement([5, 6, 7], [1, 2, 3]) == 1.0  # clearly separated
    assert probability_of_improvement([1, 2, 3], [5, 6, 7]) == 0.0
    assert probability_of_improvement([1, 2], [1, 2]) == 0.5  # ties count 1/2
    rng = np.random.default_rng(3)
    x, y = rng.normal(0.5, 1, 9), rng.normal(0, 1, 7)
    u = stats.mannwhitneyu(x, y).statistic  # U of the first sample: pairs with x > y
    assert probability_of_improvement(x, y) == pytest.approx(u / (9 * 7))
    assert mean_probability_of_improvement([5, 6], [1, 2], [1, 2], [5, 6]) == 0.5  # mean over two cells


def test_bootstrap_interval_covers_the_true_mean():
    sample = np.random.default_rng(1).normal(3.0, 1.0, 30)
    interval = stratified_bootstrap([sample], MEAN)
    assert interval.mean == pytest.approx(sample.mean())
    assert interval.low < 3.0 < interval.high
    t = mean_ci(sample)  # close to the Student-t interval at 30 values
    assert interval.half_width == pytest.approx(t.half_width, rel=0.15)
    again = stratified_bootstrap([sample], MEAN)
    assert (again.low, again.high) == (interval.low, interval.high)  # fixed generator: reproducible


def test_bootstrap_coverage_in_simulation():
    rng = np.random.default_rng(11)
    hits = 0
    for i in range(200):
        interval = stratified_bootstrap([rng.normal(0.0, 1.0, 20)], MEAN, reps=1000, seed=i)
        hits += interval.low < 0.0 < interval.high
    assert 0.88 <= hits / 200 <= 0.99  # percentile intervals run a little short of 95% at n = 20


def test_bootstrap_resamples_within_strata_only():
    # every resample keeps three 0s' worth of draws from the first stratum and three 1s' from
    # the second, so the pooled mean never moves; pooling the strata first would make it vary
    interval = stratified_bootstrap([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], lambda *s: np.concatenate(s, -1).mean(-1))
    assert (interval.mean, interval.low, interval.high) == (0.5, 0.5, 0.5)
    pooled = stratified_bootstrap([[0.0, 1.0, 2.0, 3.0], [10.0, 10.0]], pooled_iqm)
    assert pooled.mean == pytest.approx(iqm([0, 1, 2, 3, 10, 10])) and pooled.n == 2
    single = stratified_bootstrap([[1.0], [2.0, 3.0]], pooled_iqm)
    assert not single.known and single.n == 1  # a stratum of one seed: no interval


def test_holm_adjusts_step_down_in_the_input_order():
    from analysis.stats import holm

    # Holm (1979)-style worked example: m = 4, sorted 0.01, 0.02, 0.03, 0.04
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    # monotone: a larger raw p never gets a smaller adjusted one; capped at 1
    assert holm([0.5, 0.001, 0.4]) == pytest.approx([0.8, 0.003, 0.8])
    # a registered test that could not run counts as p = 1: m stays 3 (m = 2 would give 0.04, 0.04)
    out = holm([0.01, float("nan"), 0.04])
    assert out[0] == pytest.approx(0.03) and math.isnan(out[1]) and out[2] == pytest.approx(0.08)


def test_fisher_floor_is_the_complete_split_and_holm_floor_bounds_the_family():
    from analysis.stats import fisher_floor, holm, holm_floor
    assert fisher_floor(5, 5) == pytest.approx(2 / 252)  # 5-0 against 0-5: 2 of C(10, 5) tables
    assert fisher_floor(4, 4) == pytest.approx(1 / 35) and fisher_floor(1, 1) == pytest.approx(1.0)
    assert math.isnan(fisher_floor(0, 5))
    assert holm_floor([2 / 252] * 8) == pytest.approx(16 / 252)  # S6 tier B: 0.063, never below 0.05
    assert holm_floor([0.001, float("nan"), 1.0]) == pytest.approx(0.003)  # NaN still counts: m = 3
    assert holm_floor([0.5, 0.5, 0.5]) == 1.0 and math.isnan(holm_floor([]))
    floors = [0.004, 0.03, 0.2]  # the bound holds at the floors themselves: Holm's smallest adjusted p
    assert min(holm(floors)) == pytest.approx(holm_floor(floors))
