"""The optimizer update and the guard before it: AdamW (fused where torch has the kernel), the
gradient clip (torch's, less a no-op pass on CPU), and one host read per minibatch that nothing
non-finite is about to reach the weights."""

from __future__ import annotations

import math

import torch

from a3po.distributed import SINGLE, DistInfo, all_reduce_min

__all__ = ["all_finite", "clip_gradients", "make_optimizer", "check_update", "NonFiniteUpdate", "PROX_NOT_FINITE"]

PROX_NOT_FINITE = ("approximate_prox_logp result has non-finite value(s) (NaN or Inf); all values must be finite. "
                   "Check behave_logp/target_logp for -inf (a token the policy gives probability 0).")


class NonFiniteUpdate(RuntimeError):
    """Raised by the trainer before an optimizer step whose loss or gradient norm is not
    finite: that step was not taken, so the weights are those before the minibatch."""

    def __init__(self, step: int, minibatch: int, n_minibatches: int, loss: float, grad_norm: float) -> None:
        self.step, self.minibatch, self.n_minibatches = step, minibatch, n_minibatches
        self.loss, self.grad_norm = loss, grad_norm
        super().__init__(f"step {step}, minibatch {minibatch} (of 0..{n_minibatches - 1}): {self.reason}; "
                         "its optimizer step was not taken")

    @property
    def non_finite(self) -> list[str]:
        """Which of the two was not finite: `loss`, `grad_norm` or both."""
        return [name for name, value in (("loss", self.loss), ("grad_norm", self.grad_norm))
                if not math.isfinite(value)]

    @property
    def reason(self) -> str:
        return " and ".join(f"the {'minibatch loss' if name == 'loss' else 'gradient norm'} is {getattr(self, name)}"
                            for name in self.non_finite)


def all_finite(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the values' device, with no host sync, in one reduction pass.

    A NaN or an infinity anywhere makes the sum non-finite, so this is `isfinite(values).all()`
    (five elementwise passes in eager mode: abs, ne, eq, mul, all; far slower, docs/benchmarks.md)
    except where finite values sum past float32's 3.4e38, which log-probs of any real policy
    never approach; a float64 sum would rule that out too, at a cost on CPU.
    """
    return torch.isfinite(values.sum())


def clip_gradients(policy: torch.nn.Module, max_norm: float, sharded: bool = False) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` bit for bit, without its pass over every gradient when
    nothing is clipped, on a CPU.

    torch multiplies each gradient by min(1, max_norm / (norm + 1e-6)) even when that is exactly
    1.0, so that a GPU never waits on the norm. On a CPU reading the norm costs nothing, and the
    multiply by 1.0 (an identity, NaN and infinities included) is about half the clip's time,
    once per minibatch (measured in docs/benchmarks.md). The same two
    torch functions run in the same order, so norm and gradients are identical. Sharded (FSDP2)
    or GPU gradients take torch's own path.
    """
    params = [p for p in policy.parameters() if p.grad is not None]
    if sharded or not params or params[0].grad.device.type != "cpu":
        return torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if not bool(max_norm / (norm + 1e-6) >= 1.0):  # torch's coefficient; NaN scales, as torch does
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def make_optimizer(policy: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    """AdamW, fused where torch has a fused kernel for the parameters' device and dtype.

    The step is memory-bound: the fused kernel reads weights, gradients and both moments and
    writes back weights and moments once per parameter; the default CPU implementation runs
    about ten separate elementwise ops over them (docs/benchmarks.md, "AdamW").
    """
    params = [p for p in policy.parameters() if p.requires_grad]
    kwargs = dict(lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
                  weight_decay=train_cfg.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, **kwargs)


def check_update(prox_flags: list[torch.Tensor], loss: torch.Tensor, grad_norm: torch.Tensor, version: int,
                 minibatch: int, n_minibatches: int, dist: DistInfo = SINGLE) -> None:
    """Before a minibatch's optimizer step: the approximation's finiteness (a ValueError, a
    bug in the inputs) and the loss's and gradient norm's (`NonFiniteUpdate`: the run has
    diverged, a3po.run.health), read in one host transfer. Distributed, the flags are combined
    over the ranks (one all-reduce), so every rank skips the step and raises together, even
    when only one rank's share of the loss is non-finite."""
    prox_ok = torch.stack(prox_flags).all() if prox_flags else torch.ones((), dtype=torch.bool, device=loss.device)
    flags = torch.stack([prox_ok, torch.isfinite(loss), torch.isfinite(grad_norm.to(loss.device))])
    if dist.world > 1:
        flags = all_reduce_min(flags.to(torch.float32)) > 0
    prox_finite, loss_finite, grad_finite = flags.tolist()
    if not prox_finite:
        raise ValueError(PROX_NOT_FINITE)
    if not (loss_finite and grad_finite):
        loss_value = float(loss)
        if not loss_finite and math.isfinite(loss_value):
            loss_value = math.nan  # this rank's share is finite, another rank's is not
        raise NonFiniteUpdate(version, minibatch, n_minibatches, loss=loss_value, grad_norm=float(grad_norm))
