"""`algo=hybrid`'s drift probe: the token ESS of pi_theta / pi_behave at the step's start,
measured on one micro-batch, which a3po.maths.proximal.recomputes_at compares with `min_ess`
(the strategy: a3po.learner.anchors.Hybrid). Logged as `hybrid/drift_ess` when measured, beside
`hybrid/recomputed` every step; the probe's forward is timed as `prox_logp`, a cost of the method."""

from __future__ import annotations

from collections.abc import Callable

import torch

from a3po.batch import Sample
from a3po.distributed import all_reduce_min
from a3po.maths.diagnostics import LOG_RATIO_BOUND, ess

__all__ = ["drift_ess"]


@torch.no_grad()
def drift_ess(response_logp: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], micro: list[Sample]) -> torch.Tensor:
    """The token ESS of pi_theta / pi_behave on `micro` (the step's first micro-batch, before any
    update), from `response_logp` (the trainer's forward); the least over ranks, so every rank
    takes the same decision."""
    logp, _ = response_logp(micro, with_entropy=False)
    behave = torch.cat([s.behave_logp for s in micro]).to(logp.device)
    log_w = (logp.float() - behave).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return all_reduce_min(ess(torch.exp(log_w), torch.ones_like(log_w, dtype=torch.bool)))
