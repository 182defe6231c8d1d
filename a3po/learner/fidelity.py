"""With `train.log_prox_errors=true`: how every logged schedule's anchor compares with the
recomputed one on the tokens being trained, and how far the policy has drifted; with
`train.grad_fidelity_every`, what the difference does to the gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from a3po.learner.step_metrics import StepMetrics
from a3po.maths.diagnostics import entropy_terciles
from a3po.maths.loss import token_decisions
from a3po.maths.masked import masked_mean
from a3po.maths.proximal import approximate_prox_logp, approximation_errors
from a3po.maths.schedules import schedule_of
from a3po.maths.spec import Bound
from a3po.timer import PhaseTimer

__all__ = ["FidelityRecorder", "fidelity_metrics", "gradient_agreement", "loglinear_anchors", "STRATIFIED"]

# The errors also reported per stratum (minibatch k, entropy tercile) for the loglinear anchors.
STRATIFIED = ("logp_abs", "clip_flip", "clip_rate")


def fidelity_metrics(reference: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor,
                     tokens: Mapping[str, torch.Tensor], version: int, minibatch: int, n_minibatches: int, *,
                     schedules: Mapping[str, Mapping[str, Any]], objective: Bound | Mapping[str, Any],
                     correction: Bound | Mapping[str, Any]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """One micro-batch of minibatch k of m, against the recomputed anchor `reference`, as
    (values, token weight) groups for StepMetrics: each schedule's errors and the flip rates of
    the loss's per-token decisions (a3po.maths.proximal, a3po.maths.loss); the loglinear
    anchors' STRATIFIED errors in minibatch k (`.../k<k>`) and in each entropy tercile
    (`.../H1`-`H3`), each weighted by its own token count; the drift `drift/logp_abs/k<k>`,
    which against d + k/m versions gives the drift exponent (analysis.anchor.drift); and the two token
    means whose ratio is the least-squares alpha of a loglinear anchor at this (d, k/m): with
    delta = logp - behave and target = reference - behave, alpha* = mean(delta * target) /
    mean(delta^2) (`alpha_fit/{cross,delta_sq}/k<k>`; analysis.anchor.fit_schedule fits a schedule to them)."""
    behave, valid, seq = tokens["behave"], tokens["mask"], tokens["seq_index"]

    def decisions(anchor: torch.Tensor) -> dict[str, torch.Tensor]:
        return token_decisions(logp, anchor, behave, tokens["advantages"], seq, valid,
                               objective=objective, correction=correction)

    strata = {f"k{minibatch}": valid.bool(), **entropy_terciles(entropy, valid)}
    errors = approximation_errors(reference, behave, logp.detach(), tokens["versions"], version, valid, schedules,
                                  position=minibatch / n_minibatches, decisions=decisions, strata=strata,
                                  stratified=STRATIFIED)
    delta, target = logp.detach() - behave, reference.detach() - behave
    whole = {key: value for key, value in errors.items() if key.count("/") == 2}
    whole.update({f"drift/logp_abs/k{minibatch}": masked_mean(delta.abs(), valid),
                  f"alpha_fit/cross/k{minibatch}": masked_mean(delta * target, valid),
                  f"alpha_fit/delta_sq/k{minibatch}": masked_mean(delta * delta, valid)})
    groups = [(whole, torch.as_tensor(logp.numel()))]
    for stratum, members in strata.items():
        values = {key: value for key, value in errors.items() if key.endswith(f"/{stratum}")}
        groups.append((values, (valid.bool() & members).sum()))
    return groups


def loglinear_anchors(tokens: Mapping[str, torch.Tensor], logp: torch.Tensor, version: int, position: float,
                      schedules: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Each logged schedule's loglinear anchor for these tokens (label -> log-probs, detached)."""
    return {label: approximate_prox_logp(tokens["behave"], logp.detach(), tokens["versions"], version,
                                         method="loglinear", schedule=schedule_of(label, params), position=position,
                                         check_finite=False, **{k: v for k, v in params.items() if k != "name"})
            for label, params in schedules.items()}


def gradient_agreement(loss_of: Callable[[torch.Tensor], torch.Tensor], params: Iterable[torch.Tensor],
                       reference: torch.Tensor, anchors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`grad_fidelity/<label>/{cos,norm_ratio}`: the cosine and the norm ratio between the
    gradient of `loss_of(anchor)` and of `loss_of(reference)` with respect to `params`. The
    graph is kept (the caller's backward follows) and no `.grad` is touched."""
    params = [p for p in params if p.requires_grad]

    def gradient(anchor: torch.Tensor) -> list[torch.Tensor]:
        grads = torch.autograd.grad(loss_of(anchor), params, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]

    ref = gradient(reference)
    ref_sq = sum((g.double() * g.double()).sum() for g in ref)
    out = {}
    for label, anchor in anchors.items():
        grads = gradient(anchor)
        dot = sum((g.double() * r.double()).sum() for g, r in zip(grads, ref))
        sq = sum((g.double() * g.double()).sum() for g in grads)
        tiny = torch.finfo(torch.float64).tiny
        out[f"grad_fidelity/{label}/cos"] = (dot / (sq * ref_sq).sqrt().clamp(min=tiny)).float()
        out[f"grad_fidelity/{label}/norm_ratio"] = (sq.sqrt() / ref_sq.sqrt().clamp(min=tiny)).float()
    return out


@dataclass(frozen=True)
class FidelityRecorder:
    """`train.log_prox_errors` on one micro-batch at a time, given what it measures with: the
    logged schedules, the loss's groups, `train.grad_fidelity_every`, the step's timer, the
    loss as a function of the anchor's log-probs and the trainable parameters."""

    schedules: Mapping[str, Mapping[str, Any]]
    objective: Bound | Mapping[str, Any]
    correction: Bound | Mapping[str, Any]
    grad_fidelity_every: int
    timer: PhaseTimer
    parameters: Callable[[], Iterable[torch.Tensor]]

    def record(self, metrics: StepMetrics, reference: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor,
               tokens: Mapping[str, torch.Tensor], version: int, minibatch: int, n_minibatches: int, first: bool,
               loss_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Timed as `fidelity` apart from `train`; on the first micro-batch of a due step's last
        minibatch the gradient agreement too, from the training forward's graph before its
        backward (`loss_of(anchor)`: this micro-batch's loss against that anchor)."""
        with self.timer.phase("fidelity", within="train"):
            for values, n_tokens in fidelity_metrics(reference, logp, entropy, tokens, version, minibatch,
                                                     n_minibatches, schedules=self.schedules,
                                                     objective=self.objective, correction=self.correction):
                metrics.add(values, n_tokens=n_tokens)
            every = self.grad_fidelity_every
            if every and version % every == 0 and minibatch == n_minibatches - 1 and first:
                anchors = loglinear_anchors(tokens, logp, version, minibatch / n_minibatches, self.schedules)
                metrics.add(gradient_agreement(loss_of, self.parameters(), reference, anchors))
