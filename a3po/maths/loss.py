"""The decoupled policy loss the trainer optimises: an objective (a3po.maths.objectives) times
a correction of the behaviour weight (a3po.maths.corrections), averaged over valid tokens.

    w_t    = pi_prox(y_t) / pi_behave(y_t)                     behaviour weight
    loss   = sum_t keep_t * weight_t * per_token_t / n_valid    (`policy_loss`)

With objective `ppo` and correction `none` this is decoupled PPO (Hilton et al. 2022) as
AReaL's `ppo_actor_loss_fn` computes it, bit for bit (tests/oracles.py holds that shape and
tests/test_objectives.py the equality). Nothing here syncs with the host: the metrics come
back as 0-dim tensors under the names of docs/design.md.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from a3po.maths.corrections import CORRECTIONS, Correction
from a3po.maths.diagnostics import offpolicy_metrics
from a3po.maths.masked import check_same_shape, masked_max, masked_mean, masked_min
from a3po.maths.objectives import MAX_LOG_RATIO, OBJECTIVES, Objective
from a3po.maths.spec import Bound

__all__ = ["decoupled_loss", "policy_loss", "token_decisions"]


def policy_loss(objective: Objective, correction: Correction, valid: torch.Tensor) -> torch.Tensor:
    """sum_t [keep_t] weight_t * per_token_t / max(1, n_valid), 0-dim.

    `torch.where` on keep, not a product with it, so a dropped token whose per_token is inf
    (r overflowed) adds exactly 0, never 0 * inf = NaN. Dropped tokens stay in the
    denominator (a3po.maths.corrections, "Denominator").
    """
    n_valid = valid.bool().sum().clamp(min=1)
    return torch.where(correction.keep, objective.per_token * correction.weight, 0.0).sum() / n_valid


def decoupled_loss(logp: torch.Tensor, prox: torch.Tensor, behave: torch.Tensor, advantages: torch.Tensor,
                   seq_index: torch.Tensor, valid: torch.Tensor, *, objective: Bound | Mapping[str, Any],
                   correction: Bound | Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss and its metrics. `objective` and `correction`: bound at start
    (a3po.maths.spec.Bound, the trainer's: never checked here), or config groups (`name` and
    parameters), checked and bound on the call; `prox` is an anchor, detached here whatever the caller passes.
    Tensors of different shapes are a ValueError naming each one's shape (no broadcasting)."""
    check_same_shape(logp=logp, prox=prox, behave=behave, advantages=advantages, seq_index=seq_index, valid=valid)
    prox = prox.detach()
    kept = CORRECTIONS.bind(correction)(prox - behave, seq_index, valid)  # a Bound as it is: no check
    clipped = OBJECTIVES.bind(objective)(logp, prox, advantages, seq_index, valid)
    ratio = torch.exp((logp.detach() - prox).clamp(max=MAX_LOG_RATIO))  # pi_theta / pi_prox per token
    behave_weight = torch.exp((prox - behave).clamp(max=MAX_LOG_RATIO))  # before the correction
    n_valid = valid.sum()
    stats = {
        "actor/importance_weight/max": masked_max(ratio, valid),
        "actor/importance_weight/min": masked_min(ratio, valid),
        "actor/importance_weight/mean": masked_mean(ratio, valid),
        "actor/behave_weight/max": masked_max(behave_weight, valid),
        "actor/behave_weight/min": masked_min(behave_weight, valid),
        "actor/behave_weight/mean": masked_mean(behave_weight, valid),
        "actor/behave_weight/capped_tokens": (valid & ~kept.keep).sum(),
        "actor/clipped_tokens": (clipped.clip_low | clipped.clip_high).sum(),
        "actor/clip_low": clipped.clip_low.sum() / n_valid.clamp(min=1),
        "actor/clip_high": clipped.clip_high.sum() / n_valid.clamp(min=1),
        "actor/approx_kl": masked_mean(logp.detach() - prox, valid),
        "actor/valid_tokens": n_valid,
        "correction/masked_low": kept.masked_low,
        "correction/masked_high": kept.masked_high,
        "correction/truncated": kept.truncated,
        **offpolicy_metrics(behave, prox, logp, seq_index, valid),
    }
    return policy_loss(clipped, kept, valid), stats


def token_decisions(logp: torch.Tensor, prox: torch.Tensor, behave: torch.Tensor, advantages: torch.Tensor,
                    seq_index: torch.Tensor, valid: torch.Tensor, *, objective: Bound | Mapping[str, Any],
                    correction: Bound | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """What the loss decides per token given the anchor `prox`: `clip`, the objective's clip is
    in force (below or above 1); `keep`, the correction keeps the token. Comparing them under
    two anchors gives the decision flip rate (a3po.maths.proximal.approximation_errors).
    Tensors of different shapes are a ValueError naming each one's shape (no broadcasting)."""
    check_same_shape(logp=logp, prox=prox, behave=behave, advantages=advantages, seq_index=seq_index, valid=valid)
    prox = prox.detach()
    kept = CORRECTIONS.bind(correction)(prox - behave, seq_index, valid)
    clipped = OBJECTIVES.bind(objective)(logp.detach(), prox, advantages, seq_index, valid)
    return {"clip": clipped.clip_low | clipped.clip_high, "keep": kept.keep}

