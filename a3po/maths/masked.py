"""Masked reductions and the one shape check of the loss, objective, correction, proximal and
diagnostic functions. No host sync: reductions are 0-dim tensors."""

from __future__ import annotations

import math

import torch

__all__ = ["check_same_shape", "masked_mean", "masked_max", "masked_min"]


def check_same_shape(**tensors: torch.Tensor) -> None:
    """ValueError listing `name: shape` for all of `tensors` unless they share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}; these tensors must all have the same shape")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over masked entries; 0 when the mask is empty (so logs never see -inf)."""
    mask = mask.bool()
    result = torch.where(mask, values, -math.inf).amax()
    return torch.where(mask.any(), result, torch.zeros_like(result))


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    result = torch.where(mask, values, math.inf).amin()
    return torch.where(mask.any(), result, torch.zeros_like(result))
