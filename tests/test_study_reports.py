"""The study reports built on analysis.claims.rule.compare: the alpha-schedule report (S2) and the
seeded corrections report (S4). Pure parts on hand-made run scalars; each report end to end on
real tiny-model runs (slow)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.claims.rule import FAILS, HOLDS
from analysis.studies import contrast, direction_word
from analysis.studies.corrections import BY_KEY, DECIDED_IN, hypothesis_verdict, versus_none
from analysis.studies.alpha_schedules import CLIP, TRAINING, against, h_s2b, ranking


def _scalars(rows):
    """Run scalars by hand: (arm columns..., seed, {column: value})."""
    base = {"runtime": "lagged", "objective": "ppo", "correction": "none", "schedule": "", "staleness": 8}
    return pd.DataFrame([{**base, **row} for row in rows])


def _arms(values: dict[str, list[float]], column: str = "clip_ratio") -> pd.DataFrame:
    return _scalars([{"arm": arm, "seed": seed, column: v} for arm, vs in values.items() for seed, v in enumerate(vs)])


def test_contrast_is_the_claims_rule_between_any_two_arms():
    arms = _arms({"recompute": [0.03, 0.04, 0.05], "step_start": [0.01, 0.02, 0.03], "inverse": [0.031, 0.039, 0.052]})
    less = contrast([CLIP], arms[arms["arm"] == "step_start"], arms[arms["arm"] == "recompute"],
                    ("step_start", "recompute"), d=8)[0]
    assert less["verdict"] == HOLDS and less["d"] == 8 and less["effect_mean"] == pytest.approx(-0.02)
    assert direction_word(less) == "lower"
    more = contrast([CLIP], arms[arms["arm"] == "recompute"], arms[arms["arm"] == "step_start"], ("a", "b"))[0]
    assert more["verdict"] == FAILS and direction_word(more) == "higher"
    mixed = contrast([CLIP], arms[arms["arm"] == "inverse"], arms[arms["arm"] == "recompute"], ("a", "b"))[0]
    assert mixed["verdict"].startswith("inconclusive") and direction_word(mixed) == "no difference shown"
    missing = contrast([CLIP], arms[arms["arm"] == "target"], arms[arms["arm"] == "recompute"], ("target", "r"))[0]
    assert missing["verdict"].startswith("not judged") and "no value for target" in missing["verdict"]


def test_the_schedule_ranking_and_h_s2b():
    arms = _arms({"recompute": [0.03, 0.04, 0.05], "inverse": [0.05, 0.061, 0.07],
                  "step_start": [0.031, 0.039, 0.052], "target": [0.01, 0.02, 0.031]})
    versus = against(arms, "recompute", [CLIP])
    assert list(versus["arm"]) == ["inverse", "step_start", "target"]  # the paper's first
    clip, matrix = ranking(versus, arms)
    assert list(clip["arm"]) == ["target", "step_start", "inverse"]  # lowest clip-ratio difference first
    marks = {(r, c): m for r, c, m in zip(matrix["row"], matrix["column"], matrix["mark"])}
    assert marks[("target", "inverse")] == "<" and marks[("inverse", "target")] == ">"
    assert marks[("step_start", "inverse")] == "<" and marks[("target", "step_start")] == "<"
    assert h_s2b(versus, 8) == HOLDS  # step_start undecided vs recompute, inverse clips more
    flipped = _arms({"recompute": [0.03, 0.04, 0.05], "inverse": [0.031, 0.039, 0.052],
                     "step_start": [0.05, 0.061, 0.07]})
    assert h_s2b(against(flipped, "recompute", [CLIP]), 8) == FAILS
    unmet = h_s2b(against(_arms({"recompute": [0.03, 0.04, 0.05], "inverse": [0.031, 0.039, 0.052],
                                 "step_start": [0.03, 0.04, 0.05]}), "recompute", [CLIP]), 8)
    assert unmet.startswith("not met as registered")
    assert {c.key for c in TRAINING} == {"c", "d", "e", "f", "g", "g'"}


def _correction_arms():
    rows = []
    for seed in range(3):
        rows += [{"method": "recompute", "correction": "none", "seed": seed, "ess_token": 0.58 + 0.01 * seed,
                  "iw_max": 2.4 + 0.1 * seed, "final_eval_reward": 0.8},
                 {"method": "recompute", "correction": "m2po0.04", "seed": seed, "ess_token": 0.77 + 0.012 * seed,
                  "iw_max": 1.3, "final_eval_reward": 0.8},
                 {"method": "recompute", "correction": "icepop0.5_2", "seed": seed, "ess_token": 0.7,
                  "iw_max": 1.25 + 0.01 * seed, "final_eval_reward": 0.8},
                 {"method": "recompute", "correction": "seq_mis0.5_2", "seed": seed, "ess_token": 0.6,
                  "iw_max": 2.4 + 0.3 * (seed - 1), "final_eval_reward": 0.8}]
    return _scalars(rows)


def test_the_corrections_hypotheses_by_their_rule():
    arms = _correction_arms()
    verdict, records = hypothesis_verdict(DECIDED_IN[0], arms, 8)  # H-S4a: m2po's ESS higher
    assert verdict == HOLDS and records[0]["cell"] == "recompute-m2po0.04 vs recompute-none"
    verdict, records = hypothesis_verdict(DECIDED_IN[1], arms, 8)  # H-S4b: seq_mis's IW max is not lower
    assert verdict == "inconclusive" and [r["verdict"] == HOLDS for r in records] == [True, False, True]
    verdict, _ = hypothesis_verdict(DECIDED_IN[2], arms, 8)  # H-S4c: no loglinear runs
    assert verdict.startswith("not judged")
    table = versus_none(arms)
    assert set(table["correction"]) == {"m2po0.04", "icepop0.5_2", "seq_mis0.5_2"}
    assert set(table["claim"]) == {c.key for c in BY_KEY.values()}
    ess = table[(table["correction"] == "m2po0.04") & (table["claim"] == "ess")].iloc[0]
    assert direction_word(ess) == "higher"


def test_a_study_report_ends_with_its_deviations_or_fails_at_start(tmp_path, capsys):
    import argparse

    from analysis.studies import deviations_flag, write_study_report

    page = tmp_path / "study_s9.md"
    page.write_text("# S9\n\n## Deviations\n\n- none yet, but this line.\n")
    loaded = []

    def report(args):
        loaded.append(True)
        return ["# S9 report", f"command: --out {args.out}{deviations_flag(args)}"]

    def parser():  # the study's own arguments: none; write_study_report adds --out, --figures-dir, --deviations
        return argparse.ArgumentParser()

    out, figures = tmp_path / "s9.md", str(tmp_path / "s9")
    assert write_study_report(parser(), report, ["--out", str(out), "--figures-dir", figures,
                                                 "--deviations", str(page)]) == 0
    assert out.read_text() == (f"# S9 report\ncommand: --out {out} --deviations {page}\n\n"
                               f"## Deviations from the pre-registration (`{page}`)\n\n- none yet, but this line.\n")
    assert write_study_report(parser(), report, ["--out", str(out), "--figures-dir", figures,
                                                 "--deviations", str(tmp_path / "nope.md")]) == 2
    assert "error: --deviations: " in capsys.readouterr().out and len(loaded) == 1  # nothing loaded the second time


@pytest.mark.slow
def test_both_reports_from_real_runs(tiny_cfg, tmp_path, earnable_reward):
    from a3po.run.main import run, run_dir_of
    from analysis.studies.corrections import main as corrections_main
    from analysis.studies.alpha_schedules import main as schedules_main

    for seed in (0, 1):
        for arm in ("algo=recompute train.log_prox_errors=true", "algo=loglinear", "algo=loglinear schedule=step_start",
                    "algo=coupled", "algo=recompute correction=m2po", "algo=loglinear correction=seq_mis"):
            cfg = tiny_cfg(*arm.split(), "staleness=2", "train.total_steps=3", f"seed={seed}")
            run(cfg)
    sweep = run_dir_of(cfg).parent
    out = tmp_path / "docs"
    assert schedules_main([str(sweep), "--fidelity-from", str(sweep), "--seeds", "0,1",
                           "--out", str(out / "alpha_schedules.md"), "--figures-dir", str(out / "alpha_schedules")]) == 0
    assert (out / "alpha_schedules" / "alpha_schedules.png").exists()
    text = (out / "alpha_schedules.md").read_text()
    assert "--fidelity-from" in text and "--seeds 0,1" in text
    for schedule in ("inverse", "step_start", "behave"):  # coupled's runs are behave's
        assert f"| `{schedule}`" in text
    assert "H-S2a (step_start vs inverse" in text and "**H-S2b (step_start clips no more" in text
    assert "## Does any schedule beat the paper's?" in text
    # what each anchor is, from the runs' configs (d = 2, 1 minibatch, eps_clip 0.2)
    weights = {tuple(c.strip() for c in line.split("|")[1:6]) for line in text.split("What each anchor is")[1]
               .split("\n\n")[1].splitlines()[2:]}
    assert ("2", "`inverse`", "0.5", "0.5", "0.365") in weights and ("2", "`behave`", "1", "1", "0.182") in weights
    assert ("2", "`step_start`", "0", "0.2", "0.912") in weights  # 2 minibatches: w_b = (1/2) / (2 + 1/2) on the last
    assert corrections_main([str(sweep), "--out", str(out / "corrections.md"),
                             "--figures-dir", str(out / "corrections")]) == 0
    text = (out / "corrections.md").read_text()
    assert "**H-S4a (m2po keeps the token ESS higher under recompute" in text
    assert "**H-S4d (seq_mis at 0.5-2 lowers loglinear's held-out reward" in text
    assert "`m2po0.04`" in text and "`seq_mis0.5_2`" in text
    assert (out / "corrections" / "corrections_panel.png").exists()
