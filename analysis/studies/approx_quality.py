"""The approx_quality report: every schedule's anchor against recompute's, per staleness, and
the drift exponent, from runs with `train.log_prox_errors=true` (experiment=approx_quality).

    python -m analysis.studies.approx_quality SWEEP_DIR --out docs/reports/approx_quality.md --figures-dir docs/reports/approx_quality

Per schedule (loglinear; `-linear` the probability-space variant) and d: the mean over the
steady-state steps (>= d) of the log-prob error |approx - recomputed| and of the clip-decision
flip rate, then the mean over seeds; the figure is analysis.figures.panels.approx_error. Where
the runs log them: the log-prob error per minibatch k and per entropy tercile, the gradient
agreement (train.grad_fidelity_every), and for `algo=hybrid` runs how often they recomputed,
what their anchor's error was and what its forward cost against the recompute runs'.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.anchor.drift import drift_points, fit_drift
from analysis.anchor.tracking import s2_verdicts, schedule_markdown, schedule_table, steady
from analysis.figures.panels import approx_error
from analysis.load import load_runs
from analysis.provenance import generated_line
from analysis.studies import study_parser, write_study_report

def stratum_table(df: pd.DataFrame, d: int, kind: str = "logp_abs") -> pd.DataFrame:
    """Rows: schedule; columns: the strata (k0.., H1-H3) of `kind` at staleness d, mean over
    the steady-state steps, then over seeds (recompute runs only: the others train elsewhere)."""
    rows = steady(df[(df["staleness"] == d) & (df["algo"] == "recompute")], "prox_error/")
    parts = rows["metric"].str.removeprefix("prox_error/").str.split("/")
    rows = rows[(parts.str.len() == 3) & (parts.str[1] == kind)]
    rows["schedule"], rows["stratum"] = parts.str[0], parts.str[2]
    per_run = rows.groupby(["run", "schedule", "stratum"])["value"].mean().reset_index()
    table = per_run.groupby(["schedule", "stratum"])["value"].mean().unstack("stratum")
    order = sorted((c for c in table.columns if c.startswith("k")), key=lambda c: int(c[1:]))
    return table[order + [c for c in ("H1", "H2", "H3") if c in table.columns]]


def gradient_table(df: pd.DataFrame) -> pd.DataFrame:
    """Rows: schedule; columns: (cos or norm_ratio, d): mean over the logged steps >= d, then seeds."""
    rows = steady(df[df["algo"] == "recompute"], "grad_fidelity/")
    parts = rows["metric"].str.removeprefix("grad_fidelity/").str.rsplit("/", n=1)
    rows["schedule"], rows["stat"] = parts.str[0], parts.str[1]
    per_run = rows.groupby(["run", "staleness", "schedule", "stat"])["value"].mean().reset_index()
    return per_run.groupby(["schedule", "stat", "staleness"])["value"].mean().unstack(["stat", "staleness"])


def hybrid_rows(df: pd.DataFrame) -> list[dict]:
    """Per hybrid run: the share of steps >= d it recomputed, its anchor's mean log-prob error
    against recompute's (0 on those steps, its schedule's on the others) beside loglinear's
    (its schedule's on every step, the same batches), and its mean `time/prox_logp` beside the
    recompute runs' at the same d."""
    out = []
    for run, rows in df[df["algo"] == "hybrid"].groupby("run"):
        d = int(rows["staleness"].iloc[0])
        steady = rows[rows["step"] >= d].pivot_table(index="step", columns="metric", values="value")
        schedule = str(rows["schedule_name"].iloc[0] or "inverse")
        error = steady[f"prox_error/{schedule}/logp_abs"]
        recomputed = steady["hybrid/recomputed"]
        others = df[(df["algo"] == "recompute") & (df["staleness"] == d) & (df["metric"] == "time/prox_logp")]
        out.append({"run": run, "d": d, "recomputed": recomputed.mean(), "error": (error * (1 - recomputed)).mean(),
                    "loglinear_error": error.mean(), "prox_s": steady["time/prox_logp"].mean(),
                    "recompute_prox_s": others[others["step"] >= d]["value"].mean()})
    return out


def _table_lines(table: pd.DataFrame, head: str, fmt) -> list[str]:
    columns = list(table.columns)
    return [head + " | ".join(str(c) for c in columns) + " |", "|---|" + "--:|" * len(columns),
            *[f"| `{name}` | " + " | ".join(fmt(row[c]) for c in columns) + " |" for name, row in table.iterrows()]]


def _extra_sections(df: pd.DataFrame) -> list[str]:
    """The strata, gradient and hybrid sections, each where the runs log what it needs."""
    lines = []
    for d in sorted(df["staleness"].unique()):
        table = stratum_table(df, d)
        if not table.empty:
            lines += [f"Log-prob error by minibatch k and by entropy tercile (H1 lowest), d = {d}:", "",
                      *_table_lines(table, "| schedule | ", lambda v: f"{v:.3f}"), ""]
    grad = gradient_table(df)
    if not grad.empty:
        grad.columns = [f"{stat}, d = {d}" for stat, d in grad.columns]
        lines += ["Gradient agreement with recompute's (first micro-batch of the last minibatch, every "
                  "train.grad_fidelity_every steps): cosine and norm ratio.", "",
                  *_table_lines(grad, "| schedule | ", lambda v: f"{v:.4f}"), ""]
    for row in hybrid_rows(df):
        lines += [f"`{row['run']}` (algo=hybrid, d = {row['d']}): recomputed on {100 * row['recomputed']:.0f}% of "
                  f"its steps >= d; its anchor's mean log-prob error against recompute's {row['error']:.4f} vs "
                  f"loglinear's {row['loglinear_error']:.4f} on the same batches; time/prox_logp {row['prox_s']:.3f} s "
                  f"a step vs {row['recompute_prox_s']:.3f} s for the recompute runs at d = {row['d']} "
                  "(wall clock on a shared machine: read the ratio).", ""]
    return lines


def report(args: argparse.Namespace) -> list[str]:
    """The report's lines (markdown) from the parsed command line."""
    df = load_runs(args.paths)
    base = df[df["algo"] == "recompute"] if (df["algo"] == "recompute").any() else df  # hybrid runs: own section
    figure = approx_error(base, args.figures_dir)
    points = drift_points(base)
    fit = fit_drift(points["distance"].to_numpy(), points["drift"].to_numpy())
    seeds = sorted(df["seed"].unique())
    lines = ["# How good is each anchor? (experiment=approx_quality)", "",
             generated_line(f"python -m analysis.studies.approx_quality {' '.join(map(str, args.paths))} "
                            f"--out {args.out} --figures-dir {args.figures_dir}"),
             f"Runs: {df['run'].nunique()} (d = {', '.join(map(str, sorted(df['staleness'].unique())))}; seeds "
             f"{', '.join(map(str, seeds))}; precision {', '.join(sorted(df['precision'].astype(str).unique()))}). "
             "Each value: a run's mean over its steps >= d, then the mean over seeds; sorted by the error at the "
             "largest d.", "", *schedule_markdown(schedule_table(base)), "",
             f"Drift: mean |logp - behave_logp| = {fit.c:.3g} * (d + k/m)^{fit.beta:.3f} "
             f"(`python -m analysis.anchor.drift`, least squares on the logs over {fit.n_points} (step, minibatch) points; "
             "beta = 1 is linear drift, 0.5 diffusive).", "", *s2_verdicts(base), *_extra_sections(df)]
    return lines + [f"![approx_error]({Path(p).relative_to(args.out.parent)})" for p in figure if str(p).endswith(".png")]


def main(argv: list[str] | None = None) -> int:
    return write_study_report(study_parser(__doc__, "paths"), report, argv, preregistered=False)


if __name__ == "__main__":
    raise SystemExit(main())
