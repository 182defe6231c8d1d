"""The paper's figures (and the ablation figures it lacks), one function per figure.

Every function takes the tidy frame from `analysis.load` and an output directory, and
writes `<stem>.png`, `<stem>.pdf` and `<stem>.csv`, the CSV holding exactly the numbers
drawn, so a figure can be checked or redrawn elsewhere without rerunning anything. A
figure whose metrics are absent from the runs is skipped with a logged message and
returns no paths: a coupled-only sweep has no prox-error metrics, and that is not an
error.

Conventions shared by every figure, so figures can be read side by side:
- one colour per algorithm label (`colour`), the same in every figure and every sweep;
- several seeds are drawn as their mean with a shaded min-max band (with two or three
  seeds a standard-deviation band would suggest a precision the data does not have);
  the CSV also carries the std;
- per-step figures get one panel per staleness level (columns, shared y axis), because
  overlaying d=1 and d=8 curves of five algorithms is unreadable and staleness is the
  variable the sweep is about.

Run as `python -m analysis.figures SWEEP_DIR... [--out DIR] [--wandb-project P]`.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
# Figures are built on matplotlib.figure.Figure, never pyplot: no global state, no
# backend or display needed, and a notebook's inline backend is left alone.
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from analysis.load import NoRunsError, add_labels, label, label_sort_key, load_runs, load_wandb
from analysis.summary import run_scalars, write_summary

log = logging.getLogger("analysis.figures")  # the same name when run as __main__

# Fixed colours for the algorithms (tab10): recompute (the baseline) blue, loglinear
# (the paper's method) red, so the two curves every figure is about are never confused.
PALETTE = {
    "recompute": "#1f77b4",
    "loglinear": "#d62728",
    "linear": "#2ca02c",
    "coupled": "#7f7f7f",
    "metrics": "#9467bd",
}
# Schedule ablations get fixed colours too, by their position in this list; anything
# else is hashed into the same list, which is deterministic across runs and machines.
_ABLATION_SCHEDULES = ["inverse_sqrt", "exponential", "linear_decay", "constant", "behave", "target"]
_EXTRA_COLOURS = [
    "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79",
    "#ffbb78", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#637939",
]

STEP_LABEL = "training step"


def colour(algo_label: str) -> str:
    """The colour of an algorithm label, identical in every figure."""
    if algo_label in PALETTE:
        return PALETTE[algo_label]
    base, _, rest = algo_label.partition("[")
    schedule = rest.rstrip("]")
    if base in ("loglinear", "linear") and schedule in _ABLATION_SCHEDULES:
        offset = 0 if base == "loglinear" else len(_ABLATION_SCHEDULES)
        return _EXTRA_COLOURS[offset + _ABLATION_SCHEDULES.index(schedule)]
    digest = hashlib.md5(algo_label.encode("utf-8")).hexdigest()
    return _EXTRA_COLOURS[int(digest, 16) % len(_EXTRA_COLOURS)]


def linestyle(algo_label: str) -> str:
    """Dashed for metrics mode and schedule ablations: metrics mode trains exactly like
    recompute, and an ablation often tracks its base method, so a solid line drawn on
    top would hide the other one completely."""
    return "--" if algo_label == "metrics" or "[" in algo_label else "-"


def _sorted_labels(labels) -> list[str]:
    return sorted(set(labels), key=label_sort_key)


def _seed_stats(frame: pd.DataFrame, by: list[str], value: str = "value") -> pd.DataFrame:
    """Mean, std, min, max and count over seeds (the rows left in each group)."""
    stats = frame.groupby(by, sort=True)[value].agg(["mean", "std", "min", "max", "count"])
    return stats.rename(columns={"count": "n_seeds"}).reset_index()


def _time_unit(max_seconds: float) -> tuple[float, str]:
    """Hours for paper-scale runs, seconds for smoke runs: the axis stays readable and the
    label says which (the CSV always stays in seconds)."""
    if max_seconds >= 2 * 3600:
        return 3600.0, "h"
    if max_seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"


def _save(fig: Figure, data: pd.DataFrame, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf", out_dir / f"{stem}.csv"]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    data.to_csv(paths[2], index=False)
    return paths


def _legend(fig: Figure, labels: Sequence[str], title: str = "algorithm") -> None:
    handles = [Line2D([], [], color=colour(name), linestyle=linestyle(name), linewidth=2, label=name)
               for name in labels]
    fig.legend(handles=handles, loc="outside right upper", title=title, frameon=False)


def _band(ax, x, mean, low, high, name: str, n_points: int) -> None:
    ax.plot(x, mean, color=colour(name), linestyle=linestyle(name), linewidth=1.8,
            marker="o" if n_points <= 12 else None, markersize=4)
    if np.any(np.asarray(high) > np.asarray(low)):
        ax.fill_between(x, low, high, color=colour(name), alpha=0.18, linewidth=0)


def _missing(df: pd.DataFrame, metrics: Sequence[str], name: str) -> bool:
    absent = [metric for metric in metrics if not (df["metric"] == metric).any()]
    if absent:
        log.warning("%s skipped: no %s in the runs", name, ", ".join(absent))
    return bool(absent)


def _staleness_grid(n_rows: int, staleness_levels: Sequence[int], height: float = 3.2) -> tuple[Figure, np.ndarray]:
    n_cols = len(staleness_levels)
    fig = Figure(figsize=(2.0 + 3.6 * n_cols, 0.6 + height * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False, sharex=True, sharey="row")
    return fig, axes


def _step_figure(df: pd.DataFrame, out_dir: Path, stem: str, title: str,
                 panels: Sequence[tuple[str, str]], log_y: bool = False) -> list[Path]:
    """Per-step curves: one row per metric, one column per staleness level. Metrics that
    were not logged lose their row; the figure is skipped only when none was."""
    present = [(metric, y_label) for metric, y_label in panels if (df["metric"] == metric).any()]
    if not present:
        _missing(df, [metric for metric, _ in panels], stem)
        return []
    if len(present) < len(panels):
        log.info("%s: drawn without %s (not logged)", stem,
                 ", ".join(metric for metric, _ in panels if (metric, _) not in present))
    panels = present
    metrics = [metric for metric, _ in panels]
    df = add_labels(df[df["metric"].isin(metrics)])
    note = ""
    if log_y:
        non_positive = df["value"] <= 0
        if non_positive.any():
            log.info("%s: %d non-positive values left out of the log-scale plot (%s)", stem,
                     int(non_positive.sum()), ", ".join(_sorted_labels(df.loc[non_positive, "label"])))
            all_zero = set(df["label"]) - set(df.loc[~non_positive, "label"])
            if all_zero:
                note = f"\nnot drawn (0 s cannot go on a log axis): {', '.join(_sorted_labels(all_zero))}"
            df = df[~non_positive]
            if df.empty:
                log.warning("%s skipped: no positive values to draw on a log scale", stem)
                return []
    data = _seed_stats(df, ["metric", "label", "staleness", "step"])
    levels = sorted(data["staleness"].unique())
    fig, axes = _staleness_grid(len(panels), levels)
    for row, (metric, y_label) in enumerate(panels):
        for col, staleness in enumerate(levels):
            ax = axes[row, col]
            subset = data[(data["metric"] == metric) & (data["staleness"] == staleness)]
            for name in _sorted_labels(subset["label"]):
                curve = subset[subset["label"] == name]
                _band(ax, curve["step"], curve["mean"], curve["min"], curve["max"], name, len(curve))
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
    fig.suptitle(title + _seed_note(data) + note)
    _legend(fig, _sorted_labels(data["label"]))
    return _save(fig, data, out_dir, stem)


def _seed_note(data: pd.DataFrame) -> str:
    if not len(data):
        return ""
    most, fewest = int(data["n_seeds"].max()), int(data["n_seeds"].min())
    if most <= 1:
        return ""
    seeds = f"{most} seeds" if most == fewest else f"up to {most} seeds"
    return f"\nmean over {seeds}, band: min to max"


def fig1_prox_time(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Paper Fig. 1: the per-step cost of the proximal log-probs, on a log axis because
    A-3PO's interpolation and recompute's forward pass differ by orders of magnitude.
    Zero times (coupled PPO computes nothing) cannot be drawn on it and are left out,
    which the log says."""
    return _step_figure(df, Path(out_dir), "fig1_prox_time",
                        "Proximal log-prob computation time per step",
                        [("time/prox_logp", "prox logp time per step (s, log scale)")], log_y=True)


def fig2_reward_wallclock(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Paper Fig. 2: reward against wall-clock time (x is the seed-mean wall time at each
    step) and total training time per algorithm (wall time at the last step; seed mean
    with min-max whiskers). With one staleness level the two panels sit side by side as
    in the paper; with several, the curves get one panel per level on top and the bars
    are grouped by level below.
    The CSV stacks both panels, told apart by its `panel` column."""
    out_dir = Path(out_dir)
    stem = "fig2_reward_wallclock"
    if _missing(df, ["reward/mean"], stem):
        return []
    labelled = add_labels(df)
    reward = labelled[labelled["metric"] == "reward/mean"]
    curves = reward.groupby(["label", "staleness", "step"], sort=True).agg(
        wall_time_s=("wall_time", "mean"), mean=("value", "mean"), std=("value", "std"),
        min=("value", "min"), max=("value", "max"), n_seeds=("value", "count")).reset_index()
    curves.insert(0, "panel", "reward_vs_wall_time")
    totals = _seed_stats(run_scalars(labelled), ["label", "staleness"], "train_time_s")
    totals.insert(0, "panel", "training_time")
    totals["wall_time_s"] = totals["mean"]

    levels = sorted(curves["staleness"].unique())
    divisor, unit = _time_unit(float(np.nanmax([curves["wall_time_s"].max(), totals["max"].max()])))
    single = len(levels) == 1  # the paper's layout: curve left, bars right
    if single:
        fig = Figure(figsize=(12, 4.6), layout="constrained")
        grid = fig.add_gridspec(1, 2)
    else:
        fig = Figure(figsize=(2.0 + 3.6 * len(levels), 7.2), layout="constrained")
        grid = fig.add_gridspec(2, len(levels))
    curve_axes = [fig.add_subplot(grid[0, col]) for col in range(len(levels))]
    for col, (ax, staleness) in enumerate(zip(curve_axes, levels)):
        subset = curves[curves["staleness"] == staleness]
        for name in _sorted_labels(subset["label"]):
            curve = subset[subset["label"] == name]
            _band(ax, curve["wall_time_s"] / divisor, curve["mean"], curve["min"], curve["max"], name, len(curve))
        ax.set_title(f"reward vs wall-clock, staleness d = {staleness}")
        ax.set_xlabel(f"wall-clock time ({unit})")
        if col == 0:
            ax.set_ylabel("reward (mean per step)")
        ax.grid(True, alpha=0.3)
    if len(levels) > 1:
        for ax in curve_axes[1:]:
            ax.sharey(curve_axes[0])

    bar_ax = fig.add_subplot(grid[0, 1] if single else grid[1, :])
    width = 0.8 / max(totals.groupby("staleness")["label"].nunique())
    bar_ticks: list[tuple[float, str]] = []
    for group, staleness in enumerate(levels):
        # only the labels run at this staleness, so a group has no holes
        rows = totals[totals["staleness"] == staleness]
        rows = rows.iloc[sorted(range(len(rows)), key=lambda i: label_sort_key(rows["label"].iloc[i]))]
        for index, row in enumerate(rows.itertuples(index=False)):
            position = group + (index - (len(rows) - 1) / 2) * width
            bar_ticks.append((position, row.label))
            mean, low, high = row.mean / divisor, row.min / divisor, row.max / divisor
            bar_ax.bar(position, mean, width=width * 0.95, color=colour(row.label),
                       hatch="//" if linestyle(row.label) == "--" else None, edgecolor="white", linewidth=0)
            if row.n_seeds > 1:
                bar_ax.errorbar(position, mean, yerr=[[mean - low], [high - mean]], color="black", capsize=3,
                                linewidth=1)
            bar_ax.annotate(f"{mean:.3g}", (position, max(mean, high)), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=8)
    if single:
        bar_ax.set_xticks([position for position, _ in bar_ticks], [name for _, name in bar_ticks],
                          rotation=30 if len(bar_ticks) > 3 else 0, ha="right" if len(bar_ticks) > 3 else "center")
        bar_ax.set_xlabel("algorithm")
        bar_ax.set_title(f"total training time, staleness d = {levels[0]}")
    else:
        bar_ax.set_xticks(np.arange(len(levels)), [f"staleness d = {staleness}" for staleness in levels])
        bar_ax.set_title("total training time (wall-clock at the last step)")
    bar_ax.set_ylabel(f"total training time ({unit})")
    bar_ax.grid(True, axis="y", alpha=0.3)
    bar_ax.margins(y=0.12)

    fig.suptitle("Reward against wall-clock time, and total training time" + _seed_note(curves))
    _legend(fig, _sorted_labels(labelled.loc[labelled["metric"] == "reward/mean", "label"]))
    data = pd.concat([curves, totals], ignore_index=True)
    return _save(fig, data, out_dir, stem)


def fig3_entropy(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Paper Fig. 3: policy entropy per step; a faster collapse means less exploration."""
    return _step_figure(df, Path(out_dir), "fig3_entropy", "Policy entropy per step",
                        [("actor/entropy", "entropy (nats per token)")])


def fig4_importance_weight(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Paper Fig. 4: the extremes of r = pi_theta / pi_prox per step (max on top, min
    below): how far the update strays from the proximal anchor."""
    return _step_figure(df, Path(out_dir), "fig4_importance_weight",
                        r"Importance weight $\pi_\theta / \pi_{\mathrm{prox}}$ extremes per step",
                        [("actor/importance_weight/max", "importance weight max"),
                         ("actor/importance_weight/min", "importance weight min")])


def fig5_clipped_tokens(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Paper Fig. 5: tokens whose clipped surrogate was in force, per step."""
    return _step_figure(df, Path(out_dir), "fig5_clipped_tokens", "Clipped tokens per step",
                        [("actor/clipped_tokens", "clipped tokens (count per step)")])


STALENESS_QUANTITIES = [
    ("final_reward", "final reward\n(mean of last 10% of steps)"),
    ("train_time_s", "training time (s)\n(wall-clock at the last step)"),
    ("iw_max", "importance weight max\n(mean over steps)"),
    ("clipped_tokens", "clipped tokens per step\n(mean over steps)"),
]


def staleness_panel(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """How each algorithm degrades as data gets staler: the run-level scalars of the
    summary table (`analysis.summary.run_scalars`) against staleness, seed mean with a
    min-max band."""
    out_dir = Path(out_dir)
    stem = "staleness_panel"
    scalars = run_scalars(add_labels(df))
    divisor, unit = _time_unit(float(scalars["train_time_s"].max()) if scalars["train_time_s"].notna().any() else 0.0)
    long = scalars.melt(id_vars=["label", "staleness", "seed"], value_vars=[q for q, _ in STALENESS_QUANTITIES],
                        var_name="quantity", value_name="value").dropna(subset=["value"])
    if long.empty:
        log.warning("%s skipped: none of %s could be computed", stem, ", ".join(q for q, _ in STALENESS_QUANTITIES))
        return []
    data = _seed_stats(long, ["quantity", "label", "staleness"])
    levels = sorted(data["staleness"].unique())
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    for ax, (quantity, y_label) in zip(axes, STALENESS_QUANTITIES):
        subset = data[data["quantity"] == quantity]
        scale = divisor if quantity == "train_time_s" else 1.0
        for name in _sorted_labels(subset["label"]):
            curve = subset[subset["label"] == name].sort_values("staleness")
            _band(ax, curve["staleness"], curve["mean"] / scale, curve["min"] / scale, curve["max"] / scale,
                  name, len(curve))
        if subset.empty:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.set_xticks(levels)
        ax.set_xlabel("staleness d (policy versions)")
        ax.set_ylabel(y_label.replace("(s)", f"({unit})"))
        ax.grid(True, alpha=0.3)
    fig.suptitle("Metrics against staleness" + _seed_note(data))
    _legend(fig, _sorted_labels(data["label"]))
    return _save(fig, data, out_dir, stem)


APPROX_KINDS = [("logp_abs", "|approx - recomputed| prox logp\n(mean over steps)"),
                ("iw_abs", "importance-weight error\n(mean over steps)")]


def _schedule_label(schedule: str) -> str:
    """Metrics mode logs `inverse`, `exponential`, ... (log-space interpolation) and
    `<schedule>-linear` (probability space); naming them like the training runs that
    use them gives them those runs' colours."""
    if schedule.endswith("-linear"):
        return label("linear", schedule[: -len("-linear")])
    return label("loglinear", schedule)


def approx_error(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """How far each schedule's approximation is from the recomputed proximal log-probs,
    against staleness (metrics-mode runs): the figure no peer publishes. Each run's
    error is its mean over steps; seeds give the mean and min-max band. The y axis goes
    logarithmic when the errors span more than a factor of 30."""
    out_dir = Path(out_dir)
    stem = "approx_error"
    errors = df[df["metric"].str.startswith("prox_error/")].copy()
    if errors.empty:
        log.warning("%s skipped: no prox_error/<schedule>/... metrics (no metrics-mode run)", stem)
        return []
    body = errors["metric"].str.slice(len("prox_error/"))
    errors["schedule"] = body.str.rsplit("/", n=1).str[0]
    errors["kind"] = body.str.rsplit("/", n=1).str[-1]
    errors = errors[errors["kind"].isin([kind for kind, _ in APPROX_KINDS])]
    per_run = errors.groupby(["experiment", "run", "staleness", "schedule", "kind"])["value"].mean().reset_index()
    data = _seed_stats(per_run, ["kind", "schedule", "staleness"])
    data.insert(2, "label", data["schedule"].map(_schedule_label))
    levels = sorted(data["staleness"].unique())
    fig = Figure(figsize=(11, 4.3), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False).ravel()
    for ax, (kind, y_label) in zip(axes, APPROX_KINDS):
        subset = data[data["kind"] == kind]
        for name in _sorted_labels(subset["label"]):
            curve = subset[subset["label"] == name].sort_values("staleness")
            _band(ax, curve["staleness"], curve["mean"], curve["min"], curve["max"], name, len(curve))
        positive = subset["mean"][subset["mean"] > 0]
        if len(positive) and positive.max() / positive.min() > 30:
            ax.set_yscale("log", nonpositive="mask")
            y_label += " (log scale)"
        if subset.empty:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.set_xticks(levels)
        ax.set_xlabel("staleness d (policy versions)")
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Proximal-policy approximation error against recompute (metrics mode)" + _seed_note(data))
    _legend(fig, _sorted_labels(data["label"]), title="approximation")
    return _save(fig, data, out_dir, stem)


FIGURES: list[Callable[[pd.DataFrame, Path], list[Path]]] = [
    fig1_prox_time,
    fig2_reward_wallclock,
    fig3_entropy,
    fig4_importance_weight,
    fig5_clipped_tokens,
    staleness_panel,
    approx_error,
]


def make_figures(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Every figure that the runs have data for; the paths written."""
    written: list[Path] = []
    for figure in FIGURES:
        written.extend(figure(df, Path(out_dir)))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.figures",
        description="Load runs (sweep dirs, run dirs, a wandb project), write every figure with "
                    "its CSV, and the summary table.")
    parser.add_argument("sweep_dirs", nargs="*", type=Path, help="sweep or run directories (searched recursively)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <first SWEEP_DIR>/figures, or figures-<project>)")
    parser.add_argument("--wandb-project", default=None, help="also load the runs of this wandb project")
    parser.add_argument("--wandb-entity", default=None, help="wandb entity of --wandb-project")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.sweep_dirs and not args.wandb_project:
        parser.error("give at least one SWEEP_DIR or --wandb-project")

    frames = []
    try:
        if args.sweep_dirs:
            frames.append(load_runs(args.sweep_dirs))
        if args.wandb_project:
            frames.append(load_wandb(args.wandb_project, entity=args.wandb_entity))
    except NoRunsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    df = pd.concat(frames, ignore_index=True)

    out_dir = args.out or (args.sweep_dirs[0] / "figures" if args.sweep_dirs else Path(f"figures-{args.wandb_project}"))
    written = make_figures(df, out_dir)
    markdown, summary_paths = write_summary(df, out_dir)
    written.extend(summary_paths)
    print(markdown)
    print("files written:")
    for path in written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
