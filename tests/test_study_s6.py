"""S6's rules (docs/studies/s6.md) on crafted sweeps: analysis.studies' family verdicts and Holm, the
tier's family, the plateau check, tier B's collapses, and the report's command."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from analysis.collapses import cell_arm_table, collapse_family, floor_line
from analysis.hypotheses import Hypothesis as FamilyTest
from analysis.studies import decided, judge, judge_family, paired_values, run_test, what_would_decide
from analysis.figures.arms import _anchor_effect, arm_figures, by_version, with_arms
from analysis.provenance import compute_lines
from analysis.studies.s6 import (ARMS, STRESS_CELLS, STRESS_COLUMNS, collapsed, load_s6, main, plateau, stress_own,
                                 stress_runs, tier_family, tier_runs)
from test_report import dump_run

SEEDS = (100, 101, 102, 103)  # four of S6's registered seeds (conf/experiment/s6.yaml)
STEPS = 12  # staleness 8: steps 8-11 are steady
NOISE = (0.0, 0.004, -0.003, 0.002, 0.001)  # per seed, so intervals have a width


def _config(arm: str, seed: int, lr: float = 1e-5, minibatches: int = 4) -> dict:
    algo = "recompute" if arm == "recompute" else "loglinear"
    return {"experiment_name": "s6", "algo": {"name": algo, "uses_schedule": algo == "loglinear"},
            "schedule": {"name": "inverse" if arm == "recompute" else arm}, "staleness": 8, "seed": seed,
            "train": {"total_steps": STEPS, "lr": lr, "n_minibatches": minibatches}}


def _records(arm: str, seed: int, evals=(0.5, 0.7)) -> list[dict]:
    noise = NOISE[seed - SEEDS[0]]
    inverse, step_start = arm == "inverse", arm == "step_start"
    per_step = {
        "reward/mean": 0.5, "time/step": 10.0, "time/step_cpu": 10.0 - (2.0 if arm != "recompute" else 0.0) + noise,
        "time/prox_logp": 1.0 if arm == "recompute" else 0.001 * (1 + noise),
        "actor/entropy": 0.5 + (0.2 if inverse else 0.0) + noise,
        "actor/importance_weight/max": (1.5 if inverse else 3.0) + noise,
        "actor/importance_weight/min": (0.8 if inverse else 0.5) + noise,
        "actor/clip_ratio": (0.06 if inverse else 0.04) + noise / 10,
        "offpolicy/total_ratio_max": 4.0 + noise, "offpolicy/total_ratio_min": 0.3 + noise,
        "offpolicy/ess_total": 0.9 + noise, "offpolicy/kl_k3": 0.01 + noise / 100,
        # raw p about 0.01 for step_start, not significant once the family is adjusted
        "actor/grad_norm": 1.0 + ((0.08, 0.12, 0.05, 0.10, 0.07)[seed - SEEDS[0]] if step_start else 0.0),
        "prox_error/recompute/clip_rate": 0.04 + (0.005 if inverse else 0.0) + noise / 10,
        "prox_error/inverse/clip_rate": 0.06 + noise / 10, "prox_error/step_start/clip_rate": 0.04 + noise / 10,
        "prox_error/inverse/logp_abs": 0.12, "prox_error/step_start/logp_abs": 0.05,
        "prox_error/inverse/clip_flip": 0.04, "prox_error/step_start/clip_flip": 0.015,
        "staleness/mean": 8.0, "staleness/max": 8,
    }
    records = [{"step": t, "wall_time": float(t + 1), **per_step} for t in range(STEPS)]
    records[5]["eval/reward"], records[STEPS - 1]["eval/reward"] = evals[0], evals[1] + noise
    return records


def _sweep(root, arms=("recompute", "inverse", "step_start"), lr=1e-5, minibatches=4, evals_of=None, seeds=SEEDS,
           stopped_at=None):
    """The arms x seeds at (lr, minibatches); `stopped_at` maps (arm, seed) to the step a part-done run stopped at."""
    for arm in arms:
        for seed in seeds:
            name = f"{arm}-d8-s{seed}-lr{lr:g}-m{minibatches}"
            evals = evals_of(arm) if evals_of else (0.5, 0.7)
            records = _records(arm, seed, evals)[:(stopped_at or {}).get((arm, seed), STEPS)]
            dump_run(root, name, _config(arm, seed, lr, minibatches), records)
    return root


def _row(family, comparison, label):
    rows = family[(family["comparison"] == comparison) & (family["label"] == label)]
    assert len(rows) == 1
    return rows.iloc[0]


def test_the_tier_family_judges_each_test_raw_and_after_holm(tmp_path):
    scalars = load_s6([_sweep(tmp_path / "s6")])[2]
    assert set(scalars["arm"]) == {"recompute", "inverse", "step_start"}
    assert scalars.loc[scalars["arm"] == "inverse", "anchor_effect"].mean() == pytest.approx(0.015, abs=1e-3)
    family = tier_family(scalars, 8)
    assert len(family) == 30 and (family["p_holm"].dropna() >= family["p"].dropna()).all()
    inverse = "inverse vs recompute"
    assert _row(family, inverse, "R")["verdict"] == "equivalent within ±0.12"
    assert _row(family, inverse, "a")["verdict"] == "holds"            # prox time 1000x lower
    assert _row(family, inverse, "d")["verdict"] == "holds"            # entropy +0.2
    assert _row(family, inverse, "e")["verdict"] == "holds"            # IW max lower
    assert _row(family, inverse, "g")["verdict"] == "does not hold"    # clips more
    assert _row(family, inverse, "C1")["verdict"] == "higher"          # its anchor clips more on the same batches
    assert _row(family, inverse, "C2")["verdict"] == "higher"          # and its trajectory does too
    assert _row(family, inverse, "T1")["verdict"] == "no difference shown"
    grad = _row(family, "step_start vs recompute", "T5")
    assert grad["p"] < 0.05 and grad["verdict_raw"] == "higher" and grad["verdict"] == "no difference shown"
    assert _row(family, "step_start vs recompute", "e")["verdict"] == "inconclusive"
    assert math.exp(_row(family, inverse, "a")["effect"]) == pytest.approx(1000, rel=0.01)


def test_judge_rules():
    direction = FamilyTest("e", "IW max", "iw_max", "direction", -1)
    row = {"n": 5, "effect": -1.0, "low": -1.5, "high": -0.5}
    assert judge(direction, row, 0.01) == "holds" and judge(direction, row, 0.2) == "inconclusive"
    assert judge(direction, {**row, "effect": 1.0}, 0.01) == "does not hold"
    band = FamilyTest("R", "reward", "r", "equivalence", margin=0.1)
    assert judge(band, {"n": 5, "effect": 0.3, "low": 0.2, "high": 0.4}, 0.9) == "differs by more than 0.1"
    assert judge(band, {"n": 5, "effect": 0.05, "low": -0.2, "high": 0.3}, 0.4) == "inconclusive"
    assert judge(band, {"n": 1, "effect": 0.0, "low": math.nan, "high": math.nan}, math.nan).startswith("inconclusive")
    with pytest.raises(ValueError, match="sign"):
        FamilyTest("x", "x", "x", "direction")
    with pytest.raises(ValueError, match="kind"):
        FamilyTest("x", "x", "x", "bigger")
    with pytest.raises(ValueError, match="margin"):
        FamilyTest("x", "x", "x", "equivalence")


def test_effects_pair_by_seed_and_holm_counts_untestable_tests_as_p_1():
    test = FamilyTest("a", "time", "t", "direction", +1, "log_ratio")
    assert paired_values(test, {0: 1.0, 1: 2.0, 5: 9.0}, {0: 2.0, 1: 2.0}) == [math.log(2.0), 0.0]
    assert math.isnan(run_test(test, [0.3])["p"])
    two = FamilyTest("T", "x", "x", "two_sided")
    family = judge_family([("c", two, [0.1, 0.11, 0.09, 0.1]), ("c", two, [0.2]), ("c", two, [0.1, 0.12, 0.08, 0.1])])
    assert math.isnan(family.loc[1, "p_holm"]) and family.loc[1, "verdict"].startswith("inconclusive")
    low, high = sorted([family.loc[0, "p"], family.loc[2, "p"]])  # three tests counted: the registered family
    assert sorted([family.loc[0, "p_holm"], family.loc[2, "p_holm"]]) == pytest.approx([3 * low, max(3 * low, 2 * high)])
    assert not decided(family.loc[1, "verdict"])  # "inconclusive (fewer than 2 seeds)" decides nothing


def test_what_would_decide_each_undecided_test():
    reward = FamilyTest("R", "reward", "r", "equivalence", margin=0.1)
    entropy = FamilyTest("d", "entropy", "h", "direction", +1)
    clip = FamilyTest("g", "clip", "c", "direction", -1)
    family = judge_family([("x vs y", reward, [0.02, -0.05, 0.08, 0.0]),        # inside the band, too few seeds
                           ("x vs y", entropy, [0.05, -0.02, 0.04, 0.01]),      # inconclusive
                           ("x vs y", clip, [-1.0, -1.01, -0.99, -1.0]),        # decided: left out
                           ("z vs y", reward, [0.3, -0.05, 0.25, 0.05])])       # mean outside the band: never equivalent
    decide = what_would_decide(family)
    assert list(zip(decide["comparison"], decide["label"])) == [("x vs y", "R"), ("x vs y", "d"), ("z vs y", "R")]
    entropy_row = decide.iloc[1]
    assert entropy_row["sd"] == pytest.approx(float(np.std([0.05, -0.02, 0.04, 0.01], ddof=1)))
    loose, strict = int(entropy_row["seeds_loosest"]), int(entropy_row["seeds_strictest"].replace(",", ""))
    assert 4 < loose < strict  # more seeds than it has; more still at Holm's strictest level (0.05 / 4)
    assert entropy_row["mde"] > abs(entropy_row["effect"])
    assert decide.iloc[2]["seeds_loosest"] == "never" and decide.iloc[0]["seeds_loosest"] not in ("never", "")


def test_plateau_and_collapse_rules(tmp_path):
    scalars = load_s6([_sweep(tmp_path / "flat")])[2]
    assert plateau(scalars, 8)["holds"] is False  # recompute gains 0.2 between its two evals
    flat = load_s6([_sweep(tmp_path / "flatter", evals_of=lambda arm: (0.70, 0.70))])[2]
    check = plateau(flat, 8)
    assert check["holds"] and check["n"] == 4 and check["gain"] == pytest.approx(0.00075)
    assert collapsed({"flagged": False, "evals": [0.5, 0.6, 0.25]}) is True
    assert collapsed({"flagged": False, "evals": [0.5, 0.6, 0.31]}) is False
    assert collapsed({"flagged": True, "evals": [0.5, 0.6]}) is True


def test_stress_collapses_by_fisher_with_holm(tmp_path):
    root = _sweep(tmp_path / "stress", lr=3e-5, evals_of=lambda arm: (0.5, 0.05) if arm == "recompute" else (0.5, 0.6))
    scalars = load_s6([root, _sweep(tmp_path / "base", seeds=(103, 104))])[2]  # a base cell with seeds 103, 104
    runs, left_out = stress_runs(scalars, seeds=SEEDS)
    assert len(left_out) == 3 * 3 + 3 * 4 * 2  # base cell: seeds 100-102 not started; (3e-5, 8), (1e-5, 8): none
    own = stress_own(runs)  # tier B's compute leaves out its base cell, tier A's runs
    assert set(own["lr"]) == {3e-5} and len(own) == 12 and len(runs) == 15
    assert "over 12 runs" in compute_lines(own)[0]
    stress = collapse_family(runs, ARMS)
    assert list(stress["lr"]) == [1e-5, 1e-5, 3e-5, 3e-5] and list(stress["arm_collapsed"])[:2] == ["0/1"] * 2
    assert stress["p_floor"].tolist() == pytest.approx([1, 1, 1 / 35, 1 / 35])  # 1 vs 1 run, 4 vs 4 runs
    assert floor_line(stress).startswith("At these counts the best case, a complete split, gives a raw p of 0.029 "
                                         "and 0.11 after Holm: no cell can be decided")  # 4 tests x 1/35
    assert floor_line(collapse_family(runs.iloc[:0], ARMS)) == "No runs of these seeds in any cell."
    registered = collapse_family(runs, ARMS, STRESS_CELLS)  # every registered cell, with runs or not
    assert len(registered) == 8 and list(registered["verdict"]).count("not tested (no runs)") == 4
    assert registered["p_holm"].dropna().tolist() == pytest.approx([1, 1, 8 / 35, 8 / 35])  # m = 8, not 4
    assert floor_line(registered).endswith("gives a raw p of 0.029 and 0.23 after Holm: no cell can be decided, "
                                           "whatever its runs do.")
    stress = stress[stress["lr"] == 3e-5]
    assert list(stress["arm"]) == ["inverse", "step_start"]
    assert list(stress["recompute_collapsed"]) == ["4/4", "4/4"] and list(stress["arm_collapsed"]) == ["0/4", "0/4"]
    assert stress["p"].tolist() == pytest.approx([1 / 35, 1 / 35])  # Fisher's exact, 4-0 against 0-4
    assert list(stress["verdict"]) == ["no difference shown"] * 2  # Holm: 2/35 (and 1) each, above 0.05
    table = cell_arm_table(runs, ARMS, STRESS_COLUMNS)
    assert re.search(r"\| 3e-05 +\| 4 +\| recompute +\| +4 \| +4 \| +0.275 ± 0.0015 \|", table)  # evals 0.5, 0.05
    assert re.search(r"\| 1e-05 +\| 4 +\| recompute +\| +1 \| +0 \| +0.601 \|", table)  # one run: no spread
    assert re.search(r"\| +iw_min \|", table)
    assert re.search(r"\| 3e-05 +\| 4 +\| inverse +\| +4 \| +0 \| +0.55 ± 0.0015 \| 1.5 ± 0.003 \| 0.801 ± 0.003 \|", table)
    early = runs.index[(runs["lr"] == 3e-5) & (runs["arm"] == "recompute")][0]  # as if it diverged before step d
    runs.loc[early, ["iw_max", "iw_min", "total_ratio_max", "total_ratio_min"]] = float("nan")
    assert re.search(r"\| 3e-05 +\| 4 +\| recompute +\| +4 \| +4 \| +0.275 ± 0.0015 \| +3 ± [\d.]+ \(n=3\) \|",
                     cell_arm_table(runs, ARMS, STRESS_COLUMNS))


def test_the_report_command_writes_every_section(tmp_path):
    root = _sweep(tmp_path / "s6")
    out, figures = tmp_path / "report" / "s6.md", tmp_path / "report" / "s6"
    assert main([str(root), "--staleness", "8", "--out", str(out), "--figures-dir", str(figures),
                 "--deviations", "docs/studies/s6.md", "--stress", str(root)]) == 0
    text = out.read_text()
    assert text.splitlines()[2].startswith(f"Generated by `python -m analysis.studies.s6 {root} --staleness 8 --stress")
    for heading in ("## Provenance", "## Arms", "## The family: 30 tests, Holm-adjusted", "## Plateau check",
                    "## Power at the observed", "## Tier B", "## Figures",
                    "## Deviations from the pre-registration (`docs/studies/s6.md`)"):
        assert heading in text
    assert re.search(r"\| inverse vs recompute +\| R +\|", text) and "**equivalent within ±0.12**" in text
    assert "Tier B's own runs (its three cells beyond tier A's):\n\n- no runs there yet" in text  # only tier A's cell
    assert "| `step_start` | 0.050 | 1.5% |" in text and "| `inverse` | 0.120 | 4.0% |" in text  # anchors tracked
    assert re.search(r"\| 4 +\| `inverse` +\| all +\| 6.\d\d% +\| 4.\d\d% +\|.*\| more +\|", text)  # the anchor alone
    stems = ("s6_reward_d8", "s6_anchor_free_d8", "s6_clip_split_d8")
    assert sorted(p.name for p in figures.iterdir()) == sorted(f"{stem}.png" for stem in stems)
    assert all(f"![{stem}](s6/{stem}.png)" in text for stem in stems)


def test_a_missing_pre_registration_page_exits_2_before_loading(tmp_path, capsys):
    assert main([str(tmp_path / "none"), "--out", str(tmp_path / "s6.md"), "--figures-dir", str(tmp_path),
                 "--deviations", str(tmp_path / "absent.md")]) == 2
    assert "absent.md" in capsys.readouterr().out and not (tmp_path / "s6.md").exists()


def test_rewards_line_up_by_policy_version(tmp_path):
    df, _, _ = load_s6([_sweep(tmp_path / "s6", arms=("recompute",))])
    frame = by_version(with_arms(df))
    evals = frame[frame["metric"] == "eval/reward"]
    assert sorted(set(evals["x"])) == [6, STEPS]              # logged after steps 5 and 11: versions 6 and 12
    rollout = frame[frame["metric"] == "reward/mean"]
    assert sorted(set(rollout["x"])) == list(range(-8, STEPS - 8))  # step t's batch: version t - 8
    assert len(rollout) == len(SEEDS) * STEPS
    out = arm_figures(df, 8, tmp_path / "figs", "s6")
    assert out == [tmp_path / "figs" / "s6_reward_d8.png", tmp_path / "figs" / "s6_anchor_free_d8.png",
                   tmp_path / "figs" / "s6_clip_split_d8.png"]


def test_the_anchor_effect_figure_data_is_own_anchor_minus_recompute(tmp_path):
    df, _, _ = load_s6([_sweep(tmp_path / "s6")])
    arm_figures(df, 8, tmp_path / "figs", "s6")
    assert not list((tmp_path / "figs").glob("*.csv"))  # report figures: PNG only
    effect = _anchor_effect(with_arms(df).assign(x=lambda f: f["step"]))
    assert set(effect["arm"]) == {"inverse", "step_start"}
    means = effect.groupby("arm")["value"].mean()
    assert means["inverse"] == pytest.approx(0.06 - 0.045, abs=1e-3) and means["step_start"] == pytest.approx(0, abs=1e-3)


def test_the_stopping_rule_reads_the_seeds_ended_in_all_three_arms(tmp_path):
    """A part-done step_start run takes its seed out of the tier; a part-done stress run takes
    its seed out of its cell alone; the report lists both."""
    root = _sweep(tmp_path / "s6", stopped_at={("step_start", 101): 7})
    _sweep(root, lr=3e-5, minibatches=8, stopped_at={("recompute", 102): 9})
    scalars = load_s6([root])[2]
    cell, left_out = tier_runs(scalars, 8)
    assert sorted(set(cell["seed"])) == [100, 102, 103] and len(cell) == 9
    assert left_out[:3] == ["recompute seed 101: ended, its pair did not", "inverse seed 101: ended, its pair did not",
                            "step_start seed 101: part-done"]
    assert left_out[3:] == [f"{arm} seed {seed}: not started" for seed in range(104, 108)
                            for arm in ("recompute", "inverse", "step_start")]
    assert set(tier_family(cell, 8)["n"]) <= {3}
    runs, stress_left_out = stress_runs(scalars)
    by_cell = runs.groupby(["lr", "n_minibatches"])["seed"].agg(lambda s: sorted(set(s)))
    assert by_cell[(1e-5, 4)] == [100, 102, 103] and by_cell[(3e-5, 8)] == [100, 101, 103]  # tier B: seeds 100-104
    assert "lr 3e-05, 8 minibatches, recompute seed 102: part-done" in stress_left_out
    assert "lr 3e-05, 4 minibatches, recompute seed 100: not started" in stress_left_out
    out = tmp_path / "s6.md"
    assert main([str(root), "--out", str(out), "--figures-dir", str(tmp_path / "figures"), "--stress", str(root)]) == 0
    text = out.read_text()
    assert "Read from 9 runs, those of the seeds ended in every arm (the stopping rule); left out, 15 of 24 registered " \
           "runs: recompute seed 101: ended, its pair did not;" in text
    assert "lr 1e-05, 4 minibatches, step_start seed 101: part-done" in text
