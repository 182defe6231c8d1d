"""Collapse counts between arms, judged as one family: in each (lr, minibatches) cell, each
loglinear arm's collapsed runs against recompute's by Fisher's exact test (two-sided), Holm
over every cell and arm, and the floor those counts put under any p, raw and adjusted
(`analysis.stats.fisher_floor`, `holm_floor`). A run is `collapsed` by its study's own
criterion (S6's tier B: docs/studies/s6.md); its runs carry `lr`, `n_minibatches`, `arm` and
`collapsed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from analysis.markdown import fmt, fmt_spread, markdown_table
from analysis.power import ALPHA
from analysis.stats import fisher_floor, holm, holm_floor

CELL = ["lr", "n_minibatches"]
BASELINE = "recompute"


def collapse_family(runs: pd.DataFrame, arms: Sequence[str],
                    cells: Sequence[tuple[float, int]] | None = None) -> pd.DataFrame:
    """Per cell and loglinear arm of `arms`: collapse counts against recompute's, Fisher's exact
    two-sided p, its floor at these counts, and the Holm-adjusted p and verdict over all rows.
    `cells`: the registered (lr, minibatches) cells, each a row per arm even without runs ("not
    tested", counted in Holm's family as a p of 1); by default the cells `runs` has."""
    rows = []
    for (lr, m), cell in _cells(runs, cells):
        base = cell[cell["arm"] == BASELINE]["collapsed"]
        for arm in arms:
            ours = cell[cell["arm"] == arm]["collapsed"]
            table = [[int(base.sum()), int((~base).sum())], [int(ours.sum()), int((~ours).sum())]]
            p = float(scipy_stats.fisher_exact(table)[1]) if len(base) and len(ours) else math.nan
            rows.append({"lr": lr, "n_minibatches": m, "arm": arm, "recompute_collapsed": f"{table[0][0]}/{len(base)}",
                         "arm_collapsed": f"{table[1][0]}/{len(ours)}", "p": p, "p_floor": fisher_floor(len(base), len(ours)),
                         "more": BASELINE if table[0][0] / max(len(base), 1) > table[1][0] / max(len(ours), 1)
                         else "loglinear"})
    out = pd.DataFrame(rows)
    if len(out):
        out["p_holm"] = holm(list(out["p"]))
        out["verdict"] = ["not tested (no runs)" if math.isnan(p) else f"{more} collapses more" if p < ALPHA
                          else "no difference shown" for more, p in zip(out["more"], out["p_holm"])]
    return out


def _cells(runs: pd.DataFrame, cells: Sequence[tuple[float, int]] | None):
    if cells is None:
        return list(runs.groupby(CELL))
    return [((lr, m), runs[np.isclose(runs["lr"], lr) & (runs["n_minibatches"] == m)]) for lr, m in cells]


def floor_line(family: pd.DataFrame) -> str:
    """What the family can decide at its runs' counts: the best case's raw p and its Holm bound."""
    if family.empty:
        return "No runs of these seeds in any cell."
    floor = holm_floor(list(family["p_floor"]))
    reading = ("no cell can be decided, whatever its runs do" if floor >= ALPHA
               else "\"no difference shown\" is weak evidence of none")
    return (f"At these counts the best case, a complete split, gives a raw p of {fmt(family['p_floor'].min(), 2)} "
            f"and {fmt(floor, 2)} after Holm: {reading}.")


def collapse_table(family: pd.DataFrame) -> str:
    headers = ["lr", "minibatches", "arm", "recompute collapsed", "arm collapsed", "p", "p (Holm)", "**verdict**"]
    rows = [[f"{r['lr']:g}", r["n_minibatches"], r["arm"], r["recompute_collapsed"], r["arm_collapsed"],
             fmt(r["p"], 2), fmt(r["p_holm"], 2), f"**{r['verdict']}**"] for _, r in family.iterrows()]
    return markdown_table(headers, rows, numeric_from=len(headers))


def cell_arm_table(runs: pd.DataFrame, arms: Sequence[str], columns: Sequence[str]) -> str:
    """Descriptive, per cell, for recompute and each arm of `arms`: runs, collapses, and the mean ± sd
    of `columns`, with `(n=k)` where a mean covers fewer runs than the row (a run that diverged
    before the steady window has no steady value)."""
    rows = []
    for (lr, m), cell in runs.groupby(CELL):
        for arm in (BASELINE, *arms):
            ours = cell[cell["arm"] == arm]
            rows.append([f"{lr:g}", m, arm, len(ours), int(ours["collapsed"].sum()),
                         *(fmt_spread(ours[c]) + (f" (n={ours[c].count()})" if ours[c].count() < len(ours) else "")
                           for c in columns)])
    return markdown_table(["lr", "minibatches", "arm", "runs", "collapsed", *columns], rows, numeric_from=3)
