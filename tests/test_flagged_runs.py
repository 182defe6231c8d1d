"""Diverged and collapsed runs in the analysis (analysis.outcomes): counted per cell, left out
of every mean, the speedup baselines and the claims, and said so. On a crafted sweep of
recompute and loglinear x 3 seeds at d = 2, where loglinear seed 1 diverged at step 5 (its
values before that are wild) and recompute seed 2 collapsed from step 4 on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import yaml  # noqa: E402

from analysis import report, summary  # noqa: E402
from analysis.claims import rule as claims  # noqa: E402
from analysis.load import load_runs  # noqa: E402

STEPS, D, SEEDS = 10, 2, [0, 1, 2]
REWARD = {"recompute": [0.50, 0.52, 0.48], "loglinear": [0.51, 0.0, 0.49]}
ENTROPY = {"recompute": [0.30, 0.31, 0.0], "loglinear": [0.35, 99.0, 0.33]}
STEP_TIME = {"recompute": [2.0, 2.2, 2.6], "loglinear": [1.0, 0.1, 1.3]}
DIVERGED = ("loglinear", 1, 5)   # algo, seed, the step it stopped at
COLLAPSED = ("recompute", 2, 4)  # algo, seed, the step health/collapsed turns 1


def record(algo: str, seed: int, step: int, collapsed=COLLAPSED) -> dict:
    row = {"step": step, "wall_time": (step + 1) * STEP_TIME[algo][seed], "time/step": STEP_TIME[algo][seed],
           "time/step_cpu": STEP_TIME[algo][seed], "time/prox_logp": 0.5 if algo == "recompute" else 1e-4,
           "reward/mean": REWARD[algo][seed], "actor/entropy": ENTROPY[algo][seed],
           "actor/importance_weight/max": 2.0, "actor/importance_weight/min": 0.5, "actor/clipped_tokens": 10.0,
           "staleness/mean": float(min(step, D)), "staleness/max": min(step, D),
           "health/collapsed": int((algo, seed) == collapsed[:2] and step >= collapsed[2])}
    return row


def write_sweep(root: Path, diverged=(DIVERGED,), collapsed=COLLAPSED) -> Path:
    for algo in ("recompute", "loglinear"):
        for seed in SEEDS:
            name = f"{algo}-d{D}-s{seed}"
            run_dir = root / name
            run_dir.mkdir(parents=True)
            config = {"run_name": name, "experiment_name": "flagged", "algo": {"name": algo}, "staleness": D,
                      "seed": seed, "train": {"total_steps": STEPS}, "runtime": {"name": "lagged"}}
            (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
            stop = next((step for a, s, step in diverged if (a, s) == (algo, seed)), None)
            records = [record(algo, seed, step, collapsed) for step in range(STEPS if stop is None else stop)]
            if stop is not None:  # the trainer's line for the step it stopped at, and its marker
                records.append({"step": stop, "version": stop, "wall_time": 7.0, "health/diverged": 1})
                (run_dir / "diverged.json").write_text(json.dumps({"step": stop, "minibatch": 0}))
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("flagged") / "flagged")


def test_summary_counts_flagged_runs_and_leaves_them_out_of_the_means(sweep):
    table = summary.summary_table(load_runs(sweep)).set_index("label")
    loglinear, recompute = table.loc["loglinear"], table.loc["recompute"]
    assert (loglinear.n_seeds, loglinear.n_diverged, loglinear.n_collapsed) == (2, 1, 0)
    assert (recompute.n_seeds, recompute.n_diverged, recompute.n_collapsed) == (2, 0, 1)
    assert loglinear.final_reward_mean == pytest.approx((0.51 + 0.49) / 2)  # not (0.51 + 0.0 + 0.49) / 3
    assert loglinear.entropy_mean == pytest.approx((0.35 + 0.33) / 2)
    assert recompute.entropy_mean == pytest.approx((0.30 + 0.31) / 2)
    # the speedup pairs seeds present on both sides after the exclusions: seed 0 alone
    assert loglinear.speedup_vs_recompute == pytest.approx(2.0 / 1.0)

    markdown = summary.summary_markdown(table.reset_index())
    assert re.search(r"\|\s*excluded\s*\|", markdown)
    assert " 1 diverged, 0 collapsed |" in markdown and " 0 diverged, 1 collapsed |" in markdown
    assert "Excluded: runs left out of every number in their row" in markdown


def test_claims_judge_without_flagged_runs_and_the_report_says_which(sweep, tmp_path):
    df = load_runs(sweep)
    judged = claims.evaluate_claims(df).set_index("claim")
    assert set(judged["n_runs"]) == {4}
    assert set(judged["excluded"]) == {"1 diverged, 1 collapsed (loglinear-d2-s1, recompute-d2-s2)"}
    assert judged.at["d", "loglinear"].startswith("0.34 ")  # mean of 0.35 and 0.33: the 99 is out
    markdown, _ = report.write_report([sweep], tmp_path / "results.md")
    assert ("Excluded from every value above: 1 diverged, 1 collapsed (loglinear-d2-s1, recompute-d2-s2)."
            in markdown)


def test_a_side_whose_every_run_was_flagged_is_not_judged_and_its_cell_stays(tmp_path):
    every = tuple(("loglinear", seed, 3) for seed in SEEDS)
    df = load_runs(write_sweep(tmp_path / "all", diverged=every, collapsed=("none", 0, 0)))
    judged = claims.evaluate_claims(df)
    assert set(judged["verdict"]) == {"not judged (every loglinear run diverged or collapsed)"}
    table = summary.summary_table(df).set_index("label")
    assert (table.at["loglinear", "n_seeds"], table.at["loglinear", "n_diverged"]) == (0, 3)
    assert " 3 diverged, 0 collapsed |" in summary.summary_markdown(table.reset_index())


def test_a_sweep_without_flagged_runs_has_no_excluded_column(tmp_path):
    df = load_runs(write_sweep(tmp_path / "clean", diverged=(), collapsed=("none", 0, 0)))
    table = summary.summary_table(df)
    assert table["n_diverged"].sum() == table["n_collapsed"].sum() == 0
    markdown = summary.summary_markdown(table)
    assert "excluded" not in markdown.lower()
    assert set(claims.evaluate_claims(df)["excluded"]) == {""}
