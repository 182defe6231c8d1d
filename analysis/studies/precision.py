"""The precision report (S5, docs/studies/precision.md): does bf16 keep the claims study's findings?

    python -m analysis.studies.precision SWEEP... --out docs/reports/precision.md --figures-dir docs/reports/precision

The sweeps hold runs of one shape (staleness `--d`, `--m` minibatches) in two precisions. For
each claim, loglinear (`inverse`) against recompute is judged by the S1 rule
(`analysis.claims.rule.compare`) in each precision. The claims are c-g' plus the held-out reward;
a and b' are shown as timings within a precision. The two verdicts are then set side by side
(H-P1, `agreement`). The report also gives the difference of the per-seed effects
bf16 - fp32 (H-P2), and each arm's bf16 - fp32 per metric (descriptive). A run is never
compared across precisions inside one contrast.
"""

from __future__ import annotations

import argparse
import sys
import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.anchor.clip_rates import with_minibatches
from analysis.claims.paper import CLAIMS, Claim, on_effect_scale
from analysis.claims.rule import FAILS, HOLDS, compare
from analysis.frame import disambiguate
from analysis.hypotheses import HYPOTHESES
from analysis.load import load_configs, load_runs
from analysis.markdown import fmt_interval, markdown_table
from analysis.plotting import save
from analysis.provenance import generated_line, REPORT_FIGURES, figures_markdown
from analysis.scalars import run_scalars
from analysis.stats import Interval, mean_ci
from analysis.studies import code, contrast_table, deviations_flag, provenance_table, study_parser, write_study_report

__all__ = ["JUDGED", "TIMING", "agreement", "effect_shift", "versus_recompute", "per_arm", "main"]

HELD_OUT = Claim("eval", "held-out reward after the last step: higher for loglinear", "final_eval_reward",
                 "difference", +1, "difference", "not a claim of the paper")
JUDGED = [claim for claim in CLAIMS if claim.key in ("c", "d", "e", "f", "g", "g'")] + [HELD_OUT]
TIMING = [claim for claim in CLAIMS if claim.key in ("a", "b'")]
PRECISIONS = ("fp32", "bf16")
ARM_ORDER = ("recompute", "inverse", "step_start")
KEPT, CHANGED, NOT_SHOWN = "kept", "changes", "not shown at these seeds"


def agreement(reference: str, candidate: str) -> str:
    """H-P1 for one claim: `changes` when both verdicts are decided (holds / does not hold) and
    differ, `kept` when both are decided and equal, `not shown at these seeds` otherwise."""
    decided = (HOLDS, FAILS)
    if reference in decided and candidate in decided:
        return KEPT if reference == candidate else CHANGED
    return NOT_SHOWN


def _arm_runs(arms: pd.DataFrame, precision: str, arm: str, seeds: list[int] | None = None) -> pd.DataFrame:
    runs = arms[(arms["precision"] == precision) & (arms["arm"] == arm)]
    return runs if seeds is None else runs[runs["seed"].isin(seeds)]


def versus_recompute(arms: pd.DataFrame, claims: list[Claim], precision: str,
                     seeds: list[int] | None = None) -> pd.DataFrame:
    """Each claim, inverse against recompute, in one precision (on `seeds`, all where None)."""
    ours, base = _arm_runs(arms, precision, "inverse", seeds), _arm_runs(arms, precision, "recompute", seeds)
    return pd.DataFrame([{"precision": precision, **compare(claim, ours, base, ("inverse", "recompute"))}
                         for claim in claims])


def _per_seed_effects(claim: Claim, arms: pd.DataFrame, precision: str) -> dict[int, float]:
    ours = _arm_runs(arms, precision, "inverse").groupby("seed")[claim.column].mean().dropna().to_dict()
    base = _arm_runs(arms, precision, "recompute").groupby("seed")[claim.column].mean().dropna().to_dict()
    samples, _ = on_effect_scale(claim, ours, base)
    if samples is None:
        return {}
    return {seed: samples.ours[seed] - samples.base[seed] for seed in samples.seeds}


def effect_shift(claim: Claim, arms: pd.DataFrame) -> tuple[Interval, list[int]]:
    """H-P2: per seed with both precisions, (inverse - recompute) in bf16 minus the same in
    fp32, on the claim's effect scale; the mean's 95% t interval and the seeds used."""
    bf16, fp32 = _per_seed_effects(claim, arms, "bf16"), _per_seed_effects(claim, arms, "fp32")
    seeds = sorted(set(bf16) & set(fp32))
    if not seeds:
        return Interval(math.nan, math.nan, math.nan, 0), seeds
    return mean_ci([bf16[s] - fp32[s] for s in seeds]), seeds


def per_arm(arms: pd.DataFrame, claims: list[Claim]) -> pd.DataFrame:
    """Each arm's bf16 - fp32 per metric, paired by seed (a plain difference of the run scalar)."""
    records = []
    for arm in ARM_ORDER:
        ours, base = _arm_runs(arms, "bf16", arm), _arm_runs(arms, "fp32", arm)
        if ours.empty or base.empty:
            continue
        for claim in claims:
            plain = Claim(claim.key, claim.column, claim.column, "difference", +1, "difference", "")
            records.append({"arm": arm, **compare(plain, ours, base, ("bf16", "fp32"))})
    return pd.DataFrame(records)


def _h_p1_table(reference: pd.DataFrame, same_seeds: pd.DataFrame, bf16: pd.DataFrame) -> tuple[str, str]:
    rows, changed, kept = [], 0, 0
    for ref, same, new in zip(reference.itertuples(), same_seeds.itertuples(), bf16.itertuples()):
        judged = agreement(ref.verdict, new.verdict)
        changed, kept = changed + (judged == CHANGED), kept + (judged == KEPT)
        rows.append([ref.claim, ref.effect, ref.verdict, same.effect, same.verdict, new.effect, new.verdict,
                     str(new.seeds_observed), judged])
    verdict = FAILS if changed else HOLDS
    if bf16["verdict"].str.startswith("not judged").all():
        verdict = "not judged (no bf16 verdict)"
    table = markdown_table(["claim", "fp32, every seed", "verdict", "fp32, bf16's seeds", "verdict", "bf16",
                            "verdict", "bf16 seeds for 80% power", "H-P1"], rows, numeric_from=99)
    return f"{verdict} ({changed} changed, {kept} kept, {len(rows) - changed - kept} not shown)", table


def _shift_table(arms: pd.DataFrame) -> str:
    rows = []
    for claim in JUDGED:
        interval, seeds = effect_shift(claim, arms)
        excludes = interval.known and (interval.low > 0 or interval.high < 0)
        rows.append([claim.key, fmt_interval(interval), str(len(seeds)),
                     "bf16 moves the effect" if excludes else "no shift shown"])
    return markdown_table(["claim", "effect in bf16 - effect in fp32 [95% CI]", "seeds", "reading"], rows,
                          numeric_from=99)


def _figure(df: pd.DataFrame, arms: pd.DataFrame, seeds: list[int], out_dir: Path) -> list[Path]:
    """Reward and clip ratio per step, mean over `seeds` per arm (colour) and precision (line style)."""
    runs = arms.loc[arms["seed"].isin(seeds), ["experiment", "run", "arm", "precision", "seed"]]
    metrics = {"reward/mean": "rollout reward", "actor/clip_ratio": "clip ratio"}
    steps = df[df["metric"].isin(metrics)].merge(runs, on=["experiment", "run", "seed", "precision"])
    curves = steps.groupby(["metric", "arm", "precision", "step"])["value"].mean().reset_index()
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, len(metrics))
    colours = dict(zip(ARM_ORDER, ("tab:blue", "tab:orange", "tab:green")))
    for ax, (metric, title) in zip(axes, metrics.items()):
        for (arm, precision), curve in curves[curves["metric"] == metric].groupby(["arm", "precision"]):
            ax.plot(curve["step"], curve["value"], color=colours.get(arm, "0.4"),
                    linestyle="-" if precision == "bf16" else "--", marker="o", markersize=3,
                    label=f"{arm}, {precision}")
        ax.set_xlabel("step")
        ax.set_title(f"{title}, mean over seeds {', '.join(map(str, seeds))}")
    axes[0].legend(frameon=False, fontsize=8)
    return save(fig, curves, out_dir, "precision", REPORT_FIGURES)


def _command(args: argparse.Namespace) -> str:
    return (f"python -m analysis.studies.precision {' '.join(map(str, args.paths))} --d {args.d} --m {args.m} "
            f"--out {args.out} --figures-dir {args.figures_dir}" + deviations_flag(args))


def report(args: argparse.Namespace) -> list[str]:
    """The report's lines (markdown) from the parsed command line."""
    df = disambiguate(load_runs(args.paths))
    arms = with_minibatches(run_scalars(df), load_configs(args.paths))
    arms = arms[(arms["staleness"] == args.d) & (arms["m"] == args.m) & arms["precision"].isin(PRECISIONS)]
    duplicated = arms[arms.duplicated(["precision", "arm", "seed"], keep=False)]
    if len(duplicated):
        print("error: more than one run per (precision, arm, seed): "
              + ", ".join(sorted(duplicated["run"] + " (" + duplicated["experiment"] + ")")), file=sys.stderr)
        raise SystemExit(2)
    bf16_seeds = sorted(set(_arm_runs(arms, "bf16", "inverse")["seed"]) & set(_arm_runs(arms, "bf16", "recompute")["seed"]))
    reference = versus_recompute(arms, JUDGED, "fp32")
    same_seeds = versus_recompute(arms, JUDGED, "fp32", bf16_seeds)
    bf16 = versus_recompute(arms, JUDGED, "bf16")
    h_p1, h_p1_table = _h_p1_table(reference, same_seeds, bf16)
    timing = pd.concat([versus_recompute(arms, TIMING, precision) for precision in PRECISIONS], ignore_index=True)
    return ["# Does bf16 keep the science? (S5)", "",
            generated_line(_command(args)) + (
                " Pre-registered in docs/studies/precision.md (hypotheses, grid, rules); its deviations are listed there."), "",
            "## Provenance", "",
            f"- runs: {len(arms)} at d = {args.d}, {args.m} minibatches, in the paper's setup (lagged, no "
            f"correction, ppo); experiments: {', '.join(sorted(arms['experiment'].unique()))}", "",
            provenance_table(arms, [("precision", "precision")]), "",
            f"## H-P1: {HYPOTHESES['H-P1'].text}: {h_p1}", "",
            "`inverse` against recompute by the S1 rule (analysis/claims/rule.py: paired 95% t interval; TOST for c) "
            "in each precision. A claim **changes** when both precisions decide it (holds / does not hold) "
            "and differently, is **kept** when both decide it alike, and is not shown otherwise. H-P1 holds "
            "when no claim changes.", "", h_p1_table, "",
            f"## H-P2: {HYPOTHESES['H-P2'].text}", "",
            "Per seed with both precisions: (inverse - recompute) in bf16 minus the same in fp32, on the "
            "claim's effect scale (c: relative to recompute's seed mean in each precision). Descriptive.", "",
            _shift_table(arms), "",
            "## Each arm: bf16 - fp32", "",
            "Per arm and metric, the bf16 run against the fp32 run of the same seed. The two share a seed, "
            "not a trajectory (bf16 rounding changes the first sample), so this is the precision's effect "
            "on the outcome. Descriptive.", "",
            contrast_table(per_arm(arms, JUDGED), [("arm", code("arm"))], verdict="direction",
                           effect="bf16 - fp32"), "",
            "## Timing within each precision", "",
            "The fp32 runs ran on another CPU, so bf16 against fp32 time is not read from here "
            "(docs/benchmarks.md measures it side by side).", "",
            contrast_table(timing, [("precision", "precision")], effect="recompute / inverse"), "",
            "Nothing is corrected for multiplicity: each interval is at level 0.05 on its own.", "",
            "## Figure", "", figures_markdown(_figure(df, arms, bf16_seeds, args.figures_dir), args.out.parent)]


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "paths", "sweep folders (or log archives) with both precisions' runs")
    parser.add_argument("--d", type=int, default=8, help="the staleness compared")
    parser.add_argument("--m", type=int, default=4, help="the minibatches per step compared")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
