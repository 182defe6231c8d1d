"""Off-policy diagnostics: how far the training data is from the policies that use it.

Pure functions returning 0-dim float32 tensors (no `.item()`, no host sync); the trainer reads
them with the step's other metrics.

Which ratio. ESS and chi^2 measure the behaviour weight of the decoupled loss,
w = pi_prox / pi_behave: the weight the corrections act on, so these are the figures that say
whether a correction is needed. The KL estimators measure the whole gap between the sampler
and the policy being trained, KL(pi_behave || pi_theta), from samples of pi_behave (the tokens
in the batch); verl's compute_offpolicy_metrics logs the same estimators against its
`old_log_prob`, which is our pi_prox in recompute mode (and pi_theta at a step's first update).
"""

from __future__ import annotations

import math

import torch

from a3po.maths.corrections import per_sequence_mean
from a3po.maths.masked import check_same_shape, masked_max, masked_min

__all__ = ["entropy_terciles", "ess", "offpolicy_metrics", "LOG_RATIO_BOUND"]

# exp(40) ~ 2e17 squares into float32 without overflow. verl clamps log-ratios to +-20 the same
# way (verl's SAFETY_BOUND; docs/maths.md, "Sources") so a metric is never inf.
LOG_RATIO_BOUND = 20.0


def _ess_of_normalised(u: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(sum u)^2 / (n sum u^2) over valid entries, u already scaled so its largest valid entry is 1."""
    u = torch.where(valid, u, 0.0).float()
    n = valid.sum().to(torch.float32)
    total, total_sq = u.sum(), (u * u).sum()
    # <= 1 by Cauchy-Schwarz; the clamp only removes a rounding excess of an ulp.
    value = (total * total / (n * total_sq).clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    empty = torch.ones((), dtype=torch.float32, device=u.device)
    return torch.where(n > 0, torch.where(total_sq > 0, value, 0.0), empty)


def ess(w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size of importance weights w >= 0 (finite) over valid entries:

        ESS = (sum_i w_i)^2 / (n * sum_i w_i^2),   n = number of valid entries.

    In (0, 1]: 1/n when one weight carries everything, exactly 1 when all weights are equal
    (Kong 1992; verl logs it as rollout_is_eff_sample_size, rollout_corr_helper.py
    compute_is_metrics, as 1 / mean((w / mean w)^2), the same number). Scale-invariant, so it is
    computed on w / max(w) and cannot overflow. 1 when no entry is valid; 0 when all are 0.
    """
    check_same_shape(w=w, valid=valid)
    valid = valid.bool()
    w = w.detach().float()
    top = torch.where(valid, w, 0.0).amax() if w.numel() else w.new_zeros(())
    return _ess_of_normalised(w / torch.where(top > 0, top, 1.0), valid)


def _ess_of_log(log_w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # ESS from log-weights: exp(log_w - max) lies in (0, 1], so huge weights never overflow,
    # and equal log-weights give u = 1 exactly, hence ESS exactly 1.
    top = torch.where(valid, log_w, -math.inf).amax() if log_w.numel() else log_w.new_zeros(())
    top = torch.where(torch.isfinite(top), top, 0.0)
    return _ess_of_normalised(torch.exp(torch.where(valid, log_w - top, -math.inf)), valid)


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def offpolicy_metrics(behave_logp: torch.Tensor, prox_logp: torch.Tensor, logp: torch.Tensor,
                      seq_index: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Off-policy figures of one batch, 0-dim float32 tensors, over valid tokens:

    - offpolicy/ess_token: ESS of w_t = pi_prox/pi_behave (see `ess`).
    - offpolicy/ess_seq: ESS of the sequence weights rho_i = exp(mean_{t in i} log w_t), the
      geometric mean (as corrections.seq_tis; a product would be the length trap, TRL #5814),
      over the sequences with at least one valid token.
    - offpolicy/chi2_token: chi^2(pi_prox || pi_behave) ~ mean_t(w_t^2) - 1 (verl
      compute_offpolicy_metrics `chi2_token`, rollout_corr_helper.py), log w clamped to +-20.
    - offpolicy/kl_k1, offpolicy/kl_k3: KL(pi_behave || pi_theta) from the batch's tokens
      (samples of pi_behave), with r_t = pi_theta/pi_behave: k1 = mean(log pi_b - log pi_theta)
      = mean(-log r) (unbiased, noisy, can be < 0), k3 = mean((r - 1) - log r) (unbiased,
      >= 0 per token; J. Schulman, "Approximating KL Divergence", 2020; verl `kl` and
      `k3_kl`). k3 uses expm1 so a tiny KL is not lost to cancellation; log r clamped to +-20.
    - offpolicy/total_ratio_max, offpolicy/total_ratio_min, offpolicy/ess_total: the largest and
      smallest r_t = pi_theta/pi_behave (log r clamped to +-20) and its ESS. These do not depend
      on the proximal anchor, so they compare methods whose anchors differ (the importance
      weight pi_theta/pi_prox does not: recompute's is exactly 1 on a step's first minibatch).

    logp is detached: this is a metric, not a loss.
    """
    check_same_shape(behave_logp=behave_logp, prox_logp=prox_logp, logp=logp, seq_index=seq_index, valid=valid)
    valid = valid.bool()
    behave = behave_logp.detach().float()
    log_w = prox_logp.detach().float() - behave
    log_r = logp.detach().float() - behave
    log_rho, counts = per_sequence_mean(log_w, seq_index, valid)
    bounded_w = log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    bounded_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "offpolicy/ess_token": _ess_of_log(log_w, valid),
        "offpolicy/ess_seq": _ess_of_log(log_rho, counts > 0),
        "offpolicy/chi2_token": _masked_mean(torch.exp(2.0 * bounded_w), valid) - 1.0,
        "offpolicy/kl_k1": _masked_mean(-log_r, valid),
        "offpolicy/kl_k3": _masked_mean(torch.expm1(bounded_r) - bounded_r, valid),
        # exp of the masked extremes of log r: exp(0) = 1 where no token is valid
        "offpolicy/total_ratio_max": torch.exp(masked_max(bounded_r, valid)),
        "offpolicy/total_ratio_min": torch.exp(masked_min(bounded_r, valid)),
        "offpolicy/ess_total": _ess_of_log(log_r, valid),
    }


def entropy_terciles(entropy: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Bool masks `H1`, `H2`, `H3`: the valid tokens in the lowest, middle and highest third
    by entropy (cut at the valid tokens' 1/3 and 2/3 quantiles; ties go to the lower third).
    Every mask is False off `valid`, and all three are when no token is valid. Unlike the rest
    of this module it reads the quantiles on the host (a diagnostic of train.log_prox_errors)."""
    check_same_shape(entropy=entropy, valid=valid)
    valid = valid.bool()
    if not bool(valid.any()):
        return {name: torch.zeros_like(valid) for name in ("H1", "H2", "H3")}
    low, high = torch.quantile(entropy.detach()[valid].float(),
                               torch.tensor([1 / 3, 2 / 3], device=entropy.device)).tolist()
    entropy = entropy.detach()
    return {"H1": valid & (entropy <= low), "H2": valid & (entropy > low) & (entropy <= high),
            "H3": valid & (entropy > high)}
