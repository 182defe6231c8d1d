"""The mechanism report (S3, docs/studies/mechanism.md): why the clip-ratio difference between A-3PO
and recompute changes direction with the staleness d and the minibatches per step m.

    python -m analysis.studies.mechanism SWEEP_DIR... --drift-from SWEEP_DIR... --out docs/reports/mechanism.md --figures-dir docs/reports/mechanism

The model (`analysis.anchor.model`): each anchor's mean distance from the current policy under
a drift c t^beta, and the call it makes for each arm's clip ratio against recompute's.

The report: per (d, m) the S1 rules (`analysis.claims.rule.compare`) for the clip ratio (g'), IW
min (f) and IW max (e), each loglinear arm against recompute, paired by seed; beta fitted on
the recompute runs' drift; each cell's prediction and whether the verdict agrees; the slope
of the inverse - recompute clip-ratio difference on log2 m per seed (H-S3a); the anchor's
effect alone, the share of tokens each anchor would clip on recompute's own batches (H-S3d);
and the pre-registered verdicts H-S3a-d. Runs passed with `--drift-from` only feed the drift fit.
With `--across-from`, the cells across d come from those sweeps (S1's) instead, scored with the
drift fitted on them and `--drift-from`, while the cells at d and their beta come from the sweeps
given first alone: the two parts may differ in precision, and no contrast mixes precisions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.anchor.clip_rates import ARMS, counterfactual_section, with_minibatches
from analysis.anchor.drift import DriftFit, drift_points, fit_drift
from analysis.anchor.model import BAND, CLIP, RECOMPUTE, agreement, anchor_distance, prediction, score
from analysis.claims.paper import CLAIMS
from analysis.claims.rule import FAILS, HOLDS
from analysis.frame import disambiguate
from analysis.hypotheses import titled
from analysis.load import load_configs, load_runs
from analysis.markdown import fmt_interval, markdown_table
from analysis.plotting import interval_errorbar, save
from analysis.provenance import generated_line, REPORT_FIGURES, figures_markdown
from analysis.runs import lookup
from analysis.scalars import run_scalars
from analysis.stats import Interval, mean_ci
from analysis.studies import (code, contrast, contrast_table, deviations_flag, provenance_table, study_parser,
                              write_study_report)

__all__ = ["anchor_distance", "prediction", "with_minibatches", "contrast_cells", "clip_slopes",
           "score", "main"]

JUDGED = [claim for claim in CLAIMS if claim.key in ("g'", "f", "e")]


def contrast_cells(arms: pd.DataFrame, beta: float, seeds: list[int] | None = None) -> pd.DataFrame:
    """One row per (d, m, arm, claim): `analysis.claims.rule.compare` of the arm against recompute
    on the given seeds (all where None), with the model's distances and call for the clip."""
    if seeds is not None:
        arms = arms[arms["seed"].isin(seeds)]
    records = []
    for (d, m), cell in arms.groupby(["staleness", "m"], sort=True):
        base = cell[cell["arm"] == RECOMPUTE]
        for arm in ARMS:
            ours = cell[cell["arm"] == arm]
            if ours.empty or base.empty:
                continue
            distance, base_distance = anchor_distance(arm, d, m, beta), anchor_distance(RECOMPUTE, d, m, beta)
            records += contrast(JUDGED, ours, base, (arm, RECOMPUTE), d=int(d), m=int(m), arm=arm, distance=distance,
                                recompute_distance=base_distance, call=prediction(distance, base_distance))
    return pd.DataFrame(records)


def clip_slopes(arms: pd.DataFrame, d: int = 8) -> tuple[Interval, dict[int, float]]:
    """H-S3a: per seed with inverse and recompute at every minibatch count at `d`, the slope
    of the clip-ratio difference (inverse - recompute) on log2 m; their mean's 95% t interval."""
    cell = arms[(arms["staleness"] == d) & arms["arm"].isin([RECOMPUTE, "inverse"])]
    counts = sorted(cell["m"].unique())
    slopes = {}
    for seed, runs in cell.groupby("seed"):
        values = runs.pivot_table(index="m", columns="arm", values="clip_ratio", aggfunc="mean")
        if len(counts) < 2 or not {RECOMPUTE, "inverse"} <= set(values.columns):
            continue
        values = values.reindex(counts)
        difference = (values["inverse"] - values[RECOMPUTE]).to_numpy()
        if np.isfinite(difference).all():
            slopes[int(seed)] = float(np.polyfit(np.log2(counts), difference, 1)[0])
    return mean_ci(list(slopes.values())), slopes


def common_seeds(arms: pd.DataFrame, d: int = 8) -> list[int]:
    """The seeds that every (minibatch count, arm) present at `d` has."""
    cell = arms[arms["staleness"] == d]
    groups = [set(runs["seed"]) for _, runs in cell.groupby(["m", "arm"])]
    return sorted(set.intersection(*groups)) if groups else []


def drift_fits(df: pd.DataFrame, configs: dict, d: int = 8) -> tuple[DriftFit | None, dict[int, DriftFit]]:
    """beta pooled over every recompute run at `d` that logged the drift, and per minibatch count."""
    runs = df[(df["algo"] == RECOMPUTE) & (df["staleness"] == d)]
    points = drift_points(runs)
    if points.empty:
        return None, {}
    points["m"] = [int(lookup(configs.get((e, r), {}), "train.n_minibatches", -1))
                   for e, r in zip(points["experiment"], points["run"])]
    pooled = fit_drift(points["distance"].to_numpy(), points["drift"].to_numpy())
    per_m = {}
    for m, part in points.groupby("m"):
        try:
            per_m[int(m)] = fit_drift(part["distance"].to_numpy(), part["drift"].to_numpy())
        except ValueError:
            continue
    return pooled, per_m


def _ratio(cell: pd.Series) -> str:
    if cell["recompute_distance"]:
        return f"{cell['distance'] / cell['recompute_distance']:.2f}"
    return "-" if cell["distance"] == 0 else "inf"


def _cell_table(cells: pd.DataFrame) -> list[str]:
    clip_only = (lambda key: lambda c: c[key] if c["claim"] == CLIP else "")
    return contrast_table(cells, [("d", "d"), ("m", "m"), ("arm", code("arm"))],
                          [("distance ratio", _ratio), ("model's call", clip_only("call")),
                           ("agreement", lambda c: agreement(c["call"], c["verdict"]) if c["claim"] == CLIP else "")],
                          effect="arm - recompute").splitlines()


def _model_table(d: int, counts: list[int], beta: float) -> list[str]:
    rows = []
    for m in counts:
        base = anchor_distance(RECOMPUTE, d, m, beta)
        row = [str(m), f"{base:.3f}"]
        for arm in ARMS:
            distance = anchor_distance(arm, d, m, beta)
            row += [f"{distance:.3f}", prediction(distance, base)]
        rows.append(row)
    return markdown_table(["m", "recompute", "inverse", "call", "step_start", "call"], rows).splitlines()


def _score_lines(title: str, cells: pd.DataFrame, beta: float) -> list[str]:
    judged, rows = score(cells, beta)
    table = markdown_table(["d", "m", "arm", "call", "clip verdict", "agreement"],
                           [[str(r["d"]), str(r["m"]), f"`{r['arm']}`", r["call"], r["verdict"], r["agreement"]]
                            for r in rows], numeric_from=99)
    return [f"**{title}, beta = {beta:.3g}: {judged}.**", "", table, ""]


def _step_start_verdict(cells: pd.DataFrame) -> str:
    clip = cells[(cells["arm"] == "step_start") & (cells["claim"] == CLIP)]
    if clip.empty:
        return "not judged (no step_start runs)"
    return FAILS if (clip["verdict"] == FAILS).any() else HOLDS


def _figure(arms: pd.DataFrame, d: int, out_dir: Path, beta: float) -> list[Path]:
    """Measured clip ratio per m (seed mean, 95% t interval) beside the model's anchor distances."""
    cell = arms[arms["staleness"] == d]
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    grid = [1, 2, 4, 8]
    for arm, colour in ((RECOMPUTE, "tab:blue"), ("inverse", "tab:orange"), ("step_start", "tab:green")):
        runs = cell[cell["arm"] == arm]
        if runs.empty:
            continue
        by_m = runs.groupby("m")["clip_ratio"]
        interval_errorbar(left, list(by_m.groups), [mean_ci(list(v)) for _, v in by_m], marker="o", color=colour,
                          label=arm)
        right.plot(grid, [anchor_distance(arm, d, m, beta) for m in grid], marker="o", color=colour, label=arm)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("minibatches per step m")
    left.set_ylabel("clip ratio (steps >= d), mean and 95% CI over seeds")
    right.set_ylabel(f"model: mean anchor distance / c (beta = {beta:.2f})")
    left.legend(frameon=False)
    left.set_title(f"measured, d = {d}")
    right.set_title(f"predicted, d = {d}")
    return save(fig, cell[["staleness", "m", "arm", "seed", "clip_ratio"]], out_dir, "mechanism", REPORT_FIGURES)


def _command(args: argparse.Namespace) -> str:
    return (f"python -m analysis.studies.mechanism {' '.join(map(str, args.paths))}"
            + (f" --across-from {' '.join(map(str, args.across_from))}" if args.across_from else "")
            + (f" --drift-from {' '.join(map(str, args.drift_from))}" if args.drift_from else "")
            + (f" --d {args.d}" if args.d != 8 else "") + (f" --across-m {args.across_m}" if args.across_m != 4 else "")
            + f" --out {args.out} --figures-dir {args.figures_dir}" + deviations_flag(args))


def _drift_text(pooled: DriftFit | None, per_m: dict[int, DriftFit], d: int) -> str:
    if pooled is None:
        return "no recompute run at this d logged the drift: beta = 1 assumed"
    return (f"beta = {pooled.beta:.3f} (c = {pooled.c:.3g}, {pooled.n_points} (step, minibatch) points of the "
            f"recompute runs at d = {d}); per m: "
            + ", ".join(f"m = {m}: {fit.beta:.3f} ({fit.n_points} points)" for m, fit in sorted(per_m.items())))


def _verdict_lines(at_d: pd.DataFrame, across_d: pd.DataFrame, arms: pd.DataFrame, seeds: list[int],
                   betas: tuple[float, float], args: argparse.Namespace) -> list[str]:
    beta, across_beta = betas
    slope, slopes = clip_slopes(arms[arms["seed"].isin(seeds)], args.d)
    slope_verdict = HOLDS if slope.known and slope.high < 0 else FAILS if slope.known and slope.low > 0 \
        else "inconclusive"
    return ["## Pre-registered verdicts", "",
            f"**{titled('H-S3a')}: {slope_verdict}.** Slope of the "
            f"per-seed difference on log2 m: {fmt_interval(slope)} over {slope.n} seeds "
            f"({', '.join(f'seed {s}: {v:.4f}' for s, v in sorted(slopes.items()))}).", "",
            *_score_lines(f"{titled('H-S3b')}, d = {args.d}", at_d, beta),
            *_score_lines(f"The linear-drift model, d = {args.d}", at_d, 1.0),
            *_score_lines(f"H-S3b on the cells at {args.across_m} minibatches across d", across_d, across_beta),
            *_score_lines(f"The linear-drift model at {args.across_m} minibatches across d", across_d, 1.0),
            f"**{titled('H-S3c')}: {_step_start_verdict(at_d)}.**", "",
            "Nothing is corrected for multiplicity: each verdict is at level 0.05 on its own.", ""]


def report(args: argparse.Namespace) -> list[str]:
    """The report's lines (markdown) from the parsed command line."""
    df, configs, arms = _load(args.paths)
    drift_df, drift_configs = (load_runs(args.drift_from), load_configs(args.drift_from)) if args.drift_from \
        else (df.iloc[0:0], {})
    if args.across_from:
        across_df, across_configs, across_arms = _load(args.across_from)
        pooled, per_m = drift_fits(df, configs, args.d)
        across_fit = drift_fits(pd.concat([across_df, drift_df]), {**across_configs, **drift_configs}, args.d)[0]
    else:
        across_arms = arms
        pooled, per_m = drift_fits(pd.concat([df, drift_df]), {**configs, **drift_configs}, args.d)
        across_fit = pooled
    beta, across_beta = (fit.beta if fit else 1.0 for fit in (pooled, across_fit))
    seeds = common_seeds(arms, args.d)
    at_d = contrast_cells(arms[arms["staleness"] == args.d], beta, seeds)
    across_d = contrast_cells(across_arms[across_arms["m"] == args.across_m], across_beta)
    precision = ", ".join(sorted(arms["precision"].astype(str).unique()))
    across_text = ("" if not args.across_from else
                   f"- across d: {len(across_arms)} runs of {', '.join(map(str, args.across_from))}, precision "
                   f"{', '.join(sorted(across_arms['precision'].astype(str).unique()))}, scored with beta = "
                   f"{across_beta:.3f} (" + (f"{across_fit.n_points} points of their recompute runs' drift and "
                                             "--drift-from's" if across_fit else "no drift logged: 1 assumed") + ")")
    return ["# The mechanism: the clip-ratio difference against the minibatches per step (S3)", "",
            generated_line(_command(args)) + (
                " Pre-registered in docs/studies/mechanism.md (hypotheses, grid, rules); its deviations are listed there."), "",
            "## Provenance", "",
            f"- runs: {len(arms)} in the paper's setup (lagged, no correction, ppo), precision {precision}; "
            f"experiments: {', '.join(sorted(arms['experiment'].unique()))}",
            f"- at d = {args.d} the comparisons use the seeds every (m, arm) has: {', '.join(map(str, seeds))}",
            *[across_text] * bool(across_text), "",
            provenance_table(arms, [("d", "staleness"), ("m", "m")]), "",
            "## The drift and the model's calls", "",
            f"Drift exponent: {_drift_text(pooled, per_m, args.d)}. With it, the mean anchor distance per step in "
            f"units of c (`analysis.anchor.model.anchor_distance`) and the model's call against recompute "
            f"(more when the ratio > {BAND[1]}, less when < {BAND[0]}) at d = {args.d}:", "",
            *_model_table(args.d, [1, 2, 4, 8], beta), "",
            "Under linear drift (beta = 1) for comparison:", "", *_model_table(args.d, [1, 2, 4, 8], 1.0), "",
            f"## Each arm against recompute at d = {args.d}", "",
            "The S1 rules (analysis/claims/rule.py): per-seed paired difference arm - recompute, 95% Student-t "
            "interval; g' (clip ratio) and e (IW max) claim \"lower\", f (IW min) \"higher\", so for g' "
            "\"holds\" means the arm clips less and \"does not hold\" that it clips more.", "",
            *_cell_table(at_d), "",
            f"## Across d at {args.across_m} minibatches (every seed)", "", *_cell_table(across_d), "",
            f"## The anchor alone: what each anchor would clip on recompute's batches at d = {args.d}", "",
            *counterfactual_section(df, configs, at_d, args.d, beta),
            *_verdict_lines(at_d, across_d, arms, seeds, (beta, across_beta), args),
            "## Figure", "", figures_markdown(_figure(arms, args.d, args.figures_dir, beta), args.out.parent)]


def _load(paths: list) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    df = disambiguate(load_runs(paths))
    configs = load_configs(paths)
    return df, configs, with_minibatches(run_scalars(df), configs)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "paths", "sweep folders whose runs are compared")
    parser.add_argument("--drift-from", nargs="*", default=[], help="sweep folders whose recompute runs only feed the drift fit")
    parser.add_argument("--across-from", nargs="*", default=[],
                        help="sweep folders whose cells at --across-m are compared across d (with their own beta)")
    parser.add_argument("--d", type=int, default=8, help="the staleness the minibatch counts are compared at")
    parser.add_argument("--across-m", type=int, default=4, help="the minibatch count the staleness levels are compared at")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
