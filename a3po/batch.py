"""The data that flows from rollout to the trainer: one `Sample` per response, one
`RolloutBatch` per training step. Engines produce samples (reward unset), the producer
scores them, the runtime delivers batches, the trainer consumes them; nothing here imports
any of those, so the data path stays one-way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One sampled response; tensors are 1-D.

    prompt_ids: the prompt's token ids (no padding).
    response_ids: the generated token ids, EOS included when one was produced, no padding.
    behave_logp: float32 log-prob of each response token under the behaviour policy that
        sampled it (temperature and top-p applied exactly as sampled).
    versions: int64 policy version stamped on each response token when it was generated
        (per token: an interruptible engine may change weights mid-sequence).
    finished: False when generation stopped at max_new_tokens (truncated).
    reward: the task's score, set by the producer after generation.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    behave_logp: torch.Tensor
    versions: torch.Tensor
    finished: bool = True
    reward: float = 0.0

    def __post_init__(self) -> None:
        n = self.response_ids.numel()
        if self.behave_logp.numel() != n or self.versions.numel() != n:
            raise ValueError(
                f"Sample: response_ids has {n} tokens but behave_logp has {self.behave_logp.numel()} and "
                f"versions {self.versions.numel()}; they must match"
            )

    @property
    def length(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()


@dataclass
class RolloutBatch:
    """The samples for one training step: n_prompts groups of n_samples, in group order. Data
    only: the metrics that describe it travel beside it (a3po.rollout.producer.Rollout)."""

    step: int
    samples: list[Sample]
    n_prompts: int
    n_samples: int
