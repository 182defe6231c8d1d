"""analysis.stats, analysis.claims.rule, analysis.report and the corrections panel, on crafted
run directories whose effects are known: one claim that holds, one that does not, one
that is inconclusive, one that cannot be judged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from analysis import report  # noqa: E402
from analysis.claims import rule as claims  # noqa: E402
from analysis.figures import paper as figures  # noqa: E402
from analysis.figures.corrections_panel import methods  # noqa: E402
from analysis.load import load_runs  # noqa: E402
from analysis.stats import mean_ci, welch_ci  # noqa: E402

STEPS = 10
SEEDS = [0, 1, 2]


def dump_run(root: Path, name: str, config: dict, records: list[dict]) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run_name": name, **config}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


# --- crafted sweep for the claims ------------------------------------------------------

# Per-seed run-level values (steps >= d are constant, so a run's steady mean is the value).
REWARD = {"recompute": [0.50, 0.52, 0.48], "loglinear": [0.504, 0.5138, 0.4906], "coupled": [0.45, 0.46, 0.44]}
IW_MAX = {"recompute": [2.0, 2.1, 1.9], "loglinear": [2.3, 2.42, 2.19], "coupled": [3.0, 3.0, 3.0]}
IW_MIN = {"recompute": [0.40, 0.41, 0.39], "loglinear": [0.41, 0.39, 0.395], "coupled": [0.3, 0.3, 0.3]}
ENTROPY = {"recompute": [0.30, 0.31, 0.29], "loglinear": [0.35, 0.362, 0.338], "coupled": [0.2, 0.2, 0.2]}
CLIPPED = {"recompute": [100.0, 110.0, 90.0], "loglinear": [40.0, 45.0, 37.0], "coupled": [150.0, 150.0, 150.0]}
STEP_TIME = {"recompute": [2.0, 2.2, 2.6], "loglinear": [1.0, 1.0, 1.3], "coupled": [0.9, 0.9, 0.9]}
PROX_TIME = {"recompute": [0.5, 0.55, 0.6], "loglinear": [1e-4, 1e-4, 1.2e-4], "coupled": [0.0, 0.0, 0.0]}
D = 2


def claim_record(algo: str, index: int, step: int) -> dict:
    ramp = step < D  # ramp-up steps carry values that would change every verdict if counted
    return {
        "step": step, "wall_time": (step + 1) * STEP_TIME[algo][index] + 5.0 * step,  # eval pauses in wall
        "time/step": STEP_TIME[algo][index], "time/step_cpu": STEP_TIME[algo][index] * 0.95,
        "time/prox_logp": PROX_TIME[algo][index], "reward/mean": REWARD[algo][index],
        "actor/importance_weight/max": 50.0 if ramp else IW_MAX[algo][index],
        "actor/importance_weight/min": 0.01 if ramp else IW_MIN[algo][index],
        "actor/entropy": 0.0 if ramp else ENTROPY[algo][index],
        "actor/clipped_tokens": 1e4 if ramp else CLIPPED[algo][index],
        "staleness/mean": float(min(step, D)), "staleness/max": min(step, D),
    }


CONFIG = {"experiment_name": "claims", "train": {"total_steps": STEPS, "n_prompts": 8, "n_samples": 4, "lr": 2e-6},
          "model": {"name": "smollm2_135m"}, "task": {"name": "arith"}, "rollout": {"name": "hf", "max_new_tokens": 24},
          "runtime": {"name": "lagged"}}


@pytest.fixture(scope="module")
def claims_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("claims") / "claims"
    for algo in ("coupled", "recompute", "loglinear"):
        for index, seed in enumerate(SEEDS):
            config = {**CONFIG, "algo": {"name": algo}, "staleness": D, "seed": seed}
            dump_run(root, f"{algo}-d{D}-s{seed}", config,
                     [claim_record(algo, index, step) for step in range(STEPS)])
    return root


@pytest.fixture(scope="module")
def verdicts(claims_sweep) -> pd.DataFrame:
    return claims.evaluate_claims(load_runs(claims_sweep)).set_index("claim")


def test_claims_that_hold(verdicts):
    for key in ("a", "b", "b'", "d", "g"):
        assert verdicts.at[key, "verdict"] == claims.HOLDS, key
    ratios = [r / l for r, l in zip(PROX_TIME["recompute"], PROX_TIME["loglinear"])]
    assert math.exp(verdicts.at["a", "effect_mean"]) == pytest.approx(np.exp(np.mean(np.log(ratios))))
    assert verdicts.at["d", "effect_mean"] == pytest.approx(np.mean(np.subtract(ENTROPY["loglinear"],
                                                                                ENTROPY["recompute"])))
    # training time: the sums of time/step (the wall times, with their eval pauses, would differ)
    reduction = 1 - math.exp(-verdicts.at["b", "effect_mean"])
    log_ratios = np.log(np.divide(STEP_TIME["recompute"], STEP_TIME["loglinear"]))
    assert reduction == pytest.approx(1 - math.exp(-log_ratios.mean()))
    assert verdicts.at["b", "note"] == "paired over 3 seeds"  # no contention: CPU is 0.95 of wall


def test_claims_that_do_not_hold_or_are_inconclusive(verdicts):
    assert verdicts.at["e", "verdict"] == claims.FAILS  # loglinear's IW max is higher here
    differences = np.subtract(IW_MAX["loglinear"], IW_MAX["recompute"])
    interval = mean_ci(differences)
    assert (verdicts.at["e", "effect_low"], verdicts.at["e", "effect_high"]) == pytest.approx((interval.low,
                                                                                                interval.high))
    assert verdicts.at["f", "verdict"] == claims.INCONCLUSIVE_SIGN
    assert verdicts.at["c", "verdict"] == claims.INCONCLUSIVE_BAND
    relative = np.subtract(REWARD["loglinear"], REWARD["recompute"]) / np.mean(REWARD["recompute"])
    assert verdicts.at["c", "effect_mean"] == pytest.approx(relative.mean())
    assert verdicts.at["g'", "verdict"].startswith("not judged (clip_ratio has no value")
    assert verdicts.at["a", "coupled"] == "0 ± 0"
    assert verdicts.at["e", "recompute"] == f"2 ± {mean_ci(IW_MAX['recompute']).half_width:.2g}"


def test_single_seed_and_unpaired_seeds(claims_sweep, tmp_path):
    single = claims.evaluate_claims(load_runs([claims_sweep / "recompute-d2-s0", claims_sweep / "loglinear-d2-s0"]))
    assert set(single["verdict"]) <= {claims.INCONCLUSIVE_SEEDS} | {v for v in single["verdict"]
                                                                     if v.startswith("not judged")}
    assert (single["verdict"] == claims.INCONCLUSIVE_SEEDS).sum() == 8
    # loglinear seeds that recompute does not have: Welch's unpaired interval
    root = tmp_path / "unpaired"
    for index, seed in enumerate([5, 6, 7]):
        dump_run(root, f"loglinear-d{D}-s{seed}", {**CONFIG, "algo": {"name": "loglinear"}, "staleness": D,
                                                    "seed": seed},
                 [claim_record("loglinear", index, step) for step in range(STEPS)])
    mixed = claims.evaluate_claims(load_runs([claims_sweep / f"recompute-d2-s{s}" for s in SEEDS] + [root]))
    row = mixed.set_index("claim").loc["e"]
    assert row["note"] == "unpaired (3 vs 3 seeds)"
    expected = welch_ci(IW_MAX["loglinear"], IW_MAX["recompute"])
    assert (row["effect_low"], row["effect_high"]) == pytest.approx((expected.low, expected.high))


def test_report_file(claims_sweep, tmp_path, capsys):
    out = tmp_path / "docs" / "results.md"
    assert report.main([str(claims_sweep), "--out", str(out)]) == 0
    text = out.read_text()
    figures_dir = tmp_path / "docs" / "results"
    pngs = sorted(p.name for p in figures_dir.iterdir())
    assert pngs and all(name.endswith(".png") for name in pngs)  # PNG only: the repo stays small
    for name in pngs:
        assert f"](results/{name})" in text
    assert (figures_dir / "fig1_prox_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "- runs: 9 (0 incomplete" in text and "- skipped run directories: none" in text
    assert "- precision: fp32" in text  # recorded by the runs, or fp32 for runs from before the key
    assert "staleness levels: 2; seeds: 0, 1, 2" in text
    assert "- prompts per step: 8" in text and "- max new tokens: 24" in text and "- model: smollm2_135m" in text
    assert "contention (wall/CPU > 1.25, under 0.8 of a core): 0 of 9 runs" in text
    assert "### d = 2" in text
    for verdict in (claims.HOLDS, claims.FAILS, claims.INCONCLUSIVE_SIGN, claims.INCONCLUSIVE_BAND):
        assert f"**{verdict}**" in text
    assert "**not judged (clip_ratio has no value" in text
    assert "~8,500x" in text and "18-27% less" in text
    assert "## Summary table" in text and "Steady state only" in text
    assert "files written:" in capsys.readouterr().out


def test_report_skips_unreadable_runs_and_says_how_many(claims_sweep, tmp_path, capsys):
    import shutil
    import warnings

    sweep = tmp_path / "claims"
    shutil.copytree(claims_sweep, sweep)
    (sweep / "recompute-d2-s2" / "config.yaml").write_text("run_name: [unclosed\n")
    (sweep / "coupled-d2-s1" / "metrics.jsonl").write_bytes(b"\xff\xfe not text\n")
    out = tmp_path / "results.md"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert report.main([str(sweep), "--out", str(out)]) == 0
    skipped = sorted(str(w.message) for w in caught if "skipped" in str(w.message))
    assert len(skipped) == 2 and all("\n" not in message for message in skipped)  # once each, one line
    assert "coupled-d2-s1: skipped, metrics.jsonl cannot be read (UnicodeDecodeError" in skipped[0]
    assert "recompute-d2-s2: skipped, config.yaml is not valid YAML (" in skipped[1]
    text = out.read_text()
    assert "- runs: 7 (0 incomplete" in text
    line = next(line for line in text.splitlines() if line.startswith("- skipped run directories:"))
    assert line.startswith("- skipped run directories: 2, not in any number below (")
    assert f"`{sweep}/recompute-d2-s2`: config.yaml is not valid YAML (ParserError: " in line
    assert f"`{sweep}/coupled-d2-s1`: metrics.jsonl cannot be read (UnicodeDecodeError: " in line
    assert "## Claims" in text and "## Summary table" in text
    assert "files written:" in capsys.readouterr().out


def test_a_report_ends_with_its_preregistrations_deviations(claims_sweep, tmp_path, capsys):
    study = tmp_path / "study.md"
    study.write_text("# Plan\n\n## Hypotheses\n\nH1.\n\n## Deviations\n\n- 22:07 UTC: started late.\n- 23:10: resumed.\n")
    out = tmp_path / "results.md"
    assert report.main([str(claims_sweep), "--out", str(out), "--deviations", str(study)]) == 0
    text = out.read_text()
    assert text.rstrip().endswith("## Deviations from the pre-registration (`%s`)\n\n- 22:07 UTC: started late.\n"
                                  "- 23:10: resumed." % study)
    assert f"--deviations {study}`" in text  # the regenerate command is the one that ran
    no_section = tmp_path / "plain.md"
    no_section.write_text("# Nothing registered\n")
    assert report.main([str(claims_sweep), "--out", str(out), "--deviations", str(no_section)]) == 2
    err = capsys.readouterr().err
    assert f"error: --deviations: {no_section}: no '## Deviations' section" in err


def test_report_without_recompute_says_so(claims_sweep, tmp_path):
    markdown, _ = report.write_report([claims_sweep / "loglinear-d2-s0"], tmp_path / "r.md")
    assert "No context has both loglinear and recompute runs" in markdown


# --- corrections panel -----------------------------------------------------------------

CORRECTIONS = {"none": ({"name": "none"}, ""), "tis": ({"name": "tis", "cap": 2.0}, "-tis2"),
               "icepop": ({"name": "icepop", "lo": 0.5, "hi": 2}, "-icepop0.5_2")}


def correction_value(algo: str, correction: str, staleness: int, seed: int) -> float:
    return 0.5 + 0.1 * list(CORRECTIONS).index(correction) + 0.01 * staleness + (0.05 if algo == "loglinear" else 0) \
        + 0.001 * seed


@pytest.fixture(scope="module")
def corrections_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corrections") / "corrections"
    for correction, (group, segment) in CORRECTIONS.items():
        for algo in ("recompute", "loglinear"):
            for staleness in (2, 8):
                for seed in (0, 1):
                    value = correction_value(algo, correction, staleness, seed)
                    config = {**CONFIG, "algo": {"name": algo}, "correction": group, "objective": {"name": "ppo"},
                              "staleness": staleness, "seed": seed}
                    records = [{"step": t, "wall_time": float(t + 1), "time/step": 1.0, "reward/mean": value,
                                "actor/importance_weight/max": 1 + value, "actor/clip_ratio": value / 10,
                                "offpolicy/ess_token": value} for t in range(STEPS)]
                    dump_run(root, f"{algo}{segment}-d{staleness}-s{seed}", config, records)
    return root


def test_corrections_panel(corrections_sweep, tmp_path):
    df = load_runs(corrections_sweep)
    assert set(df["correction"]) == {"none", "tis2", "icepop0.5_2"}
    series = methods(df).set_index("run")["method"]
    assert series["recompute-icepop0.5_2-d8-s1"] == "recompute" and series["loglinear-tis2-d2-s0"] == "loglinear"
    written = figures.make_figures(df, tmp_path)
    for suffix in ("png", "pdf", "csv"):
        assert tmp_path / f"corrections_panel.{suffix}" in written
    data = pd.read_csv(tmp_path / "corrections_panel.csv")
    assert set(data["quantity"]) == {"final_reward", "iw_max", "clip_ratio", "ess_token"}
    row = data[(data["quantity"] == "ess_token") & (data["correction"] == "icepop0.5_2")
               & (data["method"] == "loglinear") & (data["staleness"] == 8)].iloc[0]
    values = [correction_value("loglinear", "icepop", 8, seed) for seed in (0, 1)]
    interval = mean_ci(values)
    assert row["mean"] == pytest.approx(np.mean(values)) and row["n_seeds"] == 2
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((interval.low, interval.high))
    clip = data[(data["quantity"] == "clip_ratio") & (data["correction"] == "none") & (data["method"] == "recompute")
                & (data["staleness"] == 2)].iloc[0]
    assert clip["mean"] == pytest.approx(np.mean([correction_value("recompute", "none", 2, s) / 10 for s in (0, 1)]))
    contexts = claims.evaluate_claims(df)["context"].unique().tolist()
    assert contexts == ["d = 2", "d = 8", "d = 2, correction icepop0.5_2", "d = 8, correction icepop0.5_2",
                        "d = 2, correction tis2", "d = 8, correction tis2"]


def test_uneven_contention_makes_the_wall_clock_claim_inconclusive():
    from analysis.claims.rule import CLAIMS, judge

    wall_claim = next(c for c in CLAIMS if c.key == "b")
    cpu_claim = next(c for c in CLAIMS if c.key == "b'")

    def rows(recompute_contended: bool):
        return pd.DataFrame([
            {"algo": algo, "seed": seed, "train_time_s": time, "cpu_time_s": time * 0.9, "time_basis": "time/step",
             "contended": recompute_contended and algo == "recompute"}
            for algo, time in (("recompute", 300.0), ("loglinear", 170.0)) for seed, jitter in ((0, 0), (1, 3), (2, -2))
            for time in [time + jitter]])

    uneven = judge(wall_claim, rows(recompute_contended=True))
    assert uneven["verdict"].startswith("inconclusive (wall clock contended unevenly: recompute 3/3 runs, loglinear 0/3")
    assert judge(cpu_claim, rows(recompute_contended=True))["verdict"] == "holds"  # CPU time is judged as usual
    assert judge(wall_claim, rows(recompute_contended=False))["verdict"] == "holds"
