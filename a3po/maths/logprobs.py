"""Token log-probs and entropy from logits, a row chunk at a time so memory stays
O(chunk x vocab) whatever the batch. Pure tensor functions, no host sync."""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "token_logprobs_and_entropy", "LOGPROB_CHUNK_ROWS"]

# Rows of logits turned into log-probs at once. 1,024 rows x a 150k vocabulary in float32 is
# 600 MB, the most we ever want alive on top of the logits themselves.
LOGPROB_CHUNK_ROWS = 1024


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
