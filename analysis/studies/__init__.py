"""One module per study, named as its experiment file (conf/experiment/<name>.yaml), its
pre-registration (docs/studies/<name>.md) and its report (docs/reports/<name>.md); its tests and
hypotheses are declared in `analysis.hypotheses.STUDIES` under the same name. Studies never
import each other (tests/test_analysis_layout.py): what they share is this harness, which turns
a declaration and the loaded runs into a report:

- the command line: `study_parser` (the description and the runs every study reads) and
  `write_study_report` (`--out`, `--figures-dir`, `--deviations`, the errors, the writing);
- S6 on, a Holm family of the declared tests: `paired_values`, `judge_family`, `what_would_decide`,
  and their tables `family_table` and `undecided_table`;
- S2-S5, contrasts between two arms by the S1 rule (`analysis.claims.rule.compare`): `contrast`
  and `contrast_table`, one row per (cell, claim) with the MDE and the seeds needed beside each
  verdict (the claims report, S1, has its own richer tables: analysis.claims.tables);
- `provenance_table`: the seeds of each arm.

The Holm family. A pre-registered family of paired tests, judged raw and after Holm's adjustment.
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

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from analysis.claims.rule import FAILS, HOLDS, Claim, compare
from analysis.hypotheses import FAMILY_KINDS, Hypothesis
from analysis.load import NoRunsError
from analysis.markdown import fmt, markdown_table
from analysis.power import (ALPHA, MAX_SEEDS, minimum_detectable_effect, sd_from_interval, seeds_needed, tost,
                            tost_seeds_needed)
from analysis.provenance import deviations_section
from analysis.stats import holm, mean_ci

__all__ = ["study_parser", "write_study_report", "deviations_flag", "paired_values", "run_test", "judge",
           "judge_family", "decided", "what_would_decide", "family_table", "undecided_table", "code", "contrast",
           "contrast_table", "direction_word", "provenance_table"]


# The command line every study shares.

def study_parser(doc: str, runs: str, help: str | None = None) -> argparse.ArgumentParser:
    """A study's command line before its own options: the first paragraph of its module's
    docstring `doc` as the description, then `runs`, the one or more sweep folders or log
    archives it reads. `write_study_report` adds the options every study has."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(runs, nargs="+", help=help)
    return parser


def write_study_report(parser, report: Callable, argv: list[str] | None, preregistered: bool = True) -> int:
    """The study reports' command line: `parser` with the study's own arguments, to which this
    adds `--out`, `--figures-dir` and (a `preregistered` study's) `--deviations`; `report(args)`
    -> markdown lines, written to `--out`, ending with `--deviations PAGE`'s Deviations section
    where given (checked before any loading: a missing page or section exits 2 naming it). A
    path with no usable run (`NoRunsError`: missing, empty, an unreadable archive, runs without
    metrics) exits 2 with a one-line `error:` naming it, as `python -m analysis.report` does."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figures-dir", type=Path, required=True)
    if preregistered:
        parser.add_argument("--deviations", type=Path, default=None,
                            help="the study's pre-registration page, whose Deviations section ends the report")
    args = parser.parse_args(argv)
    deviations = getattr(args, "deviations", None)
    try:
        ending = ["", deviations_section(deviations)] if deviations else []
    except (ValueError, OSError) as error:
        print(f"error: --deviations: {error}")
        return 2
    try:
        lines = report(args) + ending
    except NoRunsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


def deviations_flag(args) -> str:
    """` --deviations PAGE` for a regenerate command, or ''."""
    return f" --deviations {args.deviations}" if getattr(args, "deviations", None) else ""


# S6 on: the declared tests judged as one Holm family.

FEW_SEEDS = "inconclusive (fewer than 2 seeds)"
UNDECIDED = ("inconclusive", "no difference shown")  # and FEW_SEEDS, an inconclusive too


def decided(verdict: str) -> bool:
    """Whether a verdict decides its test: not inconclusive (with or without seeds) and not "no
    difference shown"."""
    return not verdict.startswith(UNDECIDED)


def paired_values(test: Hypothesis, treated: Mapping[int, float], baseline: Mapping[int, float]) -> list[float]:
    """Per-seed effects on the test's scale, over the seeds with a finite value on both sides
    (on the treated side alone for `one_sample`), in seed order."""
    if test.kind == "one_sample":
        return [float(treated[s]) for s in sorted(treated) if np.isfinite(treated[s])]
    seeds = sorted(s for s in treated if s in baseline and np.isfinite(treated[s]) and np.isfinite(baseline[s]))
    if test.scale == "log_ratio":
        return [math.log(baseline[s] / treated[s]) for s in seeds]
    return [float(treated[s] - baseline[s]) for s in seeds]


def run_test(test: Hypothesis, effects: Sequence[float], alpha: float = ALPHA) -> dict:
    """Mean effect, its 95% interval, n and the raw p-value (NaN below 2 seeds)."""
    if test.kind not in FAMILY_KINDS:
        raise ValueError(f"{test.label}: decided by its study's own rule, in no family")
    interval = mean_ci(effects)
    row = {"label": test.label, "quantity": test.text, "kind": test.kind, "scale": test.scale, "margin": test.margin,
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


def judge(test: Hypothesis, row: Mapping, p: float, alpha: float = ALPHA) -> str:
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


def judge_family(tests: Sequence[tuple[str, Hypothesis, Sequence[float]]], alpha: float = ALPHA) -> pd.DataFrame:
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


# S2-S5: contrasts between two arms by the S1 rule, and the seeds of each arm.

def contrast(claims: Sequence[Claim], ours: pd.DataFrame, base: pd.DataFrame, names: tuple[str, str],
             **cell) -> list[dict]:
    """Each claim between the runs `ours` and `base` (paired by seed), each record tagged with
    the cell's keys (`d=8, m=4, arm="inverse"`...)."""
    precisions = set(ours.get("precision", pd.Series(dtype=str))) | set(base.get("precision", pd.Series(dtype=str)))
    if len(precisions) > 1:
        where = ", ".join(f"{key} = {value}" for key, value in cell.items() if isinstance(value, (int, str)))
        raise ValueError(f"a contrast mixes precisions ({', '.join(sorted(map(str, precisions)))}): {names[0]} vs "
                         f"{names[1]}{f' ({where})' if where else ''}; compare runs of one precision")
    return [{**cell, "ours": names[0], "base": names[1], **compare(claim, ours, base, names)} for claim in claims]


def direction_word(record: dict) -> str:
    """The verdict as a direction for a descriptive cell: `higher` / `lower` when the interval
    excludes 0 on that side, `no difference shown` otherwise (the claim's sign says which side
    "holds" is on). For direction claims only: an equivalence claim's "holds" is no direction."""
    verdict = record["verdict"]
    if verdict not in (HOLDS, FAILS):
        return "no difference shown" if verdict.startswith("inconclusive") else verdict
    higher = (record["better"] > 0) == (verdict == HOLDS)
    return "higher" if higher else "lower"


def _cell(record: pd.Series, key: str | Callable[[pd.Series], str]) -> str:
    return key(record) if callable(key) else str(record[key])


def code(key: str) -> Callable[[pd.Series], str]:
    """A lead column shown as code: `inverse`."""
    return lambda record: f"`{record[key]}`"


def contrast_table(records: pd.DataFrame, lead: Sequence[tuple[str, str | Callable[[pd.Series], str]]],
                   extra: Sequence[tuple[str, Callable[[pd.Series], str]]] = (), verdict: str = "verdict",
                   effect: str = "ours - base") -> str:
    """Markdown: the `lead` columns (header, record key or a function of the record), then claim, effect [95% CI], the
    verdict (or `direction` for `direction_word`), MDE, seeds for 80% power at the observed
    effect, the `extra` columns and the note."""
    headers = [h for h, _ in lead] + ["claim", f"{effect} [95% CI]", verdict, "MDE", "seeds for 80% power",
                                      *[h for h, _ in extra], "note"]
    rows = []
    for _, record in records.iterrows():
        judged = direction_word(record) if verdict == "direction" else record["verdict"]
        rows.append([_cell(record, key) for _, key in lead]
                    + [record["claim"], record["effect"], judged, fmt(record["mde"], 3), str(record["seeds_observed"]),
                       *[fn(record) for _, fn in extra], record["note"]])
    return markdown_table(headers, rows, numeric_from=len(headers) + 1)


def provenance_table(frame: pd.DataFrame, keys: Sequence[tuple[str, str]], label: str = "arm") -> str:
    """Markdown: per group of the `keys` (header, column) and the `label` column, its seeds."""
    seeds = frame.groupby([column for _, column in keys] + [label])["seed"].agg(lambda s: ", ".join(map(str, sorted(s))))
    rows = [[*map(str, key[:-1]), f"`{key[-1]}`", value] for key, value in seeds.items()]
    return markdown_table([header for header, _ in keys] + [label, "seeds"], rows, numeric_from=len(keys) + 2)
