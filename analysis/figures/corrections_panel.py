"""Issue 11's corrections panel: how each off-policy correction fares under each proximal
method and staleness, from a sweep over correction x algo x staleness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from analysis.load import add_labels
from analysis.plotting import DEFAULT_SAVE, SaveOptions, colour_map, log, not_logged, save
from analysis.runs import ASYNC_SUFFIX, correction_order, label
from analysis.scalars import RUN_KEY, run_scalars
from analysis.stats import mean_ci

CORRECTION_QUANTITIES = [
    ("final_reward", "final reward\n(mean of last 10% of steps)"),
    ("iw_max", "importance weight max\n(mean over steps >= d)"),
    ("clip_ratio", "clip ratio\n(mean over steps >= d)"),
    ("ess_token", "ESS per token (fraction)\n(mean over steps >= d)"),
]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def methods(df: pd.DataFrame) -> pd.DataFrame:
    """Per run (RUN_KEY): its `method`, the series a correction is compared across: the
    label the run would have without its correction (`recompute-icepop0.5_2` -> `recompute`,
    `loglinear-tis2-gspo` -> `loglinear-gspo`), built from its identity columns, with its
    async suffix and `<experiment>/` prefix; and the columns its colour is decided from."""
    columns = ["algo", "schedule", "objective", "precision", "runtime", "schedule_name", "label_prefix"]
    runs = add_labels(df).groupby(RUN_KEY, sort=True)[columns].first().reset_index()
    bare = [label(*fields) for fields in zip(runs["algo"], runs["schedule"], [None] * len(runs), runs["objective"],
                                              runs["precision"])]
    prefix = [f"{p}/" if p else "" for p in runs["label_prefix"]]
    suffix = [ASYNC_SUFFIX if r == "async" else "" for r in runs["runtime"]]
    runs["method"] = [p + b + s for p, b, s in zip(prefix, bare, suffix)]
    return runs[RUN_KEY + ["method", "algo", "schedule_name", "label_prefix"]]


def corrections_data(df: pd.DataFrame, runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per quantity, correction, method and staleness: seed mean, 95% CI (Student t), std,
    min, max and the number of seeds, from the run-level scalars."""
    runs = methods(df) if runs is None else runs
    scalars = run_scalars(add_labels(df)).merge(runs[RUN_KEY + ["method"]], on=RUN_KEY, how="left")
    present = [q for q, _ in CORRECTION_QUANTITIES if q in scalars.columns]
    long = scalars.melt(id_vars=["correction", "method", "staleness", "seed"], value_vars=present,
                        var_name="quantity", value_name="value").dropna(subset=["value"])
    records = []
    for (quantity, correction, method, staleness), rows in long.groupby(
            ["quantity", "correction", "method", "staleness"], sort=True):
        interval = mean_ci(rows["value"].tolist())
        records.append({"quantity": quantity, "correction": correction, "method": method, "staleness": staleness,
                        "mean": interval.mean, "ci_low": interval.low, "ci_high": interval.high,
                        "std": rows["value"].std(), "min": rows["value"].min(), "max": rows["value"].max(),
                        "n_seeds": interval.n})
    return pd.DataFrame(records)


def _draw_panel(ax, subset: pd.DataFrame, corrections, series, colours, markers) -> None:
    width = 0.8 / max(1, len(series))
    for index, (method, staleness) in enumerate(series):
        rows = subset[(subset["method"] == method) & (subset["staleness"] == staleness)]
        x = np.array([corrections.index(c) for c in rows["correction"]]) + (index - (len(series) - 1) / 2) * width
        mean = rows["mean"].to_numpy()
        low = np.where(np.isfinite(rows["ci_low"]), mean - rows["ci_low"], 0.0)
        high = np.where(np.isfinite(rows["ci_high"]), rows["ci_high"] - mean, 0.0)
        ax.errorbar(x, mean, yerr=[low, high], color=colours[method], marker=markers[staleness], linestyle="none",
                    markersize=5, capsize=2, linewidth=1,
                    markerfacecolor="white" if colours.linestyle(method) == "--" else None)
    ax.set_xticks(range(len(corrections)), corrections, rotation=30, ha="right")
    ax.set_xlim(-0.6, len(corrections) - 0.4)
    ax.grid(True, axis="y", alpha=0.3)


def corrections_panel(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Issue 11: one panel each for final reward, IW max, clip ratio and ESS per token, x =
    correction (none, tis, icepop, seq_tis, seq_mis, m2po, with their parameters), and at
    each x one point per (proximal method, staleness) with its 95% Student-t CI over seeds:
    colour = method (recompute and loglinear side by side), marker = staleness. Drawn only
    when the runs hold more than one correction; a quantity nobody logged gets an empty
    panel saying so."""
    stem = "corrections_panel"
    corrections = correction_order(add_labels(df)) if "correction" in df.columns else []
    if len(corrections) < 2:
        log.info("%s skipped: the runs hold %d correction(s), it needs two or more", stem, len(corrections))
        return []
    runs = methods(df)
    data = corrections_data(df, runs)
    colours = colour_map(runs[runs["method"].isin(data["method"])].rename(columns={"method": "label"}))
    series_names = colours.order(data["method"])
    levels = sorted(data["staleness"].unique())
    markers = {staleness: MARKERS[i % len(MARKERS)] for i, staleness in enumerate(levels)}
    series = [(method, staleness) for staleness in levels for method in series_names]
    fig = Figure(figsize=(4.0 * len(CORRECTION_QUANTITIES) + 2.0, 4.4), layout="constrained")
    for ax, (quantity, y_label) in zip(fig.subplots(1, len(CORRECTION_QUANTITIES), squeeze=False).ravel(),
                                       CORRECTION_QUANTITIES):
        subset = data[data["quantity"] == quantity] if len(data) else data
        if subset.empty:
            not_logged(ax)
        _draw_panel(ax, subset, corrections, series, colours, markers)
        ax.set_ylabel(y_label)
        ax.set_xlabel("correction")
    handles = [Line2D([], [], color=colours[m], linestyle=colours.linestyle(m), linewidth=2, label=m)
               for m in series_names]
    handles += [Line2D([], [], color="black", marker=markers[d], linestyle="none", label=f"d = {d}") for d in levels]
    fig.legend(handles=handles, loc="outside right upper", title="method, staleness", frameon=False)
    fig.suptitle("Off-policy corrections by proximal method and staleness (mean, 95% CI over seeds)")
    return save(fig, data, Path(out_dir), stem, options)
