"""Number formatting and GitHub-flavoured markdown tables, shared by the summary and the
claims report (without pandas' optional `tabulate` dependency)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from analysis.stats import Interval


def fmt(value, digits: int = 4) -> str:
    """Significant digits rather than fixed decimals: prox times span 1e-5 s to 10 s."""
    if value is None or (isinstance(value, (float, np.floating)) and not np.isfinite(value)):
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if 1e3 <= abs(value) < 1e7:
        return f"{value:,.0f}"  # 8,500x and 12,345 s read better than 8.5e+03
    return f"{value:.{digits}g}"


def fmt_mean_std(mean: float, std: float) -> str:
    if std is None or not np.isfinite(std):
        return fmt(mean)
    return f"{fmt(mean)} ± {fmt(std, 2)}"


def fmt_spread(values) -> str:
    """`mean ± sd` of a pandas Series, or the mean alone where one value gives no spread."""
    return fmt(values.mean(), 3) + (f" ± {fmt(values.std(), 2)}" if values.count() > 1 else "")


def fmt_interval(interval: Interval, digits: int = 3, percent: bool = False, suffix: str = "") -> str:
    """`mean [low, high]` (the 95% CI), or the mean alone with `(n=1)` when there is no
    interval; `percent` shows fractions as percentages."""
    scale, unit = (100.0, "%") if percent else (1.0, suffix)
    if not np.isfinite(interval.mean):
        return "n/a"
    mean = f"{fmt(interval.mean * scale, digits)}{unit}"
    if not interval.known:
        return f"{mean} (n={interval.n})"
    return f"{mean} [{fmt(interval.low * scale, digits)}, {fmt(interval.high * scale, digits)}]{unit}"


def fmt_pm(interval: Interval, digits: int = 3) -> str:
    """`mean ± half-width` (95% CI over seeds), `(n=1)` for a single seed."""
    if interval.n == 0 or not np.isfinite(interval.mean):
        return "n/a"
    if not interval.known:
        return f"{fmt(interval.mean, digits)} (n={interval.n})"
    half = interval.half_width
    if half < 1e-9 * max(1.0, abs(interval.mean)):
        half = 0.0  # seeds that agree up to rounding: no spurious 6.7e-16
    return f"{fmt(interval.mean, digits)} ± {fmt(half, 2)}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """A markdown table padded to line up in a terminal; columns from `numeric_from` on are
    right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [cell.rjust(width) if i >= numeric_from else cell.ljust(width)
                  for i, (cell, width) in enumerate(zip(row, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (width + 1) + ":" if i >= numeric_from else "-" * (width + 2) for i, width in enumerate(widths)]
    return "\n".join([line(cells[0]), "|" + "|".join(rule) + "|"] + [line(row) for row in cells[1:]])


def print_written(paths) -> int:
    """The CLIs' last words: every file written, one per line; returns exit status 0."""
    print("files written:")
    for path in paths:
        print(f"  {path}")
    return 0
