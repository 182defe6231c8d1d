"""The seeded corrections report (S4, docs/studies/corrections.md): each off-policy correction against none
under each proximal method, and the four pre-registered hypotheses.

    python -m analysis.studies.corrections SWEEP_DIR... --out docs/reports/corrections.md --figures-dir docs/reports/corrections

Per staleness d and proximal method (recompute, loglinear), every correction against no
correction on the same seeds, with the S1 rules (`analysis.claims.rule.compare`): token ESS, IW max
and min, entropy, clip ratio and held-out reward, each shown as the direction its 95% interval
shows (higher, lower, no difference shown), with the MDE and the seeds needed. Then the
hypotheses H-S4a-d with their verdicts, and beside each the value one seed showed before.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pandas as pd

from analysis.claims.rule import FAILS, HOLDS, Claim
from analysis.figures.corrections_panel import corrections_panel
from analysis.frame import disambiguate
from analysis.hypotheses import titled
from analysis.load import load_configs, load_runs
from analysis.provenance import generated_line, REPORT_FIGURES, figures_markdown, provenance
from analysis.scalars import run_scalars
from analysis.studies import (code, contrast, contrast_table, deviations_flag, provenance_table, study_parser,
                              write_study_report)

__all__ = ["METRICS", "DECIDED_IN", "correction_arms", "versus_none", "hypothesis_verdict", "main"]

METHODS = ("recompute", "loglinear")
NONE = "none"
METRICS = [
    Claim("ess", "token ESS (steps >= d)", "ess_token", "difference", +1, "difference", "-"),
    Claim("iw_max", "IW max (steps >= d)", "iw_max", "difference", -1, "difference", "-"),
    Claim("iw_min", "IW min (steps >= d)", "iw_min", "difference", +1, "difference", "-"),
    Claim("entropy", "entropy (steps >= d)", "entropy", "difference", +1, "difference", "-"),
    Claim("clip", "clip ratio (steps >= d)", "clip_ratio", "difference", -1, "difference", "-"),
    Claim("eval", "held-out reward after the last step", "final_eval_reward", "difference", +1, "difference", "-"),
]
BY_KEY = {claim.key: claim for claim in METRICS}


@dataclass(frozen=True)
class Cells:
    """Where a pre-registered hypothesis (`key` in analysis.hypotheses) is decided: its cells
    ((method, correction) against (method, correction)), the metric and direction (the claim's
    sign), and what one seed showed."""

    key: str
    cells: tuple[tuple[tuple[str, str], tuple[str, str]], ...]
    claim: Claim
    one_seed: str


DECIDED_IN = [
    Cells("H-S4a", ((("recompute", "m2po0.04"), ("recompute", NONE)),), BY_KEY["ess"], "0.77 vs 0.58"),
    Cells("H-S4b", tuple(((("recompute", c), ("recompute", NONE))) for c in ("icepop0.5_2", "seq_mis0.5_2", "m2po0.04")),
          BY_KEY["iw_max"], "1.24-1.32 vs 2.45"),
    Cells("H-S4c", ((("loglinear", NONE), ("recompute", NONE)),), BY_KEY["ess"], "0.76 vs 0.58"),
    Cells("H-S4d", ((("loglinear", "seq_mis0.5_2"), ("loglinear", NONE)),), Claim(
        "eval-", "held-out reward: lower", "final_eval_reward", "difference", -1, "difference", "-"),
          "0.63 vs 0.84-0.89"),
]


def correction_arms(scalars: pd.DataFrame) -> pd.DataFrame:
    """The lagged ppo runs of recompute and loglinear (the paper's schedule), with `method`."""
    keep = (scalars["algo"].isin(METHODS) & (scalars["runtime"] == "lagged") & (scalars["objective"] == "ppo")
            & scalars["schedule"].isin(["", "inverse"]))
    return scalars[keep].assign(method=scalars.loc[keep, "algo"]).reset_index(drop=True)


def _runs(arms: pd.DataFrame, d: int, method: str, correction: str) -> pd.DataFrame:
    return arms[(arms["staleness"] == d) & (arms["method"] == method) & (arms["correction"] == correction)]


def versus_none(arms: pd.DataFrame) -> pd.DataFrame:
    """Every correction against none, per d and method: one row per (d, method, correction, metric)."""
    records = []
    for d in sorted(arms["staleness"].unique()):
        for method in METHODS:
            base = _runs(arms, d, method, NONE)
            for correction in sorted(set(arms.loc[arms["method"] == method, "correction"]) - {NONE}):
                ours = _runs(arms, d, method, correction)
                if base.empty or ours.empty:
                    continue
                records += contrast(METRICS, ours, base, (correction, NONE), d=int(d), method=method,
                                    correction=correction)
    return pd.DataFrame(records)


def hypothesis_verdict(hypothesis: Cells, arms: pd.DataFrame, d: int) -> tuple[str, list[dict]]:
    """The hypothesis at d: holds when every cell holds, does not hold when any cell does not
    hold, inconclusive otherwise; and each cell's record."""
    records = []
    for (ours, base) in hypothesis.cells:
        names = (f"{ours[0]}-{ours[1]}", f"{base[0]}-{base[1]}")
        records += contrast([hypothesis.claim], _runs(arms, d, *ours), _runs(arms, d, *base), names,
                            cell=f"{names[0]} vs {names[1]}")
    verdicts = [r["verdict"] for r in records]
    if verdicts and all(v == HOLDS for v in verdicts):
        return HOLDS, records
    if FAILS in verdicts:
        return FAILS, records
    if any(v.startswith("not judged") for v in verdicts):
        return "not judged (a cell has no runs)", records
    return "inconclusive", records


def _seed0(records: list[dict]) -> str:
    values = []
    for record in records:
        samples = record.get("samples")
        if samples is not None and 0 in samples.ours and 0 in samples.base:
            values.append(f"{samples.ours[0]:.3g} vs {samples.base[0]:.3g}")
    return "; ".join(values) or "-"


def _hypothesis_lines(arms: pd.DataFrame, d: int) -> list[str]:
    lines = []
    for hypothesis in DECIDED_IN:
        judged, records = hypothesis_verdict(hypothesis, arms, d)
        lines += [f"**{titled(hypothesis.key)[:-1]}; {hypothesis.claim.title}), d = {d}: {judged}.** "
                  f"One seed showed {hypothesis.one_seed}; seed 0 here: {_seed0(records)}.", "",
                  contrast_table(pd.DataFrame(records), [("cell", "cell")], effect="difference"), ""]
    return lines


def report(args: argparse.Namespace) -> list[str]:
    df = disambiguate(load_runs(args.paths))
    configs = load_configs(args.paths)
    scalars = run_scalars(df)
    arms = correction_arms(scalars)
    table = versus_none(arms)
    figures = corrections_panel(df[df["run"].isin(arms["run"])], args.figures_dir,
                                options=REPORT_FIGURES)
    command = (f"python -m analysis.studies.corrections {' '.join(map(str, args.paths))} --out {args.out} "
               f"--figures-dir {args.figures_dir}" + deviations_flag(args))
    lines = ["# Off-policy corrections, seeded (S4)", "",
             generated_line(command) + (
                " Pre-registered in docs/studies/corrections.md (hypotheses, grid, rules); its deviations are listed there."), "",
             "## Provenance", "", provenance(args.paths, scalars, configs), "",
             provenance_table(arms, [("d", "staleness"), ("method", "method")], label="correction"), "",
             "## The hypotheses", "",
             "The S1 rules (analysis/claims/rule.py): per-seed paired difference, 95% Student-t interval; a hypothesis "
             "holds when every one of its cells holds in its direction, does not hold when any cell shows the "
             "other direction, and is inconclusive otherwise.", ""]
    for d in sorted(arms["staleness"].unique()):
        lines += _hypothesis_lines(arms, int(d))
    lines += ["## Every correction against none", "",
              "Each cell: correction - none under the same proximal method, paired by seed; the direction its "
              "95% interval shows (descriptive: only the hypotheses above were registered).", "",
              contrast_table(table, [("d", "d"), ("method", "method"), ("correction", code("correction"))],
                             verdict="direction", effect="correction - none") if len(table) else "No cell to compare.",
              "", "Nothing is corrected for multiplicity: each interval is at level 0.05 on its own.", "",
              "## Figure", "", figures_markdown(figures, args.out.parent)]
    return lines


def main(argv: list[str] | None = None) -> int:
    return write_study_report(study_parser(__doc__, "paths", "sweep folders with the corrections runs"), report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
