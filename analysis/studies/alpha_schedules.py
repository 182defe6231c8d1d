"""The alpha-schedule report (S2, docs/studies/alpha_schedules.md): which anchor tracks recompute best, which
trains best, and whether any beats the paper's.

    python -m analysis.studies.alpha_schedules SWEEP_DIR... [--fidelity-from SWEEP_DIR...] [--seeds 0,1,2,3,4] \\
        --out docs/reports/alpha_schedules.md --figures-dir docs/reports/alpha_schedules

- Fidelity (runs passed with `--fidelity-from`: recompute with `train.log_prox_errors=true`):
  every schedule's log-prob error and clip-decision flip rate against recompute's anchor on the
  same batches, per d, and H-S2a (`analysis.studies.approx_quality`).
- Training (the other runs): every loglinear schedule (coupled counts as `behave`: its anchor is
  the behaviour policy, bit for bit) against recompute at each d with the S1 rules
  (`analysis.claims.rule.compare`) on the final reward (c, TOST ±2%), entropy (d), IW max and min (e,
  f), clipped tokens and clip ratio (g, g'); then against the paper's `inverse` on the clip ratio
  and the final reward. H-S2b: step_start's g' verdict against recompute is "holds" or
  inconclusive while inverse's is "does not hold".
- The ranking: schedules by their mean clip-ratio difference to recompute, each with its
  interval; one schedule is called better than another only where their own paired interval
  excludes 0 (the matrix).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.anchor.model import behaviour_weight, clip_reach
from analysis.anchor.tracking import s2_verdicts, schedule_markdown, schedule_table
from analysis.claims.paper import CLAIMS
from analysis.claims.rule import FAILS, HOLDS, Claim
from analysis.frame import disambiguate
from analysis.hypotheses import titled
from analysis.load import load_configs, load_runs
from analysis.markdown import markdown_table
from analysis.plotting import interval_errorbar, save
from analysis.provenance import generated_line, REPORT_FIGURES, figures_markdown, provenance
from analysis.runs import DEFAULT_SCHEDULE, lookup, schedule_arm
from analysis.scalars import run_scalars
from analysis.stats import mean_ci
from analysis.studies import (code, contrast, contrast_table, deviations_flag, provenance_table, study_parser,
                              write_study_report)

__all__ = ["schedule_arms", "anchor_weights", "against", "ranking", "h_s2b", "main"]

RECOMPUTE, PAPERS = "recompute", DEFAULT_SCHEDULE
TRAINING = [claim for claim in CLAIMS if claim.key in ("c", "d", "e", "f", "g", "g'")]
CLIP = next(claim for claim in CLAIMS if claim.key == "g'")
REWARD_HIGHER = Claim("r", "final reward: higher (mean reward/mean of the last 10% of steps)", "final_reward",
                      "difference", +1, "difference", "-")


def schedule_arms(scalars: pd.DataFrame, seeds: list[int] | None) -> pd.DataFrame:
    """The scalars of every arm (column `arm`) on the given seeds (all where None)."""
    out = scalars.assign(arm=[schedule_arm(row) for _, row in scalars.iterrows()])
    out = out[out["arm"].notna()]
    return (out[out["seed"].isin(seeds)] if seeds is not None else out).reset_index(drop=True)


def anchor_weights(arms: pd.DataFrame, configs: dict) -> pd.DataFrame:
    """Per (d, loglinear arm), from its first run's config: the behaviour weight w_b on the
    step's first and last minibatch, and the smallest |log pi_theta - log pi_behave| at which
    its anchor can clip under the run's eps_clip (`analysis.anchor.model.clip_reach`)."""
    records = []
    for (d, arm), runs in arms[arms["arm"] != RECOMPUTE].groupby(["staleness", "arm"], sort=True):
        config = configs.get((runs["experiment"].iloc[0], runs["run"].iloc[0]), {})
        schedule = dict(lookup(config, "schedule", {}) or {}) if arm != "behave" else {"name": "behave"}
        name = schedule.pop("name", PAPERS)
        m, eps = int(lookup(config, "train.n_minibatches", 1)), float(lookup(config, "objective.eps_clip", 0.2))
        weights = [behaviour_weight(name, d, k / m, **schedule) for k in range(m)]
        records.append({"d": int(d), "arm": arm, "first": weights[0], "last": weights[-1], "m": m, "eps": eps,
                        "reach": clip_reach(max(weights), eps)})
    return pd.DataFrame(records)


def _weight_lines(weights: pd.DataFrame) -> list[str]:
    rows = [[str(r["d"]), f"`{r['arm']}`", f"{r['first']:.4g}", f"{r['last']:.4g}",
             "never (the anchor is the current policy)" if r["reach"] == float("inf") else f"{r['reach']:.3g}"]
            for _, r in weights.iterrows()]
    return ["What each anchor is: its behaviour weight w_b (log pi_theta - log pi_prox = w_b (log pi_theta - "
            "log pi_behave) per token) on the step's first and last minibatch, and the smallest distance "
            "|log pi_theta - log pi_behave| at which it can clip at all (log(1 + eps_clip) / w_b). An anchor that "
            "cannot clip trains without a trust region: its lower clip ratio is no virtue.", "",
            markdown_table(["d", "schedule", "w_b, first minibatch", "w_b, last minibatch",
                            "clips only past |log pi_theta - log pi_behave| of"], rows, numeric_from=99), ""]


def _order(arms: pd.DataFrame) -> list[str]:
    names = sorted(set(arms["arm"]) - {RECOMPUTE, PAPERS})
    return [PAPERS, *names] if PAPERS in set(arms["arm"]) else names


def against(arms: pd.DataFrame, base: str, claims: list[Claim]) -> pd.DataFrame:
    """Every schedule but `base` against `base` at each d: one row per (d, schedule, claim)."""
    records = []
    for d, cell in arms.groupby("staleness", sort=True):
        base_rows = cell[cell["arm"] == base]
        for arm in _order(cell):
            if arm == base or base_rows.empty:
                continue
            records += contrast(claims, cell[cell["arm"] == arm], base_rows, (arm, base), d=int(d), arm=arm)
    return pd.DataFrame(records)


def ranking(versus_recompute: pd.DataFrame, arms: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(schedules by mean clip-ratio difference to recompute, per d; the pairwise matrix of
    clip-ratio verdicts: row clips less `<`, more `>`, undecided `~`)."""
    clip = versus_recompute[versus_recompute["claim"] == CLIP.key].sort_values(["d", "effect_mean"])
    cells = []
    for d, cell in arms.groupby("staleness", sort=True):
        names = list(clip.loc[clip["d"] == d, "arm"])
        for row in names:
            for column in names:
                if row == column:
                    continue
                record = contrast([CLIP], cell[cell["arm"] == row], cell[cell["arm"] == column], (row, column))[0]
                mark = {HOLDS: "<", FAILS: ">"}.get(record["verdict"], "~")
                cells.append({"d": int(d), "row": row, "column": column, "mark": mark})
    matrix = pd.DataFrame(cells, columns=["d", "row", "column", "mark"])
    return clip, matrix


def h_s2b(versus_recompute: pd.DataFrame, d: int) -> str:
    """docs/studies/alpha_schedules.md's rule at d: holds when step_start's clip verdict against recompute is
    "holds" or inconclusive while inverse's is "does not hold" (inverse clips more); does not
    hold when step_start clips more than recompute; otherwise its premise is not met."""
    clip = versus_recompute[(versus_recompute["claim"] == CLIP.key) & (versus_recompute["d"] == d)]
    verdicts = dict(zip(clip["arm"], clip["verdict"]))
    step_start, inverse = verdicts.get("step_start", ""), verdicts.get(PAPERS, "")
    if not step_start or not inverse or step_start.startswith("not judged") or inverse.startswith("not judged"):
        return "not judged (step_start or inverse has no clip verdict)"
    if step_start == FAILS:
        return FAILS
    if inverse == FAILS:
        return HOLDS
    return f"not met as registered: inverse's g' is \"{inverse}\", not \"does not hold\""


def _matrix_lines(matrix: pd.DataFrame, d: int, order: list[str]) -> list[str]:
    part = matrix[matrix["d"] == d]
    marks = {(r, c): m for r, c, m in zip(part["row"], part["column"], part["mark"])}
    head = "| clips less (<) / more (>) than | " + " | ".join(f"`{c}`" for c in order) + " |"
    rows = [f"| `{r}` | " + " | ".join("" if r == c else marks.get((r, c), "") for c in order) + " |" for r in order]
    return [head, "|---|" + ":-:|" * len(order), *rows]


def _figure(arms: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Per d, each arm's clip ratio and final reward: seed mean and 95% t interval."""
    levels = sorted(arms["staleness"].unique())
    fig = Figure(figsize=(11, 3.2 * len(levels)), layout="constrained")
    axes = fig.subplots(len(levels), 2, squeeze=False)
    for row, d in zip(axes, levels):
        cell = arms[arms["staleness"] == d]
        order = [RECOMPUTE, *_order(cell)]
        for ax, column, title in ((row[0], "clip_ratio", "clip ratio (steps >= d)"),
                                  (row[1], "final_reward", "final reward (last 10% of steps)")):
            interval_errorbar(ax, range(len(order)), [mean_ci(list(cell.loc[cell["arm"] == a, column])) for a in order],
                              fmt="o")
            ax.set_xticks(range(len(order)), order, rotation=30, ha="right")
            ax.set_title(f"{title}, d = {d}")
    data = arms[["staleness", "arm", "seed", "clip_ratio", "final_reward"]]
    return save(fig, data, out_dir, "alpha_schedules", REPORT_FIGURES)


def _fidelity_lines(paths: list[str]) -> list[str]:
    if not paths:
        return ["No fidelity runs were passed (`--fidelity-from`).", ""]
    df = load_runs(paths)
    base = df[df["algo"] == RECOMPUTE]
    return ["Each value: a recompute run's mean over its steps >= d of the schedule's anchor error against "
            "recompute's on the same batches, then the mean over seeds (`python -m analysis.studies.approx_quality` "
            "has the strata, the gradient agreement and the figure).", "",
            *schedule_markdown(schedule_table(base)), "", *s2_verdicts(base)]


def report(args: argparse.Namespace) -> list[str]:
    df = disambiguate(load_runs(args.paths))
    configs = load_configs(args.paths)
    scalars = run_scalars(df)
    arms = schedule_arms(scalars, args.seeds)
    versus_recompute = against(arms, RECOMPUTE, TRAINING)
    versus_papers = against(arms, PAPERS, [CLIP, REWARD_HIGHER])
    clip, matrix = ranking(versus_recompute, arms)
    command = (f"python -m analysis.studies.alpha_schedules {' '.join(map(str, args.paths))}"
               + (f" --fidelity-from {' '.join(map(str, args.fidelity_from))}" if args.fidelity_from else "")
               + (f" --seeds {','.join(map(str, args.seeds))}" if args.seeds is not None else "")
               + f" --out {args.out} --figures-dir {args.figures_dir}" + deviations_flag(args))
    figures = _figure(arms, args.figures_dir)
    used = scalars[scalars["run"].isin(arms["run"]) & scalars["experiment"].isin(arms["experiment"])]
    lines = ["# The alpha-schedule ablation (S2)", "",
             generated_line(command) + (
                " Pre-registered in docs/studies/alpha_schedules.md (hypotheses, grid, rules); its deviations are listed there."), "",
             "## Provenance", "", provenance(args.paths, used, configs), "",
             provenance_table(arms, [("d", "staleness")]), "",
             "## Which anchor tracks recompute best (fidelity, H-S2a)", "", *_fidelity_lines(args.fidelity_from),
             "## Which schedule trains best: each against recompute", "",
             "The S1 rules (analysis/claims/rule.py): per-seed paired difference schedule - recompute, 95% Student-t "
             "interval; \"holds\" is the paper's direction for A-3PO (higher entropy and IW min, lower IW max and "
             "clipping; the reward within ±2% by TOST). Coupled's runs are the `behave` schedule.", "",
             *_weight_lines(anchor_weights(arms, configs)),
             contrast_table(versus_recompute, [("d", "d"), ("schedule", code("arm"))],
                            effect="schedule - recompute"), ""]
    for d in sorted(clip["d"].unique()):
        order = list(clip.loc[clip["d"] == d, "arm"])
        lines += [f"### Ranking by clip ratio at d = {d}", "",
                  "Mean clip-ratio difference to recompute, lowest first: "
                  + "; ".join(f"`{a}` {e}" for a, e in zip(clip.loc[clip["d"] == d, "arm"],
                                                          clip.loc[clip["d"] == d, "effect"])) + ".", "",
                  "Pairwise (row against column, paired by seed, 95% t interval): `<` the row clips less, `>` more, "
                  "`~` undecided.", "", *_matrix_lines(matrix, d, order), "",
                  f"**{titled('H-S2b')}, d = {d}: "
                  f"{h_s2b(versus_recompute, d)}.**", ""]
    lines += ["## Does any schedule beat the paper's?", "",
              "Each schedule against `inverse` (the paper's): the clip ratio (\"holds\" = clips less) and the final "
              "reward (\"holds\" = higher).", "",
              contrast_table(versus_papers, [("d", "d"), ("schedule", code("arm"))], effect="schedule - inverse"), "",
              "Nothing is corrected for multiplicity: each verdict is at level 0.05 on its own, so among this many "
              "a few can come from noise alone.", "", "## Figure", "", figures_markdown(figures, args.out.parent)]
    return lines


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds={text!r} is not allowed; give seeds as integers, e.g. 0,1,2") from None


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "paths", "sweep folders with the training runs")
    parser.add_argument("--fidelity-from", nargs="*", default=[], help="sweep folders of recompute runs with the "
                        "prox_error telemetry (train.log_prox_errors)")
    parser.add_argument("--seeds", type=_seeds, default=None, help="compare on these seeds only (default: all)")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
