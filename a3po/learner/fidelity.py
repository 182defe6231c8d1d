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
    (a3po.maths.proximal, a3po.maths.loss), and the drift `drift/logp_abs/k<k>`, which
    against d + k/m versions gives the drift exponent (analysis.drift)."""
    behave, valid, seq = tokens["behave"], tokens["mask"], tokens["seq_index"]

    def decisions(anchor: torch.Tensor) -> dict[str, torch.Tensor]:
        return token_decisions(logp, anchor, behave, tokens["advantages"], seq, valid,
                               objective=objective, correction=correction)

    errors = approximation_errors(reference, behave, logp.detach(), tokens["versions"], version, valid, schedules,
                                  position=minibatch / n_minibatches, decisions=decisions)
    return {**errors, f"drift/logp_abs/k{minibatch}": masked_mean((logp.detach() - behave).abs(), valid)}
