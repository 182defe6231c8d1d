"""A pre-registered family of paired tests, judged raw and after Holm's adjustment.

Each test compares one per-run quantity between a treated arm and its baseline, paired by
seed (or, for a within-run quantity, one sample of per-seed values against 0):

- `direction`: a claimed side (`sign` +1: treated higher, -1: lower). Paired t, two-sided
  p. **holds** when p < alpha and the mean effect is on the claimed side, **does not hold** when
  p < alpha and it is on the other side, else **inconclusive**.
- `two_sided`: no claimed side. **higher** / **lower** when p < alpha, else **no difference
  shown** (never "indistinguishable": that needs an equivalence test).
- `equivalence`: TOST against +-`margin` (`analysis.power.tost`; its p is the larger of the two
  one-sided p-values). **equivalent within +-margin** when p < alpha; **differs by more than
  margin** when the 95% interval lies entirely outside the band; else **inconclusive**.
- `one_sample`: the treated arm's own per-seed values against 0, two-sided, read as `two_sided`.

`scale="log_ratio"` compares log(baseline / treated) (a time saved), so "treated cheaper" is a
positive effect. Every verdict is given twice: on the raw p-value and on the Holm-adjusted one
over the whole family (`analysis.stats.holm`); the adjusted one is the study's. A test without
two paired seeds has no p-value, counts in the family's size as a p of 1 (the registered
family's adjustment, never a looser one) and reads **inconclusive (fewer than 2 seeds)**.
Inconclusive is never a success (`decided`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from analysis.markdown import fmt, markdown_table
from analysis.power import (ALPHA, MAX_SEEDS, minimum_detectable_effect, sd_from_interval, seeds_needed, tost,
                            tost_seeds_needed)
from analysis.stats import holm, mean_ci

__all__ = ["FamilyTest", "paired_values", "run_test", "judge", "judge_family", "decided", "what_would_decide"]

KINDS = ("direction", "two_sided", "equivalence", "one_sample")
FEW_SEEDS = "inconclusive (fewer than 2 seeds)"
UNDECIDED = ("inconclusive", "no difference shown")  # and FEW_SEEDS, an inconclusive too


def decided(verdict: str) -> bool:
    """Whether a verdict decides its test: not inconclusive (with or without seeds) and not "no
    difference shown"."""
    return not verdict.startswith(UNDECIDED)


@dataclass(frozen=True)
class FamilyTest:
    label: str                # the pre-registration's name for it (R, a, T1, ...)
    quantity: str             # what it reads, in words
    column: str               # the per-run column
    kind: str                 # one of KINDS
    sign: int = 0             # direction: +1 treated higher, -1 treated lower
    scale: str = "difference"  # or "log_ratio": log(baseline / treated)
    margin: float = 0.0       # equivalence: the band's half-width, in the column's units

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.label}: kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind == "direction" and self.sign not in (-1, 1):
            raise ValueError(f"{self.label}: a direction test needs sign +1 or -1")
        if self.kind == "equivalence" and not self.margin > 0:
            raise ValueError(f"{self.label}: an equivalence test needs a margin > 0")


def paired_values(test: FamilyTest, treated: Mapping[int, float], baseline: Mapping[int, float]) -> list[float]:
    """Per-seed effects on the test's scale, over the seeds with a finite value on both sides
    (on the treated side alone for `one_sample`), in seed order."""
    if test.kind == "one_sample":
        return [float(treated[s]) for s in sorted(treated) if np.isfinite(treated[s])]
    seeds = sorted(s for s in treated if s in baseline and np.isfinite(treated[s]) and np.isfinite(baseline[s]))
    if test.scale == "log_ratio":
        return [math.log(baseline[s] / treated[s]) for s in seeds]
    return [float(treated[s] - baseline[s]) for s in seeds]


def run_test(test: FamilyTest, effects: Sequence[float], alpha: float = ALPHA) -> dict:
    """Mean effect, its 95% interval, n and the raw p-value (NaN below 2 seeds)."""
    interval = mean_ci(effects)
    row = {"label": test.label, "quantity": test.quantity, "kind": test.kind, "scale": test.scale, "margin": test.margin,
           "n": interval.n,
           "effect": interval.mean, "low": interval.low, "high": interval.high, "p": math.nan}
    if interval.n < 2:
        return row
    array = np.asarray(effects, dtype=float)
    if test.kind == "equivalence":
        row["p"] = tost(list(array), test.margin, alpha)["p"]
    elif float(array.std(ddof=1)) == 0.0:  # every seed agrees exactly: no spread to test against
        row["p"] = 0.0 if array.mean() != 0 else 1.0
    else:
        row["p"] = float(scipy_stats.ttest_1samp(array, 0.0).pvalue)
    return row


def judge(test: FamilyTest, row: Mapping, p: float, alpha: float = ALPHA) -> str:
    """The verdict of one test at p-value `p` (raw or adjusted)."""
    if row["n"] < 2 or math.isnan(p):
        return FEW_SEEDS
    significant = p < alpha
    if test.kind == "equivalence":
        if significant:
            return f"equivalent within ±{test.margin:g}"
        if row["high"] < -test.margin or row["low"] > test.margin:
            return f"differs by more than {test.margin:g}"
        return "inconclusive"
    if test.kind == "direction":
        if not significant:
            return "inconclusive"
        return "holds" if test.sign * row["effect"] > 0 else "does not hold"
    if not significant:
        return "no difference shown"
    return "higher" if row["effect"] > 0 else "lower"


def judge_family(tests: Sequence[tuple[str, FamilyTest, Sequence[float]]], alpha: float = ALPHA) -> pd.DataFrame:
    """One row per (comparison, test, per-seed effects): effect, interval, raw and Holm-adjusted
    p-values and verdicts, the adjustment over every test of the family (one without a p-value
    counted as a p of 1)."""
    rows = [{"comparison": comparison, **run_test(test, effects, alpha)} for comparison, test, effects in tests]
    adjusted = holm([row["p"] for row in rows])
    for row, p_adj, (_, test, _) in zip(rows, adjusted, tests):
        row["p_holm"] = p_adj
        row["verdict_raw"] = judge(test, row, row["p"], alpha)
        row["verdict"] = judge(test, row, p_adj, alpha)
    return pd.DataFrame(rows)


def _seeds(row: Mapping, sd: float, alpha: float) -> str:
    """Seeds for 80% power at the observed effect: a TOST's for an equivalence test ("never"
    when the effect lies outside the margin), a paired t test's otherwise."""
    if row["kind"] == "equivalence":
        needed = tost_seeds_needed(row["effect"], sd, row["margin"], alpha=alpha)
        return f"{needed:,}" if needed is not None else "never"
    needed = seeds_needed(row["effect"], sd, alpha=alpha)
    return f"{needed:,}" if needed is not None else f"> {MAX_SEEDS:,}"


def what_would_decide(family: pd.DataFrame, alpha: float = ALPHA) -> pd.DataFrame:
    """Per undecided test of a judged family (two seeds or more): the seeds' sd (from its
    interval), the MDE at its seeds, and the seeds 80% power needs at the observed effect, at
    Holm's loosest level (`alpha`, its last step) and its strictest (`alpha` / the family's size)."""
    rows = []
    for _, row in family[~family["verdict"].map(decided)].iterrows():
        if row["n"] < 2 or not np.isfinite(row["high"]):
            continue
        sd = sd_from_interval(row["low"], row["high"], int(row["n"]))
        rows.append({"comparison": row["comparison"], "label": row["label"], "n": int(row["n"]), "effect": row["effect"],
                     "sd": sd, "mde": minimum_detectable_effect(sd, int(row["n"]), alpha=alpha),
                     "seeds_loosest": _seeds(row, sd, alpha), "seeds_strictest": _seeds(row, sd, alpha / len(family))})
    return pd.DataFrame(rows, columns=["comparison", "label", "n", "effect", "sd", "mde", "seeds_loosest",
                                       "seeds_strictest"])


def shown(row: Mapping) -> str:
    """A judged test's effect [95% interval]; a log ratio shown as the ratio it is."""
    values = (row["effect"], row["low"], row["high"])
    if row["scale"] == "log_ratio":
        values = tuple(math.exp(v) if np.isfinite(v) else v for v in values)
    effect, low, high = (fmt(v, 3) for v in values)
    return f"{effect} [{low}, {high}]" + ("x" if row["scale"] == "log_ratio" else "")


def family_table(family: pd.DataFrame) -> str:
    """A judged family in markdown: each test's effect, raw and Holm p-values and verdicts."""
    headers = ["comparison", "test", "quantity", "seeds", "effect [95% CI]", "p", "p (Holm)", "verdict, raw", "**verdict**"]
    rows = [[r["comparison"], r["label"], r["quantity"], r["n"], shown(r), fmt(r["p"], 2), fmt(r["p_holm"], 2),
             r["verdict_raw"], f"**{r['verdict']}**"] for _, r in family.iterrows()]
    return markdown_table(headers, rows, numeric_from=len(headers))


def undecided_table(family: pd.DataFrame) -> str:
    """`what_would_decide` in markdown."""
    rows = [[r["comparison"], r["label"], r["n"], *(fmt(r[c], 3) for c in ("effect", "sd", "mde")),
             r["seeds_loosest"], r["seeds_strictest"]] for _, r in what_would_decide(family).iterrows()]
    return markdown_table(["comparison", "test", "seeds", "effect", "sd", "MDE", "seeds needed, α 0.05",
                           f"seeds needed, α 0.05/{len(family)}"], rows, numeric_from=2)
