"""GRPO's group-normalised advantages. A pure tensor function."""

from __future__ import annotations

import torch

__all__ = ["grpo_advantages"]


def grpo_advantages(rewards: torch.Tensor, *, norm_std: bool = True, unbiased: bool = True,
                    eps: float = 1e-5) -> torch.Tensor:
    """Group-normalised rewards. rewards: [n_groups, group_size] -> same shape.

    (r - group mean), divided by (group std + eps) when norm_std. The defaults are AReaL's
    group normalisation (`Normalization`: `std_unbiased=True`,
    `eps=1e-5`): the unbiased (n - 1) std. `unbiased=False` gives the population (n) std that
    some other GRPO implementations use; for a group of 4 the two differ by sqrt(4/3). A group
    whose rewards are all equal carries no preference: its advantage is exactly 0, never NaN,
    even where the float mean is off by an ulp.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or Inf; every reward must be finite")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed; it must be > 0")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if norm_std:
        # A group of one has no unbiased std (0/0); its advantage is 0 below anyway.
        std = rewards.std(dim=1, unbiased=unbiased and rewards.shape[1] > 1, keepdim=True)
        centred = centred / (std + eps)
    all_equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centred), centred)
