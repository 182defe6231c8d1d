"""`algo=hybrid`: the loglinear approximation on most steps, recompute's forward on the steps
a3po.maths.proximal.recomputes_at picks (every `every`-th, or when the policy has drifted far
from the behaviour policy: the token ESS of pi_theta / pi_behave at the step's start, measured
on one micro-batch, below `min_ess`). Logs `hybrid/recomputed` every step and
`hybrid/drift_ess` when it measured it; the probe's forward is timed as `prox_logp`, a cost of
the method."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from a3po.batch import Sample
from a3po.distributed import all_reduce_min
from a3po.learner.step_metrics import StepMetrics
from a3po.maths.diagnostics import LOG_RATIO_BOUND, ess
from a3po.maths.proximal import recomputes_at

if TYPE_CHECKING:
    from a3po.learner.trainer import Trainer

__all__ = ["step_recomputes", "drift_ess"]


def step_recomputes(trainer: "Trainer", samples: list[Sample], plans, version: int, metrics: StepMetrics) -> bool:
    """Whether this step trains against recompute's anchor: always for recompute, never for the
    approximations and coupled, and for hybrid on the steps recomputes_at picks."""
    if trainer.algo.anchor != "hybrid":
        return trainer.algo.anchor == "recompute"
    params = trainer.algo_params

    def probe() -> float:
        with trainer.timer.phase("prox_logp"):
            value = drift_ess(trainer, samples, plans)
        metrics.add({"hybrid/drift_ess": value})
        return float(value)

    recompute = recomputes_at(version, int(params["every"]), params["min_ess"], probe)
    metrics.add({"hybrid/recomputed": torch.tensor(float(recompute))})
    return recompute


@torch.no_grad()
def drift_ess(trainer: "Trainer", samples: list[Sample], plans) -> torch.Tensor:
    """The token ESS of pi_theta / pi_behave on the step's first micro-batch, before any update;
    the least over ranks, so every rank takes the same decision."""
    micro = [samples[i] for i in next(m for plan in plans for m in plan if m)]
    logp, _ = trainer.response_logp(micro, with_entropy=False)
    behave = torch.cat([s.behave_logp for s in micro]).to(logp.device)
    log_w = (logp.float() - behave).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return all_reduce_min(ess(torch.exp(log_w), torch.ones_like(log_w, dtype=torch.bool)))
