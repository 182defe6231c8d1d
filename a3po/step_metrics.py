"""The trainer's per-step metrics: every name and how it combines across micro-batches and
minibatches, in one table, so the names logged and the reductions applied cannot drift
apart. Values stay on the device as 0-dim tensors until `result()`, which reads them all in
one host transfer (one sync per step on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# How each value combines over the step's micro-batches (or minibatches):
#   max / min    extreme over micro-batches
#   token_mean   mean weighted by each micro-batch's valid tokens (a token mean over the step)
#   sum          total over the step
#   mb_mean      plain mean over the step's minibatches (one value each)
REDUCTIONS: dict[str, str] = {
    "actor/importance_weight/max": "max",
    "actor/importance_weight/min": "min",
    "actor/importance_weight/mean": "token_mean",
    "actor/behave_weight/max": "max",
    "actor/behave_weight/min": "min",
    "actor/behave_weight/mean": "token_mean",
    "actor/behave_weight/capped_tokens": "sum",
    "actor/clipped_tokens": "sum",
    "actor/clip_low": "token_mean",
    "actor/clip_high": "token_mean",
    "actor/approx_kl": "token_mean",
    "actor/entropy": "token_mean",
    "actor/valid_tokens": "sum",
    "actor/grad_norm": "mb_mean",
    "actor/loss": "mb_mean",
}
# Families of names that share a reduction: every schedule's approximation error, the
# corrections' dropped/truncated fractions, the off-policy diagnostics (a3po.diagnostics).
PREFIX_REDUCTIONS = {"prox_error/": "token_mean", "correction/": "token_mean", "offpolicy/": "token_mean"}


def reduction_of(name: str) -> str:
    if name in REDUCTIONS:
        return REDUCTIONS[name]
    for prefix, reduction in PREFIX_REDUCTIONS.items():
        if name.startswith(prefix):
            return reduction
    raise KeyError(f"metric {name!r} has no reduction; add it to a3po.step_metrics.REDUCTIONS")


class StepMetrics:
    """Collects one step's values; `result()` reduces them by `REDUCTIONS`."""

    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor]] = {}
        self._tokens: dict[str, list[torch.Tensor]] = {}

    def add(self, values: Mapping[str, torch.Tensor], n_tokens: int | torch.Tensor = 1) -> None:
        """Values of one micro-batch (with its valid-token count) or one minibatch."""
        for name, value in values.items():
            reduction_of(name)  # an unknown name fails here, at its first step
            self._values.setdefault(name, []).append(value.detach().float().reshape(()))
            self._tokens.setdefault(name, []).append(torch.as_tensor(n_tokens, dtype=torch.float32,
                                                                      device=value.device).reshape(()))

    def _reduce(self, name: str) -> torch.Tensor:
        values = torch.stack(self._values[name])
        reduction = reduction_of(name)
        if reduction == "max":
            return values.max()
        if reduction == "min":
            return values.min()
        if reduction == "sum":
            return values.sum()
        if reduction == "mb_mean":
            return values.mean()
        weights = torch.stack(self._tokens[name])
        return (values * weights).sum() / weights.sum().clamp(min=1)

    def result(self) -> dict[str, float]:
        """Every collected name reduced, plus `actor/clip_ratio` (clipped / valid tokens)."""
        out = {name: self._reduce(name) for name in self._values}
        if "actor/clipped_tokens" in out and "actor/valid_tokens" in out:
            out["actor/clip_ratio"] = out["actor/clipped_tokens"] / out["actor/valid_tokens"].clamp(min=1)
        if not out:
            return {}
        values = torch.stack([value.to(next(iter(out.values())).device) for value in out.values()]).tolist()
        return dict(zip(out.keys(), values))
