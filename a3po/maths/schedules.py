"""Alpha schedules: the weight A-3PO gives the current policy in its proximal anchor.

Each schedule maps staleness d >= 1 (a float32 tensor) to the TARGET weight alpha; the
behaviour weight is w_b(d) = 1 - alpha. d == 0 and prompt tokens never reach a schedule: they
get alpha = 0 (the behaviour policy itself) in `target_weight`. Each function's first comment
gives its w_b (docs/maths.md, "Alpha schedules"). A schedule whose spec has
`uses_position=True` also takes `position` = k/m, the minibatch being trained (k of m, from 0)
as a fraction of the step. A new schedule is its function and its `Spec` in `SCHEDULES`
below, plus `conf/schedule/<name>.yaml`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from dataclasses import dataclass

from a3po.maths.spec import Bound, Param, Registry, Spec

__all__ = ["SCHEDULES", "ScheduleSpec", "schedule_of", "target_weight", "validate_schedule"]


def inverse(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1/d (alpha = (d-1)/d; the A-3PO default).
    # Written as (d - 1) / d rather than 1 - 1/d: the same float32 rounding as AReaL's
    # (v_prox - v_behave) / (v_theta - v_behave), whose operands equal d - 1 and d exactly.
    return (staleness - 1.0) / staleness


def inverse_sqrt(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1/sqrt(d)
    return 1.0 - torch.rsqrt(staleness)


def exponential(staleness: torch.Tensor, gamma: float) -> torch.Tensor:
    # w_b = gamma^(d-1)
    return 1.0 - torch.pow(torch.as_tensor(gamma, dtype=staleness.dtype), staleness - 1.0)


def linear_decay(staleness: torch.Tensor, horizon: float) -> torch.Tensor:
    # w_b = max(0, 1 - (d-1)/horizon)
    return 1.0 - torch.clamp(1.0 - (staleness - 1.0) / horizon, min=0.0)


def constant(staleness: torch.Tensor, c: float) -> torch.Tensor:
    # w_b = c
    return torch.full_like(staleness, 1.0 - c)


def behave(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1: anchor on the behaviour policy.
    return torch.zeros_like(staleness)


def target(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 0: anchor on the detached current policy.
    return torch.ones_like(staleness)


def step_start(staleness: torch.Tensor, position: float) -> torch.Tensor:
    # w_b = (k/m) / (d + k/m): the weights at the start of the step (recompute's anchor) under
    # log-probs that drift linearly with versions, a minibatch update being 1/m of a version
    # (docs/maths.md, "The step-start schedule"). k = 0: alpha = 1, the current policy, which
    # is the step-start policy exactly.
    return staleness / (staleness + position)


def rational(staleness: torch.Tensor, position: float, gamma: float, c: float, b: float) -> torch.Tensor:
    # w_b = (c + b k/m) / (d^gamma + c + b k/m): the family `python -m analysis.anchor.fit_schedule`
    # fits to the logged errors. gamma = 1, c = 0, b = 1 is step_start; gamma = 1, c = 1, b = 0
    # is w_b = 1/(d + 1).
    power = torch.pow(staleness, gamma)
    return power / (power + (c + b * position))


@dataclass(frozen=True)
class ScheduleSpec(Spec):
    """An alpha schedule; `uses_position`: its function also takes `position` = k/m."""

    uses_position: bool = False


SCHEDULES = Registry("schedule", (
    ScheduleSpec("inverse", inverse, "w_b = 1/d: AReaL's anchor one version behind the current policy"),
    ScheduleSpec("inverse_sqrt", inverse_sqrt, "w_b = 1/sqrt(d)"),
    ScheduleSpec("exponential", exponential, "w_b = gamma^(d-1)",
                 {"gamma": Param(0.5, lambda v: 0.0 < v <= 1.0, "in (0, 1]")}),
    ScheduleSpec("linear_decay", linear_decay, "w_b = max(0, 1 - (d-1)/horizon)",
                 {"horizon": Param(8.0, lambda v: v >= 1.0, ">= 1")}),
    ScheduleSpec("constant", constant, "w_b = c",
                 {"c": Param(0.5, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")}),
    ScheduleSpec("behave", behave, "w_b = 1: the behaviour policy"),
    ScheduleSpec("target", target, "w_b = 0: the detached current policy"),
    ScheduleSpec("step_start", step_start, "the step-start weights under linear drift: alpha = d / (d + k/m)",
                 uses_position=True),
    ScheduleSpec("rational", rational, "w_b = (c + b k/m) / (d^gamma + c + b k/m): fitted by analysis.anchor.fit_schedule",
                 {"gamma": Param(1.0, lambda v: 0.0 < v <= 8.0, "in (0, 8]"),
                  "c": Param(0.0, lambda v: 0.0 <= v <= 1e3, "in [0, 1000]"),
                  "b": Param(1.0, lambda v: 0.0 <= v <= 1e3, "in [0, 1000]")},
                 uses_position=True),
))


def schedule_of(label: str, params: Mapping[str, object] | None) -> str:
    """The schedule function a logged schedule uses: its params' `name` where given (a label
    such as `fitted` for `{name: rational, gamma: ...}`), else the label itself."""
    return str((params or {}).get("name") or label)


def validate_schedule(schedule: str, schedule_params: Mapping[str, float] | None, where: str = "schedule"
                      ) -> dict[str, float]:
    """Check a schedule name and its parameters (a whole `cfg.schedule` will do); return every
    parameter it takes, defaults filled in. ValueError naming the key otherwise."""
    return SCHEDULES.lookup(schedule, where).check(schedule_params, where)


def target_weight(
    versions: torch.Tensor, current_version: int, schedule: str | Bound = "inverse", position: float = 0.0,
    **schedule_params
) -> torch.Tensor:
    """Per-token alpha (float32): 0 for prompt/padding (version < 0) and fresh tokens (d <= 0).
    `schedule`: bound at start (a3po.maths.spec.Bound, the trainer's: its parameters are not
    checked again), or a name with `schedule_params`, checked here. `position` = k/m in [0, 1):
    the minibatch being trained, for a schedule that uses it."""
    bound = schedule if isinstance(schedule, Bound) else Bound(SCHEDULES.lookup(schedule, "schedule"),
                                                               validate_schedule(schedule, schedule_params))
    if not 0.0 <= position < 1.0:
        raise ValueError(f"position={position!r} is not allowed; it is k/m, the minibatch index over the count, in [0, 1)")
    extra = {"position": float(position)} if bound.spec.uses_position else {}
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, got dtype {versions.dtype}")
    staleness = float(current_version) - versions.float()
    interpolate = (staleness > 0) & (versions >= 0)
    # Fill the non-interpolated entries with 1 before calling the schedule so that no
    # division by zero (and no NaN gradient or warning) ever happens, then mask them to 0.
    safe = torch.where(interpolate, staleness, torch.ones_like(staleness))
    alpha = torch.where(interpolate, bound(safe, **extra), 0.0)
    return torch.clamp(alpha, 0.0, 1.0)
