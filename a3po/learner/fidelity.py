"""With `train.log_prox_errors=true`: how every logged schedule's anchor compares with the
recomputed one on the tokens being trained, and how far the policy has drifted."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from a3po.maths.loss import token_decisions
from a3po.maths.masked import masked_mean
from a3po.maths.proximal import approximation_errors

__all__ = ["fidelity_metrics"]


def fidelity_metrics(reference: torch.Tensor, logp: torch.Tensor, tokens: Mapping[str, torch.Tensor], version: int,
                     minibatch: int, n_minibatches: int, *, schedules: Mapping[str, Mapping[str, float]],
                     objective: Mapping[str, Any], correction: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One micro-batch of minibatch k of m, against the recomputed anchor `reference`: each
    schedule's errors and the flip rates of the loss's per-token decisions
    (a3po.maths.proximal, a3po.maths.loss), the drift `drift/logp_abs/k<k>`, which against
    d + k/m versions gives the drift exponent (analysis.drift), and the two token means whose
    ratio is the least-squares alpha of a loglinear anchor at this (d, k/m): with
    delta = logp - behave and target = reference - behave, alpha* = mean(delta * target) /
    mean(delta^2) (`alpha_fit/{cross,delta_sq}/k<k>`; the fit a schedule can be made from)."""
    behave, valid, seq = tokens["behave"], tokens["mask"], tokens["seq_index"]

    def decisions(anchor: torch.Tensor) -> dict[str, torch.Tensor]:
        return token_decisions(logp, anchor, behave, tokens["advantages"], seq, valid,
                               objective=objective, correction=correction)

    errors = approximation_errors(reference, behave, logp.detach(), tokens["versions"], version, valid, schedules,
                                  position=minibatch / n_minibatches, decisions=decisions)
    delta, target = logp.detach() - behave, reference.detach() - behave
    return {**errors, f"drift/logp_abs/k{minibatch}": masked_mean(delta.abs(), valid),
            f"alpha_fit/cross/k{minibatch}": masked_mean(delta * target, valid),
            f"alpha_fit/delta_sq/k{minibatch}": masked_mean(delta * delta, valid)}
