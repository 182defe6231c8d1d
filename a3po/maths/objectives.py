"""Per-token policy-gradient objectives of the decoupled loss: ppo, gspo, cispo.

Each objective returns, per token, the loss term BEFORE the behaviour weight; a correction
(a3po/maths/corrections.py) supplies that weight, and the loss is

    loss = sum_t keep_t * weight_t * per_token_t / n_valid        (a3po.maths.loss)

The trust-region ratio is r_t = pi_theta(y_t) / pi_prox(y_t) = exp(logp - prox_logp), with
prox_logp and the advantages detached. Every peer cited below applies its objective to
pi_theta / pi_old, pi_old being the policy at the start of the step (verl's and TRL's
old_log_prob, AReaL's proximal_logprobs): our pi_prox, recomputed or approximated (A-3PO).
Nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from a3po.maths.corrections import sequence_mean
from a3po.maths.masked import check_same_shape
from a3po.maths.spec import Param, Registry, Spec

__all__ = ["Objective", "OBJECTIVES", "check_objective", "compute_objective"]
# log r is clamped here before exp: exp(80) = 5.5e34 fits float32, so a ratio never overflows
# to inf, whose backward through a dropped token (grad 0 * inf) would be NaN (prime-rl #2972).
# Below the bound the clamp returns its input bit for bit, gradient included.
MAX_LOG_RATIO = 80.0


@dataclass(frozen=True)
class Objective:
    """per_token: loss term per token (0 on invalid tokens), with gradient; clip_low /
    clip_high: bool, valid tokens where the clipped branch is in force below 1 / above 1;
    ratio: detached ratio the objective clips (per token, or the sequence ratio for gspo)."""

    per_token: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    ratio: torch.Tensor


def _upper(eps_clip: float, eps_clip_higher: float | None) -> float:
    """The upper clip distance: eps_clip_higher, or eps_clip where it is None (symmetric)."""
    return float(eps_clip if eps_clip_higher is None else eps_clip_higher)


def _clipped_surrogate(ratio, advantages, mask, eps_clip, eps_high) -> Objective:
    # The arithmetic of AReaL's `ppo_actor_loss_fn` (tests/oracles.py), operation for operation.
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * clipped_ratio
    clip_mask = (surrogate.detach() < surrogate_clipped.detach()) & mask
    per_token = torch.where(mask, torch.maximum(surrogate, surrogate_clipped), 0.0)
    r = ratio.detach()
    return Objective(per_token, clip_mask & (r < 1.0), clip_mask & (r > 1.0), r)


def ppo(logp, prox_logp, advantages, seq_index, valid, *, eps_clip: float,
        eps_clip_higher: float | None = None) -> Objective:
    """PPO clip: per_token = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), r = exp(logp - prox).

    Exactly AReaL's `ppo_actor_loss_fn` (tests/oracles.py)
    before its behaviour weight: the same clipped-token definition (-A r < -A clip(r)), and
    eps_clip_higher=None meaning symmetric; it differs only where log r > MAX_LOG_RATIO, where
    AReaL's overflows. clip_high is the part of that set with r > 1 (A > 0),
    clip_low the part with r < 1 (A < 0); together they are AReaL's clip_mask.
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, advantages=advantages, seq_index=seq_index, valid=valid)
    eps_high = _upper(eps_clip, eps_clip_higher)
    mask = valid.bool()
    ratio = torch.where(mask, torch.exp(torch.clamp(logp - prox_logp.detach(), max=MAX_LOG_RATIO)), 0.0)
    return _clipped_surrogate(ratio, advantages.detach(), mask, eps_clip, eps_high)


def gspo(logp, prox_logp, advantages, seq_index, valid, *, eps_clip: float,
         eps_clip_higher: float | None = None) -> Objective:
    """GSPO: the PPO clip on the sequence ratio s_i = exp(mean_{t in i, valid} (logp_t - prox_t)).

    Every token of sequence i gets max(-A_t s_i, -A_t clip(s_i, 1 - eps, 1 + eps_high)), so the
    clip is decided per sequence (for GRPO advantages, constant within a sequence; we use the
    per-token A as verl and TRL do, AReaL uses the sequence mean of A: the same for GRPO).
    Gradient: the GSPO-token form of verl `loss_mode=gspo` (compute_policy_loss_gspo,
    docs/maths.md, "Sources"): log s_{i,t} = (logp_t - sg(logp_t)) + sg(log s_i), whose
    value is s_i and whose gradient goes to token t's own log-prob. Averaged over a sequence's
    tokens with equal weights this is the gradient of s_i itself (TRL importance_sampling_level=
    "sequence", AReaL importance_sampling_level="sequence"); unlike it, a per-token behaviour
    weight then scales each token's own gradient. The mean runs over `valid` (AReaL: over the
    tokens its rejection sampling kept; pass `keep` as valid for that). verl also clamps log s
    at 10; we clamp at MAX_LOG_RATIO like ppo, so one-token sequences give exactly ppo. ratio = s_i per token.
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, advantages=advantages, seq_index=seq_index, valid=valid)
    eps_high = _upper(eps_clip, eps_clip_higher)
    mask = valid.bool()
    log_s = sequence_mean((logp - prox_logp).detach(), seq_index, mask)
    # (logp - sg(logp)) first: an exact 0 in value, so the sum is exactly log s_i. Invalid
    # tokens are zeroed first so a padding logp of -inf cannot make -inf - -inf = NaN.
    logp_valid = torch.where(mask, logp, 0.0)
    log_s_token = (logp_valid - logp_valid.detach()) + log_s
    ratio = torch.where(mask, torch.exp(torch.clamp(log_s_token, max=MAX_LOG_RATIO)), 0.0)
    return _clipped_surrogate(ratio, advantages.detach(), mask, eps_clip, eps_high)


def cispo(logp, prox_logp, advantages, seq_index, valid, *, eps_clip: float,
          eps_clip_higher: float | None = None) -> Objective:
    """CISPO (MiniMax-M1): per_token = -sg(clip(r, 1 - eps, 1 + eps_high)) * A * logp.

    The clipped ratio is a detached weight; the gradient -sg(clip(r)) A grad logp reaches every
    token, clipped or not. verl `loss_mode=cispo` (compute_policy_loss_cispo, core_algos.py)
    clips to [1 - clip_ratio_low, 1 + clip_ratio_high] (default 0.2 each); AReaL's
    cispo_loss_fn (PR #1412) uses the same delta-from-1 bounds and recommends eps_clip = 1
    (no lower bound) with eps_clip_higher = 4; TRL `loss_type="cispo"` caps r at epsilon_high
    itself (recommended 5.0 = 1 + 4, no lower bound). So eps_clip may be 1 here (lower bound 0).
    clip_low / clip_high: valid tokens with r outside the band, whatever the sign of A (the
    weight is clipped there; AReaL logs the same; TRL counts r > eps_high with A > 0 only).
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, advantages=advantages, seq_index=seq_index, valid=valid)
    eps_high = _upper(eps_clip, eps_clip_higher)
    mask = valid.bool()
    ratio = torch.where(mask, torch.exp((logp - prox_logp).detach()), 0.0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.where(mask, -clipped * advantages.detach() * logp, 0.0)
    return Objective(per_token, mask & (ratio < 1.0 - eps_clip), mask & (ratio > 1.0 + eps_high), ratio)


def _clip(default: float, closed: bool) -> Param:
    if closed:  # cispo: eps_clip = 1 means no lower bound on the clipped weight
        return Param(default, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    return Param(default, lambda v: 0.0 < v < 1.0, "in (0, 1)")


def _clip_higher(default: float | None) -> Param:
    return Param(default, lambda v: v > 0.0, "> 0", nullable=True, none_means="eps_clip, a symmetric range")


OBJECTIVES = Registry("objective", (
    Spec("ppo", ppo, "PPO clip on r = pi_theta/pi_prox",
         {"eps_clip": _clip(0.2, closed=False), "eps_clip_higher": _clip_higher(None)}),
    Spec("gspo", gspo, "PPO clip on the sequence ratio exp(mean log r)",
         {"eps_clip": _clip(3e-4, closed=False), "eps_clip_higher": _clip_higher(4e-4)}),
    Spec("cispo", cispo, "-sg(clip(r)) A log pi: every token keeps a gradient",
         {"eps_clip": _clip(1.0, closed=True), "eps_clip_higher": _clip_higher(4.0)}),
))


def check_objective(name: str, params: Mapping[str, Any] | None = None) -> dict[str, float | None]:
    """Every parameter objective `name` takes (a whole `cfg.objective` will do), defaults
    filled in, checked; ValueError naming the key otherwise."""
    return OBJECTIVES.lookup(name).check(params, "objective")


def compute_objective(name: str, logp, prox_logp, advantages, seq_index, valid,
                      params: Mapping[str, Any] | None = None) -> Objective:
    """Check (`check_objective`), look up and run objective `name`."""
    checked = check_objective(name, params)
    return OBJECTIVES[name].fn(logp, prox_logp, advantages, seq_index, valid, **checked)
