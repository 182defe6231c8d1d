"""Where a step's proximal log-probs come from: one small strategy per anchor kind of
a3po.maths.proximal's `Method` (`behave`, `recompute`, `approximate`, `hybrid`), built once by
`build_anchor` from the method's spec and its parameters, and given the inputs it needs.

`decide(version, probe)` says whether the step trains against recompute's forward (and what
to log about that); `approximate(...)` gives one micro-batch's anchor when it does not. The
trainer runs the forwards; a strategy never sees the trainer, only its device, on which the
metrics it logs are made (a3po.learner.step_metrics refuses a metric on another device: the
multi-rank reduction concatenates every metric into one tensor for its collective).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from a3po.maths.proximal import Method, approximate_prox_logp, recomputes_at
from a3po.maths.schedules import SCHEDULES
from a3po.maths.spec import Bound

__all__ = ["Anchor", "build_anchor"]

Probe = Callable[[], torch.Tensor]  # the hybrid's drift ESS, measured by the trainer on demand


@dataclass(frozen=True)
class Anchor:
    """`behave`: the behaviour policy's own log-probs (coupled PPO: the behaviour weight is 1)."""

    def decide(self, version: int, probe: Probe) -> tuple[bool, dict[str, torch.Tensor]]:
        """(train against recompute's forward this step?, metrics to log about the decision)."""
        return False, {}

    def may_recompute(self) -> bool:
        """Whether some step may run recompute's no-grad forward (the warm-up compiles it then)."""
        return False

    def approximate(self, behave: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, version: int,
                    position: float) -> torch.Tensor:
        return behave


@dataclass(frozen=True)
class Recompute(Anchor):
    """`recompute`: the no-grad forward of the step-start weights, every step."""

    def decide(self, version: int, probe: Probe) -> tuple[bool, dict[str, torch.Tensor]]:
        return True, {}

    def may_recompute(self) -> bool:
        return True

    def approximate(self, behave, logp, versions, version, position) -> torch.Tensor:
        raise RuntimeError("a recompute step trains against the recomputed log-probs, never an approximation")


@dataclass(frozen=True)
class Interpolation(Anchor):
    """`approximate`: the method's interpolation between behaviour and current log-probs,
    weighted by the alpha schedule; no forward pass."""

    method: str = "loglinear"
    schedule: Bound = field(default_factory=lambda: SCHEDULES.bind({"name": "inverse"}))

    def approximate(self, behave, logp, versions, version, position) -> torch.Tensor:
        """The finite check is the caller's, once per minibatch (no host sync here); the schedule
        was bound at start, so nothing is checked again."""
        return approximate_prox_logp(behave, logp.detach(), versions, version, method=self.method,
                                     schedule=self.schedule, position=position, check_finite=False)


@dataclass(frozen=True)
class Hybrid(Interpolation):
    """`hybrid`: the interpolation on most steps, recompute's forward on the steps
    `recomputes_at` picks (every `every`-th, or when the drift's ESS is below `min_ess`)."""

    every: int = 0
    min_ess: float | None = None
    device: torch.device = torch.device("cpu")  # the trainer's: where `hybrid/recomputed` is made

    def may_recompute(self) -> bool:
        return True

    def decide(self, version: int, probe: Probe) -> tuple[bool, dict[str, torch.Tensor]]:
        logged: dict[str, torch.Tensor] = {}

        def measured() -> float:
            logged["hybrid/drift_ess"] = probe()
            return float(logged["hybrid/drift_ess"])

        recompute = recomputes_at(version, self.every, self.min_ess, measured)
        return recompute, {**logged, "hybrid/recomputed": torch.tensor(float(recompute), device=self.device)}


def _interpolation(method: Method, algo_params: Mapping[str, Any], schedule: Bound,
                   device: torch.device) -> Interpolation:
    return Interpolation(method.name, schedule)


def _hybrid(method: Method, algo_params: Mapping[str, Any], schedule: Bound, device: torch.device) -> Hybrid:
    return Hybrid(method.name, schedule, every=int(algo_params["every"]),
                  min_ess=algo_params["min_ess"], device=device)


BUILDERS: dict[str, Callable[..., Anchor]] = {
    "behave": lambda *_: Anchor(),
    "recompute": lambda *_: Recompute(),
    "approximate": _interpolation,
    "hybrid": _hybrid,
}


def build_anchor(method: Method, algo_params: Mapping[str, Any], schedule: Bound,
                 device: torch.device | str = "cpu") -> Anchor:
    """The strategy for `method`'s anchor kind, with its checked parameters and the schedule
    bound to its own (a3po.maths.spec.Bound, bound once at start); `device`: the trainer's, on
    which the strategy makes the metrics it logs."""
    return BUILDERS[method.anchor](method, algo_params, schedule, torch.device(device))
