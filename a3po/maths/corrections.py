"""Off-policy corrections of the decoupled loss's behaviour weight.

Every correction here acts on ONE ratio: the behaviour weight of decoupled PPO,

    w_t = pi_prox(y_t) / pi_behave(y_t) = exp(log_w_t),   log_w = prox_logp - behave_logp,

per generated token. Peers apply the same formulas to other ratios (named in each docstring):
verl, slime and TRL to pi_old/pi_rollout (trainer vs inference engine), AReaL to the same
pi_prox/pi_behave as we do. A correction returns a `Correction`: the detached `weight` that
replaces w in the loss, and `keep`, the tokens that still contribute.

Denominator. The caller normalises by the count of VALID tokens, not of kept ones:
loss = sum(weight * keep * per_token) / n_valid, as AReaL's `ppo_actor_loss_fn` does (it saves
`loss_mask_count` before rejection sampling) and as our `train.behave_weight_cap` always did.
Dividing by the kept count instead would scale every surviving token's gradient by
n_valid / n_kept, so a mask that drops more tokens would silently raise the step size (the
pitfall raised in AReaL #1088's review and slime #657).

Numerics. A stale token can have log_w = 200, where exp overflows to inf and 0 * inf is NaN
(prime-rl #2972): a dropped token's weight comes from `torch.where`, never from a product, so it
is exactly 0. No function here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from a3po.maths.masked import check_same_shape
from a3po.maths.proximal import ALGOS
from a3po.maths.spec import Param, Registry, Spec

__all__ = ["Correction", "CorrectionSpec", "CORRECTIONS", "apply_correction", "check_combination", "check_correction",
           "per_sequence_mean", "sequence_mean"]


@dataclass(frozen=True)
class Correction:
    """weight: detached multiplier replacing w (0 where dropped or invalid); keep: bool, the
    valid tokens that contribute; masked_low / masked_high / truncated: 0-dim float32, the
    fraction of VALID tokens dropped below the low bound / above the high bound, or truncated."""

    weight: torch.Tensor
    keep: torch.Tensor
    masked_low: torch.Tensor
    masked_high: torch.Tensor
    truncated: torch.Tensor


def _check_inputs(log_w: torch.Tensor, seq_index: torch.Tensor, valid: torch.Tensor) -> None:
    check_same_shape(log_w=log_w, seq_index=seq_index, valid=valid)
    if not log_w.dtype.is_floating_point:
        raise ValueError(f"log_w must be floating point, got {log_w.dtype}")
    if seq_index.dtype.is_floating_point or seq_index.dtype == torch.bool:
        raise ValueError(f"seq_index must be an integer tensor, got dtype {seq_index.dtype}")


def per_sequence_mean(values: torch.Tensor, seq_index: torch.Tensor,
                      valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence id s in [0, numel): mean_s = sum_{t: seq t = s, valid} v_t / max(1, count_s),
    and count_s (both 1-D, length numel, in values' dtype). Differentiable in `values`. One
    bucket per possible id, so no host sync; seq_index values must lie in [0, numel)."""
    flat = torch.where(valid.bool(), values, 0.0).reshape(-1)
    index = seq_index.reshape(-1)
    sums = flat.new_zeros(flat.numel()).index_add(0, index, flat)
    counts = flat.new_zeros(flat.numel()).index_add(0, index, valid.reshape(-1).to(flat.dtype))
    return sums / counts.clamp(min=1), counts


def sequence_mean(values: torch.Tensor, seq_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`per_sequence_mean` broadcast back to the tokens: each token gets its sequence's mean."""
    means, _ = per_sequence_mean(values, seq_index, valid)
    return means[seq_index.reshape(-1)].reshape(values.shape)


def _result(valid, keep, weight, low, high=None, truncated=None) -> Correction:
    """Fractions of valid tokens; `high` defaults to every dropped token not counted as low."""
    n_valid = valid.sum().clamp(min=1).to(torch.float32)
    low = low & valid
    high = (valid & ~keep & ~low) if high is None else high & valid
    trunc = torch.zeros_like(valid) if truncated is None else truncated & valid
    return Correction(weight.detach(), keep, low.sum() / n_valid, high.sum() / n_valid, trunc.sum() / n_valid)


def none(log_w, seq_index, valid, *, cap: float | None) -> Correction:
    """weight = w; with `cap`, tokens with w > cap are DROPPED (weight 0), not truncated.

    This is the former `train.behave_weight_cap` (now `correction.cap`), bit for bit: keep =
    valid & (w <= cap), counted in masked_high. AReaL's former `behav_imp_weight_cap` (now
    RejectionSamplingConfig action=mask, metric=ratio, level=token)
    does the same to the same ratio, pi_prox/pi_behave.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    w = torch.exp(log_w.detach())
    keep = valid if cap is None else valid & (w <= cap)
    return _result(valid, keep, torch.where(keep, w, 0.0), torch.zeros_like(valid))


def tis(log_w, seq_index, valid, *, cap: float) -> Correction:
    """Token truncated IS: weight = min(w, C); every valid token is kept.

    verl `rollout_is=token` with `rollout_is_threshold` (compute_rollout_correction_weights),
    slime `--use-tis --tis-clip` (vanilla_tis_function; it also clamps below at
    `--tis-clip-low`, default 0) and TRL `token_truncate` all apply it to pi_old/pi_rollout; we
    apply it to w. C = inf is `none`. truncated = fraction of valid tokens with w > C.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    w = torch.exp(log_w.detach())
    weight = torch.where(valid, torch.clamp(w, max=cap), 0.0)
    return _result(valid, valid, weight, torch.zeros_like(valid), torch.zeros_like(valid), w > cap)


def icepop(log_w, seq_index, valid, *, lo: float, hi: float) -> Correction:
    """Token mask (IcePop / token MIS): keep = lo <= w <= hi (inclusive); weight = w on kept.

    slime `icepop_function` multiplies the loss by
    where(lo <= r <= hi, r, 0) with r = pi_old/pi_rollout, i.e. by the ratio itself on kept
    tokens; TRL `token_mask` likewise; verl `rollout_rs=token_k1` masks only. We apply it to w.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    w = torch.exp(log_w.detach())
    keep = valid & (w >= lo) & (w <= hi)
    return _result(valid, keep, torch.where(keep, w, 0.0), w < lo)


def _sequence_weight(log_w, seq_index, valid) -> torch.Tensor:
    # Geometric mean: exp of the MEAN log weight, never of the sum (TRL #5814: a sum makes a
    # sequence weight the product of hundreds of ratios, which is 0 or inf for long answers).
    return torch.exp(sequence_mean(log_w.detach(), seq_index, valid))


def seq_tis(log_w, seq_index, valid, *, cap: float) -> Correction:
    """Sequence TIS: every token of sequence i gets weight min(rho_i, C), rho_i = exp(mean_t log w_t).

    The sequence weight REPLACES the token weights w_t (it does not multiply them), as in every
    peer: verl `rollout_is=sequence` broadcasts min(prod_t r_t, C) (a product, the length trap
    we avoid), TRL `sequence_truncate` clamp(exp(sum_t log r_t)), both on pi_old/pi_rollout;
    AReaL RejectionSamplingConfig(level=sequence, metric=ratio, action=clamp) broadcasts the
    geometric mean on pi_prox/pi_behave (`apply_rejection_sampling`).
    truncated = fraction of valid tokens whose rho_i > C.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    rho = _sequence_weight(log_w, seq_index, valid)
    weight = torch.where(valid, torch.clamp(rho, max=cap), 0.0)
    return _result(valid, valid, weight, torch.zeros_like(valid), torch.zeros_like(valid), rho > cap)


def seq_mis(log_w, seq_index, valid, *, lo: float, hi: float) -> Correction:
    """Sequence mask: drop every token of sequence i if rho_i = exp(mean_t log w_t) is outside
    [lo, hi] (inclusive bounds); kept tokens keep their own weight w_t.

    A pure rejection filter, as verl `rollout_rs=seq_mean_k1` (rollout_corr_helper.py,
    compute_rollout_rejection_mask; it bounds k1 = -mean log r by [log lo, log hi], i.e. 1/rho,
    the same for symmetric bounds such as [0.5, 2]). AReaL (action=mask, metric=ratio,
    level=sequence) and TRL `sequence_mask` instead weight kept tokens by the sequence weight;
    we keep w_t so seq_mis isolates the effect of rejection on the decoupled loss.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    rho = _sequence_weight(log_w, seq_index, valid)
    keep = valid & (rho >= lo) & (rho <= hi)
    return _result(valid, keep, torch.where(keep, torch.exp(log_w.detach()), 0.0), rho < lo)


def m2po(log_w, seq_index, valid, *, tau: float) -> Correction:
    """M2PO: drop the valid tokens with the largest m2 = (log w)^2 until the mean of m2 over the
    REMAINING valid tokens is < tau; weight = w on kept tokens.

    With m2 sorted descending, k = the first index whose suffix mean sum_{j>=k} m2_j / (n - k)
    is < tau; the k largest are dropped. If no suffix qualifies, all but the smallest are
    dropped. This is AReaL's `_apply_m2po_masking` / `_get_m2po_loss_mask`
    (`actor.m2_threshold`), on the same ratio (old_logp - prox_logp,
    squared). Unlike AReaL, whose masked loss_mask then shrinks the denominator, ours stays
    n_valid. The set is the valid tokens of the call (AReaL: the micro-batch its loss sees).
    A dropped token counts as masked_high if log w > 0, else masked_low.
    """
    _check_inputs(log_w, seq_index, valid)
    valid = valid.bool()
    flat_lw, flat_valid = log_w.detach().reshape(-1), valid.reshape(-1)
    m2 = flat_lw * flat_lw
    # Invalid tokens sort last (key -1 < any m2) and add 0 to every suffix sum.
    key, order = torch.sort(torch.where(flat_valid, m2, -1.0), descending=True, stable=True)
    values = torch.clamp(key, min=0.0)
    suffix = values.flip(0).cumsum(0).flip(0)
    n_valid = flat_valid.sum()
    position = torch.arange(m2.numel(), device=m2.device)
    below = (suffix / (n_valid - position).clamp(min=1).to(m2.dtype) < tau) & (position < n_valid)
    first = torch.where(below, position, m2.numel()).amin() if m2.numel() else n_valid
    n_drop = torch.where(first < m2.numel(), first, (n_valid - 1).clamp(min=0))
    drop = torch.zeros_like(flat_valid).index_copy(0, order, position < n_drop).reshape(valid.shape)
    keep = valid & ~drop
    return _result(valid, keep, torch.where(keep, torch.exp(log_w.detach()), 0.0), drop & (log_w < 0))


def _lo_below_hi(values: Mapping[str, float | None]) -> None:
    if not values["lo"] < values["hi"]:
        raise ValueError(f"correction lo={values['lo']:g}, hi={values['hi']:g} is not allowed; lo must be < hi")


def _positive(default: float | None, nullable: bool = False) -> Param:
    return Param(default, lambda v: v > 0, "> 0", nullable=nullable, none_means="no cap")


_BOUNDS = {"lo": Param(0.5, lambda v: v >= 0, ">= 0"), "hi": Param(2.0, lambda v: v > 0, "> 0")}


@dataclass(frozen=True)
class CorrectionSpec(Spec):
    """A correction; `with_behave_anchor`: whether it means anything when pi_prox is the
    behaviour policy itself (coupled PPO, w = 1 on every token): only `none` does."""

    with_behave_anchor: bool = False


CORRECTIONS = Registry("correction", (
    CorrectionSpec("none", none, "w as is; with cap, tokens with w > cap are dropped",
                   {"cap": _positive(None, nullable=True)}, with_behave_anchor=True),
    CorrectionSpec("tis", tis, "token truncated IS: min(w, cap)", {"cap": _positive(2.0)}),
    CorrectionSpec("icepop", icepop, "token mask: keep lo <= w <= hi", dict(_BOUNDS), _lo_below_hi),
    CorrectionSpec("seq_tis", seq_tis, "sequence truncated IS: min(rho, cap)", {"cap": _positive(2.0)}),
    CorrectionSpec("seq_mis", seq_mis, "sequence mask: keep lo <= rho <= hi", dict(_BOUNDS), _lo_below_hi),
    CorrectionSpec("m2po", m2po, "drop the largest (log w)^2 until their mean is below tau", {"tau": _positive(0.04)}),
))


def check_correction(name: str, params: Mapping[str, float | None] | None = None) -> dict[str, float | None]:
    """Every parameter correction `name` takes (a whole `cfg.correction` will do), defaults
    filled in, checked without running it: an unknown name, a key it does not take (a typo
    never passes) or a value out of range is a ValueError naming it."""
    return CORRECTIONS.lookup(name).check(params, "correction")


def apply_correction(name: str, log_w: torch.Tensor, seq_index: torch.Tensor, valid: torch.Tensor,
                     params: Mapping[str, float | None] | None = None) -> Correction:
    """Check (`check_correction`), look up and run correction `name`."""
    checked = check_correction(name, params)
    return CORRECTIONS[name].fn(log_w, seq_index, valid, **checked)


def check_combination(correction: str, method: str) -> None:
    """ValueError (key, value and why) for a correction without meaning beside proximal method
    `method` (a3po.maths.proximal.ALGOS): with the behaviour policy as the anchor (coupled PPO)
    the behaviour weight pi_prox/pi_behave is exactly 1 on every token, so a correction of it
    can only do nothing, or (a bound below 1) scale or drop every token alike. Every objective
    combines with every correction: gspo clips the sequence ratio pi_theta/pi_prox while the
    correction weights each token's pi_prox/pi_behave, two ratios AReaL also treats as
    orthogonal (importance_sampling_level vs rejection_sampling.level)."""
    spec, anchor = CORRECTIONS.lookup(correction), ALGOS.lookup(method).anchor
    if anchor == "behave" and not spec.with_behave_anchor:
        allowed = sorted(name for name, spec in CORRECTIONS.items() if spec.with_behave_anchor)
        decoupled = [name for name, m in ALGOS.items() if m.anchor != "behave"]
        raise ValueError(
            f"correction={correction!r} is not allowed with algo={method} (coupled PPO): the behaviour weight "
            f"pi_prox/pi_behave is exactly 1 there, so the correction has nothing to correct; use correction="
            f"{'/'.join(allowed)}, or a decoupled method ({', '.join(decoupled)})"
        )
