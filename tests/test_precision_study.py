"""The precision report (S5, analysis/studies/precision.py) and the rule that no contrast mixes
precisions: pure parts on hand-made run scalars, the report end to end on real tiny runs (slow)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.claims.rule import FAILS, HOLDS
from analysis.studies import contrast
from analysis.claims.paper import CLAIMS
from analysis.studies.precision import CHANGED, KEPT, NOT_SHOWN, agreement, effect_shift, per_arm, versus_recompute
from analysis.scalars import context_of

CLIP = next(claim for claim in CLAIMS if claim.key == "g'")


def _arms(values: dict[tuple[str, str], list[float]]) -> pd.DataFrame:
    """(precision, arm) -> clip ratio per seed 0, 1, ..."""
    return pd.DataFrame([{"precision": precision, "arm": arm, "seed": seed, "clip_ratio": v, "experiment": "e",
                          "run": f"{arm}-{precision}-s{seed}"}
                         for (precision, arm), vs in values.items() for seed, v in enumerate(vs)])


def test_agreement_needs_both_verdicts_decided():
    assert agreement(HOLDS, HOLDS) == KEPT and agreement(FAILS, FAILS) == KEPT
    assert agreement(HOLDS, FAILS) == CHANGED and agreement(FAILS, HOLDS) == CHANGED
    assert agreement(FAILS, "inconclusive (CI of the difference includes 0)") == NOT_SHOWN
    assert agreement("not judged (x)", HOLDS) == NOT_SHOWN


def test_each_precision_is_judged_on_its_own_runs_and_the_shift_is_per_seed():
    arms = _arms({("fp32", "recompute"): [0.030, 0.031, 0.029], ("fp32", "inverse"): [0.055, 0.058, 0.052],
                  ("bf16", "recompute"): [0.020, 0.022, 0.021], ("bf16", "inverse"): [0.041, 0.045, 0.043]})
    fp32 = versus_recompute(arms, [CLIP], "fp32").iloc[0]
    bf16 = versus_recompute(arms, [CLIP], "bf16").iloc[0]
    assert fp32["verdict"] == FAILS and fp32["effect_mean"] == pytest.approx(0.025)  # inverse clips more
    assert bf16["verdict"] == FAILS and bf16["effect_mean"] == pytest.approx(0.022)
    only_two = versus_recompute(arms, [CLIP], "fp32", seeds=[0, 1]).iloc[0]
    assert only_two["effect_mean"] == pytest.approx(0.026)
    shift, seeds = effect_shift(CLIP, arms)
    # per seed: (0.021 - 0.025), (0.023 - 0.027), (0.022 - 0.023)
    assert seeds == [0, 1, 2] and shift.mean == pytest.approx((-0.004 - 0.004 - 0.001) / 3)
    lonely = _arms({("fp32", "recompute"): [0.03], ("fp32", "inverse"): [0.05]})
    empty, none = effect_shift(CLIP, lonely)
    assert none == [] and math.isnan(empty.mean)


def test_per_arm_pairs_bf16_with_the_fp32_run_of_the_same_seed():
    arms = _arms({("fp32", "recompute"): [0.030, 0.031, 0.029], ("bf16", "recompute"): [0.020, 0.022, 0.020]})
    record = per_arm(arms, [CLIP]).iloc[0]
    assert record["arm"] == "recompute" and record["effect_mean"] == pytest.approx(-0.0093333, abs=1e-6)
    assert record["verdict"] == FAILS  # the plain difference "higher" is refuted: bf16 is lower


def test_no_contrast_mixes_precisions():
    arms = _arms({("fp32", "recompute"): [0.03, 0.031], ("bf16", "inverse"): [0.04, 0.041]})
    with pytest.raises(ValueError, match="mixes precisions \\(bf16, fp32\\)"):
        contrast([CLIP], arms[arms["arm"] == "inverse"], arms[arms["arm"] == "recompute"], ("inverse", "recompute"))
    frame = pd.DataFrame({"label_prefix": ["", ""], "correction": ["none"] * 2, "objective": ["ppo"] * 2,
                          "runtime": ["lagged"] * 2, "precision": ["fp32", "bf16"]})
    first, second = context_of(frame)
    assert first != second  # the claims report and the speedups never pair across precisions


@pytest.mark.slow
def test_the_report_from_real_runs_in_both_precisions(tiny_cfg, tmp_path, earnable_reward):
    from a3po.run.main import run, run_dir_of
    from analysis.studies.precision import main

    for precision in ("fp32", "bf16"):
        for seed in (0, 1):
            for arm in ("algo=recompute", "algo=loglinear", "algo=loglinear schedule=step_start"):
                cfg = tiny_cfg(*arm.split(), "staleness=2", "train.total_steps=3", f"seed={seed}",
                               f"precision={precision}", "experiment_name=precision")
                run(cfg)
    sweep = run_dir_of(cfg).parent
    assert {p.name for p in sweep.iterdir() if p.is_dir()} >= {"recompute-bf16-d2-s0", "recompute-d2-s0"}
    out = tmp_path / "docs" / "precision.md"
    assert main([str(sweep), "--d", "2", "--m", "2", "--out", str(out),
                 "--figures-dir", str(tmp_path / "docs" / "precision")]) == 0
    text = out.read_text()
    assert "--d 2 --m 2 --out" in text  # the regenerate command is the one that ran
    assert "| bf16      | `inverse`    | 0, 1  |" in text and "| fp32      | `step_start` | 0, 1  |" in text
    assert "## H-P1: the findings survive: " in text and "## H-P2: does bf16 move the effect's size?" in text
    judged = [line.split("|")[1].strip() for line in text.split("## H-P1")[1].split("## H-P2")[0].splitlines()
              if line.startswith("| ") and not line.startswith("| claim")]
    assert judged == ["c", "d", "e", "f", "g", "g'", "eval"]
    arms = {line.split("|")[1].strip() for line in text.split("## Each arm")[1].split("## Timing")[0].splitlines()
            if line.startswith("| `")}
    assert arms == {"`recompute`", "`inverse`", "`step_start`"}
    assert (tmp_path / "docs" / "precision" / "precision.png").exists()
