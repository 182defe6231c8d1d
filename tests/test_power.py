"""analysis.power against textbook values and simulation (scipy.stats underneath)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.power import (minimum_detectable_effect, paired_power, sd_from_interval, seeds_needed, tost,
                            tost_power, tost_seeds_needed)


def test_sd_from_interval_inverts_the_student_t_interval():
    values = np.array([0.1, 0.4, 0.25, 0.3])
    half = stats.t.ppf(0.975, 3) * values.std(ddof=1) / 2
    assert sd_from_interval(values.mean() - half, values.mean() + half, 4) == pytest.approx(values.std(ddof=1))


def test_seeds_needed_matches_the_textbook_paired_t_test():
    # Cohen's d = 0.5 at alpha 0.05, 80% power: 34 pairs (paired t-test, e.g. G*Power)
    assert seeds_needed(0.5, 1.0) == 34
    assert seeds_needed(1.0, 1.0) == 10
    assert paired_power(0.5, 1.0, 34) >= 0.8 > paired_power(0.5, 1.0, 33)


def test_power_agrees_with_simulation():
    rng = np.random.default_rng(0)
    draws = rng.normal(0.8, 1.0, size=(20_000, 8))
    rejected = stats.ttest_1samp(draws, 0.0, axis=1).pvalue < 0.05
    assert paired_power(0.8, 1.0, 8) == pytest.approx(rejected.mean(), abs=0.015)


def test_mde_is_the_effect_with_80_percent_power():
    mde = minimum_detectable_effect(1.0, 10)
    assert paired_power(mde, 1.0, 10) == pytest.approx(0.8, abs=1e-6)
    assert minimum_detectable_effect(1.0, 40) < mde  # more seeds, smaller detectable effect


def test_tost():
    rng = np.random.default_rng(1)
    close = list(rng.normal(0.0, 0.01, 20))
    assert tost(close, margin=0.02)["equivalent"]
    assert not tost(list(rng.normal(0.0, 0.2, 5)), margin=0.02)["equivalent"]
    assert tost_seeds_needed(0.03, 0.05, margin=0.02) is None  # the true effect is outside the band
    n = tost_seeds_needed(0.0, 0.05, margin=0.02)
    assert tost_power(0.0, 0.05, n, 0.02) >= 0.8 > tost_power(0.0, 0.05, n - 1, 0.02)
    draws = rng.normal(0.0, 0.05, size=(4000, n))
    sim = np.mean([tost(list(row), 0.02)["equivalent"] for row in draws[:1000]])
    assert sim >= 0.75  # the bound is conservative: simulated power is at least about the bound
