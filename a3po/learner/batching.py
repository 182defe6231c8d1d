"""How a step's samples become minibatches (one optimizer update each) and token-budget
micro-batches (one forward + backward each)."""

from __future__ import annotations

from typing import Mapping

import torch

from a3po.errors import ConfigError

__all__ = ["split_minibatches", "pack_micro_batches"]


def split_minibatches(n_items: int, n_minibatches: int, generator: torch.Generator) -> list[list[int]]:
    """A seeded shuffle cut into n_minibatches near-equal parts: each sample is used once a step."""
    order = torch.randperm(n_items, generator=generator).tolist()
    return [part.tolist() for part in torch.tensor(order).tensor_split(n_minibatches) if part.numel()]


def pack_micro_batches(lengths: Mapping[int, int], token_budget: int) -> list[list[int]]:
    """Group sample indices so each padded micro-batch (count x longest) fits the budget.

    Longest first, so a micro-batch's samples have similar lengths and padding stays small.
    """
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    micro_batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if lengths[index] > token_budget:
            raise ConfigError(
                f"train.token_budget={token_budget} is not allowed: a sequence of {lengths[index]} tokens "
                "(prompt + response) does not fit one micro-batch; raise the budget or shorten responses"
            )
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > token_budget:
            micro_batches.append(current)
            current = []
        current.append(index)
    if current:
        micro_batches.append(current)
    return micro_batches
