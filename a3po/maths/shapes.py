"""`check_same_shape(**tensors)`: the one shape check of the loss, objective, correction,
proximal and diagnostic functions. Its ValueError names every tensor with its shape."""

from __future__ import annotations

import torch

__all__ = ["check_same_shape"]


def check_same_shape(**tensors: torch.Tensor) -> None:
    """ValueError listing `name: shape` for all of `tensors` unless they share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}; these tensors must all have the same shape")
