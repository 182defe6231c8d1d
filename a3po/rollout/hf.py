"""Rollout with transformers `generate` (KV cache), the CPU default.

The engine samples from the trainer's own module rather than a copy: on one CPU process a
second copy would double memory for nothing, and the lagged runtime only ever generates
between training steps. `update_weights` therefore costs nothing but a version bump, which
is honest: there is no transfer to time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from a3po.rollout.base import Generation


class HFEngine:
    def __init__(self, policy: torch.nn.Module, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 32, batch_size: int | None = None, version: int = 0) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
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
    def generate(self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int) -> list[list[Generation]]:
        """Sample n_samples per prompt; the RNG is seeded here so a batch depends on (weights, seed) only."""
        requests = [list(ids) for ids in prompt_ids for _ in range(n_samples)]
        chunk = self.batch_size or len(requests)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            flat: list[Generation] = []
            for start in range(0, len(requests), chunk):
                flat.extend(self._generate_chunk(requests[start:start + chunk]))
        finally:
            torch.random.set_rng_state(generator_state)
        return [flat[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_ids))]

    def _generate_chunk(self, requests: list[list[int]]) -> list[Generation]:
        device = next(self.policy.parameters()).device
        width = max(len(r) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, ids in enumerate(requests):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        was_training = self.policy.training
        self.policy.eval()
        try:
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
            generations.append(Generation(
                prompt_ids=torch.tensor(ids, dtype=torch.long),
                response_ids=tokens[:length].clone(),
                behave_logp=logp[row, :length].clone(),
                versions=torch.full((length,), self.version, dtype=torch.long),
                finished=finished,
            ))
        return generations
