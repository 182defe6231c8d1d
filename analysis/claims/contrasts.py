"""Contrasts between two arms, as the study reports show them: one row per
(cell, claim) judged by `analysis.claims.rule.compare` with the S1 rules, with the MDE and the seeds
needed beside each verdict. Used by the alpha-schedule (S2), mechanism (S3) and corrections
(S4) reports; the claims report (S1) has its own richer tables (analysis.claims.tables).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from analysis.claims.rule import FAILS, HOLDS, Claim, compare
from analysis.load import NoRunsError
from analysis.markdown import fmt, markdown_table
from analysis.provenance import deviations_section
from analysis.runs import DEFAULT_SCHEDULE

__all__ = ["code", "schedule_arm", "contrast", "contrast_table", "direction_word", "provenance_table", "write_study_report",
           "deviations_flag"]


def schedule_arm(row: pd.Series) -> str | None:
    """A run's arm in the paper's setup (lagged, no correction, ppo): `recompute`, the loglinear
    schedule's label (`inverse`, `exponential0.5`; runs logged before the record have none and
    ran `inverse`), or `behave` for coupled (its anchor is the behaviour policy, bit for bit);
    None for any other run."""
    if row["runtime"] != "lagged" or row["correction"] != "none" or row["objective"] != "ppo":
        return None
    if row["algo"] == "recompute":
        return "recompute"
    if row["algo"] == "coupled":
        return "behave"
    if row["algo"] == "loglinear":
        return row["schedule"] or DEFAULT_SCHEDULE
    return None


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


def write_study_report(parser, report: Callable, argv: list[str] | None) -> int:
    """The study reports' command line: `parser` with the study's own arguments, to which this
    adds `--out`, `--figures-dir` and `--deviations`; `report(args)` -> markdown lines, written
    to `--out`, ending with `--deviations PAGE`'s Deviations section where given (checked
    before any loading: a missing page or section exits 2 naming it). A path with no usable
    run (`NoRunsError`: missing, empty, an unreadable archive, runs without metrics) exits 2
    with a one-line `error:` naming it, as `python -m analysis.report` does."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figures-dir", type=Path, required=True)
    parser.add_argument("--deviations", type=Path, default=None,
                        help="the study's pre-registration page, whose Deviations section ends the report")
    args = parser.parse_args(argv)
    try:
        ending = ["", deviations_section(args.deviations)] if args.deviations else []
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
