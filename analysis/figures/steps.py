"""The paper's per-step figures (1, 3, 4, 5): one row per metric, one column per staleness
level (shared y axis), because overlaying d=1 and d=8 curves of five algorithms is
unreadable and staleness is the variable the sweep is about. The CSV holds the seed mean,
std, min and max at every step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.load import add_labels
from analysis.plotting import (DEFAULT_SAVE, STEP_LABEL, SaveOptions, band, colour_map, legend, log, missing,
                               save, seed_note, seed_stats)


def _staleness_grid(n_rows: int, staleness_levels: Sequence[int], height: float = 3.2) -> tuple[Figure, np.ndarray]:
    n_cols = len(staleness_levels)
    # at least 7 inches wide: a single column leaves the title and the legend no room otherwise
    fig = Figure(figsize=(max(7.0, 2.0 + 3.6 * n_cols), 0.6 + height * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False, sharex=True, sharey="row")
    return fig, axes


def _positive_only(df: pd.DataFrame, stem: str, colours) -> tuple[pd.DataFrame, str]:
    """The rows a log axis can show, and a title note naming labels left out entirely."""
    non_positive = df["value"] <= 0
    if not non_positive.any():
        return df, ""
    log.info("%s: %d non-positive values left out of the log-scale plot (%s)", stem,
             int(non_positive.sum()), ", ".join(colours.order(df.loc[non_positive, "label"])))
    all_zero = set(df["label"]) - set(df.loc[~non_positive, "label"])
    note = f"\nnot drawn (0 s cannot go on a log axis): {', '.join(colours.order(all_zero))}" if all_zero else ""
    return df[~non_positive], note


def _draw_cells(axes, data: pd.DataFrame, panels, levels, colours, log_y: bool) -> None:
    for row, (metric, y_label) in enumerate(panels):
        for col, staleness in enumerate(levels):
            ax = axes[row, col]
            subset = data[(data["metric"] == metric) & (data["staleness"] == staleness)]
            for name in colours.order(subset["label"]):
                curve = subset[subset["label"] == name]
                band(ax, curve["step"], curve["mean"], curve["min"], curve["max"], name, colours, len(curve))
            if log_y:
                ax.set_yscale("log", nonpositive="mask")
            ax.grid(True, alpha=0.3, which="major")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
            if row == 0:
                ax.set_title(f"staleness d = {staleness}")
            if row == len(panels) - 1:
                ax.set_xlabel(STEP_LABEL)
            if col == 0:
                ax.set_ylabel(y_label)


def step_figure(df: pd.DataFrame, out_dir: Path, stem: str, title: str, panels: Sequence[tuple[str, str]],
                log_y: bool = False, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Per-step curves: one row per metric, one column per staleness level. Metrics that
    were not logged lose their row; the figure is skipped only when none was."""
    present = [(metric, y_label) for metric, y_label in panels if (df["metric"] == metric).any()]
    if not present:
        missing(df, [metric for metric, _ in panels], stem)
        return []
    if len(present) < len(panels):
        log.info("%s: drawn without %s (not logged)", stem,
                 ", ".join(metric for metric, _ in panels if (metric, _) not in present))
    df = add_labels(df)
    colours = colour_map(df)
    df = df[df["metric"].isin([metric for metric, _ in present])]
    note = ""
    if log_y:
        df, note = _positive_only(df, stem, colours)
        if df.empty:
            log.warning("%s skipped: no positive values to draw on a log scale", stem)
            return []
    data = seed_stats(df, ["metric", "label", "staleness", "step"])
    levels = sorted(data["staleness"].unique())
    fig, axes = _staleness_grid(len(present), levels)
    _draw_cells(axes, data, present, levels, colours, log_y)
    fig.suptitle(title + seed_note(data) + note)
    legend(fig, colours.order(data["label"]), colours)
    return save(fig, data, out_dir, stem, options)


def fig1_prox_time(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Paper Fig. 1: the per-step cost of the proximal log-probs, on a log axis because
    A-3PO's interpolation and recompute's forward pass differ by orders of magnitude.

    Coupled is drawn where its logged time is positive: its proximal log-probs are the
    behaviour log-probs themselves, so its time is a copy's few microseconds (the floor of
    the axis, not a cost) or exactly 0. Zeros cannot go on a log axis and are left out (the
    log says how many); a label with no positive value at all is named in the title as not
    drawn.
    """
    return step_figure(df, Path(out_dir), "fig1_prox_time", "Proximal log-prob computation time per step",
                       [("time/prox_logp", "prox logp time per step (s, log scale)")], log_y=True, options=options)


def fig3_entropy(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Paper Fig. 3: policy entropy per step; a faster collapse means less exploration."""
    return step_figure(df, Path(out_dir), "fig3_entropy", "Policy entropy per step",
                       [("actor/entropy", "entropy (nats per token)")], options=options)


def fig4_importance_weight(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Paper Fig. 4: the extremes of r = pi_theta / pi_prox per step (max on top, min
    below): how far the update strays from the proximal anchor."""
    return step_figure(df, Path(out_dir), "fig4_importance_weight",
                       r"Importance weight $\pi_\theta / \pi_{\mathrm{prox}}$ extremes per step",
                       [("actor/importance_weight/max", "importance weight max"),
                        ("actor/importance_weight/min", "importance weight min")], options=options)


def fig5_clipped_tokens(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Paper Fig. 5: tokens whose clipped surrogate was in force, per step (a count, which
    scales with the tokens per step), with the clip ratio (the size-free fraction) below
    where it was logged."""
    return step_figure(df, Path(out_dir), "fig5_clipped_tokens", "Clipped tokens per step",
                       [("actor/clipped_tokens", "clipped tokens (count per step)"),
                        ("actor/clip_ratio", "clip ratio (clipped / valid tokens)")], options=options)
