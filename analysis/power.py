"""Power analysis for paired seed comparisons (scipy.stats): the minimum detectable effect at
the seeds a sweep has, the seeds needed to detect a given effect, and the same for the
two one-sided tests (TOST) of an equivalence band. Used by docs/study.md's pre-registration.

Every comparison in the claims report pairs loglinear with recompute by seed, so the unit is
the per-seed difference: mean `effect`, standard deviation `sd`, `n` seeds, a two-sided
paired t-test at level `alpha`. Power comes from the noncentral t distribution.

    python -m analysis.power --effect 0.037 --sd 0.0087 --seeds 3
"""

from __future__ import annotations

import argparse
import math

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
    n = 2
    while paired_power(effect, sd, n, alpha) < power:
        n = n + 1 if n < 64 else int(n * 1.05) + 1
        if n > MAX_SEEDS:
            return None
    return n


def minimum_detectable_effect(sd: float, n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest |effect| a paired test of n seeds detects with `power` (bisection on power)."""
    if n < 2:
        return math.inf
    low, high = 0.0, sd
    while paired_power(high, sd, n, alpha) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if paired_power(middle, sd, n, alpha) < power else (low, middle)
    return high


def tost_power(effect: float, sd: float, n: int, margin: float, alpha: float = ALPHA) -> float:
    """P(the two one-sided tests at `alpha` conclude |difference| < margin), by the standard
    lower bound P(T1 rejects) + P(T2 rejects) - 1 with noncentral t statistics."""
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
    n = 2
    while tost_power(effect, sd, n, margin, alpha) < power:
        n = n + 1 if n < 64 else int(n * 1.05) + 1
        if n > MAX_SEEDS:
            return None
    return n


def tost(differences: list[float], margin: float, alpha: float = ALPHA) -> dict[str, float]:
    """The two one-sided paired t-tests of H0: |mean difference| >= margin; equivalent when
    both p-values are below alpha (the 90% interval inside the band, for alpha 0.05)."""
    n = len(differences)
    if n < 2:
        raise ValueError("TOST needs at least 2 paired seeds")
    lower = stats.ttest_1samp(differences, -margin, alternative="greater").pvalue
    upper = stats.ttest_1samp(differences, margin, alternative="less").pvalue
    return {"p_lower": float(lower), "p_upper": float(upper), "p": float(max(lower, upper)),
            "equivalent": bool(max(lower, upper) < alpha)}


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
