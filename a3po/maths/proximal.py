"""The proximal policy of decoupled PPO, approximated without a forward pass (A-3PO).

Decoupled PPO anchors its trust region on a proximal policy pi_prox. Computing its
log-probs exactly ("recompute") costs one extra no-grad forward pass per training step.
A-3PO replaces it, per token, with an interpolation between the behaviour policy that
sampled the token and the (detached) current policy, weighted by how stale the token is:

    d      = current_version - version            (staleness, per token)
    alpha  = target weight, from a schedule;  w_b(d) = 1 - alpha is the behaviour weight
    loglinear:  prox = behave + alpha * (target - behave)
    linear:     prox = log((1 - alpha) * exp(behave) + alpha * exp(target) + 1e-10)

With the default `inverse` schedule alpha = (d - 1) / d, which is AReaL's
`(v_prox - v_behave) / (v_theta - v_behave)` with v_prox = v_theta - 1; the arithmetic
below follows AReaL's order of operations so the results agree bit for bit.

Everything here is a pure tensor function: no model, no config, no global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from a3po.maths.shapes import check_same_shape

__all__ = [
    "SCHEDULES",
    "METHODS",
    "approximate_prox_logp",
    "target_weight",
    "approximation_errors",
    "staleness_stats",
    "validate_schedule",
]

# Added inside the log of the probability-space interpolation, as AReaL does, so a token
# whose interpolated probability underflows gives a large negative log-prob, not -inf.
LINEAR_LOG_EPS = 1e-10


# ---------------------------------------------------------------------------------------
# Alpha schedules. Each maps staleness d >= 1 (a float32 tensor) to the TARGET weight alpha;
# the behaviour weight is 1 - alpha. d == 0 and prompt tokens never reach a schedule: they
# get alpha = 0 (the behaviour policy itself) in `target_weight`. Each function's first
# comment gives its behaviour weight w_b(d) = 1 - alpha(d) (docs/design.md section 1.3).
# ---------------------------------------------------------------------------------------


def _inverse(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1/d (alpha = (d-1)/d; the A-3PO default).
    # Written as (d - 1) / d rather than 1 - 1/d: the same float32 rounding as AReaL's
    # (v_prox - v_behave) / (v_theta - v_behave), whose operands equal d - 1 and d exactly.
    return (staleness - 1.0) / staleness


def _inverse_sqrt(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1/sqrt(d)
    return 1.0 - torch.rsqrt(staleness)


def _exponential(staleness: torch.Tensor, gamma: float) -> torch.Tensor:
    # w_b = gamma^(d-1)
    return 1.0 - torch.pow(torch.as_tensor(gamma, dtype=staleness.dtype), staleness - 1.0)


def _linear_decay(staleness: torch.Tensor, horizon: float) -> torch.Tensor:
    # w_b = max(0, 1 - (d-1)/horizon)
    return 1.0 - torch.clamp(1.0 - (staleness - 1.0) / horizon, min=0.0)


def _constant(staleness: torch.Tensor, c: float) -> torch.Tensor:
    # w_b = c
    return torch.full_like(staleness, 1.0 - c)


def _behave(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 1: anchor on the behaviour policy.
    return torch.zeros_like(staleness)


def _target(staleness: torch.Tensor) -> torch.Tensor:
    # w_b = 0: anchor on the detached current policy.
    return torch.ones_like(staleness)


def _check_gamma(gamma: float) -> None:
    if not (0.0 < gamma <= 1.0):
        raise ValueError(f"schedule 'exponential': gamma={gamma!r} is not allowed; it must be in (0, 1]")


def _check_horizon(horizon: float) -> None:
    if not horizon >= 1:
        raise ValueError(f"schedule 'linear_decay': horizon={horizon!r} is not allowed; it must be >= 1")


def _check_c(c: float) -> None:
    if not (0.0 <= c <= 1.0):
        raise ValueError(f"schedule 'constant': c={c!r} is not allowed; it must be in [0, 1]")


@dataclass(frozen=True)
class Schedule:
    """One alpha schedule: its target-weight function, parameter names and range checks."""

    target_weight: Callable[..., torch.Tensor]
    params: tuple[str, ...] = ()
    checks: Mapping[str, Callable[[float], None]] = field(default_factory=dict)


SCHEDULES: dict[str, Schedule] = {
    "inverse": Schedule(_inverse),
    "inverse_sqrt": Schedule(_inverse_sqrt),
    "exponential": Schedule(_exponential, ("gamma",), {"gamma": _check_gamma}),
    "linear_decay": Schedule(_linear_decay, ("horizon",), {"horizon": _check_horizon}),
    "constant": Schedule(_constant, ("c",), {"c": _check_c}),
    "behave": Schedule(_behave),
    "target": Schedule(_target),
}

METHODS = ("loglinear", "linear")


def validate_schedule(schedule: str, schedule_params: Mapping[str, float]) -> dict[str, float]:
    """Check a schedule name and its parameters; return exactly the parameters it takes.

    Extra keys (e.g. a config's `name`) are ignored so a whole `cfg.schedule` can be passed.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not allowed; allowed schedules: {sorted(SCHEDULES)}"
        )
    spec = SCHEDULES[schedule]
    params: dict[str, float] = {}
    for name in spec.params:
        if name not in schedule_params:
            raise ValueError(f"schedule {schedule!r} needs the parameter {name!r}")
        value = schedule_params[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"schedule {schedule!r}: {name}={value!r} is not a number")
        spec.checks[name](float(value))
        params[name] = float(value)
    return params


def target_weight(
    versions: torch.Tensor, current_version: int, schedule: str = "inverse", **schedule_params
) -> torch.Tensor:
    """Per-token alpha (float32): 0 for prompt/padding (version < 0) and fresh tokens (d <= 0)."""
    params = validate_schedule(schedule, schedule_params)
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, got dtype {versions.dtype}")
    staleness = float(current_version) - versions.float()
    interpolate = (staleness > 0) & (versions >= 0)
    # Fill the non-interpolated entries with 1 before calling the schedule so that no
    # division by zero (and no NaN gradient or warning) ever happens, then mask them to 0.
    safe = torch.where(interpolate, staleness, torch.ones_like(staleness))
    alpha = torch.where(interpolate, SCHEDULES[schedule].target_weight(safe, **params), 0.0)
    return torch.clamp(alpha, 0.0, 1.0)


def _check_finite(name: str, value: torch.Tensor) -> None:
    if not bool(torch.isfinite(value).all()):
        n_bad = int((~torch.isfinite(value)).sum())
        raise ValueError(
            f"{name} has {n_bad} non-finite value(s) (NaN or Inf); all values must be finite. "
            "Check behave_logp/target_logp for -inf (a token the policy gives probability 0)."
        )


def approximate_prox_logp(
    behave_logp: torch.Tensor,
    target_logp: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    *,
    method: str = "loglinear",
    schedule: str = "inverse",
    check_finite: bool = True,
    **schedule_params: float,
) -> torch.Tensor:
    """A-3PO's proximal log-probs: no forward pass, one fused elementwise expression.

    `target_logp` is detached, so no gradient flows through the anchor. Tokens with
    version < 0 (prompt, padding) return `behave_logp` exactly, in both methods (AReaL's
    `linear` would return log(exp(behave) + 1e-10) there; those tokens are never in the loss).
    On generated tokens the result equals AReaL's `compute_prox_logp_approximations`.
    `check_finite` costs one host sync; the trainer keeps it on (once per minibatch).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed; allowed methods: {list(METHODS)}")
    check_same_shape(behave_logp=behave_logp, target_logp=target_logp, versions=versions)
    if not behave_logp.dtype.is_floating_point or not target_logp.dtype.is_floating_point:
        raise ValueError(
            f"behave_logp and target_logp must be floating point, got {behave_logp.dtype} and {target_logp.dtype}"
        )
    alpha = target_weight(versions, current_version, schedule, **schedule_params)
    target_logp = target_logp.detach()
    behave_logp = behave_logp.detach()
    if method == "loglinear":
        prox_logp = behave_logp + alpha * (target_logp - behave_logp)
    else:
        p_mix = (1 - alpha) * torch.exp(behave_logp) + alpha * torch.exp(target_logp)
        prox_logp = torch.where(versions >= 0, torch.log(p_mix + LINEAR_LOG_EPS), behave_logp)
    if check_finite:
        _check_finite("approximate_prox_logp result", prox_logp)
    return prox_logp


def staleness_stats(versions: torch.Tensor, current_version: int, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Token-weighted staleness over generated tokens: `staleness/{mean,max,min}` (0-dim tensors).

    A long response counts as many times as it has tokens, because the loss does too.
    """
    generated = versions >= 0
    if mask is not None:
        check_same_shape(versions=versions, mask=mask)
        generated = generated & mask.bool()
    staleness = (float(current_version) - versions.float())
    count = generated.sum()
    has_any = count > 0
    zero = torch.zeros((), dtype=torch.float32, device=versions.device)
    mean = torch.where(has_any, torch.where(generated, staleness, 0.0).sum() / count.clamp(min=1), zero)
    max_ = torch.where(has_any, torch.where(generated, staleness, -math.inf).amax(), zero)
    min_ = torch.where(has_any, torch.where(generated, staleness, math.inf).amin(), zero)
    return {"staleness/mean": mean, "staleness/max": max_, "staleness/min": min_}


def approximation_errors(
    prox_logp_true: torch.Tensor,
    behave_logp: torch.Tensor,
    target_logp: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    loss_mask: torch.Tensor,
    schedules: Mapping[str, Mapping[str, float]],
    methods: tuple[str, ...] = METHODS,
) -> dict[str, torch.Tensor]:
    """`metrics` mode: how far is each approximation from the recomputed proximal policy?

    For each schedule (name -> its params) and method, mean over valid tokens of
    |prox_approx - prox_true| (`logp_abs`), of the importance weight
    |exp(target - prox_approx) - exp(target - prox_true)| (`iw_abs`) and of the behaviour
    weight |exp(prox_approx - behave) - exp(prox_true - behave)| (`bw_abs`). Keys are
    `prox_error/<schedule>/...` for loglinear and `prox_error/<schedule>-linear/...` for linear.
    """
    check_same_shape(prox_logp_true=prox_logp_true, behave_logp=behave_logp, target_logp=target_logp,
                      versions=versions, loss_mask=loss_mask)
    mask = loss_mask.bool()
    count = mask.sum().clamp(min=1)
    target_logp = target_logp.detach()
    prox_logp_true = prox_logp_true.detach()
    iw_true = torch.exp(target_logp - prox_logp_true)
    bw_true = torch.exp(prox_logp_true - behave_logp)
    out: dict[str, torch.Tensor] = {}
    for schedule, params in schedules.items():
        for method in methods:
            approx = approximate_prox_logp(
                behave_logp, target_logp, versions, current_version,
                method=method, schedule=schedule, check_finite=False, **dict(params),
            )
            label = schedule if method == "loglinear" else f"{schedule}-{method}"
            errors = {
                "logp_abs": (approx - prox_logp_true).abs(),
                "iw_abs": (torch.exp(target_logp - approx) - iw_true).abs(),
                "bw_abs": (torch.exp(approx - behave_logp) - bw_true).abs(),
            }
            for name, err in errors.items():
                out[f"prox_error/{label}/{name}"] = torch.where(mask, err, 0.0).sum() / count
    return out
