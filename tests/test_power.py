"""analysis.power against textbook values and simulation (scipy.stats underneath)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from analysis.power import (minimum_detectable_effect, paired_power, sd_from_interval, seeds_needed, tost,
                            tost_power, tost_seeds_needed, tost_welch)
from analysis.stats import mean_ci, welch_ci


def test_sd_from_interval_inverts_the_student_t_interval():
    values = np.array([0.1, 0.4, 0.25, 0.3])
    half = stats.t.ppf(0.975, 3) * values.std(ddof=1) / 2
    assert sd_from_interval(values.mean() - half, values.mean() + half, 4) == pytest.approx(values.std(ddof=1))


def test_seeds_needed_matches_the_textbook_paired_t_test():
    # Cohen's d = 0.5 at alpha 0.05, 80% power: 34 pairs (paired t-test, e.g. G*Power)
    assert seeds_needed(0.5, 1.0) == 34
    assert seeds_needed(1.0, 1.0) == 10
    assert paired_power(0.5, 1.0, 34) >= 0.8 > paired_power(0.5, 1.0, 33)


def test_seeds_needed_are_the_fewest_past_64_too():
    # past 64 the search steps by 5%: the answer is the first n at power, not the step that passed it
    needed = tost_seeds_needed(0.0, 0.10, 0.0146)
    assert needed == 404 and tost_power(0.0, 0.10, 403, 0.0146) < 0.8 <= tost_power(0.0, 0.10, 404, 0.0146)
    needed = seeds_needed(0.01, 0.1)
    assert needed > 64 and paired_power(0.01, 0.1, needed - 1) < 0.8 <= paired_power(0.01, 0.1, needed)
    assert seeds_needed(1e-4, 1.0) is None  # past MAX_SEEDS


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


def test_tost_by_hand():
    # differences 0.01, 0, -0.01, 0.005: mean 0.00125, sd sqrt(2.1875e-4 / 3), se = sd / 2
    result = tost([0.01, 0.0, -0.01, 0.005], margin=0.02)
    se = math.sqrt(2.1875e-4 / 3) / 2
    assert result["p_lower"] == pytest.approx(stats.t.sf((0.00125 + 0.02) / se, 3)) == pytest.approx(0.0077937, abs=1e-6)
    assert result["p_upper"] == pytest.approx(stats.t.cdf((0.00125 - 0.02) / se, 3)) == pytest.approx(0.0109377, abs=1e-6)
    assert result["equivalent"] and result["p"] == result["p_upper"]


def test_tost_is_the_90_percent_interval_inside_the_band():
    rng = np.random.default_rng(5)
    for _ in range(200):
        differences = list(rng.normal(rng.uniform(-0.03, 0.03), rng.uniform(0.002, 0.03), rng.integers(2, 12)))
        interval = mean_ci(differences, confidence=0.90)
        assert tost(differences, 0.02)["equivalent"] == (-0.02 < interval.low and interval.high < 0.02)
        ours, base = list(rng.normal(0.01, 0.01, 5)), list(rng.normal(0.0, 0.01, 4))
        welch = welch_ci(ours, base, confidence=0.90)
        assert tost_welch(ours, base, 0.02)["equivalent"] == (-0.02 < welch.low and welch.high < 0.02)


def test_tost_welch_matches_scipy():
    ours, base = [0.51, 0.50, 0.49, 0.52], [0.50, 0.505, 0.495]
    result = tost_welch(ours, base, margin=0.03)
    shifted_up = stats.ttest_ind(np.add(ours, 0.03), base, equal_var=False, alternative="greater").pvalue
    shifted_down = stats.ttest_ind(np.subtract(ours, 0.03), base, equal_var=False, alternative="less").pvalue
    assert (result["p_lower"], result["p_upper"]) == pytest.approx((shifted_up, shifted_down))


def test_zero_spread():
    assert tost([0.01, 0.01, 0.01], 0.02)["equivalent"]  # every seed agrees, inside the band
    assert not tost([0.03, 0.03], 0.02)["equivalent"]
    assert minimum_detectable_effect(0.0, 5) == 0.0 and seeds_needed(0.1, 0.0) == 2
    assert tost_seeds_needed(0.0, 0.0, 0.02) == 2


@pytest.mark.parametrize("n", [3, 5, 10, 21])
def test_mde_and_seeds_needed_round_trip(n):
    # the MDE at n seeds is the effect that n seeds detect with 80% power: n seeds are needed for it
    assert seeds_needed(minimum_detectable_effect(0.3, n), 0.3) == n
