"""The claims section of the report as markdown: per context, the verdict table and, below
it, the table of what is shown beside the verdict (power, IQM, probability of improvement);
then, per claim, the same robust statistics across d."""

from __future__ import annotations

import math

import pandas as pd

from analysis.claims.beside import across_d_rows
from analysis.claims.paper import CLAIMS, Claim, shown
from analysis.markdown import fmt, fmt_interval, markdown_table

BY_KEY = {claim.key: claim for claim in CLAIMS}
VERDICT_HEADERS = ["claim", "paper", "coupled", "recompute", "loglinear", "loglinear vs recompute [95% CI]",
                   "verdict", "notes"]
BESIDE_HEADERS = ["claim", "seeds here", "sd of the effect", "MDE at these seeds", "seeds for 80% power: observed effect",
                  "seeds for 80% power: paper's effect", "IQM of the effect [95% bootstrap CI]",
                  "P(loglinear better) [95% bootstrap CI]", "notes"]
ACROSS_HEADERS = ["claim", "d", "IQM of the per-seed effects [95% stratified bootstrap CI]",
                  "mean over d of P(loglinear better) [95% stratified bootstrap CI]"]
NO_CLAIMS = ("No context has both loglinear and recompute runs (with the default schedule), so no claim "
             "can be judged from these runs. The summary table below still reports what was measured.")


def shown_size(claim: Claim, value: float | None) -> str:
    """A size on the effect's scale (an MDE, the paper's effect) shown like the effect."""
    if value is None or not math.isfinite(value):
        return "-"
    if claim.shown_as == "ratio":
        return f"{fmt(math.exp(value), 3)}x"
    if claim.shown_as == "reduction":
        return f"{fmt(100 * (1 - math.exp(-value)), 3)}% less"
    if claim.shown_as == "percent":
        return f"{fmt(100 * value, 3)}%"
    return fmt(value, 3)


def shown_sd(claim: Claim, sd: float) -> str:
    """The per-seed sd on the scale the test runs on: log for the times, % for the reward."""
    if not math.isfinite(sd):
        return "-"
    scale, unit = {"log_ratio": (1.0, " (log)"), "relative": (100.0, "%")}.get(claim.effect, (1.0, ""))
    return f"{fmt(scale * sd, 2)}{unit}"


def _paper_seeds(claim: Claim, seeds: str) -> str:
    return seeds if claim.paper_effect is None or seeds == "-" else f"{seeds} (at {shown_size(claim, claim.paper_effect)})"


def _beside_row(row) -> list[str]:
    claim = BY_KEY[row.claim]
    note = f"TOST: {row.seeds_if_zero} seeds if the truth is 0" if row.seeds_if_zero else ""
    return [f"({row.claim})", str(row.n_seeds or "-"), shown_sd(claim, row.sd), shown_size(claim, row.mde),
            row.seeds_observed, _paper_seeds(claim, row.seeds_paper), shown(claim, row.iqm),
            fmt_interval(row.improvement, digits=2), note]


def context_markdown(context: str, rows: pd.DataFrame) -> list[str]:
    """The verdict table of one context, its exclusions, and the table beside it."""
    verdicts = [[f"({r.claim}) {r.title}", r.paper, r.coupled, r.recompute, r.loglinear, r.effect,
                 f"**{r.verdict}**", r.note] for r in rows.itertuples(index=False)]
    parts = [f"### {context}", "", markdown_table(VERDICT_HEADERS, verdicts, numeric_from=99), ""]
    excluded = rows["excluded"].iloc[0] if "excluded" in rows.columns else ""
    if excluded:  # diverged or collapsed runs (analysis.outcomes): counted, never averaged
        parts += [f"Excluded from every value above: {excluded}.", ""]
    if "samples" in rows.columns:
        beside = [_beside_row(r) for r in rows.itertuples(index=False)]
        parts += [f"Beside the verdict, not part of it ({context}):", "",
                  markdown_table(BESIDE_HEADERS, beside, numeric_from=1), ""]
    return parts


def across_d_markdown(claims: pd.DataFrame) -> list[str]:
    """Per family of contexts with two or more d: one row per claim."""
    rows = across_d_rows(claims) if "samples" in claims.columns else []
    parts = []
    for family in dict.fromkeys(row["family"] for row in rows):
        table = [[f"({r['claim']}) {r['title']}", r["staleness"], shown(BY_KEY[r["claim"]], r["iqm"]),
                  fmt_interval(r["improvement"], digits=2)] for r in rows if r["family"] == family]
        parts += [f"### Across d: {family}", "", markdown_table(ACROSS_HEADERS, table, numeric_from=1), ""]
    return parts


def claims_markdown(claims: pd.DataFrame) -> str:
    """One verdict table (verdicts in bold) and one table beside it per context; then the
    robust statistics across d."""
    if claims.empty:
        return NO_CLAIMS
    parts = []
    for context, rows in claims.groupby("context", sort=False):
        parts += context_markdown(context, rows)
    return "\n".join(parts + across_d_markdown(claims))
