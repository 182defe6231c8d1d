"""Rollout on the Hugging Face model itself, the CPU default: our own decode loop
(a3po.rollout.decode) over the model's decoder and output layer.

`HFEngine` samples between training steps (runtime=lagged): from the trainer's own module in
float32, or in bf16 from a copy of its linear layers kept in bf16 and refreshed at each weight
sync (the sync's only cost). `HFCopyEngine` is the variant for generation concurrent with
training (runtime=async): it owns a private copy of every weight.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from a3po.batch import Sample
from a3po.device import autocast_dtype
from a3po.rollout.base import GenerationCancelled, StagedWeightUpdates
from a3po.rollout.decode import decode
from a3po.rollout.weights import ComputeWeights


class HFEngine:
    private = False  # ComputeWeights: share the trainer's tensors that need no cast

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
        device = next(policy.parameters()).device
        # The trainer's precision rule, so the behaviour log-probs are computed as the
        # trainer's own forward computes them; the weights stored as that rule casts them.
        self.autocast_dtype = autocast_dtype(device, policy, precision)
        self.weights = ComputeWeights(policy, self.autocast_dtype, private=self.private)

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
        self.weights.refresh(policy)
        self.version = version

    def close(self) -> None:
        self.policy = None
        self.weights = None

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int) -> list[list[Sample]]:
        """Sample n_samples per prompt from a generator seeded here: a batch depends on
        (weights, seed) only, whatever else draws random numbers meanwhile."""
        requests = [list(ids) for ids in prompt_ids for _ in range(n_samples)]
        chunk = self.batch_size or len(requests)
        device = next(self.weights.module.parameters()).device
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
        flat: list[Sample] = []
        for start in range(0, len(requests), chunk):
            flat.extend(self._generate_chunk(requests[start:start + chunk], generator, device))
        return [flat[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_ids))]

    def _generate_chunk(self, requests: list[list[int]], generator: torch.Generator,
                        device: torch.device) -> list[Sample]:
        index: dict[tuple[int, ...], int] = {}  # a group's samples share one prefill
        rows_of = torch.tensor([index.setdefault(tuple(r), len(index)) for r in requests])
        distinct = list(index)
        width = max(len(r) for r in requests)
        input_ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        real = torch.zeros((len(distinct), width), dtype=torch.bool)
        for row, ids in enumerate(distinct):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            real[row, width - len(ids):] = True
        module = self.weights.module
        was_training = module.training
        module.eval()
        try:
            out = decode(module, input_ids.to(device), real.to(device), max_new_tokens=self.max_new_tokens,
                         stop_ids=torch.tensor(sorted(self.eos_ids), device=device), pad_id=self.pad_id,
                         generator=generator, temperature=self.temperature, top_p=self.top_p,
                         autocast_dtype=self.autocast_dtype, rows_of=rows_of.to(device))
        finally:
            module.train(was_training)
        tokens, logp = out.tokens.cpu(), out.logp.cpu()
        return [Sample(prompt_ids=torch.tensor(ids, dtype=torch.long),
                       response_ids=tokens[row, :length].clone(),
                       behave_logp=logp[row, :length].clone(),
                       versions=torch.full((length,), self.version, dtype=torch.long),
                       finished=finished)
                for row, (ids, length, finished) in enumerate(zip(requests, out.lengths, out.finished))]


class HFCopyEngine(StagedWeightUpdates, HFEngine):
    """An HF engine over a private copy of the policy, for generation concurrent with training.

    `HFEngine` samples from the trainer's own tensors, which the optimizer changes in place
    mid-generation. This copy changes only between `generate` calls: an update that arrives
    while a batch is generating is staged (one clone of the state dict) and loaded before the
    next batch, so every token of a call is sampled, and stamped, by one version and the
    trainer never waits for generation to finish.
    """

    private = True  # ComputeWeights: every tensor the copy's own

    def __init__(self, policy: torch.nn.Module, tokenizer, **kwargs) -> None:
        # The copy keeps the trainer's requires_grad flags (generation runs under no_grad, so
        # they cost nothing): torch.matmul picks mm or bmm by them for non-contiguous inputs,
        # and a copy without them samples behaviour log-probs that differ in the last bits.
        super().__init__(policy, tokenizer, **kwargs)
        self.policy = self.weights.module
        self._init_staging()
        self._cancelled = threading.Event()
        # the decode loop calls the decoder once per new token: the earliest point a cancel can act
        self.weights.module.get_decoder().register_forward_pre_hook(self._raise_if_cancelled)

    def _raise_if_cancelled(self, module, args) -> None:
        if self._cancelled.is_set():
            raise GenerationCancelled("generation cancelled: the runtime is shutting down")

    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.weights.load_state(state)
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
