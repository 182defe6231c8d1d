"""The A-3PO paper's claims, each judged against a sweep with an explicit rule.

A claim compares loglinear (A-3PO) with recompute in one context: the same staleness d,
correction, objective and runtime (and experiment, when sweeps are mixed), both with the
paper's default schedule. Each run is first reduced to its run-level scalar
(`analysis.scalars.run_scalars`: steady-state means over steps >= d, the training-time
sum, the final reward), then:

Effect and its interval. Over seeds, with a two-sided 95% Student-t interval:
- paired by seed when at least two seeds have both a loglinear and a recompute run (the
  interval of the per-seed effects); otherwise Welch's unpaired interval of the difference
  of the means (`analysis.stats.difference_ci`);
- ratios (prox-logp time, training time) are effects on the log scale, log(recompute /
  loglinear), mapped back to a ratio or a reduction (1 - loglinear / recompute) for
  display; differences (entropy, IW max and min, clipped tokens, clip ratio) are
  loglinear - recompute; the final reward's effect is the relative difference
  (loglinear - recompute) / |mean recompute reward over seeds| (the denominator is the
  seed mean, not each seed's value, so one seed with a reward near 0 cannot blow it up).

Verdict.
- The wall-clock training-time claim (b) is "inconclusive (wall clock contended unevenly)"
  when the share of contended runs (wall/CPU > 1.25) differs between recompute and
  loglinear: their wall times then measure when each ran, not the algorithm; the CPU-time
  claim (b') is judged as usual.
- Direction claims (a, b, d, e, f, g: "lower", "higher", "less"): "holds" when the whole
  interval lies on the claimed side of 0, "does not hold" when the whole interval lies on
  the other side, "inconclusive (CI of the difference includes 0)" otherwise.
- The equivalence claim (c, reward within 2%): "holds" when the interval of the relative
  difference lies inside [-2%, +2%], "does not hold" when it lies entirely outside
  (entirely below -2% or entirely above +2%), "inconclusive (CI crosses ±2%)" otherwise.
- Effects within float32 resolution (1e-6 of the quantity's size; 1e-6 on the log scale
  for ratios) count as 0, so rounding noise repeated by every seed is not an effect.
- With fewer than two seeds on either side there is no interval: "inconclusive (fewer than
  2 seeds)". A metric with no value on either side (not logged, or a run with no step
  >= d): "not judged (...)" naming what is missing.
- Diverged and collapsed runs (`analysis.outcomes`) are left out of every value and
  interval; each context says how many it left out, and a side whose every run was left
  out is "not judged (every ... run diverged or collapsed)".

The rule judges the direction (or the 2% band) only; the size of an effect is shown
beside the paper's value and left to the reader, because it depends on the model, the
hardware and the batch size (prox-logp time scales with the model, clipped-token counts
with the tokens per step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.identity import DEFAULT_SCHEDULE
from analysis.markdown import fmt_interval, fmt_pm
from analysis.outcomes import excluded_of, with_outcomes
from analysis.scalars import context_of, run_scalars
from analysis.stats import Interval, difference_ci, mean_ci

HOLDS = "holds"
FAILS = "does not hold"
INCONCLUSIVE_SIGN = "inconclusive (CI of the difference includes 0)"
INCONCLUSIVE_BAND = "inconclusive (CI crosses ±2%)"
INCONCLUSIVE_SEEDS = "inconclusive (fewer than 2 seeds)"
# A wall-clock comparison where one side's runs shared their cores and the other's did not
# measures the machine, not the algorithm: the CPU-time claim (b') is the one to read then.
INCONCLUSIVE_CONTENDED = "inconclusive (wall clock contended unevenly: {detail}; read b')"
ALGOS = ["coupled", "recompute", "loglinear"]
# Metrics are float32 on the trainer's side: two runs whose per-step values differ by one
# float32 ulp (IW max 1.0 vs 1.0000009) show a "difference" with a zero-width interval when
# every seed repeats it. Effects within this fraction of the quantity's size count as 0.
RESOLUTION = 1e-6


@dataclass(frozen=True)
class Claim:
    """One claim: the run scalar it is about, how the effect is formed ("log_ratio",
    "difference" or "relative"), the claimed sign of the effect (+1 / -1; 0 for the
    equivalence band `margin`), how the effect is shown, and the paper's value."""

    key: str
    title: str
    column: str
    effect: str
    sign: int
    shown_as: str
    paper: str
    margin: float = 0.0


CLAIMS = [
    Claim("a", "prox-logp time: recompute / loglinear (steps >= d)", "prox_time_s", "log_ratio", +1, "ratio",
          "~8,500x (~10 s vs 0.0012 s per step)"),
    Claim("b", "training time: loglinear less than recompute (sum of time/step)", "train_time_s", "log_ratio", +1,
          "reduction", "18-27% less (2.72 h vs 3.46 h)"),
    Claim("b'", "training CPU time: loglinear less than recompute (sum of time/step_cpu)", "cpu_time_s",
          "log_ratio", +1, "reduction", "not reported"),
    Claim("c", "final reward: loglinear within 2% of recompute", "final_reward", "relative", 0, "percent",
          "within 2% (0.937 vs 0.954: -1.8%)", margin=0.02),
    Claim("d", "entropy: higher for loglinear (steps >= d)", "entropy", "difference", +1, "difference",
          "0.084 vs 0.070"),
    Claim("e", "IW max: lower for loglinear (steps >= d)", "iw_max", "difference", -1, "difference",
          "2.20 vs 3.69"),
    Claim("f", "IW min: higher for loglinear (steps >= d)", "iw_min", "difference", +1, "difference",
          "0.35 vs 0.26"),
    Claim("g", "clipped tokens: fewer for loglinear (count per step, steps >= d)", "clipped_tokens", "difference", -1,
          "difference", "31.6 vs 194.5 (a count: compare by direction only)"),
    Claim("g'", "clip ratio: lower for loglinear (steps >= d)", "clip_ratio", "difference", -1, "difference",
          "not reported (count only)"),
]


def verdict(interval: Interval, sign: int, margin: float = 0.0, resolution: float = 0.0) -> str:
    """The verdict of an effect's interval under the module's rule; for direction claims,
    bounds within `resolution` of 0 count as 0 (see `RESOLUTION`)."""
    if interval.n == 0 or not np.isfinite(interval.mean):
        return "not judged (no value)"
    if not interval.known:
        return INCONCLUSIVE_SEEDS
    if sign == 0:
        if -margin <= interval.low and interval.high <= margin:
            return HOLDS
        if interval.high < -margin or interval.low > margin:
            return FAILS
        return INCONCLUSIVE_BAND
    low, high = sorted([sign * interval.low, sign * interval.high])
    if low > resolution:
        return HOLDS
    if high < -resolution:
        return FAILS
    return INCONCLUSIVE_SIGN


def _by_seed(rows: pd.DataFrame, column: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in zip(rows["seed"], rows[column]) if np.isfinite(v)}


def effect_interval(claim: Claim, ours: Mapping[int, float], base: Mapping[int, float]) -> tuple[Interval, str, str]:
    """(interval of the effect, how it was formed, a reason it could not be formed or "")."""
    if claim.effect == "log_ratio":
        if any(v <= 0 for v in [*ours.values(), *base.values()]):
            return Interval(math.nan, math.nan, math.nan, 0), "", "a time <= 0"
        interval, how = difference_ci({s: math.log(v) for s, v in base.items()},
                                      {s: math.log(v) for s, v in ours.items()})
        return interval, how, ""
    interval, how = difference_ci(ours, base)
    if claim.effect == "relative":
        scale = abs(float(np.mean(list(base.values()))))
        if scale == 0:
            return Interval(math.nan, math.nan, math.nan, 0), how, "recompute's reward is 0"
        interval = interval.scaled(1.0 / scale)
    return interval, how, ""


def shown(claim: Claim, interval: Interval) -> str:
    """The effect as a reader wants it: a ratio (x), a reduction (%) or a difference."""
    if claim.shown_as == "ratio":
        return fmt_interval(interval.mapped(math.exp), suffix="x")
    if claim.shown_as == "reduction":
        reduction = interval.mapped(lambda x: 1.0 - math.exp(-x))
        return fmt_interval(reduction, percent=True) + " less"
    if claim.shown_as == "percent":
        return fmt_interval(interval, percent=True)
    return fmt_interval(interval)


def _notes(claim: Claim, rows: pd.DataFrame, how: str, interval: Interval) -> str:
    notes = [how] if how else []
    if claim.effect == "relative" and np.isfinite(interval.mean) and abs(interval.mean) > claim.margin:
        notes.append("loglinear higher" if interval.mean > 0 else "loglinear lower")
    if claim.column in ("train_time_s", "cpu_time_s"):
        flagged = int(rows["contended"].sum())
        if flagged:
            notes.append(f"{flagged} of {len(rows)} runs contended (wall/CPU > 1.25)")
        if claim.column == "train_time_s" and (rows["time_basis"] == "wall_time").any():
            notes.append("some runs lack time/step: wall time used")
    return "; ".join(notes)


def _uneven_contention(claim: Claim, rows: pd.DataFrame) -> str:
    """For the wall-clock training-time claim: `recompute 3/3, loglinear 0/3 runs` when the
    two sides' shares of contended runs differ, else ''."""
    if claim.column != "train_time_s":
        return ""
    shares = {algo: (int(rows.loc[rows["algo"] == algo, "contended"].sum()), int((rows["algo"] == algo).sum()))
              for algo in ("recompute", "loglinear")}
    if shares["recompute"][1] == 0 or shares["loglinear"][1] == 0:
        return ""
    fractions = {algo: flagged / n for algo, (flagged, n) in shares.items()}
    if fractions["recompute"] == fractions["loglinear"]:
        return ""
    return ", ".join(f"{algo} {flagged}/{n} runs" for algo, (flagged, n) in shares.items())


def judge(claim: Claim, rows: pd.DataFrame) -> dict:
    """One claim in one context: the per-algorithm values, the effect and the verdict."""
    values = {algo: _by_seed(rows[rows["algo"] == algo], claim.column) for algo in ALGOS}
    record = {"claim": claim.key, "title": claim.title, "paper": claim.paper,
              **{algo: fmt_pm(mean_ci(list(values[algo].values()))) for algo in ALGOS}}
    ours, base = values["loglinear"], values["recompute"]
    if not ours or not base:
        absent = [algo for algo, seeds in (("loglinear", ours), ("recompute", base)) if not seeds]
        record.update(effect="n/a", verdict=f"not judged ({claim.column} has no value for {' and '.join(absent)}: "
                                            "not logged, or no step >= d)",
                      note="", effect_mean=math.nan, effect_low=math.nan, effect_high=math.nan)
        return record
    interval, how, problem = effect_interval(claim, ours, base)
    size = max(abs(np.mean(list(ours.values()))), abs(np.mean(list(base.values())))) \
        if claim.effect == "difference" else 1.0
    judged = f"not judged ({problem})" if problem else verdict(interval, claim.sign, claim.margin, RESOLUTION * size)
    note = _notes(claim, rows, how, interval)
    uneven = _uneven_contention(claim, rows)
    if uneven and not problem:
        judged = INCONCLUSIVE_CONTENDED.format(detail=uneven)
    if not problem and interval.mean != 0 and max(abs(interval.low), abs(interval.high)) <= RESOLUTION * size:
        note += "; within float32 resolution: counted as 0"
    record.update(effect=shown(claim, interval) if not problem else "n/a", verdict=judged, note=note,
                  effect_mean=interval.mean, effect_low=interval.low, effect_high=interval.high)
    return record


def context_title(rows: pd.DataFrame) -> str:
    """`d = 4`, plus whatever else sets this context apart from the paper's setup."""
    first = rows.iloc[0]
    parts = [f"d = {first['staleness']}"]
    prefix = first["label"].rpartition("/")[0]
    if prefix:
        parts.append(f"experiment {prefix}")
    if first["runtime"] != "lagged":
        parts.append(f"runtime {first['runtime']}")
    if first["correction"] != "none":
        parts.append(f"correction {first['correction']}")
    if first["objective"] != "ppo":
        parts.append(f"objective {first['objective']}")
    return ", ".join(parts)


def _context_order(key: tuple[str, int]) -> tuple:
    """The paper's setup (no correction, ppo, lagged) first, then the rest; by d within."""
    prefix, correction, objective, runtime = key[0].split("|")
    return (prefix, correction != "none", objective != "ppo", runtime != "lagged", key[0], key[1])


def evaluate_claims(df: pd.DataFrame, scalars: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every claim in every context that has both loglinear and recompute runs (with the
    default schedule): one row per (context, claim). `effect_mean/low/high` hold the raw
    effect (log ratio, difference or relative difference) for scripts."""
    scalars = run_scalars(df) if scalars is None else scalars
    if "flagged" not in scalars.columns:
        scalars = with_outcomes(scalars, df)
    plain = scalars[scalars["algo"].isin(ALGOS) & scalars["schedule"].isin(["", DEFAULT_SCHEDULE])]
    plain = plain.assign(context=context_of(plain))
    groups = dict(list(plain.groupby(["context", "staleness"], sort=True)))
    records = []
    for key in sorted(groups, key=_context_order):
        every_run = groups[key]
        staleness = key[1]
        if not {"loglinear", "recompute"} <= set(every_run["algo"]):
            continue
        rows = every_run[~every_run["flagged"]]  # diverged and collapsed runs are counted, not averaged
        title, excluded = context_title(every_run), excluded_of(every_run, with_names=True)
        left_out = [algo for algo in ("loglinear", "recompute") if not (rows["algo"] == algo).any()]
        for claim in CLAIMS:
            if claim.column == "cpu_time_s" and every_run["cpu_time_s"].isna().all():
                continue  # old logs: no CPU time, and claim b already covers training time
            record = judge(claim, rows)
            if left_out:
                record["verdict"] = f"not judged (every {' and '.join(left_out)} run diverged or collapsed)"
            records.append({"context": title, "staleness": staleness, "n_runs": len(rows), **record,
                            "excluded": excluded})
    columns = ["context", "staleness", "n_runs", "claim", "title", "paper", *ALGOS, "effect", "verdict", "note",
               "effect_mean", "effect_low", "effect_high", "excluded"]
    return pd.DataFrame(records, columns=columns)
