"""Rollout with transformers `generate` (KV cache), the CPU default.

The engine samples from the trainer's own module rather than a copy: on one CPU process a
second copy would double memory for nothing, and the lagged runtime only ever generates
between training steps. `update_weights` therefore costs nothing but a version bump, which
is honest: there is no transfer to time. `HFCopyEngine` is the variant for generation
concurrent with training (runtime=async): it owns a private copy of the weights.
"""

from __future__ import annotations

import copy
import threading
from typing import Sequence

import torch

from a3po.batch import Sample
from a3po.device import autocast, autocast_dtype
from a3po.seeds import seeded
from a3po.rollout.base import GenerationCancelled, StagedWeightUpdates


class HFEngine:
    def __init__(self, policy: torch.nn.Module, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 32, batch_size: int | None = None, version: int = 0,
                 precision: str = "fp32") -> None:
        self.policy = policy
        self.precision = precision  # resolved (a3po.device): the trainer's, so behave_logp is computed alike
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = batch_size
        self.version = version
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = self._eos_ids(policy, tokenizer)

    @staticmethod
    def _eos_ids(policy, tokenizer) -> set[int]:
        ids = {tokenizer.eos_token_id}
        configured = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(configured)
        return {i for i in ids if i is not None}

    def update_weights(self, policy: torch.nn.Module, version: int) -> None:
        self.policy = policy
        self.version = version

    def close(self) -> None:
        self.policy = None

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int) -> list[list[Sample]]:
        """Sample n_samples per prompt; the RNG is seeded here so a batch depends on (weights, seed) only."""
        requests = [list(ids) for ids in prompt_ids for _ in range(n_samples)]
        chunk = self.batch_size or len(requests)
        flat: list[Sample] = []
        with seeded(seed):
            for start in range(0, len(requests), chunk):
                flat.extend(self._generate_chunk(requests[start:start + chunk]))
        return [flat[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_ids))]

    def _generate_chunk(self, requests: list[list[int]]) -> list[Sample]:
        device = next(self.policy.parameters()).device
        width = max(len(r) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, ids in enumerate(requests):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        was_training = self.policy.training
        self.policy.eval()
        # The trainer's precision rule, so the behaviour log-probs are computed as the
        # trainer's own forward computes them.
        try:
            with autocast(device, autocast_dtype(device, self.policy, self.precision)):
                out = self.policy.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    do_sample=True,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    top_k=0,
                    max_new_tokens=self.max_new_tokens,
                    pad_token_id=self.pad_id,
                    eos_token_id=sorted(self.eos_ids),
                    output_scores=True,  # processed scores: exactly the distribution sampled from
                    return_dict_in_generate=True,
                )
        finally:
            self.policy.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        # scores[i] is [batch, vocab] for generated position i; log-softmax in float32
        scores = torch.stack(out.scores, dim=1).float().cpu()
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        generations = []
        for row, ids in enumerate(requests):
            tokens = new_tokens[row]
            is_eos = torch.isin(tokens, torch.tensor(sorted(self.eos_ids)))
            finished = bool(is_eos.any())
            length = int(is_eos.nonzero()[0, 0]) + 1 if finished else tokens.numel()
            generations.append(Sample(
                prompt_ids=torch.tensor(ids, dtype=torch.long),
                response_ids=tokens[:length].clone(),
                behave_logp=logp[row, :length].clone(),
                versions=torch.full((length,), self.version, dtype=torch.long),
                finished=finished,
            ))
        return generations


class HFCopyEngine(StagedWeightUpdates, HFEngine):
    """An HF engine over a private copy of the policy, for generation concurrent with training.

    `HFEngine` samples from the trainer's own module, which the optimizer changes in place
    mid-generation. This copy changes only between `generate` calls: an update that arrives
    while a batch is generating is staged (one clone of the state dict) and loaded before the
    next batch, so every token of a call is sampled, and stamped, by one version and the
    trainer never waits for generation to finish.
    """

    def __init__(self, policy: torch.nn.Module, tokenizer, **kwargs) -> None:
        # Keeps the trainer's requires_grad flags (generation runs under no_grad, so they cost
        # nothing): torch.matmul picks mm or bmm by them for the prefill's non-contiguous
        # last-position hidden states, and a copy without them samples behaviour log-probs
        # that differ from the trainer's module in the last bits.
        private = copy.deepcopy(policy)
        super().__init__(private, tokenizer, **kwargs)
        self._init_staging()
        self._cancelled = threading.Event()
        # generate() calls forward once per new token: the earliest point a cancel can act
        private.register_forward_pre_hook(self._raise_if_cancelled)

    def _raise_if_cancelled(self, module, args) -> None:
        if self._cancelled.is_set():
            raise GenerationCancelled("generation cancelled: the runtime is shutting down")

    @torch.no_grad()
    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        for name, tensor in self.policy.state_dict().items():
            tensor.copy_(state[name])
        self.version = version

    def update_weights(self, policy: torch.nn.Module, version: int) -> None:
        if policy is self.policy:
            raise ValueError("HFCopyEngine.update_weights got its own private copy; pass the trainer's policy")
        StagedWeightUpdates.update_weights(self, policy, version)

    def generate(self, prompt_ids, n_samples: int, *, seed: int):
        with self._generate_lock:
            if self._cancelled.is_set():
                raise GenerationCancelled("generation cancelled: the runtime is shutting down")
            self._apply_pending()
            return super().generate(prompt_ids, n_samples, seed=seed)

    def cancel(self) -> None:
        """End the current and every later `generate` with GenerationCancelled (shutdown)."""
        self._cancelled.set()

    def close(self) -> None:
        self.cancel()
        with self._generate_lock:
            self._pending = None
            super().close()
