"""Power analysis for paired seed comparisons (scipy.stats): the minimum detectable effect at
the seeds a sweep has, the seeds needed to detect a given effect, and the same for the
two one-sided tests (TOST) of an equivalence band. Used by docs/studies/claims.md's pre-registration
and by the claims report (analysis.claims.rule, analysis.claims.beside).

Every comparison in the claims report pairs loglinear with recompute by seed, so the unit is
the per-seed difference: mean `effect`, standard deviation `sd`, `n` seeds, a two-sided
paired t-test at level `alpha`. Power comes from the noncentral t distribution.

    python -m analysis.power --effect 0.037 --sd 0.0087 --seeds 3
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
from scipy import stats

ALPHA, POWER = 0.05, 0.8
MAX_SEEDS = 10_000


def sd_from_interval(low: float, high: float, n: int, confidence: float = 0.95) -> float:
    """The per-seed standard deviation behind a paired Student-t interval [low, high] of n seeds."""
    if n < 2:
        raise ValueError(f"n={n}: an interval needs at least 2 seeds")
    half = (high - low) / 2
    return half * math.sqrt(n) / stats.t.ppf((1 + confidence) / 2, n - 1)


def paired_power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """P(a two-sided paired t-test at `alpha` rejects 0) when the true mean difference is `effect`."""
    if n < 2:
        return 0.0
    df, noncentrality = n - 1, abs(effect) * math.sqrt(n) / sd
    critical = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.cdf(-critical, df, noncentrality))


def seeds_needed(effect: float, sd: float, power: float = POWER, alpha: float = ALPHA) -> int | None:
    """The fewest seeds (>= 2) whose paired test detects `effect` with `power`; None past MAX_SEEDS."""
    if effect == 0 or sd <= 0:
        return None if effect == 0 else 2
    return fewest_seeds(lambda n: paired_power(effect, sd, n, alpha), power)


def fewest_seeds(power_at: Callable[[int], float], power: float = POWER) -> int | None:
    """The fewest n >= 2 with `power_at(n) >= power`, for a power that grows with n; None past
    MAX_SEEDS. One seed at a time to 64, then steps of 5% to bracket it, then a bisection inside
    the bracket (the steps alone return up to 5% more seeds than needed)."""
    below, n = 1, 2
    while power_at(n) < power:
        below, n = n, (n + 1 if n < 64 else int(n * 1.05) + 1)
        if n > MAX_SEEDS:
            if power_at(MAX_SEEDS) < power:
                return None
            n = MAX_SEEDS
            break
    while n - below > 1:
        middle = (below + n) // 2
        below, n = (below, middle) if power_at(middle) >= power else (middle, n)
    return n


def minimum_detectable_effect(sd: float, n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest |effect| a paired test of n seeds detects with `power` (bisection on power)."""
    if n < 2:
        return math.inf
    if sd <= 0:
        return 0.0
    low, high = 0.0, sd
    while paired_power(high, sd, n, alpha) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if paired_power(middle, sd, n, alpha) < power else (low, middle)
    return high


def tost_power(effect: float, sd: float, n: int, margin: float, alpha: float = ALPHA) -> float:
    """P(the two one-sided tests at `alpha` conclude |difference| < margin), by the standard
    lower bound P(T1 rejects) + P(T2 rejects) - 1 with noncentral t statistics (normal per-seed
    differences): tight where power is high, below the true power where it is low, so the seeds
    it says are needed err high (figures: docs/sweeps.md)."""
    if n < 2 or margin <= 0:
        return 0.0
    df, scale = n - 1, math.sqrt(n) / sd
    critical = stats.t.ppf(1 - alpha, df)
    above_lower = stats.nct.sf(critical, df, (effect + margin) * scale)
    below_upper = stats.nct.cdf(-critical, df, (effect - margin) * scale)
    return max(0.0, float(above_lower + below_upper - 1))


def tost_seeds_needed(effect: float, sd: float, margin: float, power: float = POWER,
                      alpha: float = ALPHA) -> int | None:
    """The fewest seeds whose TOST shows equivalence within +-margin with `power`; None if
    |effect| >= margin (equivalence is false) or past MAX_SEEDS."""
    if abs(effect) >= margin:
        return None
    if sd <= 0:
        return 2
    return fewest_seeds(lambda n: tost_power(effect, sd, n, margin, alpha), power)


def tost_from(mean: float, se: float, df: float, margin: float, alpha: float = ALPHA) -> dict[str, float]:
    """The two one-sided t-tests of H0: |true difference| >= margin for an estimate `mean`
    with standard error `se` on `df` degrees of freedom: p_lower tests H0 difference <= -margin,
    p_upper H0 difference >= +margin; equivalent when both are below alpha, which is the same
    as the (1 - 2 alpha) interval (90% for alpha 0.05) lying strictly inside the band."""
    if se == 0:  # every seed agrees: the estimate is the truth as far as these seeds can tell
        lower, upper = float(mean <= -margin), float(mean >= margin)
    else:
        lower = float(stats.t.sf((mean + margin) / se, df))
        upper = float(stats.t.cdf((mean - margin) / se, df))
    return {"p_lower": lower, "p_upper": upper, "p": max(lower, upper), "equivalent": bool(max(lower, upper) < alpha)}


def tost(differences: list[float], margin: float, alpha: float = ALPHA) -> dict[str, float]:
    """TOST on paired per-seed differences (one-sample t-tests against -margin and +margin)."""
    n = len(differences)
    if n < 2:
        raise ValueError("TOST needs at least 2 paired seeds")
    array = np.asarray(differences, dtype=float)
    return tost_from(float(array.mean()), float(array.std(ddof=1)) / math.sqrt(n), n - 1, margin, alpha)


def tost_welch(treated: list[float], baseline: list[float], margin: float, alpha: float = ALPHA) -> dict[str, float]:
    """TOST on mean(treated) - mean(baseline) for unpaired seeds (Welch's standard error and
    Welch-Satterthwaite degrees of freedom, as analysis.stats.welch_ci)."""
    a, b = np.asarray(treated, dtype=float), np.asarray(baseline, dtype=float)
    if min(len(a), len(b)) < 2:
        raise ValueError("TOST needs at least 2 seeds on each side")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    return tost_from(float(a.mean() - b.mean()), se, df, margin, alpha)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--effect", type=float, required=True, help="mean per-seed difference to detect")
    parser.add_argument("--sd", type=float, required=True, help="per-seed standard deviation of the difference")
    parser.add_argument("--seeds", type=int, default=3, help="seeds the sweep has (for its MDE)")
    parser.add_argument("--margin", type=float, default=None, help="equivalence band +-margin (TOST)")
    args = parser.parse_args(argv)
    print(f"MDE at {args.seeds} seeds: {minimum_detectable_effect(args.sd, args.seeds):.4g}")
    print(f"seeds needed for 80% power: {seeds_needed(args.effect, args.sd)}")
    if args.margin is not None:
        print(f"seeds needed for TOST within +-{args.margin:g} at 80% power: "
              f"{tost_seeds_needed(args.effect, args.sd, args.margin)}")


if __name__ == "__main__":
    main()
