"""Each run reduced to the scalars that tables, panels and the claims report compare.

One function (`run_scalars`) defines every run-level number once, so the summary table,
the staleness and corrections panels and the claims report can never disagree about what
"training time" or "IW max" means.

Timing. `time/step` is the wall time of a step's training phases (rollout, prox logp,
train, weight sync and the waits) without eval and checkpoint writing; a run's training
time is its sum over steps, which is what two algorithms are compared on. The wall time at
the last step (`wall_time`) also counts eval, checkpoints and start-up, and is reported
beside it, not used for speedups. `time/step_cpu` is the process's CPU time over the same
span; logs from before it existed have no CPU time (`cpu_missing`).

Steady state. In the first D steps of a run (D = its staleness, or the async bound) the
data is fresher than D because there is no older policy yet, so the per-step diagnostics
are averaged over steps >= D only (`steady_steps` counts them; a run shorter than D has
none and its diagnostics are NaN). Final reward is the mean over the last 10% of steps.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.load import add_labels
from analysis.stats import Interval, mean_ci

RUN_KEY = ["experiment", "run"]

# Per-step metrics summarised by their mean over a run's steady-state steps.
STEP_MEANS = {
    "iw_max": "actor/importance_weight/max",
    "iw_min": "actor/importance_weight/min",
    "clipped_tokens": "actor/clipped_tokens",
    "clip_ratio": "actor/clip_ratio",
    "prox_time_s": "time/prox_logp",
    "entropy": "actor/entropy",
}
# Off-policy diagnostics, the same way; columns appear in tables only where logged.
DIAGNOSTIC_MEANS = {
    "ess_token": "offpolicy/ess_token",
    "ess_seq": "offpolicy/ess_seq",
    "chi2_token": "offpolicy/chi2_token",
    "kl_k1": "offpolicy/kl_k1",
    "kl_k3": "offpolicy/kl_k3",
    "masked_low": "correction/masked_low",
    "masked_high": "correction/masked_high",
    "truncated": "correction/truncated",
    "clip_low": "actor/clip_low",
    "clip_high": "actor/clip_high",
}
ALL_MEANS = {**STEP_MEANS, **DIAGNOSTIC_MEANS}

# wall x threads / CPU above this means the process ran on less than 1 / 1.25 = 0.8 of the cores
# its threads could use, on average over its training steps (see `contended`).
CONTENTION_RATIO = 1.25

IDENTITY = ["label", "variant", "algo", "schedule", "correction", "objective", "runtime", "staleness",
            "max_staleness", "seed", "precision", "complete", "label_prefix"]


def final_window(n_steps: int) -> int:
    """Steps averaged for `final_reward` (the rollout reward): the last n_steps // 10, at least
    one. Below 20 steps that is the last step alone, whose batch a policy d versions old sampled
    (S1-S5 ran 16 steps: their "final reward" is one mid-training batch of 32 samples). Kept as
    it was so the committed S1-S5 reports regenerate unchanged; the final policy's reward is
    `final_eval_reward` and, from S6 on, `last_evals_reward`."""
    return max(1, n_steps // 10)


LAST_EVALS = 2  # evals averaged for `last_evals_reward` (S6's primary reward)


def plateau_check(evals, bound: float) -> tuple[Interval, bool]:
    """The registered plateau check (S6, S7): each run's gain between its last two evals (`evals`
    holds one list per run; runs with fewer than two are left out), the mean gain's 95% interval
    over runs, and whether its upper end is below `bound` (the curve has flattened)."""
    gains = [e[-1] - e[-2] for e in evals if isinstance(e, list) and len(e) >= 2]
    interval = mean_ci(gains)
    return interval, bool(interval.known and interval.high < bound)


def contended(wall_s: float, cpu_s: float, ratio: float = CONTENTION_RATIO, threads: float = 1.0) -> bool:
    """Whether a run's timings are suspect because it shared the machine.

    Rule: wall x threads / CPU > 1.25 over the same training steps, i.e. the process got less
    than 0.8 of the cores its `threads` torch threads could use (`machine/threads`; runs logged
    before that key count as one thread). A CPU-bound trainer keeps its threads busy, so a lower
    share means it waited for cores that other jobs held, and its wall time (hence any speedup
    computed from it) is inflated by them. With one thread that is the old rule, wall / CPU >
    1.25; a 2-thread run squeezed onto one core reads 2 x wall / CPU near 2 and is flagged
    (tests/test_contention.py runs one beside a CPU hog). A GPU run legitimately idles its CPU
    while kernels run, so on GPU runs the flag means "check", not "bad". Missing or zero CPU
    time: not flagged (unknown, reported as CPU missing instead).
    """
    if not (np.isfinite(wall_s) and np.isfinite(cpu_s)) or cpu_s <= 0:
        return False
    threads = threads if np.isfinite(threads) and threads >= 1 else 1.0
    return wall_s * threads / cpu_s > ratio


def contention_rule(scalars: pd.DataFrame) -> str:
    """The contention rule as a report states it: wall / CPU for one-thread runs (every run logged
    before `machine/threads` counts as one), wall x threads / CPU where some run used more."""
    if "threads" in scalars and (scalars["threads"] > 1).any():
        return "wall x threads / CPU > 1.25, under 0.8 of the cores its threads could use"
    return "wall/CPU > 1.25, under 0.8 of a core"


def _per_run(df: pd.DataFrame, metric: str, how: str, name: str) -> pd.Series:
    rows = df[df["metric"] == metric]
    if rows.empty:
        return pd.Series(dtype=float, name=name)
    return rows.groupby(RUN_KEY)["value"].agg(how).rename(name)


def _timing(df: pd.DataFrame, identity: pd.DataFrame) -> pd.DataFrame:
    """Training time (sum of time/step; the wall time at the last step where a run never
    logged time/step), CPU time, wall time at the last step, and the contention flag."""
    last_step = df.groupby(RUN_KEY)["step"].max().rename("last_step")
    n_steps = df.groupby(RUN_KEY)["step"].nunique().rename("n_steps")
    at_last = df.merge(last_step.reset_index(), on=RUN_KEY)
    wall = at_last[at_last["step"] == at_last["last_step"]].groupby(RUN_KEY)["wall_time"].max().rename("wall_time_s")
    out = identity[[]].join([last_step, n_steps, wall, _per_run(df, "time/step", "sum", "train_time_s"),
                             _per_run(df, "time/step_cpu", "sum", "cpu_time_s"),
                             _per_run(df, "time/eval", "sum", "eval_time_s"),
                             _per_run(df, "time/checkpoint", "sum", "checkpoint_time_s")])
    out["time_basis"] = np.where(out["train_time_s"].notna(), "time/step", "wall_time")
    out["train_time_s"] = out["train_time_s"].fillna(out["wall_time_s"])
    out["cpu_missing"] = out["cpu_time_s"].isna()
    out["wall_cpu_ratio"] = [t / c if np.isfinite(c) and c > 0 else math.nan
                             for t, c in zip(out["train_time_s"], out["cpu_time_s"])]
    # runs logged before `machine/threads` existed count as one thread (the rule they were judged by)
    out["threads"] = _per_run(df, "machine/threads", "max", "threads").reindex(out.index).fillna(1.0)
    out["contended"] = [contended(t, c, threads=n) for t, c, n in
                        zip(out["train_time_s"], out["cpu_time_s"], out["threads"])]
    # runtime=async with rollout and training on one CUDA device: their phase times overlap
    shared = _per_run(df, "runtime/shared_device", "max", "shared_device").reindex(out.index)
    out["shared_device"] = shared.fillna(0).astype(bool)
    return out


def _steady_means(steady: pd.DataFrame, index: pd.Index) -> pd.DataFrame:
    rows = steady[steady["metric"].isin(ALL_MEANS.values())]
    means = rows.groupby(RUN_KEY + ["metric"])["value"].mean()
    means = means.unstack("metric") if len(means) else pd.DataFrame(index=index)
    means = means.reindex(index=index, columns=list(ALL_MEANS.values()))
    means.columns = list(ALL_MEANS)
    return means


def _rewards(df: pd.DataFrame) -> list[pd.Series]:
    def tail_mean(values: pd.Series) -> float:
        return float(values.iloc[-final_window(len(values)):].mean())

    reward = df[df["metric"] == "reward/mean"].sort_values("step")
    evals = df[df["metric"] == "eval/reward"].sort_values("step")
    return [reward.groupby(RUN_KEY)["value"].agg(tail_mean).rename("final_reward"),
            evals.groupby(RUN_KEY)["value"].last().rename("final_eval_reward"),
            evals.groupby(RUN_KEY)["value"].agg(lambda v: float(v.iloc[-LAST_EVALS:].mean())).rename("last_evals_reward")]


def run_scalars(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run (keyed by experiment and run): identity, completeness, timing,
    rewards, the staleness actually reached and the steady-state means of `ALL_MEANS`.

    `staleness_reached_mean` / `_max`: the mean of `staleness/mean` and the max of
    `staleness/max` over steady-state steps; for a lagged run they equal D, for an async
    run they say how stale its data actually was under the bound D.
    """
    df = add_labels(df)
    identity = df.groupby(RUN_KEY, sort=True)[[c for c in IDENTITY if c in df.columns]].first()
    steady = df[df["step"] >= df["max_staleness"]] if "max_staleness" in df.columns else df
    steady_steps = steady.groupby(RUN_KEY)["step"].nunique().rename("steady_steps")
    out = identity.join(_timing(df, identity)).join([steady_steps, *_rewards(df),
                                                     _per_run(steady, "staleness/mean", "mean", "staleness_reached_mean"),
                                                     _per_run(steady, "staleness/max", "max", "staleness_reached_max")])
    out["steady_steps"] = out["steady_steps"].fillna(0).astype(int)
    out = out.join(_steady_means(steady, identity.index))
    return out.reset_index()


def context_of(frame: pd.DataFrame) -> pd.Series:
    """What must match for two labels to be compared as "algorithm A vs recompute": the
    experiment prefix of a disambiguated label, correction, objective, runtime and precision (the
    schedule is left out: recompute has none)."""
    return (frame["label_prefix"] + "|" + frame["correction"] + "|" + frame["objective"] + "|" + frame["runtime"]
            + "|" + frame["precision"].astype(str))
