"""S8's registered rules (docs/studies/s8.md) on synthetic sweeps whose answers are known: the
pilot's plan (length, cost, arms and seeds) and the main report's family, plateau checks and answer."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from analysis import curves
from analysis.load import load_runs
from analysis.studies import s8

ARMS = {"recompute": ("recompute", "inverse"), "inverse": ("loglinear", "inverse"),
        "step_start": ("loglinear", "step_start")}  # recompute's config carries the default schedule


def flat_from(start: float, level: float, rise: float):
    """A curve rising `rise` per 10 steps until step `start`, then flat at `level`."""
    return lambda steps: level - max(0.0, start - steps) / 10 * rise


def write_run(sweep: Path, arm: str, seed: int, curve, steps: int = 100, total: int = 100, step_cpu_s: float = 36.0,
              bump: float = 0.0, experiment: str = "s8") -> None:
    """A run directory as the trainer leaves it: its held-out reward after every 10th step follows
    `curve` (+ `bump`), each step costs `step_cpu_s` of CPU."""
    algo, schedule = ARMS[arm]
    name = f"{algo}{'-' + schedule if arm == 'step_start' else ''}-bf16-d2-s{seed}"
    run = sweep / name
    run.mkdir(parents=True)
    config = {"run_name": name, "experiment_name": experiment, "staleness": 2, "seed": seed, "precision": "bf16",
              "algo": {"name": algo, "uses_schedule": algo == "loglinear"}, "schedule": {"name": schedule},
              "train": {"total_steps": total}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with open(run / "metrics.jsonl", "w") as handle:
        for step in range(steps):
            record = {"step": step, "wall_time": 40.0 * (step + 1), "time/step": step_cpu_s, "time/step_cpu": step_cpu_s,
                      "time/eval": 0.0, "time/checkpoint": 0.0, "reward/mean": 0.5, "actor/entropy": 0.4,
                      "actor/clip_ratio": 0.01, "offpolicy/total_ratio_max": 3.0, "response/truncated": 0.1}
            if (step + 1) % 10 == 0:
                record["eval/reward"] = curve(step + 1) + bump
            handle.write(json.dumps(record) + "\n")


def pilot(tmp_path: Path, curves_by_arm, step_cpu_s: float = 36.0, noise=None, steps: int = 100) -> Path:
    sweep = tmp_path / "s8_pilot"
    for arm in ARMS:
        for seed in (300, 301, 302):
            bump = (noise or {}).get(seed, 0.0) if arm != "recompute" else 0.0
            write_run(sweep, arm, seed, curves_by_arm[arm], steps=steps, step_cpu_s=step_cpu_s, bump=bump,
                      experiment="s8_pilot")
    return sweep


def test_the_slope_is_the_least_squares_one_per_10_steps():
    evals = {50: 0.80, 60: 0.82, 70: 0.84, 80: 0.84}
    assert curves.slope(evals, 80) == pytest.approx(0.014)  # (0, .02, .04, .04) over 4 evals: 0.07 / 5
    assert curves.slope(evals, 90) is None  # the eval after step 90 is missing
    assert curves.early_reward({10: 0.1, 20: 0.2, 30: 0.3, 40: 0.4, 50: 0.5}) == pytest.approx(0.3)
    assert math.isnan(curves.early_reward({10: 0.1}))


def test_an_arm_still_rising_sets_the_length(tmp_path):
    # inverse rises 0.02 per 10 steps until step 80, the others are flat from step 50
    plan = s8.plan(load_runs(pilot(tmp_path, {"recompute": flat_from(50, 0.91, 0.05),
                                              "inverse": flat_from(80, 0.90, 0.02),
                                              "step_start": flat_from(50, 0.87, 0.05)})))
    assert plan.slopes.loc["inverse", 90] == pytest.approx(0.014)
    assert plan.slopes.loc["inverse", 100] == pytest.approx(0.006)
    assert (plan.l_star, plan.length) == (100, 100)
    # 100 steps of 36 CPU-s: 1 CPU-hour a run, 9 for the pilot
    assert plan.run_hours == pytest.approx(1.0) and plan.pilot_hours == pytest.approx(9.0)
    assert (plan.n3, plan.n2) == (15, 23)  # floor(51 / 3.3), floor(51 / 2.2)
    # no spread between seeds: sigma is tier C's floor; 15 seeds give (a) under 80% power at 0.05 / 6
    assert plan.sigma == s8.SIGMA_FLOOR and plan.power_second_arm < 0.80
    assert plan.arms == ("recompute", "inverse") and plan.seeds == tuple(range(310, 333))


def test_flat_curves_give_a_short_length_and_leave_room_for_the_second_arm(tmp_path):
    plan = s8.plan(load_runs(pilot(tmp_path, {arm: flat_from(30, 0.9, 0.05) for arm in ARMS}, step_cpu_s=18.0)))
    assert (plan.l_star, plan.length) == (60, 70)
    assert plan.run_hours == pytest.approx(70 * 18 / 3600)
    assert plan.n3 == math.floor((60 - 4.5) / (3 * 1.1 * 0.35)) and plan.power_second_arm >= 0.80
    assert plan.arms == ("recompute", "inverse", "step_start") and len(plan.seeds) == plan.n3
    assert "**L = 70**" in s8.plan_markdown(plan)


def test_the_pilots_spread_raises_sigma_above_tier_cs(tmp_path):
    noise = {300: -0.06, 301: 0.0, 302: 0.06}  # inverse - recompute differs by seed: sd 0.06
    plan = s8.plan(load_runs(pilot(tmp_path, {arm: flat_from(30, 0.85, 0.05) for arm in ARMS}, noise=noise)))
    assert plan.pilot_sd == pytest.approx(0.06) and plan.sigma == pytest.approx(0.06)


def test_the_plan_waits_for_the_whole_pilot(tmp_path):
    with pytest.raises(SystemExit, match="the pilot has not ended: 9 of 9 runs found, part-done"):
        s8.plan(load_runs(pilot(tmp_path, {arm: flat_from(30, 0.9, 0.05) for arm in ARMS}, steps=60)))


def main_sweep(tmp_path: Path, inverse_curve, seeds=range(310, 326), noise=0.01) -> Path:
    sweep = tmp_path / "s8"
    for seed in seeds:
        jitter = noise * ((seed * 7919) % 11 - 5) / 5  # a fixed spread over seeds
        write_run(sweep, "recompute", seed, flat_from(40, 0.91, 0.05), total=80, steps=80)
        write_run(sweep, "inverse", seed, inverse_curve, total=80, steps=80, bump=jitter)
    return sweep


@pytest.mark.parametrize("inverse_curve, expected", [
    (flat_from(40, 0.87, 0.06), "A-3PO costs final reward"),          # 4 points lower at its plateau
    (flat_from(40, 0.91, 0.12), "A-3PO only learns slower"),          # trails early, the same plateau
    (flat_from(80, 0.91, 0.03), "undecided"),                         # still rising at step 80: (a), (b) not answered
])
def test_the_answer_follows_the_registered_mapping(tmp_path, inverse_curve, expected):
    runs = s8.study_runs(load_runs(main_sweep(tmp_path, inverse_curve)), 80)
    judged = s8.judge(runs, ("recompute", "inverse"), 80)
    assert judged.answers == {"inverse": expected}
    assert list(judged.family["label"]) == ["a", "b", "c"]
    if expected == "undecided":
        assert judged.plateaus["inverse"][1] is False and judged.plateaus["recompute"][1] is True
        assert judged.family.iloc[0]["verdict"] == "not answered: inverse still rising at step 80"
    else:
        assert all(holds for _, holds in judged.plateaus.values())


def test_the_margin_of_b_is_two_percent_of_recomputes_mean(tmp_path):
    runs = s8.study_runs(load_runs(main_sweep(tmp_path, flat_from(40, 0.91, 0.05))), 80)
    (_, test, _), = [t for t in s8.tests_of(runs, "inverse") if t[1].label == "b"]
    assert test.margin == pytest.approx(0.02 * 0.91)


def test_the_report_is_written_from_the_registered_grid(tmp_path, monkeypatch):
    """The report reads its seeds, arms and length from conf/experiment/s8.yaml (here a stand-in),
    leaves out a seed not ended in every arm, and opens with the answer."""
    from analysis import stopping

    experiments = tmp_path / "experiment"
    experiments.mkdir()
    (experiments / "s8.yaml").write_text(
        "train:\n  total_steps: 80\nhydra:\n  sweeper:\n    params:\n      staleness: 2\n"
        "      seed: 310,311,312,313,314,315,316,317,318\n      +variant: recompute,loglinear-inverse\n")
    monkeypatch.setattr(s8, "EXPERIMENTS", experiments)
    monkeypatch.setattr(s8, "registered_seeds", lambda name: stopping.registered_seeds(name, experiments))
    sweep = main_sweep(tmp_path, flat_from(40, 0.87, 0.06), seeds=range(310, 318))  # seed 318 not started
    out = tmp_path / "report" / "s8.md"
    assert s8.main(["report", str(sweep), "--out", str(out), "--figures-dir", str(tmp_path / "figures")]) == 0
    text = out.read_text()
    assert "- **inverse**: A-3PO costs final reward" in text
    assert "inverse seed 318: not started" in text and "recompute seed 318: not started" in text
    assert re.search(r"\| inverse - recompute +\| a +\|.*\*\*lower\*\*", text)
    assert "after 80" in text and "## Plateau check, per arm" in text
