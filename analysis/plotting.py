"""What every figure shares: colours, line styles, bands, legends, saving.

Conventions, so figures can be read side by side:
- one colour per label, the same in every figure of a sweep (`colour_map`): the base
  algorithms have fixed colours (recompute blue, loglinear red), variants get a colour of
  their own, and two variants that would collide (`exponential0.5` and `exponential0.7`)
  are moved apart deterministically; all of it decided from the runs' identity columns
  (algorithm, schedule name), never from the label's text;
- variants (any label beyond the bare algorithm) are dashed, so a variant that tracks its
  base method does not hide it;
- several seeds are drawn as their mean with a shaded min-max band (with two or three seeds
  a standard-deviation band would suggest a precision the data does not have); the CSV
  also carries the std.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
# Figures are built on matplotlib.figure.Figure, never pyplot: no global state, no
# backend or display needed, and a notebook's inline backend is left alone.
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from analysis.runs import label_rows

log = logging.getLogger("analysis.figures")  # one logger name for every figure module

PALETTE = {
    "recompute": "#1f77b4",
    "loglinear": "#d62728",
    "linear": "#2ca02c",
    "coupled": "#7f7f7f",
    "metrics": "#9467bd",
}
# Schedule ablations get fixed colours by their position in this list; anything else is
# hashed into the same list, which is deterministic across runs and machines.
_ABLATION_SCHEDULES = ["inverse_sqrt", "exponential", "linear_decay", "constant", "behave", "target"]
_EXTRA_COLOURS = [
    "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79",
    "#ffbb78", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#637939",
]

STEP_LABEL = "training step"


@dataclass(frozen=True)
class SaveOptions:
    """Which files a figure writes and at what resolution: PNG + PDF + CSV at 150 dpi for
    `python -m analysis.figures`; the claims report writes small PNGs only."""

    formats: tuple[str, ...] = ("png", "pdf", "csv")
    dpi: int = 150


DEFAULT_SAVE = SaveOptions()


def colour(name: str, algo: str, schedule_name: str = "", prefix: str = "") -> str:
    """The preferred colour of label `name` of a run of `algo` with schedule `schedule_name`
    (its `label_prefix` is `prefix`), before collisions are resolved by `colour_map`: the
    algorithm's own for its plain label, a fixed one per schedule ablation of loglinear and
    linear, else one hashed from the label."""
    if name == (f"{prefix}/{algo}" if prefix else algo) and algo in PALETTE:
        return PALETTE[algo]
    if algo in ("loglinear", "linear") and schedule_name in _ABLATION_SCHEDULES:
        offset = 0 if algo == "loglinear" else len(_ABLATION_SCHEDULES)
        return _EXTRA_COLOURS[offset + _ABLATION_SCHEDULES.index(schedule_name)]
    digest = hashlib.md5(name.encode("utf-8")).hexdigest()
    return _EXTRA_COLOURS[int(digest, 16) % len(_EXTRA_COLOURS)]


def linestyle(name: str, algo: str) -> str:
    """Dashed for metrics mode and for every label beyond the bare algorithm (a variant, an
    async or an `<experiment>/` prefixed one); solid for the plain algorithm."""
    return "-" if name == algo and algo != "metrics" else "--"


class Palette(dict):
    """Label -> colour for the labels drawn together, in table and legend order, with each
    label's line style: what `colour_map` returns and `band`/`legend` draw with."""

    def __init__(self, colours: Mapping[str, str], linestyles: Mapping[str, str]) -> None:
        super().__init__(colours)
        self.linestyles = dict(linestyles)

    def linestyle(self, name: str) -> str:
        return self.linestyles[name]

    def order(self, labels: Iterable[str]) -> list[str]:
        """`labels` (any of this palette's) in legend order."""
        wanted = set(labels)
        unknown = wanted - set(self)
        if unknown:
            raise KeyError(f"labels not in this palette: {sorted(unknown)}")
        return [name for name in self if name in wanted]


def colour_map(frame: pd.DataFrame) -> Palette:
    """The palette of the labels of `frame` (its `label`, `algo` and, where present,
    `schedule_name` and `label_prefix` columns) drawn together: each label's preferred
    colour, unless an earlier label (in table order) took it, then the next free one."""
    mapping: dict[str, str] = {}
    rows = label_rows(frame)
    taken = set()
    for row in rows.itertuples(index=False):
        wanted = colour(row.label, row.algo, row.schedule_name, row.label_prefix)
        if wanted in taken and wanted in _EXTRA_COLOURS:
            start = _EXTRA_COLOURS.index(wanted)
            free = [_EXTRA_COLOURS[(start + i) % len(_EXTRA_COLOURS)] for i in range(len(_EXTRA_COLOURS))]
            wanted = next((c for c in free if c not in taken), wanted)
        mapping[row.label] = wanted
        taken.add(wanted)
    return Palette(mapping, {row.label: linestyle(row.label, row.algo) for row in rows.itertuples(index=False)})


def seed_stats(frame: pd.DataFrame, by: list[str], value: str = "value") -> pd.DataFrame:
    """Mean, std, min, max and count over seeds (the rows left in each group)."""
    stats = frame.groupby(by, sort=True)[value].agg(["mean", "std", "min", "max", "count"])
    return stats.rename(columns={"count": "n_seeds"}).reset_index()


def time_unit(max_seconds: float) -> tuple[float, str]:
    """Hours for paper-scale runs, seconds for smoke runs: the axis stays readable and the
    label says which (the CSV always stays in seconds)."""
    if max_seconds >= 2 * 3600:
        return 3600.0, "h"
    if max_seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"


def save(fig: Figure, data: pd.DataFrame, out_dir: Path, stem: str,
         options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in options.formats:
        path = out_dir / f"{stem}.{fmt}"
        if fmt == "csv":
            data.to_csv(path, index=False)
        else:
            fig.savefig(path, dpi=options.dpi)
        paths.append(path)
    return paths


def legend(fig: Figure, labels: Sequence[str], colours: Palette, title: str = "algorithm") -> None:
    handles = [Line2D([], [], color=colours[name], linestyle=colours.linestyle(name), linewidth=2, label=name)
               for name in labels]
    fig.legend(handles=handles, loc="outside right upper", title=title, frameon=False)


def band(ax, x, mean, low, high, name: str, colours: Palette, n_points: int) -> None:
    """A seed-mean curve with its min-max band (markers on short curves)."""
    ax.plot(x, mean, color=colours[name], linestyle=colours.linestyle(name), linewidth=1.8,
            marker="o" if n_points <= 12 else None, markersize=4)
    if np.any(np.asarray(high) > np.asarray(low)):
        ax.fill_between(x, low, high, color=colours[name], alpha=0.18, linewidth=0)


def interval_errorbar(ax, x, intervals, **style) -> None:
    """Seed means with their 95% intervals (analysis.stats.Interval) as error bars; an
    interval that is not known (one seed) draws no bar."""
    means = [i.mean for i in intervals]
    below = [i.mean - i.low if i.known else 0.0 for i in intervals]
    above = [i.high - i.mean if i.known else 0.0 for i in intervals]
    ax.errorbar(x, means, yerr=[below, above], capsize=3, **style)


def missing(df: pd.DataFrame, metrics: Sequence[str], name: str) -> bool:
    absent = [metric for metric in metrics if not (df["metric"] == metric).any()]
    if absent:
        log.warning("%s skipped: no %s in the runs", name, ", ".join(absent))
    return bool(absent)


def seed_note(data: pd.DataFrame) -> str:
    if not len(data):
        return ""
    most, fewest = int(data["n_seeds"].max()), int(data["n_seeds"].min())
    if most <= 1:
        return ""
    seeds = f"{most} seeds" if most == fewest else f"up to {most} seeds"
    return f"\nmean over {seeds}, band: min to max"


def not_logged(ax) -> None:
    ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
