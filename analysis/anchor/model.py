"""The anchor-distance model of S3 (docs/studies/mechanism.md): how far each proximal anchor sits from
the current policy, and which way that says the clip ratio should differ from recompute's.

The PPO clip acts on |log pi_theta - log pi_prox|, the anchor's distance from the current
policy. On minibatch k of a step (k = 0..m-1) the current policy is k/m versions past the
step's start and d + k/m past the behaviour policy. Recompute's anchor is the step-start
policy; a loglinear anchor with behaviour weight w_b has log pi_theta - log pi_prox =
w_b (log pi_theta - log pi_behave) exactly. With a mean per-token drift of c t^beta over t
versions (the drift exponent, `analysis.anchor.drift`), the mean anchor distance of a step in units
of c is

    recompute:  mean_k (k/m)^beta
    loglinear:  mean_k w_b(d, k/m) (d + k/m)^beta

and the model calls an arm's clip ratio more than recompute's when its distance is over 1.25
times recompute's, less when under 0.8 times, and makes no call in between (`prediction`).
`score` holds the clip verdicts of a study against those calls (H-S3b's rule).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from a3po.maths.schedules import target_weight
from analysis.claims.rule import FAILS, HOLDS

__all__ = ["RECOMPUTE", "BAND", "MORE", "LESS", "NO_CALL", "EQUAL", "CLIP", "behaviour_weight", "clip_reach",
           "anchor_distance", "prediction", "agreement", "score"]

RECOMPUTE = "recompute"
BAND = (0.8, 1.25)
MORE, LESS, NO_CALL, EQUAL = "more", "less", "no call", "equal"
CLIP = "g'"  # the clip-ratio claim (analysis.claims.paper), direction "lower"


def behaviour_weight(schedule: str, d: float, position: float = 0.0, **params) -> float:
    """w_b = 1 - alpha of a loglinear anchor at staleness d and minibatch position k/m: a token of
    version 0 trained at version d."""
    return 1.0 - float(target_weight(torch.tensor([0]), d, schedule, position=float(position), **params)[0])


def clip_reach(w_b: float, eps_clip: float) -> float:
    """The smallest |log pi_theta - log pi_behave| at which an anchor with behaviour weight w_b
    can clip at all: the ratio is exp(w_b (log pi_theta - log pi_behave)), and the nearer bound
    is log(1 + eps); infinite where w_b = 0 (the anchor is the current policy: nothing clips)."""
    return math.log1p(eps_clip) / w_b if w_b > 0 else math.inf


def anchor_distance(arm: str, d: float, m: int, beta: float) -> float:
    """A step's mean anchor distance in units of c under drift c t^beta: recompute's, or a
    loglinear anchor's with the schedule `arm` (any registered schedule, its defaults)."""
    if m < 1 or d <= 0 or beta <= 0:
        raise ValueError(f"anchor_distance needs m >= 1, d > 0 and beta > 0; got m={m}, d={d}, beta={beta}")
    positions = np.arange(m) / m
    if arm == RECOMPUTE:
        return float(np.mean(positions**beta))
    # w_b = 1 - alpha at staleness d: a token of version 0 trained at version d
    w_b = [behaviour_weight(arm, d, p) for p in positions]
    return float(np.mean(np.asarray(w_b) * (d + positions) ** beta))


def prediction(arm_distance: float, recompute_distance: float, band: tuple[float, float] = BAND) -> str:
    """The model's call for the arm's clip ratio against recompute's: more, less, no call
    (ratio of distances inside `band`) or equal (both anchors are the current policy)."""
    if recompute_distance == 0:
        return EQUAL if arm_distance == 0 else MORE
    ratio = arm_distance / recompute_distance
    return MORE if ratio > band[1] else LESS if ratio < band[0] else NO_CALL


def agreement(call: str, verdict: str) -> str:
    """A clip cell against the model: agrees (it holds in the called direction), disagrees
    (it holds in the other), undecided, or no call. The claim's direction is "lower"."""
    if call not in (MORE, LESS):
        return "no call"
    lower = {HOLDS: True, FAILS: False}.get(verdict)
    if lower is None:
        return "undecided"
    return "agrees" if lower == (call == LESS) else "disagrees"


def score(cells: pd.DataFrame, beta: float) -> tuple[str, list[dict]]:
    """H-S3b's verdict over the clip cells under drift exponent `beta`, and each cell's row."""
    rows = []
    for _, cell in cells[cells["claim"] == CLIP].iterrows():
        call = prediction(anchor_distance(cell["arm"], cell["d"], cell["m"], beta),
                          anchor_distance(RECOMPUTE, cell["d"], cell["m"], beta))
        rows.append({"d": cell["d"], "m": cell["m"], "arm": cell["arm"], "call": call,
                     "verdict": cell["verdict"], "agreement": agreement(call, cell["verdict"])})
    outcomes = [row["agreement"] for row in rows if row["agreement"] != "no call"]
    if "disagrees" in outcomes:
        return FAILS, rows
    if outcomes and outcomes.count("agrees") * 2 >= len(outcomes):
        return HOLDS, rows
    return "inconclusive", rows
