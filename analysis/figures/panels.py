"""Figures built from run-level scalars or time axes: the paper's Fig. 2 (reward against
training time, total training time), the staleness panel and the approximation error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.load import add_labels
from analysis.plotting import (DEFAULT_SAVE, SaveOptions, band, colour_map, legend, log, missing, not_logged,
                               save, seed_note, seed_stats, time_unit)
from analysis.runs import label
from analysis.scalars import RUN_KEY, run_scalars


def training_clock(df: pd.DataFrame) -> pd.DataFrame:
    """Per run and step, the training time spent up to the end of that step: the running
    sum of time/step (eval and checkpoints left out), or wall_time for runs that never
    logged time/step."""
    steps = df[["experiment", "run", "step", "wall_time"]].drop_duplicates(["experiment", "run", "step"])
    per_step = df[df["metric"] == "time/step"].sort_values("step")
    clock = per_step.assign(train_time_s=per_step.groupby(RUN_KEY)["value"].cumsum())
    steps = steps.merge(clock[RUN_KEY + ["step", "train_time_s"]], on=RUN_KEY + ["step"], how="left")
    has_clock = steps.groupby(RUN_KEY)["train_time_s"].transform(lambda s: s.notna().any())
    steps.loc[~has_clock, "train_time_s"] = steps.loc[~has_clock, "wall_time"]
    return steps[RUN_KEY + ["step", "train_time_s"]]


def _bars(bar_ax, totals: pd.DataFrame, levels, colours, divisor: float) -> list[tuple[float, str]]:
    width = 0.8 / max(totals.groupby("staleness")["label"].nunique())
    ticks: list[tuple[float, str]] = []
    for group, staleness in enumerate(levels):
        rows = totals[totals["staleness"] == staleness]  # only labels run at this d: no holes
        rows = rows.set_index("label", drop=False).loc[colours.order(rows["label"])]
        for index, row in enumerate(rows.itertuples(index=False)):
            position = group + (index - (len(rows) - 1) / 2) * width
            ticks.append((position, row.label))
            mean, low, high = row.mean / divisor, row.min / divisor, row.max / divisor
            bar_ax.bar(position, mean, width=width * 0.95, color=colours[row.label],
                       hatch="//" if colours.linestyle(row.label) == "--" else None, edgecolor="white", linewidth=0)
            if row.n_seeds > 1:
                bar_ax.errorbar(position, mean, yerr=[[mean - low], [high - mean]], color="black", capsize=3,
                                linewidth=1)
            bar_ax.annotate(f"{mean:.3g}", (position, max(mean, high)), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=8)
    return ticks


def _label_bars(bar_ax, ticks, levels, single: bool, unit: str) -> None:
    if single:
        bar_ax.set_xticks([position for position, _ in ticks], [name for _, name in ticks],
                          rotation=30 if len(ticks) > 3 else 0, ha="right" if len(ticks) > 3 else "center")
        bar_ax.set_xlabel("algorithm")
        bar_ax.set_title(f"total training time, staleness d = {levels[0]}")
    else:
        bar_ax.set_xticks(np.arange(len(levels)), [f"staleness d = {staleness}" for staleness in levels])
        bar_ax.set_title("total training time (sum of time/step)")
    bar_ax.set_ylabel(f"total training time ({unit})")
    bar_ax.grid(True, axis="y", alpha=0.3)
    bar_ax.margins(y=0.12)


def _reward_curves(labelled: pd.DataFrame) -> pd.DataFrame:
    reward = labelled[labelled["metric"] == "reward/mean"].merge(training_clock(labelled), on=RUN_KEY + ["step"])
    curves = reward.groupby(["label", "staleness", "step"], sort=True).agg(
        train_time_s=("train_time_s", "mean"), mean=("value", "mean"), std=("value", "std"),
        min=("value", "min"), max=("value", "max"), n_seeds=("value", "count")).reset_index()
    curves.insert(0, "panel", "reward_vs_training_time")
    return curves


def fig2_reward_wallclock(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Paper Fig. 2: reward against training time (x: the seed mean of the running sum of
    time/step at each step, so eval and checkpoint pauses do not stretch the curves) and
    total training time per algorithm (sum of time/step; seed mean with min-max whiskers).
    One staleness level: the two panels side by side as in the paper; several: one curve
    panel per level on top and the bars grouped by level below. The CSV stacks both
    panels, told apart by its `panel` column."""
    stem = "fig2_reward_wallclock"
    if missing(df, ["reward/mean"], stem):
        return []
    labelled = add_labels(df)
    colours = colour_map(labelled)
    curves = _reward_curves(labelled)
    totals = seed_stats(run_scalars(labelled), ["label", "staleness"], "train_time_s")
    totals.insert(0, "panel", "training_time")
    totals["train_time_s"] = totals["mean"]
    levels = sorted(curves["staleness"].unique())
    divisor, unit = time_unit(float(np.nanmax([curves["train_time_s"].max(), totals["max"].max()])))
    single = len(levels) == 1
    fig = Figure(figsize=(12, 4.6) if single else (2.0 + 3.6 * len(levels), 7.2), layout="constrained")
    grid = fig.add_gridspec(1, 2) if single else fig.add_gridspec(2, len(levels))
    curve_axes = [fig.add_subplot(grid[0, col]) for col in range(len(levels))]
    for col, (ax, staleness) in enumerate(zip(curve_axes, levels)):
        subset = curves[curves["staleness"] == staleness]
        for name in colours.order(subset["label"]):
            curve = subset[subset["label"] == name]
            band(ax, curve["train_time_s"] / divisor, curve["mean"], curve["min"], curve["max"], name, colours,
                 len(curve))
        ax.set_title(f"reward vs training time, d = {staleness}" if single else f"staleness d = {staleness}")
        ax.set_xlabel(f"training time ({unit}, sum of time/step)")
        if col == 0:
            ax.set_ylabel("reward (mean per step)")
        else:
            ax.sharey(curve_axes[0])
        ax.grid(True, alpha=0.3)
    bar_ax = fig.add_subplot(grid[0, 1] if single else grid[1, :])
    _label_bars(bar_ax, _bars(bar_ax, totals, levels, colours, divisor), levels, single, unit)
    fig.suptitle("Reward against training time, and total training time" + seed_note(curves))
    legend(fig, colours.order(curves["label"]), colours)
    return save(fig, pd.concat([curves, totals], ignore_index=True), Path(out_dir), stem, options)


STALENESS_QUANTITIES = [
    ("final_reward", "final reward\n(mean of last 10% of steps)"),
    ("train_time_s", "training time (s)\n(sum of time/step)"),
    ("entropy", "entropy\n(mean over steps >= d)"),
    ("iw_max", "importance weight max\n(mean over steps >= d)"),
    ("iw_min", "importance weight min\n(mean over steps >= d)"),
    ("clipped_tokens", "clipped tokens per step\n(mean over steps >= d)"),
    ("clip_ratio", "clip ratio\n(mean over steps >= d)"),
    ("prox_time_s", "prox logp time per step (s)\n(mean over steps >= d)"),
]


def staleness_panel(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """How each algorithm degrades as data gets staler: the run-level scalars of the
    summary table (`analysis.scalars.run_scalars`) against staleness, seed mean with a
    min-max band. The clipped-token count grows with tokens per step, so the clip ratio
    is drawn beside it. Prox time is on a log axis (coupled's zeros are not drawn)."""
    stem = "staleness_panel"
    scalars = run_scalars(add_labels(df))
    colours = colour_map(add_labels(df))
    divisor, unit = time_unit(float(scalars["train_time_s"].max()) if scalars["train_time_s"].notna().any() else 0.0)
    long = scalars.melt(id_vars=["label", "staleness", "seed"], value_vars=[q for q, _ in STALENESS_QUANTITIES],
                        var_name="quantity", value_name="value").dropna(subset=["value"])
    if long.empty:
        log.warning("%s skipped: none of %s could be computed", stem, ", ".join(q for q, _ in STALENESS_QUANTITIES))
        return []
    data = seed_stats(long, ["quantity", "label", "staleness"])
    levels = sorted(data["staleness"].unique())
    fig = Figure(figsize=(16, 7.5), layout="constrained")
    axes = fig.subplots(2, 4, squeeze=False).ravel()
    for ax in axes[len(STALENESS_QUANTITIES):]:
        ax.set_axis_off()
    for ax, (quantity, y_label) in zip(axes, STALENESS_QUANTITIES):
        subset = data[data["quantity"] == quantity]
        scale = divisor if quantity == "train_time_s" else 1.0
        for name in colours.order(subset["label"]):
            curve = subset[subset["label"] == name].sort_values("staleness")
            band(ax, curve["staleness"], curve["mean"] / scale, curve["min"] / scale, curve["max"] / scale,
                 name, colours, len(curve))
        if subset.empty:
            not_logged(ax)
        if quantity == "prox_time_s" and (subset["mean"] > 0).any():
            ax.set_yscale("log", nonpositive="mask")
        ax.set_xticks(levels)
        ax.set_xlabel("staleness d (policy versions)")
        ax.set_ylabel(y_label.replace("(s)\n(sum", f"({unit})\n(sum"))
        ax.grid(True, alpha=0.3)
    fig.suptitle("Metrics against staleness" + seed_note(data))
    legend(fig, colours.order(data["label"]), colours)
    return save(fig, data, Path(out_dir), stem, options)


APPROX_KINDS = [("logp_abs", "|approx - recomputed| prox logp\n(mean over steps)"),
                ("iw_abs", "importance-weight error\n(mean over steps)"),
                ("clip_flip", "clip-decision flip rate\n(share of valid tokens, mean over steps)")]


def _approximation(schedule: str) -> tuple[str, str]:
    """train.log_prox_errors logs `inverse`, `exponential`, ... (log-space interpolation) and
    `<schedule>-linear` (probability space): the (algo, schedule name) of the training runs
    that use them, whose labels and colours they are drawn with."""
    if schedule.endswith("-linear"):
        return "linear", schedule[: -len("-linear")]
    return "loglinear", schedule


def approx_error(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """How far each schedule's approximation is from the recomputed proximal log-probs,
    against staleness (runs with train.log_prox_errors): the log-prob and importance-weight
    errors and how often the anchor changes a token's clip decision, the figures no peer
    publishes. Each run's value is its mean over steps; seeds give the mean and min-max band.
    A panel's y axis goes logarithmic when its values span more than a factor of 30."""
    stem = "approx_error"
    errors = df[df["metric"].str.startswith("prox_error/")].copy()
    if errors.empty:
        log.warning("%s skipped: no prox_error/<schedule>/... metrics (no run with train.log_prox_errors)", stem)
        return []
    body = errors["metric"].str.slice(len("prox_error/"))
    errors["schedule"] = body.str.rsplit("/", n=1).str[0]
    errors["kind"] = body.str.rsplit("/", n=1).str[-1]
    errors = errors[errors["kind"].isin([kind for kind, _ in APPROX_KINDS])]
    per_run = errors.groupby(["experiment", "run", "staleness", "schedule", "kind"])["value"].mean().reset_index()
    data = seed_stats(per_run, ["kind", "schedule", "staleness"])
    methods = pd.DataFrame(list(data["schedule"].map(_approximation)), columns=["algo", "schedule_name"])
    data.insert(2, "label", [label(algo, schedule) for algo, schedule in zip(methods["algo"], methods["schedule_name"])])
    colours = colour_map(methods.assign(label=data["label"].to_numpy()))
    levels = sorted(data["staleness"].unique())
    fig = Figure(figsize=(16, 4.3), layout="constrained")
    for ax, (kind, y_label) in zip(fig.subplots(1, len(APPROX_KINDS), squeeze=False).ravel(), APPROX_KINDS):
        subset = data[data["kind"] == kind]
        for name in colours.order(subset["label"]):
            curve = subset[subset["label"] == name].sort_values("staleness")
            band(ax, curve["staleness"], curve["mean"], curve["min"], curve["max"], name, colours, len(curve))
        positive = subset["mean"][subset["mean"] > 0]
        if len(positive) and positive.max() / positive.min() > 30:
            ax.set_yscale("log", nonpositive="mask")
            y_label += " (log scale)"
        if subset.empty:
            not_logged(ax)
        ax.set_xticks(levels)
        ax.set_xlabel("staleness d (policy versions)")
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Proximal-policy approximation error against recompute (train.log_prox_errors)" + seed_note(data))
    legend(fig, colours.order(data["label"]), colours, title="approximation")
    return save(fig, data, Path(out_dir), stem, options)
