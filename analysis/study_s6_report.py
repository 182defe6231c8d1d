"""S6's report in markdown (`python -m analysis.study_s6`): the tier's family of tests with raw
and Holm-adjusted verdicts, per-arm means, the plateau check, the power at the observed spread
and, when given, tier B's collapse table."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.markdown import fmt, markdown_table
from analysis.power import minimum_detectable_effect, sd_from_interval, tost_seeds_needed
from analysis.study_s6 import ARMS, BASELINE, MARGIN, PLATEAU_GAIN, TESTS, plateau, tier_family

ARM_COLUMNS = ("last_evals_reward", "entropy", "clip_ratio", "iw_max", "total_ratio_max", "kl_k3", "cpu_time_s")
PAPER_MARGIN = 0.02  # the paper's "within 2%", relative to recompute's reward


def _shown(row: pd.Series) -> str:
    """Effect [95% interval]; a log ratio shown as the ratio it is."""
    scale = next(t.scale for t in TESTS if t.label == row["label"])
    values = (row["effect"], row["low"], row["high"])
    if scale == "log_ratio":
        values = tuple(math.exp(v) if np.isfinite(v) else v for v in values)
    effect, low, high = (fmt(v, 3) for v in values)
    return f"{effect} [{low}, {high}]" + ("x" if scale == "log_ratio" else "")


def family_table(family: pd.DataFrame) -> str:
    headers = ["comparison", "test", "quantity", "seeds", "effect [95% CI]", "p", "p (Holm)", "verdict, raw", "**verdict**"]
    rows = [[r["comparison"], r["label"], r["quantity"], r["n"], _shown(r), fmt(r["p"], 2), fmt(r["p_holm"], 2),
             r["verdict_raw"], f"**{r['verdict']}**"] for _, r in family.iterrows()]
    return markdown_table(headers, rows, numeric_from=len(headers))


def arm_table(scalars: pd.DataFrame, staleness: int) -> str:
    cell = scalars[scalars["staleness"] == staleness]
    rows = []
    for arm in (BASELINE, *ARMS):
        runs = cell[cell["arm"] == arm]
        rows.append([arm, len(runs), int(runs["flagged"].sum()),
                     *(f"{fmt(runs[c].mean(), 3)} ± {fmt(runs[c].std(), 2)}" for c in ARM_COLUMNS)])
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


def stress_table(stress: pd.DataFrame) -> str:
    headers = ["lr", "minibatches", "arm", "recompute collapsed", "arm collapsed", "p", "p (Holm)", "**verdict**"]
    rows = [[f"{r['lr']:g}", r["n_minibatches"], r["arm"], r["recompute_collapsed"], r["arm_collapsed"],
             fmt(r["p"], 2), fmt(r["p_holm"], 2), f"**{r['verdict']}**"] for _, r in stress.iterrows()]
    return markdown_table(headers, rows, numeric_from=len(headers))


def report(scalars: pd.DataFrame, staleness: int, stress: pd.DataFrame | None = None) -> str:
    family = tier_family(scalars, staleness)
    check = plateau(scalars, staleness)
    lines = [f"# S6 at d = {staleness}: the claims on the words testbed", "",
             "Pre-registered in docs/study_s6.md (tests, margin, Holm family, verdict rules). Regenerate:", "",
             "```", f"python -m analysis.study_s6 LOGS --staleness {staleness} --out THIS_FILE", "```", "",
             "## Arms (mean ± sd over runs)", "", arm_table(scalars, staleness), "",
             f"## The family: {len(family)} tests, Holm-adjusted", "", family_table(family), "",
             "## Plateau check (recompute: last eval - the one before)", "",
             f"{fmt(check['gain'], 3)} [{fmt(check['low'], 3)}, {fmt(check['high'], 3)}] over {check['n']} seeds: "
             + ("**holds** (upper end below " if check["holds"] else "**does not hold** (upper end not below ")
             + f"{PLATEAU_GAIN:g}).", "", "## Power at the observed spread", "", *power_lines(family, scalars, staleness)]
    if stress is not None and len(stress):
        lines += ["", "## Tier B: collapses (Fisher's exact, Holm over the cells)", "", stress_table(stress)]
    return "\n".join(lines) + "\n"
