"""S8's registered rules (docs/studies/s8.md), on synthetic pilots whose answers are known."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.studies import s8

SEEDS = (300, 301, 302)
ARMS = {"recompute": ("recompute", "inverse"), "inverse": ("loglinear", "inverse"),
        "step_start": ("loglinear", "step_start")}  # recompute's config carries the default schedule


def _pilot(curves: dict[str, callable], step_cpu_s: float = 36.0, noise: dict[int, float] | None = None,
           complete: bool = True) -> pd.DataFrame:
    """A pilot's long frame: per arm and seed, 100 steps of `time/step_cpu` and an eval after every
    10th step whose reward is `curves[arm](steps done)` (+ the seed's `noise` for loglinear arms)."""
    rows = []
    for arm, (algo, schedule) in ARMS.items():
        for seed in SEEDS:
            run = f"{arm}-s{seed}"
            for step in range(100):
                common = dict(run=run, seed=seed, staleness=2, algo=algo, schedule=schedule, step=step,
                              complete=complete)
                rows.append({**common, "metric": "time/step_cpu", "value": step_cpu_s})
                if (step + 1) % 10 == 0:
                    bump = (noise or {}).get(seed, 0.0) if arm != "recompute" else 0.0
                    rows.append({**common, "metric": "eval/reward", "value": curves[arm](step + 1) + bump})
    return pd.DataFrame(rows)


def flat_from(start: float, level: float, rise: float):
    """A curve rising `rise` per 10 steps until `start`, then flat at `level`."""
    return lambda steps: level - max(0.0, start - steps) / 10 * rise


def test_the_slope_is_the_least_squares_one_per_10_steps():
    evals = {50: 0.80, 60: 0.82, 70: 0.84, 80: 0.84}
    assert s8.slope(evals, 80) == pytest.approx(0.014)  # (0, .02, .04, .04) over 4 evals: 0.07 / 5
    assert s8.slope(evals, 90) is None  # the eval after step 90 is missing


def test_an_arm_still_rising_sets_the_length():
    # inverse rises 0.02 per 10 steps until step 80, the others are flat from step 50
    pilot = _pilot({"recompute": flat_from(50, 0.91, 0.05), "inverse": flat_from(80, 0.90, 0.02),
                    "step_start": flat_from(50, 0.87, 0.05)})
    plan = s8.plan(pilot)
    assert plan.slopes.loc["inverse", 90] == pytest.approx(0.014)
    assert plan.slopes.loc["inverse", 100] == pytest.approx(0.006)
    assert (plan.l_star, plan.length) == (100, 100)
    # 100 steps of 36 CPU-s: 1 CPU-hour a run, 9 for the pilot
    assert plan.run_hours == pytest.approx(1.0) and plan.pilot_hours == pytest.approx(9.0)
    assert (plan.n3, plan.n2) == (15, 23)  # floor(51 / 3.3), floor(51 / 2.2)
    # no spread between seeds: sigma is tier C's floor; 15 seeds give (a) under 80% power at 0.05 / 6
    assert plan.sigma == s8.SIGMA_FLOOR and plan.power_second_arm < 0.80
    assert plan.arms == ("recompute", "inverse") and plan.seeds == tuple(range(310, 333))


def test_flat_curves_give_a_short_length_and_leave_room_for_the_second_arm():
    pilot = _pilot({arm: flat_from(30, 0.9, 0.05) for arm in ARMS}, step_cpu_s=18.0)
    plan = s8.plan(pilot)
    assert (plan.l_star, plan.length) == (60, 70)
    assert plan.run_hours == pytest.approx(70 * 18 / 3600)
    assert plan.n3 == math.floor((60 - 4.5) / (3 * 1.1 * 0.35)) and plan.power_second_arm >= 0.80
    assert plan.arms == ("recompute", "inverse", "step_start") and len(plan.seeds) == plan.n3
    assert "**L = 70**" in s8.plan_markdown(plan)


def test_the_pilots_spread_raises_sigma_above_tier_cs():
    noise = {300: -0.06, 301: 0.0, 302: 0.06}  # inverse - recompute differs by seed: sd 0.06
    pilot = _pilot({arm: flat_from(30, 0.85, 0.05) for arm in ARMS}, noise=noise)
    plan = s8.plan(pilot)
    assert plan.pilot_sd == pytest.approx(0.06) and plan.sigma == pytest.approx(0.06)


def test_the_plan_waits_for_the_whole_pilot():
    pilot = _pilot({arm: flat_from(30, 0.9, 0.05) for arm in ARMS}, complete=False)
    with pytest.raises(SystemExit, match="the pilot has not ended: 9 of 9 runs found, part-done"):
        s8.plan(pilot)
    with pytest.raises(SystemExit, match="6 of 9 runs found"):
        s8.plan(pilot[~pilot["run"].str.startswith("step_start")].assign(complete=True))
