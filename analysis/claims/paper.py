"""The A-3PO paper's claims as data: the run scalar each is about, how its effect is formed
and shown, the paper's value and, where the paper gives one, its effect size on the scale the
effect is tested on. Judged by `analysis.claims.rule`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from analysis.claims.beside import Samples
from analysis.markdown import fmt_interval
from analysis.stats import Interval


@dataclass(frozen=True)
class Claim:
    """One claim: the run scalar it is about, how the effect is formed ("log_ratio",
    "difference" or "relative"), the claimed sign of the effect (+1 / -1; 0 for the
    equivalence band `margin`), how the effect is shown, the paper's value, and the paper's
    effect on the effect's scale (None where the paper gives none)."""

    key: str
    title: str
    column: str
    effect: str
    sign: int
    shown_as: str
    paper: str
    margin: float = 0.0
    paper_effect: float | None = None


CLAIMS = [
    Claim("a", "prox-logp time: recompute / loglinear (steps >= d)", "prox_time_s", "log_ratio", +1, "ratio",
          "~8,500x (~10 s vs 0.0012 s per step)", paper_effect=math.log(8500)),
    Claim("b", "training time: loglinear less than recompute (sum of time/step)", "train_time_s", "log_ratio", +1,
          "reduction", "18-27% less (2.72 h vs 3.46 h)", paper_effect=math.log(3.46 / 2.72)),
    Claim("b'", "training CPU time: loglinear less than recompute (sum of time/step_cpu)", "cpu_time_s",
          "log_ratio", +1, "reduction", "not reported"),
    Claim("c", "final reward: loglinear within 2% of recompute", "final_reward", "relative", 0, "percent",
          "within 2% (0.937 vs 0.954: -1.8%)", margin=0.02, paper_effect=(0.937 - 0.954) / 0.954),
    Claim("d", "entropy: higher for loglinear (steps >= d)", "entropy", "difference", +1, "difference",
          "0.084 vs 0.070", paper_effect=0.084 - 0.070),
    Claim("e", "IW max: lower for loglinear (steps >= d)", "iw_max", "difference", -1, "difference",
          "2.20 vs 3.69", paper_effect=2.20 - 3.69),
    Claim("f", "IW min: higher for loglinear (steps >= d)", "iw_min", "difference", +1, "difference",
          "0.35 vs 0.26", paper_effect=0.35 - 0.26),
    # a count scales with the tokens per step: the paper's difference is no effect size here
    Claim("g", "clipped tokens: fewer for loglinear (count per step, steps >= d)", "clipped_tokens", "difference", -1,
          "difference", "31.6 vs 194.5 (a count: compare by direction only)"),
    Claim("g'", "clip ratio: lower for loglinear (steps >= d)", "clip_ratio", "difference", -1, "difference",
          "not reported (count only)"),
]


def on_effect_scale(claim: Claim, ours: Mapping[int, float], base: Mapping[int, float]) -> tuple[Samples | None, str]:
    """Both sides' values on a scale where the effect is ours - base: -log(value) for ratios
    (so the effect is log(recompute / loglinear)), value / |recompute's seed mean| for the
    relative reward, the value itself otherwise; or (None, why not)."""
    if claim.effect == "log_ratio":
        if any(v <= 0 for v in [*ours.values(), *base.values()]):
            return None, "a time <= 0"
        return Samples({s: -math.log(v) for s, v in ours.items()}, {s: -math.log(v) for s, v in base.items()}), ""
    if claim.effect == "relative":
        scale = abs(float(np.mean(list(base.values()))))
        if scale == 0:
            return None, "recompute's reward is 0"
        return Samples({s: v / scale for s, v in ours.items()}, {s: v / scale for s, v in base.items()}), ""
    return Samples(dict(ours), dict(base)), ""


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
