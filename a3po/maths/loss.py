"""The decoupled PPO actor loss, token log-probs/entropy, and GRPO advantages.

Pure tensor functions. Nothing here calls `.item()` or otherwise syncs with the host, so the
training step can stay asynchronous on a GPU; reductions for logging come back as 0-dim
tensors and the trainer reads them once per step.
"""

from __future__ import annotations

import math

import torch

from a3po.maths.shapes import check_same_shape

__all__ = [
    "ppo_actor_loss",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "grpo_advantages",
    "masked_max",
    "masked_min",
    "masked_mean",
]

# Rows of logits turned into log-probs at once. 1,024 rows x a 150k vocabulary in float32 is
# 600 MB, the most we ever want alive on top of the logits themselves.
LOGPROB_CHUNK_ROWS = 1024


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over masked entries; 0 when the mask is empty (so logs never see -inf)."""
    mask = mask.bool()
    result = torch.where(mask, values, -math.inf).amax()
    return torch.where(mask.any(), result, torch.zeros_like(result))


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    result = torch.where(mask, values, math.inf).amin()
    return torch.where(mask.any(), result, torch.zeros_like(result))


def _check_clip_and_cap(eps_clip, eps_clip_higher, behave_weight_cap) -> float:
    """ValueError naming the argument for a bad clip range or cap; returns the upper clip."""
    if not eps_clip > 0:
        raise ValueError(f"eps_clip={eps_clip!r} is not allowed; it must be > 0")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if not eps_high > 0:
        raise ValueError(f"eps_clip_higher={eps_clip_higher!r} is not allowed; it must be > 0 (or None)")
    if behave_weight_cap is not None and not behave_weight_cap > 0:
        raise ValueError(f"behave_weight_cap={behave_weight_cap!r} is not allowed; it must be > 0 (or None)")
    return eps_high


def ppo_actor_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behave_logp: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, *, eps_clip: float, eps_clip_higher: float | None = None,
                   behave_weight_cap: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2022) as in AReaL's `ppo_actor_loss_fn`.

    r = exp(logp - prox_logp) is clipped to [1 - eps_clip, 1 + eps_clip_higher]; the
    surrogate max(-A r, -A clip(r)) is multiplied by the detached behaviour weight
    w = exp(prox_logp - behave_logp); tokens with w > behave_weight_cap get weight 0 but stay
    in the denominator (the count of all valid tokens). Coupled PPO is prox_logp = behave_logp.
    prox_logp is an anchor: it is detached here whatever the caller passes.

    The reference of the default loss, written as AReaL writes it: the trainer composes the
    same loss from `objective=ppo` x `correction=none` (a3po.maths.objectives, a3po.maths.corrections),
    and tests/test_objectives.py holds the two equal bit for bit, gradient included.
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, behave_logp=behave_logp, advantages=advantages, loss_mask=loss_mask)
    eps_high = _check_clip_and_cap(eps_clip, eps_clip_higher, behave_weight_cap)
    mask = loss_mask.bool()
    prox_logp = prox_logp.detach()
    behave_logp = behave_logp.detach()
    advantages = advantages.detach()
    n_valid = mask.sum().clamp(min=1)

    ratio = torch.where(mask, torch.exp(logp - prox_logp), 0.0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * clipped_ratio
    clip_mask = (surrogate.detach() < surrogate_clipped.detach()) & mask
    pg_loss = torch.maximum(surrogate, surrogate_clipped)

    behave_weight_raw = torch.exp(prox_logp - behave_logp)
    behave_mask = mask if behave_weight_cap is None else mask & (behave_weight_raw <= behave_weight_cap)
    behave_weight = torch.where(behave_mask, behave_weight_raw, 0.0)
    pg_loss = pg_loss * behave_weight
    loss = torch.where(mask, pg_loss, 0.0).sum() / n_valid

    importance_weight = ratio.detach()
    log_ratio = (logp.detach() - prox_logp)
    n_clipped = clip_mask.sum()
    stats = {
        # per token
        "importance_weight": importance_weight,
        "behave_weight": behave_weight,
        "clip_mask": clip_mask,
        "approx_kl": torch.where(mask, log_ratio, 0.0),
        # reductions (0-dim tensors; the logged names of docs/design.md without the `actor/` prefix)
        "importance_weight/max": masked_max(importance_weight, mask),
        "importance_weight/min": masked_min(importance_weight, mask),
        "importance_weight/mean": masked_mean(importance_weight, mask),
        # The raw weight, before the cap: the figure is about how far the data drifted.
        "behave_weight/max": masked_max(behave_weight_raw, mask),
        "behave_weight/min": masked_min(behave_weight_raw, mask),
        "behave_weight/mean": masked_mean(behave_weight_raw, mask),
        "behave_weight/capped_tokens": (mask & ~behave_mask).sum(),
        "clipped_tokens": n_clipped,
        "clip_ratio": n_clipped / n_valid,
        "approx_kl/mean": masked_mean(log_ratio, mask),
        "valid_tokens": mask.sum(),
    }
    return loss, stats


def _chunked_rows(logits: torch.Tensor) -> list[tuple[int, int]]:
    n_rows = logits.shape[0]
    return [(start, min(start + LOGPROB_CHUNK_ROWS, n_rows)) for start in range(0, n_rows, LOGPROB_CHUNK_ROWS)]


def _flat_rows(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] and tokens [...] as [rows, V] and [rows], after checking the shapes agree."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)} vs tokens {tuple(tokens.shape)}; "
                         "logits must be tokens' shape plus a vocabulary dimension")
    return logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without a full-vocabulary log-softmax tensor.

    logit[token] - logsumexp(logits), a row chunk at a time and in float32 (the way TRL's
    selective_log_softmax does), so memory stays O(chunk x vocab) whatever the batch.
    logits: [..., V]; tokens: [...] (int64). Differentiable.
    """
    flat_logits, flat_tokens = _flat_rows(logits, tokens)
    pieces = []
    for start, end in _chunked_rows(flat_logits):
        chunk = flat_logits[start:end].float()
        chosen = chunk.gather(-1, flat_tokens[start:end, None]).squeeze(-1)
        pieces.append(chosen - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(tokens.shape)


def _entropy_of_rows(chunk: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    # -sum p log p with log p = logit - logZ: summing small terms keeps float32 accurate for
    # peaked distributions, where logZ - sum(p * logit) would cancel two large numbers.
    log_probs = chunk - log_z[:, None]
    return -(torch.exp(log_probs) * log_probs).sum(-1)


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both at once, sharing the logsumexp: the training forward needs both and the vocab
    pass is the expensive part. The log-probs carry gradient, the entropy does not."""
    flat_logits, flat_tokens = _flat_rows(logits, tokens)
    logp_pieces, entropy_pieces = [], []
    for start, end in _chunked_rows(flat_logits):
        chunk = flat_logits[start:end].float()
        log_z = torch.logsumexp(chunk, dim=-1)
        chosen = chunk.gather(-1, flat_tokens[start:end, None]).squeeze(-1)
        logp_pieces.append(chosen - log_z)
        with torch.no_grad():
            entropy_pieces.append(_entropy_of_rows(chunk.detach(), log_z.detach()))
    if not logp_pieces:
        empty = flat_logits.new_zeros(0, dtype=torch.float32)
        return empty.reshape(tokens.shape), empty.reshape(tokens.shape)
    return torch.cat(logp_pieces).reshape(tokens.shape), torch.cat(entropy_pieces).reshape(tokens.shape)


def grpo_advantages(rewards: torch.Tensor, *, norm_std: bool = True, unbiased: bool = True,
                    eps: float = 1e-5) -> torch.Tensor:
    """Group-normalised rewards. rewards: [n_groups, group_size] -> same shape.

    (r - group mean), divided by (group std + eps) when norm_std. The defaults are AReaL's
    group normalisation (`Normalization` in areal/utils/data.py: `std_unbiased=True`,
    `eps=1e-5`): the unbiased (n - 1) std. `unbiased=False` gives the population (n) std that
    some other GRPO implementations use; for a group of 4 the two differ by sqrt(4/3). A group
    whose rewards are all equal carries no preference: its advantage is exactly 0, never NaN,
    even where the float mean is off by an ulp.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or Inf; every reward must be finite")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed; it must be > 0")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if norm_std:
        # A group of one has no unbiased std (0/0); its advantage is 0 below anyway.
        std = rewards.std(dim=1, unbiased=unbiased and rewards.shape[1] > 1, keepdim=True)
        centred = centred / (std + eps)
    all_equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centred), centred)
