"""The headline table: per algorithm label and staleness, what the paper's table and
figures report, from the run-level scalars of `analysis.scalars`.

Seeds are aggregated per (label, staleness); the label carries every parameter of a run
(schedule, correction, objective, async), so only runs that differ in nothing but the seed
are averaged. Diverged and collapsed runs (`analysis.outcomes`) are counted per row and left
out of its means.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import add_labels
from analysis.markdown import fmt, fmt_interval, fmt_mean_std, markdown_table
from analysis.outcomes import EXCLUDED_NOTE, excluded_text, with_outcomes
from analysis.runs import label_order
from analysis.scalars import DIAGNOSTIC_MEANS, STEP_MEANS, context_of, run_scalars
from analysis.stats import Interval, mean_ci

GROUP = ["label", "staleness"]

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

CLIPPED_NOTE = ("Clipped tokens are a count per step, so they scale with the tokens per step "
                "(prompts x samples x response length): compare them with the paper's counts by "
                "direction only; the clip ratio (clipped / valid tokens) is the size-free measure.")


def _speedup(rows: pd.DataFrame, baseline: pd.DataFrame, column: str) -> Interval:
    """recompute's training time / this row's: per seed where both have the seed (mean
    and 95% CI of the per-seed ratios), else the ratio of the seed means (no interval)."""
    ours = {s: v for s, v in zip(rows["seed"], rows[column]) if np.isfinite(v) and v > 0}
    theirs = {s: v for s, v in zip(baseline["seed"], baseline[column]) if np.isfinite(v)}
    seeds = [s for s in ours if s in theirs]
    if seeds:
        return mean_ci([theirs[s] / ours[s] for s in seeds])
    if not ours or not theirs:
        return Interval(math.nan, math.nan, math.nan, 0)
    return Interval(float(np.mean(list(theirs.values())) / np.mean(list(ours.values()))), math.nan, math.nan, 1)


def _speedups(scalars: pd.DataFrame) -> pd.DataFrame:
    """Speedup over recompute for every (label, staleness), against the recompute runs of the
    same staleness, correction, objective, runtime (and experiment prefix)."""
    columns = [*GROUP, "speedup_vs_recompute", "speedup_ci_low", "speedup_ci_high", "speedup_cpu_vs_recompute"]
    if scalars.empty:  # every run was left out (diverged or collapsed)
        return pd.DataFrame(columns=columns)
    scalars = scalars.assign(context=context_of(scalars))
    records = []
    for (name, staleness), rows in scalars.groupby(GROUP, sort=False):
        baseline = scalars[(scalars["algo"] == "recompute") & (scalars["staleness"] == staleness)
                           & (scalars["context"] == rows["context"].iloc[0])]
        wall = _speedup(rows, baseline, "train_time_s") if len(baseline) else Interval(math.nan, math.nan, math.nan, 0)
        cpu = _speedup(rows, baseline, "cpu_time_s") if len(baseline) else Interval(math.nan, math.nan, math.nan, 0)
        records.append({"label": name, "staleness": staleness, "speedup_vs_recompute": wall.mean,
                        "speedup_ci_low": wall.low, "speedup_ci_high": wall.high,
                        "speedup_cpu_vs_recompute": cpu.mean})
    return pd.DataFrame(records, columns=columns)


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (label, staleness): seeds and incomplete runs, diverged and collapsed runs (left out
    of every other column, the speedup baselines included), training/CPU/wall time,
    contention, the speedup over recompute (from training-time sums, with its 95% CI over
    paired seeds), the staleness reached, final rewards (mean ± std over seeds), and the seed
    means of the steady-state diagnostics (off-policy ones only where some run logged them)."""
    scalars = with_outcomes(run_scalars(df), df)
    kept = scalars[~scalars["flagged"]]
    outcomes = scalars.groupby(GROUP, sort=False).agg(
        runtime=("runtime", "first"), steady_from_step=("max_staleness", "first"),
        n_diverged=("diverged", "sum"), n_collapsed=("collapsed", "sum")).reset_index()
    grouped = kept.groupby(GROUP, sort=False)
    aggregations = dict(
        n_seeds=("seed", "nunique"), n_incomplete=("complete", lambda c: int((~c.astype(bool)).sum())),
        train_time_s_mean=("train_time_s", "mean"), train_time_s_std=("train_time_s", "std"),
        cpu_time_s_mean=("cpu_time_s", "mean"), wall_time_s_mean=("wall_time_s", "mean"),
        wall_cpu_ratio_mean=("wall_cpu_ratio", "mean"), n_contended=("contended", "sum"),
        n_cpu_missing=("cpu_missing", "sum"), steady_steps_min=("steady_steps", "min"),
        staleness_reached_mean=("staleness_reached_mean", "mean"),
        staleness_reached_max=("staleness_reached_max", "max"),
        final_reward_mean=("final_reward", "mean"), final_reward_std=("final_reward", "std"),
        final_eval_reward_mean=("final_eval_reward", "mean"), final_eval_reward_std=("final_eval_reward", "std"),
    )
    aggregations.update({f"{name}_mean": (name, "mean") for name in STEP_MEANS})
    aggregations.update({f"{name}_mean": (name, "mean") for name in DIAGNOSTIC_MEANS if kept[name].notna().any()})
    if (kept["threads"] > 1).any():  # only where some run used several threads (older summaries unchanged)
        aggregations["threads_max"] = ("threads", "max")
    table = outcomes.merge(grouped.agg(**aggregations).reset_index(), on=GROUP, how="left")
    table = table.merge(_speedups(kept), on=GROUP, how="left")
    for column in ("n_seeds", "n_incomplete", "n_diverged", "n_collapsed", "n_contended", "n_cpu_missing"):
        table[column] = table[column].fillna(0).astype(int)  # 0 where every run of the row was left out
    rank = {name: i for i, name in enumerate(label_order(add_labels(df)))}
    order = sorted(table.index, key=lambda i: (table.at[i, "staleness"], rank[table.at[i, "label"]]))
    table = table.loc[order].reset_index(drop=True)
    front = ["label", "staleness", "runtime", "steady_from_step", "n_seeds", "n_incomplete", "n_diverged",
             "n_collapsed", "train_time_s_mean",
             "train_time_s_std", "cpu_time_s_mean", "wall_time_s_mean", "wall_cpu_ratio_mean", "n_contended",
             "n_cpu_missing", "speedup_vs_recompute", "speedup_ci_low", "speedup_ci_high", "speedup_cpu_vs_recompute"]
    return table[front + [c for c in table.columns if c not in front]]


def _flagged(table: pd.DataFrame) -> bool:
    """Whether any row left a diverged or collapsed run out (older tables have no such column)."""
    return bool({"n_diverged", "n_collapsed"} <= set(table.columns)
                and (table["n_diverged"].sum() + table["n_collapsed"].sum()) > 0)


def _time_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    headers = ["algo", "d", "seeds", "incomplete", "training time (s)", "CPU time (s)", "wall at last step (s)",
               "wall/CPU", "contended", "speedup vs recompute", "staleness reached (mean/max)", "final reward",
               "final eval reward"]
    flagged = _flagged(table)
    if flagged:
        headers.insert(3, "excluded")
    rows = []
    for r in table.itertuples(index=False):
        speedup = Interval(r.speedup_vs_recompute, r.speedup_ci_low, r.speedup_ci_high,
                           2 if np.isfinite(r.speedup_ci_low) else 1)
        cpu = "missing" if r.n_seeds and r.n_cpu_missing == r.n_seeds else fmt(r.cpu_time_s_mean)
        rows.append([r.label, fmt(r.staleness), fmt(r.n_seeds), fmt(r.n_incomplete),
                     fmt_mean_std(r.train_time_s_mean, r.train_time_s_std), cpu, fmt(r.wall_time_s_mean),
                     fmt(r.wall_cpu_ratio_mean, 3), f"{r.n_contended}/{r.n_seeds}",
                     fmt_interval(speedup).replace(" (n=1)", "") if np.isfinite(r.speedup_vs_recompute) else "",
                     f"{fmt(r.staleness_reached_mean, 3)} / {fmt(r.staleness_reached_max, 3)}",
                     fmt_mean_std(r.final_reward_mean, r.final_reward_std),
                     fmt_mean_std(r.final_eval_reward_mean, r.final_eval_reward_std)])
        if flagged:
            rows[-1].insert(3, excluded_text(r.n_diverged, r.n_collapsed))
    return headers, rows


def _steady_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    headers = ["algo", "d", "steady from step", "IW max", "IW min", "clipped tokens", "clip ratio",
               "prox logp time (s)", "entropy"]
    rows = [[r.label, fmt(r.staleness), fmt(r.steady_from_step), fmt(r.iw_max_mean), fmt(r.iw_min_mean),
             fmt(r.clipped_tokens_mean), fmt(r.clip_ratio_mean, 3), fmt(r.prox_time_s_mean, 3),
             fmt(r.entropy_mean)] for r in table.itertuples(index=False)]
    return headers, rows


DIAGNOSTIC_HEADERS = {"ess_token": "ESS token", "ess_seq": "ESS seq", "chi2_token": "chi2 token",
                      "kl_k1": "KL k1", "kl_k3": "KL k3", "masked_low": "masked low", "masked_high": "masked high",
                      "truncated": "truncated", "clip_low": "clip low", "clip_high": "clip high"}


def _diagnostic_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    present = [name for name in DIAGNOSTIC_MEANS if f"{name}_mean" in table.columns]
    headers = ["algo", "d"] + [DIAGNOSTIC_HEADERS[name] for name in present]
    rows = [[r["label"], fmt(r["staleness"])] + [fmt(r[f"{name}_mean"], 3) for name in present]
            for _, r in table.iterrows()]
    return headers, rows if present else []


def paper_markdown() -> str:
    paper_rows = [[f"{name} ({unit})" if unit else name, loglinear, recompute]
                  for name, unit, loglinear, recompute in PAPER_NUMBERS]
    paper_rows.append(["speedup vs recompute (from training time)", f"{3.46 / 2.72:.2f}", "1"])
    return markdown_table(["quantity", "loglinear (A-3PO)", "recompute"], paper_rows, numeric_from=1)


TIME_NOTE = (
    "Mean ± std over seeds (std left out for a single seed). d: staleness (the bound for async runs). "
    "Training time: the sum over steps of time/step, the wall time of the training phases without eval "
    "and checkpoints; CPU time: the same span's process CPU time (\"missing\" for logs without "
    "time/step_cpu); wall at last step: wall_time, which also counts eval, checkpoints and start-up. "
    "wall/CPU > 1.25 means the process got under 0.8 of a core: its times are inflated by other jobs "
    "(contended: flagged runs / runs). Speedup: recompute's training time / this row's, per seed where "
    "both have the seed (mean [95% CI]), at the same d, correction, objective and runtime. Staleness "
    "reached: mean of staleness/mean and max of staleness/max over steady-state steps. Final reward: "
    "mean of reward/mean over the last 10% of a run's steps; final eval reward: the last eval/reward. "
    "Incomplete runs count up to their last logged step.")
THREADS_NOTE = (
    "Runs of several torch threads (machine/threads) are held to wall x threads / CPU > 1.25: under 0.8 "
    "of the cores their threads could use.")
STEADY_NOTE = (
    "Steady state only: every number here is a mean over steps >= D (D = the staleness, or the async "
    "bound), because the first D steps train on fresher data than D; then the mean over seeds. A run "
    "with no step >= D has no value here. " + CLIPPED_NOTE)


def summary_markdown(table: pd.DataFrame) -> str:
    """This sweep's tables (time and reward; steady-state diagnostics; off-policy
    diagnostics where logged), then the paper's numbers for the same quantities."""
    time_note = TIME_NOTE + (" " + THREADS_NOTE if "threads_max" in table else "") + \
        (" " + EXCLUDED_NOTE if _flagged(table) else "")
    parts = ["## This sweep", "", markdown_table(*_time_rows(table)), "", time_note, "",
             "### Steady-state diagnostics (steps >= D)", "", markdown_table(*_steady_rows(table)), "",
             STEADY_NOTE, ""]
    headers, rows = _diagnostic_rows(table)
    if rows:
        parts += ["### Off-policy diagnostics (steps >= D)", "", markdown_table(headers, rows), "",
                  "ESS: effective sample size of the importance weights as a fraction of tokens (sequences); "
                  "masked/truncated: fraction of tokens a correction dropped or capped; clip low/high: "
                  "fraction of tokens clipped at 1 - eps / 1 + eps.", ""]
    parts += ["## A-3PO paper (Qwen2.5-1.5B-Instruct, GSM8K)", "", paper_markdown(), ""]
    return "\n".join(parts)


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
