"""The mechanism report (S3): the anchor-distance model, its calls, the scoring of verdicts
against them, the slope of the clip gap on log2 m, and the report from real runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from a3po.run.main import run, run_dir_of
from analysis.anchor.model import (EQUAL, LESS, MORE, NO_CALL, agreement, anchor_distance, behaviour_weight, clip_reach,
                                   prediction, score)
from analysis.anchor.clip_rates import counterfactual_cells, counterfactual_rates, counterfactual_verdict
from analysis.studies.mechanism import clip_slopes, main


def test_anchor_distances_by_hand():
    # recompute: mean_k (k/m)^beta; inverse: w_b = 1/d of the drift over d + k/m versions
    assert anchor_distance("recompute", 8, 1, 1.0) == 0.0
    assert anchor_distance("recompute", 8, 2, 1.0) == pytest.approx(0.25)
    assert anchor_distance("recompute", 8, 4, 0.5) == pytest.approx((0 + 0.5 + 0.5**0.5 + 0.75**0.5) / 4)
    assert anchor_distance("inverse", 8, 1, 1.0) == pytest.approx(1.0)
    assert anchor_distance("inverse", 8, 2, 1.0) == pytest.approx((8 + 8.5) / 2 / 8)
    assert anchor_distance("inverse", 4, 2, 0.5) == pytest.approx((4**0.5 + 4.5**0.5) / 2 / 4)
    # step_start is recompute's anchor exactly under linear drift, and closer under diffusive drift
    for m in (1, 2, 4, 8):
        assert anchor_distance("step_start", 8, m, 1.0) == pytest.approx(anchor_distance("recompute", 8, m, 1.0))
    assert anchor_distance("step_start", 8, 4, 0.48) == pytest.approx(0.123, abs=1e-3)
    # the target anchor is the current policy, the behave anchor the behaviour policy
    assert anchor_distance("target", 8, 4, 0.5) == 0.0
    assert anchor_distance("behave", 8, 1, 0.5) == pytest.approx(8**0.5)
    with pytest.raises(ValueError, match="m >= 1"):
        anchor_distance("inverse", 8, 0, 1.0)


def test_behaviour_weights_and_where_an_anchor_can_clip():
    assert behaviour_weight("inverse", 8) == pytest.approx(0.125)
    assert behaviour_weight("exponential", 8, gamma=0.5) == pytest.approx(0.5**7)
    assert behaviour_weight("linear_decay", 8, horizon=8) == pytest.approx(0.125)  # inverse's, at d = 8 only
    assert behaviour_weight("step_start", 8, 0.75) == pytest.approx(0.75 / 8.75)
    assert behaviour_weight("step_start", 8, 0.0) == 0.0 and behaviour_weight("target", 8) == 0.0
    # exp(w_b x) leaves [1 - eps, 1 + eps] first at x = log(1 + eps) / w_b
    assert clip_reach(0.125, 0.2) == pytest.approx(np.log(1.2) / 0.125)
    assert clip_reach(0.0, 0.2) == float("inf")


def test_the_pre_registered_table_at_d8():
    """docs/studies/mechanism.md's table: beta = 0.48 reverses the direction between m = 2 and m = 4."""
    calls = {m: prediction(anchor_distance("inverse", 8, m, 0.48), anchor_distance("recompute", 8, m, 0.48))
             for m in (1, 2, 4, 8)}
    assert calls == {1: MORE, 2: NO_CALL, 4: LESS, 8: LESS}
    linear = {m: prediction(anchor_distance("inverse", 8, m, 1.0), anchor_distance("recompute", 8, m, 1.0))
              for m in (1, 2, 4, 8)}
    assert set(linear.values()) == {MORE}
    assert prediction(0.0, 0.0) == EQUAL and prediction(1.0, 1.1) == NO_CALL and prediction(2.0, 1.0) == MORE


def test_agreement_reads_the_clip_claims_direction():
    # g' claims "lower": holds = the arm clips less
    assert agreement(LESS, "holds") == "agrees" and agreement(MORE, "does not hold") == "agrees"
    assert agreement(MORE, "holds") == "disagrees" and agreement(LESS, "does not hold") == "disagrees"
    assert agreement(MORE, "inconclusive (CI of the difference includes 0)") == "undecided"
    assert agreement(NO_CALL, "holds") == "no call"


def _cells(rows):
    return pd.DataFrame([{"claim": "g'", "d": d, "m": m, "arm": arm, "verdict": verdict} for d, m, arm, verdict in rows])


def test_score_holds_fails_and_stays_inconclusive_by_the_rule():
    beta = 0.48  # calls at d = 8: m1 more, m2 no call, m4 less, m8 less
    agree = _cells([(8, 1, "inverse", "does not hold"), (8, 2, "inverse", "holds"), (8, 4, "inverse", "holds"),
                    (8, 8, "inverse", "inconclusive")])
    judged, rows = score(agree, beta)
    assert judged == "holds" and [r["agreement"] for r in rows] == ["agrees", "no call", "agrees", "undecided"]
    disagree = _cells([(8, 1, "inverse", "does not hold"), (8, 4, "inverse", "does not hold")])
    assert score(disagree, beta)[0] == "does not hold"
    undecided = _cells([(8, 1, "inverse", "inconclusive"), (8, 4, "inverse", "inconclusive"),
                        (8, 8, "inverse", "holds")])
    assert score(undecided, beta)[0] == "inconclusive"  # 1 of 3 agrees: less than half


def test_the_clip_slope_per_seed():
    rows = []
    for seed, gap in ((0, 0.02), (1, 0.03), (2, 0.025)):
        for m in (1, 2, 4, 8):
            rows.append({"staleness": 8, "m": m, "seed": seed, "arm": "recompute", "clip_ratio": 0.01})
            rows.append({"staleness": 8, "m": m, "seed": seed, "arm": "inverse",
                         "clip_ratio": 0.01 + gap * (3 - np.log2(m))})  # slope -gap on log2 m
    interval, slopes = clip_slopes(pd.DataFrame(rows))
    assert slopes == pytest.approx({0: -0.02, 1: -0.03, 2: -0.025})
    assert interval.mean == pytest.approx(-0.025) and interval.high < 0


def _rate_rows(m: int, seed: int, rates: dict[str, float], d: int = 8) -> list[dict]:
    """A recompute run's logged clip rates (each anchor's, every valid token and H3), at steps d-1..d+1."""
    run = f"recompute-d{d}-s{seed}-m{m}"
    return [{"experiment": "mechanism", "run": run, "algo": "recompute", "staleness": d, "seed": seed, "step": step,
             "metric": f"prox_error/{anchor}/clip_rate{suffix}", "value": rate * (2.0 if suffix else 1.0)}
            for step in (d - 1, d, d + 1) for anchor, rate in rates.items() for suffix in ("", "/H3")]


def test_the_anchor_alone_is_paired_within_each_recompute_run():
    rows, configs = [], {}
    for m, gap in ((2, 0.02), (8, -0.01)):
        for seed in (0, 1, 2):
            rows += _rate_rows(m, seed, {"recompute": 0.03 + 0.01 * seed, "inverse": 0.03 + 0.01 * seed + gap + 0.001 * seed,
                                         "step_start": 0.03 + 0.01 * seed, "fitted": 0.5})
            configs[("mechanism", f"recompute-d8-s{seed}-m{m}")] = {"train": {"n_minibatches": m}}
    rows.append({**rows[0], "step": 3, "value": 99.0})  # a step before d: not counted
    rates = counterfactual_rates(pd.DataFrame(rows), configs)
    assert set(rates["m"]) == {2, 8} and set(rates["stratum"]) == {"", "H3"} and "fitted" not in rates.columns
    whole = rates[(rates["m"] == 2) & (rates["stratum"] == "") & (rates["seed"] == 0)].iloc[0]
    assert whole["recompute"] == pytest.approx(0.03) and whole["inverse"] == pytest.approx(0.05)
    cells = counterfactual_cells(rates)
    inverse = cells[(cells["arm"] == "inverse") & (cells["stratum"] == "")].set_index("m")
    assert inverse.loc[2, "difference"].mean == pytest.approx(0.021) and inverse.loc[2, "direction"] == "more"
    assert inverse.loc[8, "direction"] == "less"
    assert inverse.loc[2, "arm_rate"] == pytest.approx(0.061) and inverse.loc[2, "recompute_rate"] == pytest.approx(0.04)
    h3 = cells[(cells["arm"] == "inverse") & (cells["stratum"] == "H3") & (cells["m"] == 2)].iloc[0]
    assert h3["difference"].mean == pytest.approx(0.042)
    same = cells[(cells["arm"] == "step_start") & (cells["stratum"] == "")]
    assert (same["direction"] == "undecided").all()  # identical rates: a zero-width interval at 0
    assert counterfactual_verdict(cells) == "does not hold"  # less at m = 8
    assert counterfactual_verdict(cells[cells["m"] == 2], counts=(2,)) == "holds"
    assert counterfactual_verdict(cells[cells["m"] == 2]) == "not judged (no clip rates logged at m = 8)"
    assert counterfactual_rates(pd.DataFrame(rows).assign(algo="loglinear"), configs).empty


@pytest.mark.slow
def test_the_report_from_real_runs(tiny_cfg, tmp_path, earnable_reward):
    """Recompute with the drift logged, inverse and step_start at 1 and 2 minibatches, d = 2, two
    seeds: every section is written, each (m, arm) is compared on its seeds, the drift is fitted."""
    for m in (1, 2):
        for seed in (0, 1):
            for arm in ("algo=recompute", "algo=loglinear", "algo=loglinear schedule=step_start"):
                if m == 1 and "step_start" in arm:
                    continue
                cfg = tiny_cfg(*arm.split(), "staleness=2", "train.total_steps=3", f"train.n_minibatches={m}",
                               f"seed={seed}", "experiment_name=mechanism", "train.log_prox_errors=true",
                               "run_name='${a3po_run_name:${identity}}-m" + str(m) + "'")
                run(cfg)
    sweep = run_dir_of(cfg).parent
    out = tmp_path / "docs" / "mechanism.md"
    assert main([str(sweep), "--d", "2", "--across-m", "2", "--out", str(out),
                 "--figures-dir", str(tmp_path / "docs" / "mechanism")]) == 0
    text = out.read_text()
    assert "at d = 2 the comparisons use the seeds every (m, arm) has: 0, 1" in text
    assert "Drift exponent: beta = " in text and "per m: m = 1:" in text
    assert "--d 2 --across-m 2 --out" in text  # the regenerate command is the one that ran
    rows = [[cell.strip() for cell in line.split("|")[1:6]] for line in text.splitlines() if line.startswith("| 2 |")]
    compared = {(row[1], row[2]) for row in rows if row[3] == "g'"}
    assert compared == {("1", "`inverse`"), ("2", "`inverse`"), ("2", "`step_start`")}
    # m = 1: recompute's anchor is the current policy, so the model calls inverse "more"
    assert any(row[1] == "1" and row[2] == "`inverse`" and row[3] == "g'" for row in rows)
    assert "| 1 |     0.000 |" in text  # recompute's distance at m = 1 in the model table
    assert "**H-S3a (the inverse - recompute clip gap falls as m grows):" in text
    assert "**H-S3c (step_start clips no more than recompute at every m):" in text
    # the anchor alone, from the recompute runs' logged clip rates: m = 1 and 2, every token and the terciles
    section = text.split("## The anchor alone")[1].split("## ")[0]
    anchors = {tuple(c.strip() for c in line.split("|")[1:4]) for line in section.splitlines() if line.startswith("| ")}
    assert {("1", "`inverse`", "all"), ("2", "`step_start`", "all"), ("2", "`inverse`", "H3")} <= anchors
    assert "**H-S3d (on the same batches the inverse anchor clips more than recompute's, m = 2 and 8): " \
           "not judged (no clip rates logged at m = 8).**" in section
    assert (tmp_path / "docs" / "mechanism" / "mechanism.png").exists()
    # --across-from: the cells across d from other sweeps, with their own beta (no drift logged there: 1)
    for seed in (0, 1):
        for algo in ("recompute", "loglinear"):
            cfg = tiny_cfg(f"algo={algo}", "staleness=1", "train.total_steps=2", "train.n_minibatches=2", f"seed={seed}",
                           "experiment_name=claims")
            run(cfg)
    across = run_dir_of(cfg).parent
    assert main([str(sweep), "--d", "2", "--across-m", "2", "--across-from", str(across), "--out", str(out),
                 "--figures-dir", str(tmp_path / "docs" / "mechanism")]) == 0
    text = out.read_text()
    assert f"--across-from {across}" in text
    assert "- across d: 4 runs of" in text and "precision fp32, scored with beta = 1.000 (no drift logged" in text
    across_rows = {tuple(c.strip() for c in line.split("|")[1:5]) for line in
                   text.split("## Across d")[1].split("## ")[0].splitlines() if line.startswith("| 1 |")}
    assert ("1", "2", "`inverse`", "g'") in across_rows  # d = 1 from --across-from, not the d = 2 runs
