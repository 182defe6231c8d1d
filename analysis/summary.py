"""The headline table: per algorithm label and staleness, what the paper's Table/Figs report.

Each run is first reduced to a handful of scalars (`run_scalars`), then seeds are
aggregated (`summary_table`). The staleness panel figure reuses `run_scalars`, so the
figure and the table can never disagree about what "final reward" means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import add_labels, label_sort_key

RUN_KEY = ["experiment", "run"]

# Per-step metrics summarised by their mean over the steps of a run.
STEP_MEANS = {
    "iw_max": "actor/importance_weight/max",
    "iw_min": "actor/importance_weight/min",
    "clipped_tokens": "actor/clipped_tokens",
    "prox_time_s": "time/prox_logp",
    "entropy": "actor/entropy",
}

# A-3PO paper, Qwen2.5-1.5B-Instruct on GSM8K: (quantity, unit, loglinear, recompute).
PAPER_NUMBERS = [
    ("prox logp time per step", "s", "0.0012", "~10"),
    ("training time", "h", "2.72", "3.46"),
    ("final reward", "", "0.937", "0.954"),
    ("importance weight max", "", "2.20", "3.69"),
    ("importance weight min", "", "0.35", "0.26"),
    ("clipped tokens", "count", "31.6", "194.5"),
    ("entropy", "nats", "0.084", "0.070"),
]


def final_window(n_steps: int) -> int:
    """Steps averaged for the final reward: the last 10% (at least one), because the
    per-step reward of a small batch is too noisy for its last value alone to rank
    algorithms."""
    return max(1, n_steps // 10)


def run_scalars(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: identity, completeness and the scalars the table and the
    staleness panel compare.

    Training time is the wall time at the run's last logged step, so an incomplete run
    reports the time it actually trained (its row in the summary counts it as
    incomplete).
    """
    df = add_labels(df) if "label" not in df.columns else df
    identity = (df.groupby(RUN_KEY, sort=True)[["label", "algo", "schedule", "staleness", "seed", "complete"]]
                .first())
    last_step = df.groupby(RUN_KEY)["step"].max().rename("last_step")
    at_last = df.merge(last_step.reset_index(), on=RUN_KEY)
    at_last = at_last[at_last["step"] == at_last["last_step"]]
    train_time = at_last.groupby(RUN_KEY)["wall_time"].max().rename("train_time_s")

    def tail_mean(values: pd.Series) -> float:
        return float(values.iloc[-final_window(len(values)):].mean())

    reward = df[df["metric"] == "reward/mean"].sort_values("step")
    final_reward = reward.groupby(RUN_KEY)["value"].agg(tail_mean).rename("final_reward")
    evals = df[df["metric"] == "eval/reward"].sort_values("step")
    final_eval = evals.groupby(RUN_KEY)["value"].last().rename("final_eval_reward")

    step_means = df[df["metric"].isin(STEP_MEANS.values())].groupby(RUN_KEY + ["metric"])["value"].mean()
    step_means = step_means.unstack("metric") if len(step_means) else pd.DataFrame(index=identity.index)
    step_means = step_means.reindex(columns=list(STEP_MEANS.values()))
    step_means.columns = list(STEP_MEANS)

    out = identity.join([last_step, train_time, final_reward, final_eval]).join(step_means)
    return out.reset_index()


def _ratio(numerator: float, denominator: float) -> float:
    if denominator is None or not np.isfinite(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (algo label, staleness): seed mean ± std of training time, final reward and
    final eval reward, the speedup over recompute at the same staleness (ratio of the
    seed-mean training times), the seed means of the per-step diagnostics, and how many
    seeds there are and how many of them did not finish."""
    scalars = run_scalars(df)
    grouped = scalars.groupby(["label", "staleness"], sort=False)
    table = grouped.agg(
        train_time_s_mean=("train_time_s", "mean"),
        train_time_s_std=("train_time_s", "std"),
        final_reward_mean=("final_reward", "mean"),
        final_reward_std=("final_reward", "std"),
        final_eval_reward_mean=("final_eval_reward", "mean"),
        final_eval_reward_std=("final_eval_reward", "std"),
        iw_max_mean=("iw_max", "mean"),
        iw_min_mean=("iw_min", "mean"),
        clipped_tokens_mean=("clipped_tokens", "mean"),
        prox_time_s_mean=("prox_time_s", "mean"),
        entropy_mean=("entropy", "mean"),
        n_seeds=("seed", "nunique"),
        n_incomplete=("complete", lambda complete: int((~complete.astype(bool)).sum())),
    ).reset_index()
    recompute_time = table[table["label"] == "recompute"].set_index("staleness")["train_time_s_mean"]
    table["speedup_vs_recompute"] = [
        _ratio(recompute_time.get(staleness, math.nan), time)
        for staleness, time in zip(table["staleness"], table["train_time_s_mean"])
    ]
    order = sorted(table.index, key=lambda i: (table.at[i, "staleness"], label_sort_key(table.at[i, "label"])))
    table = table.loc[order].reset_index(drop=True)
    columns = ["label", "staleness", "n_seeds", "n_incomplete", "train_time_s_mean", "train_time_s_std",
               "speedup_vs_recompute", "final_reward_mean", "final_reward_std", "final_eval_reward_mean",
               "final_eval_reward_std", "iw_max_mean", "iw_min_mean", "clipped_tokens_mean",
               "prox_time_s_mean", "entropy_mean"]
    return table[columns]


def fmt(value: float, digits: int = 4) -> str:
    """Significant digits rather than fixed decimals: prox times span 1e-5 s to 10 s."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return f"{value:.{digits}g}"


def fmt_mean_std(mean: float, std: float) -> str:
    if std is None or not np.isfinite(std):
        return fmt(mean)
    return f"{fmt(mean)} ± {fmt(std, 2)}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """A GitHub-flavoured markdown table padded to line up in a terminal, without
    pandas' optional `tabulate` dependency; columns from `numeric_from` on are
    right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [cell.rjust(width) if i >= numeric_from else cell.ljust(width)
                  for i, (cell, width) in enumerate(zip(row, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (width + 1) + ":" if i >= numeric_from else "-" * (width + 2) for i, width in enumerate(widths)]
    return "\n".join([line(cells[0]), "|" + "|".join(rule) + "|"] + [line(row) for row in cells[1:]])


def summary_markdown(table: pd.DataFrame) -> str:
    """This sweep's table, then the paper's numbers for the same quantities, so a reader
    sees at a glance whether the direction of each effect reproduces."""
    headers = ["algo", "d", "seeds", "incomplete", "train time (s)", "speedup vs recompute",
               "final reward", "final eval reward", "IW max", "IW min", "clipped tokens",
               "prox logp time (s)", "entropy"]
    rows = []
    for record in table.itertuples(index=False):
        rows.append([
            record.label, fmt(record.staleness), fmt(record.n_seeds), fmt(record.n_incomplete),
            fmt_mean_std(record.train_time_s_mean, record.train_time_s_std),
            fmt(record.speedup_vs_recompute, 3),
            fmt_mean_std(record.final_reward_mean, record.final_reward_std),
            fmt_mean_std(record.final_eval_reward_mean, record.final_eval_reward_std),
            fmt(record.iw_max_mean), fmt(record.iw_min_mean), fmt(record.clipped_tokens_mean),
            fmt(record.prox_time_s_mean, 3), fmt(record.entropy_mean),
        ])
    paper_rows = [[f"{name} ({unit})" if unit else name, loglinear, recompute]
                  for name, unit, loglinear, recompute in PAPER_NUMBERS]
    paper_rows.append(["speedup vs recompute (from training time)", f"{3.46 / 2.72:.2f}", "1"])
    return "\n".join([
        "## This sweep",
        "",
        markdown_table(headers, rows, numeric_from=1),
        "",
        "Mean ± std over seeds (std left out for a single seed). d: staleness. Final reward: mean "
        "of reward/mean over the last 10% of a run's steps (at least one); final eval reward: the "
        "last eval/reward. IW max/min, clipped tokens, prox logp time, entropy: mean over steps, "
        "then over seeds. Speedup: recompute's mean training time at the same d divided by this "
        "row's. Incomplete runs are included up to their last logged step.",
        "",
        "## A-3PO paper (Qwen2.5-1.5B-Instruct, GSM8K)",
        "",
        markdown_table(["quantity", "loglinear (A-3PO)", "recompute"], paper_rows, numeric_from=1),
        "",
    ])


def write_summary(df: pd.DataFrame, out_dir: str | Path) -> tuple[str, list[Path]]:
    """summary.csv (full precision, for scripts) and summary.md (for people)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = summary_table(df)
    markdown = summary_markdown(table)
    csv_path = out_dir / "summary.csv"
    md_path = out_dir / "summary.md"
    table.to_csv(csv_path, index=False)
    md_path.write_text(markdown, encoding="utf-8")
    return markdown, [csv_path, md_path]
