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
- The equivalence claim (c, reward within 2%), by TOST (two one-sided t-tests of the
  relative difference against -2% and +2%, paired when the seeds are, Welch's otherwise):
  "holds" when both one-sided p-values are below 0.05 (the same as the 90% interval lying
  inside [-2%, +2%]); "does not hold" when the 95% interval lies entirely outside the band
  (entirely below -2% or entirely above +2%); "inconclusive (TOST: 90% CI not inside ±2%)"
  otherwise. Its notes give both p-values and the 90% interval.
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

import numpy as np
import pandas as pd

from analysis.claims.beside import NO_INTERVAL, Samples, beside
from analysis.claims.paper import CLAIMS, Claim, on_effect_scale, shown
from analysis.markdown import fmt, fmt_pm
from analysis.outcomes import excluded_of, with_outcomes
from analysis.power import ALPHA
from analysis.runs import DEFAULT_SCHEDULE, LEGACY_VALUES
from analysis.scalars import context_of, contention_rule, run_scalars
from analysis.stats import Interval, difference_ci, mean_ci

__all__ = ["CLAIMS", "Claim", "compare", "evaluate_claims", "judge", "verdict", "equivalence_verdict"]

HOLDS = "holds"
FAILS = "does not hold"
INCONCLUSIVE_SIGN = "inconclusive (CI of the difference includes 0)"
INCONCLUSIVE_BAND = "inconclusive (TOST: 90% CI not inside ±2%)"
INCONCLUSIVE_SEEDS = "inconclusive (fewer than 2 seeds)"
# A wall-clock comparison where one side's runs shared their cores and the other's did not
# measures the machine, not the algorithm: the CPU-time claim (b') is the one to read then.
INCONCLUSIVE_CONTENDED = "inconclusive (wall clock contended unevenly: {detail}; read b')"
ALGOS = ["coupled", "recompute", "loglinear"]
# Runs in another precision are another context (the paper's setup is shown without it).
DEFAULT_PRECISION = LEGACY_VALUES["precision"]
# Metrics are float32 on the trainer's side: two runs whose per-step values differ by one
# float32 ulp (IW max 1.0 vs 1.0000009) show a "difference" with a zero-width interval when
# every seed repeats it. Effects within this fraction of the quantity's size count as 0.
RESOLUTION = 1e-6


def verdict(interval: Interval, sign: int, resolution: float = 0.0) -> str:
    """The verdict of a direction claim's 95% interval; bounds within `resolution` of 0
    count as 0 (see `RESOLUTION`)."""
    if interval.n == 0 or not np.isfinite(interval.mean):
        return "not judged (no value)"
    if not interval.known:
        return INCONCLUSIVE_SEEDS
    low, high = sorted([sign * interval.low, sign * interval.high])
    if low > resolution:
        return HOLDS
    if high < -resolution:
        return FAILS
    return INCONCLUSIVE_SIGN


def equivalence_verdict(tost: Mapping | None, interval: Interval, margin: float) -> str:
    """The reward claim's verdict: TOST against ±margin (`analysis.power.tost`), and the 95%
    interval for "does not hold"."""
    if interval.n == 0 or not np.isfinite(interval.mean):
        return "not judged (no value)"
    if tost is None or not interval.known:
        return INCONCLUSIVE_SEEDS
    if tost["equivalent"]:
        return HOLDS
    if interval.high < -margin or interval.low > margin:
        return FAILS
    return INCONCLUSIVE_BAND


def _by_seed(rows: pd.DataFrame, column: str) -> dict[int, float]:
    if column not in rows.columns:
        return {}
    return {int(s): float(v) for s, v in zip(rows["seed"], rows[column]) if np.isfinite(v)}


def _tost_note(claim: Claim, samples: Samples, tost: Mapping | None) -> str:
    """`TOST ±2%: p = 0.01 (> -2%), 0.3 (< +2%); 90% CI -0.5% [-3%, 2%]` for the reward claim."""
    if tost is None:
        return ""
    ci90, _ = difference_ci(samples.ours, samples.base, 1 - 2 * ALPHA)
    return (f"TOST ±{claim.margin:.0%}: p = {fmt(tost['p_lower'], 2)} (> -{claim.margin:.0%}), "
            f"{fmt(tost['p_upper'], 2)} (< +{claim.margin:.0%}); 90% CI {shown(claim, ci90)}")


def _notes(claim: Claim, rows: pd.DataFrame, how: str, interval: Interval, names: tuple[str, str]) -> list[str]:
    notes = [how] if how else []
    if claim.effect == "relative" and np.isfinite(interval.mean) and abs(interval.mean) > claim.margin:
        notes.append(f"{names[0]} higher" if interval.mean > 0 else f"{names[0]} lower")
    if claim.column in ("train_time_s", "cpu_time_s"):
        flagged = int(rows["contended"].sum())
        if flagged:
            notes.append(f"{flagged} of {len(rows)} runs contended ({contention_rule(rows).split(',')[0]})")
        if claim.column == "train_time_s" and (rows["time_basis"] == "wall_time").any():
            notes.append("some runs lack time/step: wall time used")
    return notes


def _uneven_contention(claim: Claim, rows: pd.DataFrame, names: tuple[str, str]) -> str:
    """For the wall-clock training-time claim: `recompute 3/3, loglinear 0/3 runs` when the
    two sides' shares of contended runs differ, else ''."""
    if claim.column != "train_time_s":
        return ""
    shares = {algo: (int(rows.loc[rows["algo"] == algo, "contended"].sum()), int((rows["algo"] == algo).sum()))
              for algo in names[::-1]}
    if any(n == 0 for _, n in shares.values()):
        return ""
    fractions = {algo: flagged / n for algo, (flagged, n) in shares.items()}
    if len(set(fractions.values())) == 1:
        return ""
    return ", ".join(f"{algo} {flagged}/{n} runs" for algo, (flagged, n) in shares.items())


# What a claim that cannot be judged shows in the columns beside its verdict.
NOTHING_BESIDE = {"n_seeds": 0, "sd": math.nan, "mde": math.nan, "seeds_observed": "-", "seeds_paper": "-",
                  "seeds_if_zero": "", "iqm": NO_INTERVAL, "improvement": NO_INTERVAL, "tost": None, "samples": None}


def _not_judged(record: dict, reason: str) -> dict:
    record.update(effect="n/a", verdict=f"not judged ({reason})", note="", effect_mean=math.nan,
                  effect_low=math.nan, effect_high=math.nan, **NOTHING_BESIDE)
    return record


def judge(claim: Claim, rows: pd.DataFrame) -> dict:
    """One claim in one context: the per-algorithm values, the effect, the verdict, and the
    numbers shown beside it (`analysis.claims.beside.beside`)."""
    values = {algo: rows[rows["algo"] == algo] for algo in ALGOS}
    record = {algo: fmt_pm(mean_ci(list(_by_seed(values[algo], claim.column).values()))) for algo in ALGOS}
    return {**record, **compare(claim, values["loglinear"], values["recompute"], ("loglinear", "recompute"))}


def compare(claim: Claim, ours_rows: pd.DataFrame, base_rows: pd.DataFrame,
            names: tuple[str, str] = ("loglinear", "recompute")) -> dict:
    """One claim between any two arms' runs (`ours_rows` against `base_rows`, paired by seed):
    the effect, the verdict by the rules above, and the numbers shown beside it. `names` name
    the two arms in what is missing. The alpha-schedule, mechanism and corrections reports
    judge their contrasts with it; `judge` is it for loglinear against recompute."""
    record = {"claim": claim.key, "title": claim.title, "paper": claim.paper, "better": claim.sign or +1}
    ours, base = _by_seed(ours_rows, claim.column), _by_seed(base_rows, claim.column)
    if not ours or not base:
        absent = " and ".join(name for name, seeds in zip(names, (ours, base)) if not seeds)
        return _not_judged(record, f"{claim.column} has no value for {absent}: not logged, or no step >= d")
    samples, problem = on_effect_scale(claim, ours, base)
    if samples is None:
        return _not_judged(record, problem)
    interval, how = difference_ci(samples.ours, samples.base)
    extra = beside(samples, interval.mean, claim.sign, claim.paper_effect, claim.margin)
    size = max(abs(np.mean(list(ours.values()))), abs(np.mean(list(base.values())))) \
        if claim.effect == "difference" else 1.0
    if claim.margin:
        judged = equivalence_verdict(extra["tost"], interval, claim.margin)
    else:
        judged = verdict(interval, claim.sign, RESOLUTION * size)
    rows = pd.concat([ours_rows.assign(algo=names[0]), base_rows.assign(algo=names[1])])
    notes = _notes(claim, rows, how, interval, names) + [_tost_note(claim, samples, extra["tost"])] * bool(claim.margin)
    uneven = _uneven_contention(claim, rows, names)
    if uneven:
        judged = INCONCLUSIVE_CONTENDED.format(detail=uneven)
    if interval.mean != 0 and max(abs(interval.low), abs(interval.high)) <= RESOLUTION * size:
        notes.append("within float32 resolution: counted as 0")
    record.update(effect=shown(claim, interval), verdict=judged, note="; ".join(n for n in notes if n),
                  effect_mean=interval.mean, effect_low=interval.low, effect_high=interval.high,
                  samples=samples, **extra)
    return record


def context_title(rows: pd.DataFrame) -> str:
    """`d = 4`, plus whatever else sets this context apart from the paper's setup."""
    return ", ".join([f"d = {rows.iloc[0]['staleness']}", *_setting(rows)])


def family_title(rows: pd.DataFrame) -> str:
    """The context less its d: what the contexts compared across d share."""
    return ", ".join(_setting(rows)) or "the paper's setup"


def _setting(rows: pd.DataFrame) -> list[str]:
    first = rows.iloc[0]
    parts = []
    prefix = first["label_prefix"]
    if prefix:
        parts.append(f"experiment {prefix}")
    if first["runtime"] != "lagged":
        parts.append(f"runtime {first['runtime']}")
    if first["correction"] != "none":
        parts.append(f"correction {first['correction']}")
    if first["objective"] != "ppo":
        parts.append(f"objective {first['objective']}")
    if first["precision"] != DEFAULT_PRECISION:
        parts.append(f"precision {first['precision']}")
    return parts


def _context_order(key: tuple[str, int]) -> tuple:
    """The paper's setup (no correction, ppo, lagged) first, then the rest; by d within."""
    prefix, correction, objective, runtime, precision = key[0].split("|")
    return (prefix, correction != "none", objective != "ppo", runtime != "lagged", precision != DEFAULT_PRECISION,
            key[0], key[1])


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
            records.append({"context": title, "family": family_title(every_run), "staleness": staleness,
                            "n_runs": len(rows), **record, "excluded": excluded})
    columns = ["context", "family", "staleness", "n_runs", "claim", "title", "paper", *ALGOS, "effect", "verdict",
               "note", "effect_mean", "effect_low", "effect_high", "excluded", *NOTHING_BESIDE, "better"]
    return pd.DataFrame(records, columns=columns)
