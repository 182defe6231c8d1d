"""Runs that did not simply learn, as the trainer flags them (a3po.run.health): diverged (a
non-finite loss or gradient stopped the run; the step it stopped at logs `health/diverged`
= 1, and the run directory holds diverged.json) and collapsed (entropy ~0 with a zero
gradient for `train.collapse_steps` steps in a row: `health/collapsed` = 1 on some step).

Such a run is an outcome worth counting, but its numbers are not a sample of how the
setting behaves (a diverged run's last steps, a collapsed run's frozen reward), so the
summary table and the claims leave flagged runs out of every mean and say how many they
left out, per cell. The flags are read from the metrics themselves, so runs loaded from a
wandb project are flagged alike.
"""

from __future__ import annotations

import pandas as pd

RUN_KEY = ["experiment", "run"]
DIVERGED_METRIC = "health/diverged"
COLLAPSED_METRIC = "health/collapsed"


def _runs_with(df: pd.DataFrame, metric: str) -> set[tuple[str, str]]:
    rows = df[(df["metric"] == metric) & (df["value"] >= 1)]
    return set(zip(rows["experiment"], rows["run"]))


def with_outcomes(scalars: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """`scalars` (one row per run) with `diverged`, `collapsed` and `flagged` columns. A run
    that collapsed and then diverged counts as diverged only, so counts add up to the
    flagged runs."""
    diverged, collapsed = _runs_with(df, DIVERGED_METRIC), _runs_with(df, COLLAPSED_METRIC)
    keys = list(zip(scalars["experiment"], scalars["run"]))
    out = scalars.copy()
    out["diverged"] = [key in diverged for key in keys]
    out["collapsed"] = [key in collapsed and key not in diverged for key in keys]
    out["flagged"] = out["diverged"] | out["collapsed"]
    return out


def excluded_text(n_diverged: int, n_collapsed: int, runs: list[str] | None = None) -> str:
    """`1 diverged, 0 collapsed` (with the run names when given), or '' when none was left out."""
    if not n_diverged and not n_collapsed:
        return ""
    names = f" ({', '.join(sorted(runs))})" if runs else ""
    return f"{n_diverged} diverged, {n_collapsed} collapsed{names}"


def excluded_of(rows: pd.DataFrame, with_names: bool = False) -> str:
    """`excluded_text` of the flagged runs among `rows` (scalars with outcome columns)."""
    flagged = rows[rows["flagged"]]
    return excluded_text(int(rows["diverged"].sum()), int(rows["collapsed"].sum()),
                         list(flagged["run"]) if with_names else None)


EXCLUDED_NOTE = ("Excluded: runs left out of every number in their row (and of the speedup baselines): "
                 "diverged (a non-finite loss or gradient stopped the run; diverged.json in its directory) or "
                 "collapsed (entropy below train.collapse_entropy with a zero gradient for train.collapse_steps "
                 "steps in a row; health/collapsed). Seeds counts the runs that remain.")
