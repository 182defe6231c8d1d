"""The proximal policy of decoupled PPO: the methods that obtain it (`ALGOS`), and A-3PO's
approximation without a forward pass.

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
below follows AReaL's order of operations so the results agree bit for bit. The schedules
live in a3po.maths.schedules. A new approximation is its interpolation function and its
`Method` in `ALGOS` below, plus `conf/algo/<name>.yaml`.

Everything here is a pure tensor function: no model, no config, no global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from a3po.maths.schedules import schedule_of, target_weight
from a3po.maths.masked import check_same_shape
from a3po.maths.spec import Bound, Param, Registry, Spec

__all__ = [
    "ALGOS",
    "Method",
    "approximations",
    "approximate_prox_logp",
    "approximation_errors",
    "recomputes_at",
    "staleness_stats",
]

# Added inside the log of the probability-space interpolation, as AReaL does, so a token
# whose interpolated probability underflows gives a large negative log-prob, not -inf.
LINEAR_LOG_EPS = 1e-10


def _check_interpolation(behave_logp: torch.Tensor, target_logp: torch.Tensor, alpha: torch.Tensor,
                         versions: torch.Tensor) -> None:
    if torch.as_tensor(alpha).dim() == 0:
        check_same_shape(behave_logp=behave_logp, target_logp=target_logp, versions=versions)
    else:
        check_same_shape(behave_logp=behave_logp, target_logp=target_logp, alpha=alpha, versions=versions)


def loglinear(behave_logp: torch.Tensor, target_logp: torch.Tensor, alpha: torch.Tensor,
              versions: torch.Tensor) -> torch.Tensor:
    """prox = behave + alpha * (target - behave): interpolation in log-prob space (A-3PO).
    `alpha` is per token (the same shape) or a 0-dim tensor."""
    _check_interpolation(behave_logp, target_logp, alpha, versions)
    return behave_logp + alpha * (target_logp - behave_logp)


def linear(behave_logp: torch.Tensor, target_logp: torch.Tensor, alpha: torch.Tensor,
           versions: torch.Tensor) -> torch.Tensor:
    """prox = log((1 - alpha) p_behave + alpha p_target + 1e-10) on generated tokens, behave
    elsewhere: interpolation in probability space."""
    _check_interpolation(behave_logp, target_logp, alpha, versions)
    p_mix = (1 - alpha) * torch.exp(behave_logp) + alpha * torch.exp(target_logp)
    return torch.where(versions >= 0, torch.log(p_mix + LINEAR_LOG_EPS), behave_logp)


@dataclass(frozen=True)
class Method(Spec):
    """A proximal method (`algo=`). `anchor`: how its proximal log-probs are obtained:
    `behave` (the behaviour policy: coupled PPO, the behaviour weight is exactly 1),
    `recompute` (a no-grad forward of the step-start weights: the pass A-3PO removes),
    `approximate` (`fn`, an interpolation between behaviour and current log-probs weighted
    by the alpha schedule) or `hybrid` (`fn` on most steps, recompute's forward on the steps
    `recomputes_at` picks)."""

    anchor: str = "approximate"

    @property
    def uses_schedule(self) -> bool:
        return self.anchor in ("approximate", "hybrid")


def recomputes_at(step: int, every: int, min_ess: float | None, drift_ess: Callable[[], float]) -> bool:
    """Whether `algo=hybrid` runs recompute's forward at `step`: every `every`-th step (0: none
    by count), or when `min_ess` is set and the token ESS of pi_theta / pi_behave at the step's
    start, measured on one micro-batch (`drift_ess`, called only then), is below it."""
    if every and step % every == 0:
        return True
    return min_ess is not None and drift_ess() < min_ess


ALGOS = Registry("algo.name", (
    Method("coupled", None, "standard PPO/GRPO: the ratio is taken against the behaviour policy", anchor="behave"),
    Method("recompute", None, "decoupled PPO with the proximal forward pass", anchor="recompute"),
    Method("loglinear", loglinear, "A-3PO: interpolation in log-prob space"),
    Method("linear", linear, "A-3PO variant: interpolation in probability space"),
    Method("hybrid", loglinear, "loglinear, with the recompute forward every `every` steps or when the drift's ESS "
           "falls below `min_ess`", anchor="hybrid",
           params={"every": Param(4, lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0 (0: never by count)"),
                   "min_ess": Param(None, lambda v: 0.0 < v <= 1.0, "in (0, 1]", nullable=True,
                                    none_means="no ESS trigger")}),
))


def approximations() -> tuple[str, ...]:
    """The interpolations themselves (those `train.log_prox_errors` evaluates every schedule with)."""
    return tuple(name for name, method in ALGOS.items() if method.anchor == "approximate")


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
    schedule: str | Bound = "inverse",
    position: float = 0.0,
    check_finite: bool = True,
    **schedule_params: float,
) -> torch.Tensor:
    """A-3PO's proximal log-probs: no forward pass, one fused elementwise expression.

    `target_logp` is detached, so no gradient flows through the anchor. Tokens with
    version < 0 (prompt, padding) return `behave_logp` exactly, in both methods (AReaL's
    `linear` would return log(exp(behave) + 1e-10) there; those tokens are never in the loss).
    On generated tokens the result equals AReaL's `compute_prox_logp_approximations`.
    `check_finite` costs one host sync; the trainer turns it off and checks the loss and
    gradient instead (a3po.learner.trainer), which a non-finite anchor reaches.
    """
    interpolate = ALGOS.lookup(method).fn
    if interpolate is None:
        raise ValueError(f"method={method!r} is not an approximation; allowed: {list(approximations())}")
    check_same_shape(behave_logp=behave_logp, target_logp=target_logp, versions=versions)
    if not behave_logp.dtype.is_floating_point or not target_logp.dtype.is_floating_point:
        raise ValueError(
            f"behave_logp and target_logp must be floating point, got {behave_logp.dtype} and {target_logp.dtype}"
        )
    alpha = target_weight(versions, current_version, schedule, position, **schedule_params)
    prox_logp = interpolate(behave_logp.detach(), target_logp.detach(), alpha, versions)
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
    methods: tuple[str, ...] | None = None,
    position: float = 0.0,
    decisions: Callable[[torch.Tensor], Mapping[str, torch.Tensor]] | None = None,
    strata: Mapping[str, torch.Tensor] | None = None,
    stratified: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """How far is each approximation from the recomputed proximal policy?

    For each schedule (name -> its params) and method, mean over valid tokens of
    |prox_approx - prox_true| (`logp_abs`), of the importance weight
    |exp(target - prox_approx) - exp(target - prox_true)| (`iw_abs`) and of the behaviour
    weight |exp(prox_approx - behave) - exp(prox_true - behave)| (`bw_abs`). With `decisions`
    (an anchor -> per-token bool decisions, e.g. a3po.maths.loss.token_decisions: clipped,
    kept), the share of valid tokens whose decision differs between the two anchors
    (`<decision>_flip`) and the share each anchor makes it for (`<decision>_rate`; the recomputed
    anchor's as `prox_error/recompute/...`). Keys are `prox_error/<schedule>/...` for loglinear and
    `prox_error/<schedule>-linear/...` for linear. A schedule's params may name the schedule
    function it uses (`{name: rational, gamma: ...}` under the label `fitted`: `schedule_of`).
    `strata` (name -> a bool mask) with `stratified` (error names): those errors of the
    loglinear anchors also as means over the valid tokens of each stratum,
    `prox_error/<schedule>/<error>/<stratum>`.
    """
    check_same_shape(prox_logp_true=prox_logp_true, behave_logp=behave_logp, target_logp=target_logp,
                      versions=versions, loss_mask=loss_mask)
    mask = loss_mask.bool()
    target_logp, prox_logp_true = target_logp.detach(), prox_logp_true.detach()
    truth = decisions(prox_logp_true) if decisions is not None else {}
    out = _means("prox_error/recompute", {f"{key}_rate": made.float() for key, made in truth.items()}, mask, strata,
                 stratified)
    for schedule, given in schedules.items():
        name, params = schedule_of(schedule, given), {key: value for key, value in given.items() if key != "name"}
        for method in methods or approximations():
            approx = approximate_prox_logp(behave_logp, target_logp, versions, current_version, method=method,
                                           schedule=name, position=position, check_finite=False, **params)
            label = schedule if method == "loglinear" else f"{schedule}-{method}"
            errors = _errors(approx, prox_logp_true, behave_logp, target_logp)
            if decisions is not None:
                errors.update(_decision_errors(decisions(approx), truth))
            out.update(_means(f"prox_error/{label}", errors, mask,
                              strata if method == "loglinear" else None, stratified))
    return out


def _decision_errors(made: Mapping[str, torch.Tensor], truth: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per token and decision: whether an anchor's decision differs from the recomputed one's
    (`<decision>_flip`) and whether the anchor makes it (`<decision>_rate`)."""
    out = {}
    for decision, mask in made.items():
        out.update({f"{decision}_flip": (mask != truth[decision]).float(), f"{decision}_rate": mask.float()})
    return out


def _means(prefix: str, errors: Mapping[str, torch.Tensor], mask: torch.Tensor,
           strata: Mapping[str, torch.Tensor] | None, stratified: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each per-token error's mean over the valid tokens, and the stratified ones' over each stratum's."""
    out = {}
    for name, err in errors.items():
        out[f"{prefix}/{name}"] = torch.where(mask, err, 0.0).sum() / mask.sum().clamp(min=1)
        for stratum, members in (strata or {}).items() if name in stratified else ():
            inside = mask & members.bool()
            out[f"{prefix}/{name}/{stratum}"] = torch.where(inside, err, 0.0).sum() / inside.sum().clamp(min=1)
    return out


def _errors(approx: torch.Tensor, prox_true: torch.Tensor, behave: torch.Tensor, target: torch.Tensor
            ) -> dict[str, torch.Tensor]:
    """Per token: the anchors' log-prob, importance-weight and behaviour-weight differences."""
    return {
        "logp_abs": (approx - prox_true).abs(),
        "iw_abs": (torch.exp(target - approx) - torch.exp(target - prox_true)).abs(),
        "bw_abs": (torch.exp(approx - behave) - torch.exp(prox_true - behave)).abs(),
    }
