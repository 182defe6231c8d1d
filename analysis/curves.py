"""Held-out reward curves as the studies' rules read them (S8's length rule and plateau check):
a run's evals keyed by the steps done, the least-squares slope over its last evals, the length
rule over candidate steps, and the registered per-run reward at a length."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis.stats import Interval, mean_ci

FLAT = 0.01        # reward per 10 steps: the length rule's and the plateau check's bound
WINDOW = 4         # evals in a slope: after s - 30, s - 20, s - 10, s
EVERY = 10         # steps between evals
MARGIN_STEPS = 10  # the length rule's L = min(L* + 10, MAX_STEPS)
MAX_STEPS = 100


def evals_by_step(df: pd.DataFrame) -> pd.Series:
    """Per run, its held-out rewards keyed by the steps done when each ran (an eval logged at step
    index i ran after step i + 1)."""
    rows = df[df["metric"] == "eval/reward"]
    return rows.groupby("run").apply(lambda r: dict(zip((r["step"] + 1).astype(int), r["value"].astype(float))),
                                     include_groups=False)


def slope(evals: Mapping[int, float], end: int) -> float | None:
    """The least-squares slope of held-out reward against step over the evals after end - 30,
    end - 20, end - 10 and end, in reward per 10 steps; None where one of them is missing."""
    steps = [end - EVERY * k for k in range(WINDOW - 1, -1, -1)]
    if any(s not in evals for s in steps):
        return None
    return float(np.polyfit(np.array(steps, dtype=float), [evals[s] for s in steps], 1)[0] * EVERY)


def mean_slopes(runs: pd.DataFrame, candidates: Sequence[int]) -> pd.DataFrame:
    """Each arm's mean slope over its runs at each candidate step (NaN where no run reached it);
    `runs` has columns arm and evals."""
    table = {}
    for arm, rows in runs.groupby("arm", sort=False):
        values = {s: [v for e in rows["evals"] if (v := slope(e, s)) is not None] for s in candidates}
        table[arm] = {s: float(np.mean(v)) if v else math.nan for s, v in values.items()}
    return pd.DataFrame(table).T.reindex(columns=list(candidates))


def length_rule(slopes: pd.DataFrame) -> tuple[int | None, int]:
    """(L*, L): L* the smallest candidate at which every arm's mean slope is below `FLAT` there and
    at every larger candidate (None if none), L = min(L* + 10, 100), or 100 without an L*."""
    flat = (slopes < FLAT).all(axis=0)  # NaN compares False: an arm without the evals is not flat
    for s in slopes.columns:
        if flat.loc[s:].all():
            return int(s), min(int(s) + MARGIN_STEPS, MAX_STEPS)
    return None, MAX_STEPS


def paired_sd(runs: pd.DataFrame, column: str, arm: str, baseline: str = "recompute") -> float:
    """The standard deviation over seeds of `arm` - `baseline` in `column` (NaN under 2 seeds)."""
    pivot = runs.pivot_table(index="seed", columns="arm", values=column)
    if arm not in pivot or baseline not in pivot:
        return math.nan
    differences = (pivot[arm] - pivot[baseline]).dropna()
    return float(differences.std(ddof=1)) if len(differences) >= 2 else math.nan


def last_evals(evals: Mapping[int, float], end: int) -> float:
    """The registered `last_evals_reward` at length `end`: the mean of the evals after end - 10 and end."""
    values = [evals.get(end - EVERY), evals.get(end)]
    return float(np.mean(values)) if None not in values else math.nan


def early_reward(evals: Mapping[int, float], through: int = 50) -> float:
    """The mean held-out reward of the evals after steps 10, 20, ..., `through` (NaN if one is missing)."""
    values = [evals.get(s) for s in range(EVERY, through + 1, EVERY)]
    return float(np.mean(values)) if None not in values else math.nan


def plateau(evals_of_runs: Sequence[Mapping[int, float]], end: int, bound: float = FLAT) -> tuple[Interval, bool]:
    """The registered plateau check of one arm: each run's slope over its evals after end - 30 ..
    end, the mean's 95% interval over runs, and whether its upper end is below `bound`."""
    slopes = [v for e in evals_of_runs if (v := slope(e, end)) is not None]
    interval = mean_ci(slopes)
    return interval, bool(interval.known and interval.high < bound)
