"""S6's rules, as docs/studies/s6.md registers them, applied to its sweeps.

    python -m analysis.studies.s6 docs/logs/s6.tar.xz --staleness 8 --out docs/reports/s6.md \
        --figures-dir docs/reports/s6 --deviations docs/studies/s6.md [--stress docs/logs/s6_stress.tar.xz]

Tier A (or C, `--staleness 2`): loglinear `inverse` and `step_start`, each against recompute,
paired by seed, through `TESTS` (declared in `analysis.hypotheses`; `analysis.studies.judge_family`:
raw and Holm-adjusted verdicts over the tier's 30 tests), the plateau check on recompute's last
two evals, and, with `--stress`, tier B's collapse counts (`analysis.collapses`: Fisher's exact
test, Holm over its cells); the report in markdown: the family's raw and Holm-adjusted verdicts,
per-arm means, the plateau check, the power at the observed spread, tier B's collapse table and
the figures (analysis/figures/arms.py).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pandas as pd

from analysis.anchor.clip_rates import recompute_batches_lines
from analysis.collapses import cell_arm_table, collapse_family, collapse_table, floor_line
from analysis.figures.arms import arm_figures
from analysis.hypotheses import STUDIES, declared
from analysis.load import load_configs, load_runs
from analysis.markdown import fmt, fmt_spread, markdown_table
from analysis.outcomes import with_outcomes
from analysis.power import minimum_detectable_effect, sd_from_interval, tost_seeds_needed
from analysis.provenance import compute_lines, figures_markdown, generated_line, provenance
from analysis.scalars import plateau_check, run_scalars
from analysis.stopping import (diverged_line, left_out_line, registered_seeds, reward_of_the_diverged, rows_of,
                               seeds_ended_in_every_arm)
from analysis.studies import (deviations_flag, family_table, judge_family, paired_values, provenance_table, study_parser,
                              undecided_table, write_study_report)

ARMS = ("inverse", "step_start")  # the loglinear schedules each compared with recompute
BASELINE = "recompute"
MARGIN = declared("s6", "R").margin  # R's equivalence band, absolute reward (docs/studies/s6.md)
PLATEAU_GAIN = 0.05                # the plateau check's bound on recompute's last eval gain
COLLAPSE_FRACTION = 0.5            # collapsed: last eval below half the run's best eval
TIER_CELL = (1e-5, 4)  # tiers A and C: (lr, minibatches), conf/experiment/s6.yaml
STRESS_CELLS = (TIER_CELL, (3e-5, 4), (3e-5, 8), (1e-5, 8))  # tier B's (lr, minibatches); the first is tier A's runs
STEADY_EXTRAS = {"total_ratio_max": "offpolicy/total_ratio_max", "total_ratio_min": "offpolicy/total_ratio_min",
                 "ess_total": "offpolicy/ess_total", "grad_norm": "actor/grad_norm",
                 "clip_recompute_anchor": "prox_error/recompute/clip_rate"}
TESTS = STUDIES["s6"]  # the tier's family, per loglinear arm against recompute (analysis.hypotheses)
KEEPS_FLAGGED = {"R", "R'"}  # the reward keeps collapsed runs (their low reward is the outcome)


def _arm(row) -> str:
    return BASELINE if row["algo"] == BASELINE else str(row["schedule"]) if row["algo"] == "loglinear" else ""


def _evals(df: pd.DataFrame) -> pd.Series:
    """Each run's held-out rewards in step order, as a list."""
    evals = df[df["metric"] == "eval/reward"].sort_values("step")
    return evals.groupby(["experiment", "run"])["value"].agg(list).rename("evals")


def s6_scalars(df: pd.DataFrame, configs) -> pd.DataFrame:
    """One row per run of `df` (`load_runs`): `run_scalars`, outcomes, the arm, lr and minibatches
    (from `configs`), its evals, the steady means of `STEADY_EXTRAS` and the anchor effect."""
    scalars = with_outcomes(run_scalars(df), df).set_index(["experiment", "run"])
    steady = df[df["step"] >= df["max_staleness"]]
    for column, metric in STEADY_EXTRAS.items():
        scalars[column] = steady[steady["metric"] == metric].groupby(["experiment", "run"])["value"].mean()
    own = steady[steady["metric"] == "prox_error/" + steady["schedule"].astype(str) + "/clip_rate"]
    scalars["clip_own_anchor"] = own.groupby(["experiment", "run"])["value"].mean()
    scalars["anchor_effect"] = scalars["clip_own_anchor"] - scalars["clip_recompute_anchor"]
    scalars = scalars.join(_evals(df))
    scalars["lr"] = [float(configs[key]["train"]["lr"]) for key in scalars.index]
    scalars["n_minibatches"] = [int(configs[key]["train"]["n_minibatches"]) for key in scalars.index]
    scalars = scalars.reset_index()
    scalars["arm"] = [_arm(row) for _, row in scalars.iterrows()]
    return reward_of_the_diverged(scalars)


def _by_seed(rows: pd.DataFrame, column: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in zip(rows["seed"], rows[column])}


def _cell(scalars: pd.DataFrame, staleness: int, lr: float, minibatches: int) -> pd.DataFrame:
    return scalars[(scalars["staleness"] == staleness) & np.isclose(scalars["lr"], lr)
                   & (scalars["n_minibatches"] == minibatches) & (scalars["arm"] != "")]


def tier_runs(scalars: pd.DataFrame, staleness: int, seeds=None) -> tuple[pd.DataFrame, list[str]]:
    """The stopping rule (`analysis.stopping`) on the tier (`TIER_CELL` at `staleness`): its ended runs
    of the seeds (`s6`'s by default) ended in all three arms, and the registered runs left out."""
    return seeds_ended_in_every_arm(_cell(scalars, staleness, *TIER_CELL), registered_seeds("s6") if seeds is None
                                    else seeds, (BASELINE, *ARMS))


def tier_family(scalars: pd.DataFrame, staleness: int) -> pd.DataFrame:
    """TESTS for each arm against recompute at `staleness`, judged as one Holm family."""
    cell = scalars[scalars["staleness"] == staleness]
    family = []
    for arm in ARMS:
        for test in TESTS:
            keep = (lambda rows: rows) if test.label in KEEPS_FLAGGED else (lambda rows: rows[~rows["flagged"]])
            treated, baseline = keep(cell[cell["arm"] == arm]), keep(cell[cell["arm"] == BASELINE])
            effects = paired_values(test, _by_seed(treated, test.column), _by_seed(baseline, test.column))
            family.append((f"{arm} vs {BASELINE}", test, effects))
    return judge_family(family)


def plateau(scalars: pd.DataFrame, staleness: int) -> dict:
    """Recompute's gain between its last two evals over seeds; holds when the 95% upper end < PLATEAU_GAIN."""
    runs = scalars[(scalars["staleness"] == staleness) & (scalars["arm"] == BASELINE)]
    runs = runs[runs["complete"].astype(bool) & ~runs["diverged"].astype(bool)]  # the evals after the last two tens
    interval, holds = plateau_check(runs["evals"], PLATEAU_GAIN)
    return {"gain": interval.mean, "low": interval.low, "high": interval.high, "n": interval.n, "holds": holds}


def collapsed(row) -> bool:
    """Tier B's criterion: the last eval below half the best, or analysis.outcomes flags the run."""
    evals = row["evals"] if isinstance(row["evals"], list) else []
    return bool(row["flagged"]) or (len(evals) > 0 and evals[-1] < COLLAPSE_FRACTION * max(evals))


def stress_runs(scalars: pd.DataFrame, staleness: int = 8, seeds=None) -> tuple[pd.DataFrame, list[str]]:
    """Tier B's runs at `staleness` under the stopping rule, cell by cell (`STRESS_CELLS`; seeds
    `s6_stress`'s by default, so tier A's other seeds stay out of its base cell), each marked
    `collapsed`, and the registered runs left out, named with their cell."""
    seeds, kept, left_out = registered_seeds("s6_stress") if seeds is None else seeds, [], []
    for lr, m in STRESS_CELLS:
        runs, missing = seeds_ended_in_every_arm(_cell(scalars, staleness, lr, m), seeds, (BASELINE, *ARMS))
        kept += [runs] if len(runs) else []
        left_out += [f"lr {lr:g}, {m} minibatches, {line}" for line in missing]
    runs = pd.concat(kept, ignore_index=True) if kept else scalars.iloc[:0].copy()
    runs["collapsed"] = [collapsed(row) for _, row in runs.iterrows()]
    return runs, left_out


def stress_own(runs: pd.DataFrame, staleness: int = 8) -> pd.DataFrame:
    """Tier B's runs without its base cell (`TIER_CELL`: tier A's runs, counted in tier A's compute)."""
    return runs.drop(_cell(runs, staleness, *TIER_CELL).index)


ARM_COLUMNS = ("last_evals_reward", "entropy", "clip_ratio", "iw_max", "total_ratio_max", "kl_k3", "cpu_time_s")
PAPER_MARGIN = 0.02  # the paper's "within 2%", relative to recompute's reward


def arm_table(scalars: pd.DataFrame, staleness: int) -> str:
    cell = scalars[scalars["staleness"] == staleness]
    rows = []
    for arm in (BASELINE, *ARMS):
        runs = cell[cell["arm"] == arm]
        rows.append([arm, len(runs), int(runs["flagged"].sum()),
                     *(fmt_spread(runs[c]) for c in ARM_COLUMNS)])
    return markdown_table(["arm", "runs", "flagged", *ARM_COLUMNS], rows, numeric_from=1)


def power_lines(family: pd.DataFrame, scalars: pd.DataFrame, staleness: int) -> list[str]:
    """The reward's observed spread, the MDE at the seeds there are, and the seeds a TOST needs."""
    lines = []
    base = scalars[(scalars["staleness"] == staleness) & (scalars["arm"] == BASELINE)]["last_evals_reward"].mean()
    for _, row in family[family["label"] == "R'"].iterrows():
        n = int(row["n"])
        if n < 2 or not np.isfinite(row["high"]):
            continue
        sd = sd_from_interval(row["low"], row["high"], n)
        paper = PAPER_MARGIN * base if np.isfinite(base) else math.nan
        lines.append(f"- {row['comparison']}: sd of the paired reward difference {fmt(sd, 3)} over {n} seeds; "
                     f"MDE {fmt(minimum_detectable_effect(sd, n), 3)}; seeds a TOST at ±{MARGIN:g} needs at a true "
                     f"difference 0: {tost_seeds_needed(0.0, sd, MARGIN)}; at the paper's 2% (±{fmt(paper, 3)}): "
                     f"{tost_seeds_needed(0.0, sd, paper) if np.isfinite(paper) else 'n/a'}.")
    return lines


STRESS_COLUMNS = ("last_evals_reward", "iw_max", "iw_min", "total_ratio_max", "total_ratio_min")  # tier B, descriptive


def _command(args: argparse.Namespace) -> str:
    return (f"python -m analysis.studies.s6 {' '.join(map(str, args.logs))} --staleness {args.staleness}"
            + (f" --stress {' '.join(map(str, args.stress))}" if args.stress else "")
            + f" --out {args.out} --figures-dir {args.figures_dir}" + deviations_flag(args))


def load_s6(paths) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """The runs of `paths` (`load_runs`), their configs and their `s6_scalars`."""
    df, configs = load_runs(paths), load_configs(paths)
    return df, configs, s6_scalars(df, configs)


def report(args: argparse.Namespace) -> list[str]:
    """The report's lines (markdown) from the parsed command line."""
    df, configs, scalars = load_s6(args.logs)
    staleness = args.staleness
    seeds = registered_seeds("s6")
    cell, left_out = tier_runs(scalars, staleness, seeds)
    skipped, df = df.attrs.get("skipped", ()), rows_of(df, cell)
    family, check = tier_family(cell, staleness), plateau(cell, staleness)
    diverged = [line, ""] if (line := diverged_line(cell)) else []
    lines = [f"# S6 at d = {staleness}: the claims on the words testbed", "",
             generated_line(_command(args)) + " Pre-registered in docs/studies/s6.md (tests, margin, Holm family, "
             "verdict rules); its deviations end this page.", "",
             "## Provenance", "", provenance(args.logs, cell, configs, skipped), "",
             provenance_table(cell, [("d", "staleness")]), "",
             left_out_line(len(cell), left_out, 3 * len(seeds)), "",
             "## Arms (mean ± sd over runs)", "", arm_table(cell, staleness), "", *diverged,
             f"## The family: {len(family)} tests, Holm-adjusted", "",
             "Verdicts as registered: \"inconclusive\" and \"no difference shown\" never count as a claim holding; "
             "\"equivalent\" only from the TOST of R.", "", family_table(family), "",
             "## Plateau check (recompute: last eval - the one before)", "",
             f"{fmt(check['gain'], 3)} [{fmt(check['low'], 3)}, {fmt(check['high'], 3)}] over {check['n']} seeds: "
             + ("**holds** (upper end below " if check["holds"] else "**does not hold** (upper end not below ")
             + f"{PLATEAU_GAIN:g}).", "", "## Power at the observed spread", "", *power_lines(family, cell, staleness), "",
             "What would decide each undecided test: its seeds' spread (from its interval), the smallest effect "
             "its seeds detect with 80% power (MDE), and the seeds 80% power needs at the observed effect, at "
             "Holm's last step (α 0.05) and at its first (α 0.05 over the family's size). Effects on the test's "
             "scale (log ratio for a and b'); R's seeds are a TOST's at ±" + f"{MARGIN:g} (never: the observed "
             "effect lies outside the margin).", "", undecided_table(family),
             "", "## The anchors on recompute's own batches (descriptive)", "",
             *recompute_batches_lines(df, configs, staleness)]
    if args.stress:
        seeds = registered_seeds("s6_stress")
        runs, stress_left_out = stress_runs(load_s6([*args.stress, *args.logs])[2], seeds=seeds)
        stress = collapse_family(runs, ARMS, STRESS_CELLS)
        lines += ["", "## Tier B: collapses (Fisher's exact, Holm over the cells)", "",
                  f"Seeds {', '.join(map(str, seeds))} in every cell (the cell lr 1e-05, 4 minibatches is tier A's "
                  "runs of them). " + left_out_line(len(runs), stress_left_out, 3 * len(seeds) * len(STRESS_CELLS))
                  + " " + floor_line(stress), "", "Tier B's own runs (its three cells beyond tier A's):", "",
                  *(compute_lines(own) if len(own := stress_own(runs)) else ["- no runs there yet"]), "",
                  collapse_table(stress), "",
                  "Each cell's arms (descriptive; mean ± sd over runs):", "", cell_arm_table(runs, ARMS, STRESS_COLUMNS)]
    return lines + ["", "## Figures", "", figures_markdown(arm_figures(df, staleness, args.figures_dir, "s6"), args.out.parent)]


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "logs", "the tier's sweep (run directories or a docs/logs archive)")
    parser.add_argument("--staleness", type=int, default=8)
    parser.add_argument("--stress", nargs="*", default=None, help="tier B's sweep, with tier A's for its base cell")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
