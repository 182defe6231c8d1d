"""Token log-probs and entropy from logits: the training step's pass over the vocabulary.

One autograd function reads each row chunk of the logits once forward (log-sum-exp, the token's
log-prob, the entropy, all accumulated in float32) and once backward (the softmax recomputed
from the saved log-sum-exp, written straight into the logits' gradient), so autograd keeps no
float32 copy of the logits and no [rows, vocab] intermediate per operation. A chunk is a few MB,
small enough that its several passes stay in the CPU's cache instead of each streaming from
memory (docs/benchmarks.md, "Rollout at the hardware's pace").

The arithmetic is the unfused one's, operation for operation: log-probs and gradient are bit for
bit those of `chosen - logsumexp(logits)` under autograd (tests/test_loss.py), at temperature 1.
A temperature divides the float32 logits (the rollout's sampler divides there too). Pure tensor
functions, no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "token_logprobs_and_entropy", "LOGPROB_CHUNK_BYTES", "LOGPROB_CHUNK_ROWS", "chunk_rows"]

# Float32 bytes of one row chunk: small enough to stay in a core's cache across the chunk's
# passes (1-16 MB measured on SmolLM2's vocabulary: docs/benchmarks.md).
LOGPROB_CHUNK_BYTES = 2 * 2**20
# The most rows a chunk holds whatever the vocabulary (a small vocabulary's chunk of 4 MB would
# otherwise be tens of thousands of rows).
LOGPROB_CHUNK_ROWS = 1024


def chunk_rows(vocab: int) -> int:
    """Rows of logits turned into log-probs at once."""
    return max(1, min(LOGPROB_CHUNK_ROWS, LOGPROB_CHUNK_BYTES // (4 * max(1, vocab))))


def _chunks(n_rows: int, vocab: int) -> list[tuple[int, int]]:
    rows = chunk_rows(vocab)
    return [(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def _flat_rows(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] and tokens [...] as [rows, V] and [rows], after checking the shapes agree."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)} vs tokens {tuple(tokens.shape)}; "
                         "logits must be tokens' shape plus a vocabulary dimension")
    return logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    scores = chunk.float()
    return scores / temperature if temperature != 1.0 else scores


def _entropy_of_rows(scores: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    # -sum p log p with log p = logit - logZ: summing small terms keeps float32 accurate for
    # peaked distributions, where logZ - sum(p * logit) would cancel two large numbers.
    log_probs = scores - log_z[:, None]
    return -(torch.exp(log_probs) * log_probs).sum(-1)


class _VocabularyPass(torch.autograd.Function):
    """(logits [rows, V], tokens [rows]) -> log-prob of each token [rows] (differentiable in the
    logits) and, when asked, the entropy of each row [rows] (not differentiable)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        n_rows = logits.shape[0]
        log_z = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n_rows if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start, end in _chunks(n_rows, logits.shape[-1]):
            scores = _scaled(logits[start:end], temperature)
            chunk_log_z = torch.logsumexp(scores, dim=-1)
            log_z[start:end] = chunk_log_z
            logp[start:end] = scores.gather(-1, tokens[start:end, None]).squeeze(-1) - chunk_log_z
            if with_entropy:
                entropy[start:end] = _entropy_of_rows(scores, chunk_log_z)
        ctx.save_for_backward(logits, tokens, log_z)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        """d logp_r / d score_rv = [v = token_r] - softmax_rv, computed as autograd computes
        `chosen - logsumexp`: (-g) * exp(score - logZ), then + g at the token."""
        logits, tokens, log_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start, end in _chunks(logits.shape[0], logits.shape[-1]):
            scores = _scaled(logits[start:end], ctx.temperature)
            g = grad_logp[start:end]
            chunk_grad = (-g)[:, None] * (scores - log_z[start:end, None]).exp()
            chunk_grad.scatter_add_(-1, tokens[start:end, None], g[:, None])
            if ctx.temperature != 1.0:
                chunk_grad = chunk_grad / ctx.temperature
            grad[start:end] = chunk_grad
        return grad, None, None, None


def _vocabulary_pass(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: it must be > 0")
    flat_logits, flat_tokens = _flat_rows(logits, tokens)
    logp, entropy = _VocabularyPass.apply(flat_logits, flat_tokens, float(temperature), with_entropy)
    return logp.reshape(tokens.shape), entropy.reshape(tokens.shape) if with_entropy else None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token], in float32, without a full-vocabulary tensor.
    logits: [..., V]; tokens: [...] (int64). Differentiable in the logits."""
    return _vocabulary_pass(logits, tokens, temperature, with_entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both from one read of each logit chunk: the training forward needs both and the
    vocabulary pass is the expensive part. The log-probs carry gradient, the entropy does not."""
    return _vocabulary_pass(logits, tokens, temperature, with_entropy=True)
