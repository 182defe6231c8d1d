"""analysis.claims.rule' verdict rules (the Student-t rule, TOST for the reward), the numbers
beside them (analysis.claims.beside: MDE, seeds needed, IQM, probability of improvement) and
their markdown, on crafted run scalars whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.claims import rule as claims
from analysis.claims.tables import claims_markdown, shown_size
from analysis.claims.beside import Samples, beside, effect_sd, seeds_text
from analysis.claims.paper import CLAIMS
from analysis.power import minimum_detectable_effect, seeds_needed, tost_seeds_needed
from analysis.stats import Interval, mean_ci

BY_KEY = {claim.key: claim for claim in CLAIMS}


# --- verdict rules -----------------------------------------------------------------------

@pytest.mark.parametrize("interval, sign, expected", [
    (Interval(1.0, 0.5, 1.5, 3), +1, claims.HOLDS),
    (Interval(1.0, 0.5, 1.5, 3), -1, claims.FAILS),
    (Interval(0.2, -0.1, 0.5, 3), +1, claims.INCONCLUSIVE_SIGN),
    (Interval(-1.0, -1.5, -0.5, 3), -1, claims.HOLDS),
    (Interval(1.0, math.nan, math.nan, 1), +1, claims.INCONCLUSIVE_SEEDS),
])
def test_direction_verdicts(interval, sign, expected):
    assert claims.verdict(interval, sign) == expected


def test_float32_noise_is_not_an_effect():
    ulp = Interval(9.54e-7, 9.54e-7, 9.54e-7, 3)  # IW max 1.0 vs 1.0000009 on every seed
    assert claims.verdict(ulp, -1) == claims.FAILS
    assert claims.verdict(ulp, -1, resolution=claims.RESOLUTION * 1.0) == claims.INCONCLUSIVE_SIGN


@pytest.mark.parametrize("equivalent, low, high, expected", [
    (True, -0.015, 0.01, claims.HOLDS),  # TOST: both one-sided p-values below 0.05
    (True, -0.025, 0.01, claims.HOLDS),  # the 95% interval may cross the band when the 90% one does not
    (False, -0.05, -0.03, claims.FAILS),
    (False, 0.025, 0.04, claims.FAILS),
    (False, -0.03, 0.01, claims.INCONCLUSIVE_BAND),
    (False, -0.015, 0.01, claims.INCONCLUSIVE_BAND),
])
def test_equivalence_verdicts(equivalent, low, high, expected):
    tost = {"p_lower": 0.01, "p_upper": 0.01 if equivalent else 0.2, "equivalent": equivalent}
    assert claims.equivalence_verdict(tost, Interval((low + high) / 2, low, high, 3), 0.02) == expected
    assert claims.equivalence_verdict(None, Interval(0.0, math.nan, math.nan, 1), 0.02) == claims.INCONCLUSIVE_SEEDS




def reward_rows(relative: list[float]) -> pd.DataFrame:
    """Recompute's reward 1.0 on every seed, loglinear's 1 + the given relative difference."""
    return pd.DataFrame([{"algo": algo, "seed": seed, "final_reward": 1.0 + (r if algo == "loglinear" else 0.0)}
                         for seed, r in enumerate(relative) for algo in ("recompute", "loglinear")])


def test_reward_claim_is_judged_by_tost():
    # sd 0.015 at 4 seeds: the 90% interval (t 2.35) lies inside ±2%, the 95% one (t 3.18) does not
    record = claims.judge(BY_KEY["c"], reward_rows([-0.013, -0.013, 0.013, 0.013]))
    assert record["verdict"] == claims.HOLDS
    assert record["effect_low"] < -0.02 < 0.02 < record["effect_high"]  # the old 95% rule: inconclusive
    p_lower = stats.ttest_1samp([-0.013, -0.013, 0.013, 0.013], -0.02, alternative="greater").pvalue
    assert record["tost"]["p_lower"] == pytest.approx(p_lower) and record["tost"]["p_upper"] == pytest.approx(p_lower)
    assert "TOST ±2%: p = " in record["note"] and "; 90% CI " in record["note"] and "[-1.77, 1.77]%" in record["note"]
    assert claims.judge(BY_KEY["c"], reward_rows([-0.05, -0.04, -0.045]))["verdict"] == claims.FAILS
    assert claims.judge(BY_KEY["c"], reward_rows([-0.03, 0.0, 0.02]))["verdict"] == claims.INCONCLUSIVE_BAND
    assert claims.judge(BY_KEY["c"], reward_rows([0.01]))["verdict"] == claims.INCONCLUSIVE_SEEDS


# --- beside the verdict ------------------------------------------------------------------

def test_effect_sd_paired_and_unpaired():
    paired = Samples({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.5, 2: 1.0})
    assert effect_sd(paired) == (pytest.approx(np.std([1.0, 1.5, 3.0], ddof=1)), 3)
    unpaired = Samples({5: 1.0, 6: 2.0, 7: 4.0}, {0: 0.0, 1: 0.5})
    expected = math.sqrt(np.var([1.0, 2.0, 4.0], ddof=1) + np.var([0.0, 0.5], ddof=1))
    assert effect_sd(unpaired) == (pytest.approx(expected), 2)
    assert math.isnan(effect_sd(Samples({0: 1.0}, {0: 2.0}))[0])


def test_seeds_text():
    assert seeds_text(1.0, 1.0) == str(seeds_needed(1.0, 1.0)) == "10"
    assert seeds_text(None, 1.0) == "-"  # the paper gives no effect size
    assert seeds_text(0.0, 1.0) == "- (effect 0)"
    assert seeds_text(1e-4, 1.0) == "> 10,000"
    assert seeds_text(0.03, 0.01, margin=0.02) == "never (outside ±2%)"
    assert seeds_text(0.0, 0.05, margin=0.02) == f"{tost_seeds_needed(0.0, 0.05, 0.02):,}"


def test_beside_a_clearly_separated_cell():
    ours = {s: 2.0 + 0.1 * s for s in range(6)}
    base = {s: 1.0 + 0.13 * s for s in range(6)}
    record = beside(Samples(ours, base), effect=float(np.mean([ours[s] - base[s] for s in ours])), sign=+1,
                    paper_effect=0.5)
    differences = [ours[s] - base[s] for s in range(6)]
    assert record["n_seeds"] == 6 and record["sd"] == pytest.approx(np.std(differences, ddof=1))
    assert record["mde"] == pytest.approx(minimum_detectable_effect(record["sd"], 6))
    assert record["seeds_paper"] == f"{seeds_needed(0.5, record['sd']):,}"
    improvement = record["improvement"]  # every loglinear run above every recompute run
    assert (improvement.mean, improvement.low, improvement.high) == (1.0, 1.0, 1.0)
    assert record["iqm"].mean == pytest.approx(np.mean(sorted(differences)[1:5]))  # trim_mean cuts 1 of 6 each end
    assert record["iqm"].low <= record["iqm"].mean <= record["iqm"].high
    lower = beside(Samples(ours, base), effect=0.9, sign=-1, paper_effect=None)  # "lower is better" claims
    assert lower["improvement"].mean == 0.0 and lower["seeds_paper"] == "-" and lower["tost"] is None


# --- evaluate_claims and its markdown, on run scalars -----------------------------------

VALUES = {"prox_time_s": (1.0, 1e-3), "train_time_s": (300.0, 250.0), "cpu_time_s": (290.0, 240.0),
          "final_reward": (0.5, 0.5), "entropy": (0.30, 0.35), "iw_max": (2.0, 1.8), "iw_min": (0.4, 0.45),
          "clipped_tokens": (100.0, 60.0), "clip_ratio": (0.1, 0.06)}


def scalars_frame(stalenesses=(2, 8), seeds=range(5)) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for d in stalenesses:
        for seed in seeds:
            for index, algo in enumerate(("recompute", "loglinear")):
                values = {column: pair[index] * (1 + 0.01 * rng.standard_normal()) for column, pair in VALUES.items()}
                rows.append({"algo": algo, "schedule": "", "label": algo, "label_prefix": "", "correction": "none",
                             "objective": "ppo", "precision": "fp32",
                             "runtime": "lagged", "staleness": d, "seed": seed, "run": f"{algo}-d{d}-s{seed}",
                             "flagged": False, "diverged": False, "collapsed": False, "contended": False,
                             "time_basis": "time/step", **values})
    return pd.DataFrame(rows)


def test_claims_table_beside_and_across_d():
    judged = claims.evaluate_claims(pd.DataFrame(), scalars_frame())
    assert list(judged["context"].unique()) == ["d = 2", "d = 8"] and set(judged["family"]) == {"the paper's setup"}
    row = judged[(judged["context"] == "d = 8")].set_index("claim").loc["e"]
    assert row["verdict"] == claims.HOLDS and row["n_seeds"] == 5
    assert row["seeds_paper"] != "-" and row["improvement"].mean > 0.9
    text = claims_markdown(judged)
    assert "Beside the verdict, not part of it (d = 8):" in text and "MDE at these seeds" in text
    assert "### Across d: the paper's setup" in text and "| 2, 8 |" in text.replace("  ", "")
    assert f"(at {shown_size(BY_KEY['e'], -1.49)})" in text and "(at 8,500x)" in text
    assert "TOST: " in text and "seeds if the truth is 0" in text


def test_shown_size():
    assert shown_size(BY_KEY["a"], math.log(8500)) == "8,500x"
    assert shown_size(BY_KEY["b"], math.log(3.46 / 2.72)) == "21.4% less"
    assert shown_size(BY_KEY["c"], -0.0178) == "-1.78%"
    assert shown_size(BY_KEY["e"], -1.49) == "-1.49" and shown_size(BY_KEY["g"], None) == "-"
