"""Beside the verdict: power, the reward claim's TOST, and robust statistics, per claim and d.

Beside the verdict. These numbers are shown next to each verdict and never change it (the
verdict is the Student-t rule above; for the reward claim, TOST). Each is on the scale the
effect is tested on (log(recompute / loglinear) for the times, the relative difference for
the reward, loglinear - recompute otherwise), with the MDE and the IQM shown like the effect.
- sd: the standard deviation of the per-seed effect (paired seeds), or sqrt(var_loglinear +
  var_recompute) when the seeds are not paired.
- MDE: the smallest |effect| a two-sided paired t-test at alpha 0.05 detects with 80% power
  at the seeds this cell has, given that sd (analysis.power, scipy's noncentral t).
- Seeds for 80% power: the fewest seeds that paired test needs to detect the observed mean
  effect, and the paper's effect where the paper gives one ("-" where it does not). For the
  reward claim, the seeds TOST needs to show equivalence within ±2% with 80% power if the
  true effect is the observed one, or the paper's (-1.8%); "never" when that effect lies
  outside the band; the seeds it needs if the truth is 0 are in the notes.
- IQM [95% CI]: the interquartile mean of the per-seed effects (Agarwal et al. 2021,
  "Deep RL at the Edge of the Statistical Precipice"; the difference of the two sides' IQMs
  when seeds are not paired), with a percentile bootstrap interval: 10,000 resamples of the
  seeds within each stratum (the seed pairs of the cell, or each side's seeds when
  unpaired), generator seed 0.
- P(loglinear better) [95% CI]: the probability of improvement of the same paper, the
  chance that a loglinear run beats a recompute run in the claimed direction (for the
  reward: a higher reward) over every (loglinear, recompute) pair of runs, ties 1/2; 1
  means every loglinear run is better than every recompute run, 0.5 no difference. Its
  interval resamples each side's seeds on its own (a stratified bootstrap, strata = the
  cells (d, algorithm)).
- Across d: per claim, the IQM of every per-seed effect at every d, and the mean over d of
  P(loglinear better), each with a stratified bootstrap interval resampling seeds within
  each cell, never across d (rliable's aggregate over tasks; an IQM only when every d is
  paired by seed).

With 2 to 10 seeds a bootstrap interval is too narrow (it cannot see beyond the values
drawn); the verdict is the t interval's. Nothing is corrected for multiplicity (the
pre-registration's 7 claims, 9 rows with b' and g', at each d): every verdict is at level
0.05 on its own, so among this many a few can come from noise alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.power import MAX_SEEDS, minimum_detectable_effect, seeds_needed, tost, tost_seeds_needed, tost_welch
from analysis.robust import (iqm, mean_probability_of_improvement, pooled_iqm, probability_of_improvement,
                             stratified_bootstrap)
from analysis.stats import Interval, paired

NO_INTERVAL = Interval(math.nan, math.nan, math.nan, 0)


@dataclass(frozen=True)
class Samples:
    """One cell's run scalars on the effect's scale, by seed: the effect is ours - base."""

    ours: dict[int, float]
    base: dict[int, float]

    @property
    def seeds(self) -> list[int]:
        return paired(self.ours, self.base)

    @property
    def is_paired(self) -> bool:
        return len(self.seeds) >= 2

    def differences(self) -> list[float]:
        return [self.ours[s] - self.base[s] for s in self.seeds]


def effect_sd(samples: Samples) -> tuple[float, int]:
    """(sd of the per-seed effect, seeds): paired when at least two seeds have both sides,
    else sqrt(var_ours + var_base) at the smaller side's seeds; NaN below two seeds."""
    if samples.is_paired:
        differences = samples.differences()
        return float(np.std(differences, ddof=1)), len(differences)
    n = min(len(samples.ours), len(samples.base))
    if n < 2:
        return math.nan, n
    variance = np.var(list(samples.ours.values()), ddof=1) + np.var(list(samples.base.values()), ddof=1)
    return float(math.sqrt(variance)), n


def seeds_text(effect: float | None, sd: float, margin: float = 0.0) -> str:
    """The seeds needed for 80% power as shown: a count, `> 10,000`, `never (outside ±2%)`
    for an equivalence that is false, `-` when there is no effect to detect or no sd."""
    if effect is None or not math.isfinite(sd) or not math.isfinite(effect):
        return "-"
    if margin:
        if abs(effect) >= margin:
            return f"never (outside ±{margin:.0%})"
        needed = tost_seeds_needed(effect, sd, margin)
    elif effect == 0:
        return "- (effect 0)"
    else:
        needed = seeds_needed(effect, sd)
    return f"> {MAX_SEEDS:,}" if needed is None else f"{needed:,}"


def power_columns(effect: float, sd: float, n: int, paper_effect: float | None, margin: float = 0.0) -> dict:
    """sd, MDE at n seeds, and the seeds needed at the observed and the paper's effect."""
    mde = minimum_detectable_effect(sd, n) if n >= 2 and math.isfinite(sd) else math.nan
    record = {"n_seeds": n, "sd": sd, "mde": mde, "seeds_observed": seeds_text(effect, sd, margin),
              "seeds_paper": seeds_text(paper_effect, sd, margin)}
    record["seeds_if_zero"] = seeds_text(0.0, sd, margin) if margin else ""
    return record


def iqm_interval(samples: Samples) -> Interval:
    """IQM of the per-seed effects (the difference of IQMs when unpaired), bootstrap 95% CI."""
    if samples.is_paired:
        return stratified_bootstrap([samples.differences()], iqm)
    return stratified_bootstrap([list(samples.ours.values()), list(samples.base.values())],
                                lambda ours, base: iqm(ours) - iqm(base))


def improvement_interval(samples: Samples, better: int) -> Interval:
    """P(a loglinear run beats a recompute run), `better` = +1 when higher is better on the
    effect's scale, -1 when lower; stratified bootstrap 95% CI (each side on its own)."""
    ours = [better * v for v in samples.ours.values()]
    base = [better * v for v in samples.base.values()]
    return stratified_bootstrap([ours, base], probability_of_improvement)


def tost_of(samples: Samples, margin: float) -> dict | None:
    """TOST of the effect against ±margin (paired when the seeds are, else Welch); None
    below two seeds."""
    if samples.is_paired:
        return tost(samples.differences(), margin)
    if min(len(samples.ours), len(samples.base)) < 2:
        return None
    return tost_welch(list(samples.ours.values()), list(samples.base.values()), margin)


def beside(samples: Samples, effect: float, sign: int, paper_effect: float | None, margin: float = 0.0) -> dict:
    """Every number shown beside one cell's verdict."""
    sd, n = effect_sd(samples)
    record = power_columns(effect, sd, n, paper_effect, margin)
    record["iqm"] = iqm_interval(samples)
    record["improvement"] = improvement_interval(samples, sign or +1)
    record["tost"] = tost_of(samples, margin) if margin else None
    return record


def across_d(cells: list[Samples], better: int) -> tuple[Interval, Interval]:
    """(pooled IQM of the per-seed effects, mean P(loglinear better)) over several d, each
    with a stratified bootstrap 95% CI (seeds resampled within each cell); the IQM is
    NO_INTERVAL unless every cell is paired."""
    if all(cell.is_paired for cell in cells):
        pooled = stratified_bootstrap([cell.differences() for cell in cells], pooled_iqm)
    else:
        pooled = NO_INTERVAL
    strata = []
    for cell in cells:
        strata += [[better * v for v in cell.ours.values()], [better * v for v in cell.base.values()]]
    return pooled, stratified_bootstrap(strata, mean_probability_of_improvement)


def across_d_rows(claims) -> list[dict]:
    """One row per (family of contexts that differ only in d, claim) with samples at two or
    more d: the d levels and `across_d`'s two intervals. `claims` is evaluate_claims' frame."""
    rows = []
    judged = claims[claims["samples"].notna()] if len(claims) else claims
    for (family, key), cells in judged.groupby(["family", "claim"], sort=False):
        if cells["staleness"].nunique() < 2:
            continue
        pooled, improvement = across_d(list(cells["samples"]), int(cells["better"].iloc[0]))
        rows.append({"family": family, "claim": key, "title": cells["title"].iloc[0],
                     "staleness": ", ".join(str(d) for d in cells["staleness"]), "iqm": pooled,
                     "improvement": improvement})
    return rows
