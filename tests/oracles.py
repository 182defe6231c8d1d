"""Reference implementations the library is tested against, written as their authors write
them (not used by the library itself)."""

from __future__ import annotations

import torch

from a3po.maths.masked import check_same_shape, masked_max, masked_mean, masked_min


def _check_clip_and_cap(eps_clip, eps_clip_higher, behave_weight_cap) -> float:
    """ValueError naming the argument for a bad clip range or cap; returns the upper clip."""
    if not eps_clip > 0:
        raise ValueError(f"eps_clip={eps_clip!r} is not allowed; it must be > 0")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if not eps_high > 0:
        raise ValueError(f"eps_clip_higher={eps_clip_higher!r} is not allowed; it must be > 0 (or None)")
    if behave_weight_cap is not None and not behave_weight_cap > 0:
        raise ValueError(f"behave_weight_cap={behave_weight_cap!r} is not allowed; it must be > 0 (or None)")
    return eps_high


def ppo_actor_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behave_logp: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, *, eps_clip: float, eps_clip_higher: float | None = None,
                   behave_weight_cap: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2022) as in AReaL's `ppo_actor_loss_fn`.

    r = exp(logp - prox_logp) is clipped to [1 - eps_clip, 1 + eps_clip_higher]; the
    surrogate max(-A r, -A clip(r)) is multiplied by the detached behaviour weight
    w = exp(prox_logp - behave_logp); tokens with w > behave_weight_cap get weight 0 but stay
    in the denominator (the count of all valid tokens). Coupled PPO is prox_logp = behave_logp.
    prox_logp is an anchor: it is detached here whatever the caller passes.

    The reference of the default loss, written as AReaL writes it: the trainer composes the
    same loss from `objective=ppo` x `correction=none` (a3po.maths.objectives, a3po.maths.corrections),
    and tests/test_objectives.py holds the two equal bit for bit, gradient included.
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, behave_logp=behave_logp, advantages=advantages, loss_mask=loss_mask)
    eps_high = _check_clip_and_cap(eps_clip, eps_clip_higher, behave_weight_cap)
    mask = loss_mask.bool()
    prox_logp = prox_logp.detach()
    behave_logp = behave_logp.detach()
    advantages = advantages.detach()
    n_valid = mask.sum().clamp(min=1)

    ratio = torch.where(mask, torch.exp(logp - prox_logp), 0.0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * clipped_ratio
    clip_mask = (surrogate.detach() < surrogate_clipped.detach()) & mask
    pg_loss = torch.maximum(surrogate, surrogate_clipped)

    behave_weight_raw = torch.exp(prox_logp - behave_logp)
    behave_mask = mask if behave_weight_cap is None else mask & (behave_weight_raw <= behave_weight_cap)
    behave_weight = torch.where(behave_mask, behave_weight_raw, 0.0)
    pg_loss = pg_loss * behave_weight
    loss = torch.where(mask, pg_loss, 0.0).sum() / n_valid

    importance_weight = ratio.detach()
    log_ratio = (logp.detach() - prox_logp)
    n_clipped = clip_mask.sum()
    stats = {
        # per token
        "importance_weight": importance_weight,
        "behave_weight": behave_weight,
        "clip_mask": clip_mask,
        "approx_kl": torch.where(mask, log_ratio, 0.0),
        # reductions (0-dim tensors; the logged names of docs/design.md without the `actor/` prefix)
        "importance_weight/max": masked_max(importance_weight, mask),
        "importance_weight/min": masked_min(importance_weight, mask),
        "importance_weight/mean": masked_mean(importance_weight, mask),
        # The raw weight, before the cap: the figure is about how far the data drifted.
        "behave_weight/max": masked_max(behave_weight_raw, mask),
        "behave_weight/min": masked_min(behave_weight_raw, mask),
        "behave_weight/mean": masked_mean(behave_weight_raw, mask),
        "behave_weight/capped_tokens": (mask & ~behave_mask).sum(),
        "clipped_tokens": n_clipped,
        "clip_ratio": n_clipped / n_valid,
        "approx_kl/mean": masked_mean(log_ratio, mask),
        "valid_tokens": mask.sum(),
    }
    return loss, stats
