"""One GRPO training step with a pluggable proximal policy.

advantages (GRPO group norm) -> prox logp (by algo) -> n_minibatches optimizer updates, each accumulated
over token-budget micro-batches -> grad clip -> optimizer step. The metrics are declared in a3po.metrics,
the maths in a3po.maths; this file only moves tensors between them and the model. With N ranks
(a3po.distributed) each trains on its shard of every minibatch; the loss stays the 1-process token mean."""

from __future__ import annotations

from typing import Mapping

import torch

from a3po.batch import RolloutBatch, Sample
from a3po.device import autocast, autocast_dtype
from a3po.learner.anchors import Anchor
from a3po.learner.batching import pack_micro_batches, split_minibatches
from a3po.learner.fidelity import FidelityRecorder
from a3po.learner.hybrid import drift_ess
from a3po.learner.step_metrics import StepMetrics
from a3po.learner.update import all_finite, check_update, clip_gradients, make_optimizer
from a3po.maths.advantages import grpo_advantages
from a3po.maths.logprobs import token_logprobs, token_logprobs_and_entropy
from a3po.maths.loss import decoupled_loss
from a3po.maths.spec import Bound
from a3po.models.loading import compiled_layers, enable_activation_checkpointing, layers_swapped
from a3po.schema import TrainConfig
from a3po.distributed import SINGLE, DistInfo, all_reduce_max, all_reduce_sum, local_value, shard, wrap_fsdp
from a3po.timer import DeviceSpans, PhaseTimer


class Trainer:
    """The learner: forwards, the proximal log-probs of the run's method and the optimizer updates
    of one step, from its parts: the `train` group, the method's anchor strategy, the loss's
    objective and correction bound to their parameters (a3po.maths.spec.Bound), the sampling
    temperature, the resolved precision and, with `train.log_prox_errors`, the fidelity
    telemetry. `trainer_from` builds them from the run's config."""

    def __init__(self, policy: torch.nn.Module, train: TrainConfig, *, anchor: Anchor, objective: Bound,
                 correction: Bound, temperature: float, precision: str, pad_id: int, device: torch.device,
                 timer: PhaseTimer, dist: DistInfo = SINGLE, fidelity: FidelityRecorder | None = None) -> None:
        self.policy = policy
        # With N ranks (a3po.distributed) each trains on its shard of every minibatch; the
        # model is sharded with FSDP2 before the optimizer sees its parameters.
        self.dist = dist
        self.anchor, self.objective, self.correction, self.fidelity = anchor, objective, correction, fidelity
        self.device = device  # the anchor makes its per-step metrics here (a3po.learner.step_metrics)
        self.train = train
        self.temperature = float(temperature)
        self.pad_id = pad_id
        self.timer = timer
        # The lm_head is applied only at response positions: most positions of a sequence are
        # prompt, and a [tokens, vocab] logits tensor is the largest thing in the step.
        self._decoder = policy.get_decoder() if hasattr(policy, "get_decoder") else None
        self._lm_head = policy.get_output_embeddings()
        self._logits = self._response_logits
        if train.activation_checkpointing:  # before FSDP2 shards the layers
            enable_activation_checkpointing(policy)
        self._compiled = compiled_layers(policy, dist.world) if train.compile else None  # train.compile
        if dist.world > 1:  # the root's parameters are gathered around this call as around forward
            self._logits = wrap_fsdp(policy, forward_method=self._response_logits,
                                     mixed_precision=train.fsdp_mixed_precision)
        self.optimizer = make_optimizer(policy, train)
        # `precision` (resolved, a3po.device): bf16 is autocast with float32 master weights,
        # optimizer and log-softmax; the HF engine samples under the same rule, so behave and
        # current log-probs are computed alike.
        self.precision = precision
        self.autocast_dtype = autocast_dtype(device, policy, precision)

    # ------------------------------------------------------------------ forward
    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host-built tensors go to a GPU from pinned memory without blocking: a pageable copy
        waits for the queue to drain, which would be a hidden sync per micro-batch."""
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _padded_inputs(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, flat indices of the positions that predict a response token)."""
        width = max(s.length for s in samples)
        input_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        positions = []
        for row, s in enumerate(samples):
            n_prompt, n_resp = s.prompt_ids.numel(), s.response_ids.numel()
            input_ids[row, :n_prompt] = s.prompt_ids
            input_ids[row, n_prompt:n_prompt + n_resp] = s.response_ids
            attention_mask[row, :n_prompt + n_resp] = 1
            # the logits at position i predict token i + 1
            start = row * width + n_prompt - 1
            positions.append(torch.arange(start, start + n_resp))
        # Built on the host: a boolean-mask index on a GPU would sync to learn how many rows it selects.
        return self._to_device(input_ids), self._to_device(attention_mask), self._to_device(torch.cat(positions))

    def response_logp(self, samples: list[Sample], with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (with grad if enabled) and entropy of every response token, concatenated
        sample by sample in order; one padded forward of the micro-batch. The entropy (None
        when not asked for) is a logged metric: the recompute forward does not need it."""
        input_ids, attention_mask, predicts_response = self._padded_inputs(samples)
        targets = self._to_device(torch.cat([s.response_ids for s in samples]))
        with autocast(self.device, self.autocast_dtype):
            logits = self._logits(input_ids, attention_mask, predicts_response)
        # the temperature divides the float32 logits inside the vocabulary pass, as the sampler divides them
        if not with_entropy:
            return token_logprobs(logits, targets, self.temperature), None
        return token_logprobs_and_entropy(logits, targets, self.temperature)

    def _response_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         predicts_response: torch.Tensor) -> torch.Tensor:
        """Logits at the positions that predict a response token, one row each."""
        if self._decoder is not None:
            with layers_swapped(self._decoder, self._compiled):
                hidden = self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return self._lm_head(hidden.last_hidden_state.flatten(0, 1).index_select(0, predicts_response))
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return logits.flatten(0, 1).index_select(0, predicts_response)

    def warm_up(self, prompt_ids: list[int]) -> None:
        """The first calls' set-up cost paid before step 0 (a3po.run.main.warm_up): forward + backward
        on two rows of `prompt_ids` (compiled layers would specialise on one), and, compiled, the no-grad
        forward where the run recomputes. No optimizer step, no RNG, gradients dropped: no result changes."""
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        n = max(1, min(8, ids.numel() // 2))
        rows = [Sample(prompt_ids=ids[:-n], response_ids=ids[-n:], behave_logp=torch.zeros(n),
                       versions=torch.zeros(n, dtype=torch.long))] * 2
        self.policy.train()
        logp, _ = self.response_logp(rows)  # with the entropy, as a training forward
        (logp.sum() * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.eval()  # as the recompute forward runs
        if self._compiled is not None and (self.anchor.may_recompute() or self.fidelity):
            with torch.no_grad():
                self.response_logp(rows, with_entropy=False)

    @torch.no_grad()
    def recompute_prox_logp(self, samples: list[Sample], plans: list[list[list[int]]]) -> dict[int, torch.Tensor]:
        """`recompute`: the no-grad forward of the weights as they are at the START of the step,
        frozen for every minibatch; the cost A-3PO removes; in eval mode at every step (no dropout,
        one compiled graph). Sample index -> its response tokens' log-probs."""
        self.policy.eval()
        prox_by_sample: dict[int, torch.Tensor] = {}
        for plan in plans:
            for micro in plan:
                if not micro:
                    self._idle_pass(samples, backward=False)
                    continue
                logp, _ = self.response_logp([samples[i] for i in micro], with_entropy=False)
                for i, piece in zip(micro, logp.split([samples[i].response_ids.numel() for i in micro])):
                    prox_by_sample[i] = piece
        return prox_by_sample

    def plan(self, samples: list[Sample], generator: torch.Generator) -> list[list[list[int]]]:
        """Minibatches of sample indices (the same on every rank), this rank's shard of each
        cut into token-budget micro-batches."""
        minibatches = split_minibatches(len(samples), self.train.n_minibatches, generator)
        plans = [pack_micro_batches({i: samples[i].length for i in shard(mb, self.dist.rank, self.dist.world)},
                                    self.train.token_budget) for mb in minibatches]
        return plans if self.dist.world == 1 else self._equal_micro_batch_counts(plans)

    def _equal_micro_batch_counts(self, plans: list[list[list[int]]]) -> list[list[list[int]]]:
        """FSDP gathers and reduces in every forward and backward, so every rank must run as
        many micro-batches as the rank with the most; the others get empty ones, run as an
        idle pass (`_idle_pass`) that changes nothing."""
        counts = all_reduce_max(torch.tensor([len(plan) for plan in plans], device=self.device)).tolist()
        return [plan + [[] for _ in range(count - len(plan))] for plan, count in zip(plans, counts)]

    def _idle_pass(self, samples: list[Sample], backward: bool) -> None:
        """A forward (and a zero backward) on one sample: FSDP's collectives, no effect."""
        logp, _ = self.response_logp(samples[:1], with_entropy=False)
        if backward:
            (logp.sum() * 0.0).backward()

    def minibatch_tokens(self, samples: list[Sample], plan: list[list[int]]) -> int:
        """Response tokens in the whole minibatch, over every rank's shard: the denominator of
        the token mean, so N ranks' summed gradients are the 1-process gradient."""
        local = sum(samples[i].response_ids.numel() for micro in plan for i in micro)
        if self.dist.world == 1:
            return local
        return int(all_reduce_sum(torch.tensor(local, device=self.device)).item())

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
        rewards = (rewards + self.train.reward_bias) * self.train.reward_scaling
        advantages = grpo_advantages(rewards.view(batch.n_prompts, batch.n_samples), norm_std=self.train.adv_norm_std,
                                     unbiased=self.train.adv_std_unbiased, eps=self.train.adv_eps).view(-1)
        if self.train.adv_batch_norm:
            # token-weighted, as a normalisation over the batch's response tokens would be
            lengths = torch.tensor([s.response_ids.numel() for s in batch.samples], dtype=torch.float32)
            mean = (advantages * lengths).sum() / lengths.sum()
            std = (((advantages - mean) ** 2 * lengths).sum() / lengths.sum()).sqrt()
            advantages = (advantages - mean) / (std + 1e-5)
        return advantages

    # ------------------------------------------------------------------ step
    def step(self, batch: RolloutBatch, version: int, generator: torch.Generator) -> dict[str, float]:
        """Train on one batch at trainer version `version`; returns the step's scalar metrics."""
        samples = batch.samples
        advantages = self.advantages(batch)
        plans = self.plan(samples, generator)
        metrics = StepMetrics(self.device)
        recompute = self._decide(samples, plans, version, metrics)
        recomputed = self._recomputed_prox(samples, plans, recompute)
        approximation_time = DeviceSpans(self.device)

        self.policy.train()
        with self.timer.phase("train"):
            for index, plan in enumerate(plans):
                n_tokens = self.minibatch_tokens(samples, plan)
                self.optimizer.zero_grad(set_to_none=True)
                minibatch_loss = torch.zeros((), device=self.device)
                finite_flags: list[torch.Tensor] = []
                # one autocast scope per minibatch: weights cast once, not per micro-batch (same values)
                with autocast(self.device, self.autocast_dtype):
                    for micro in plan:
                        if not micro:  # another rank has more micro-batches (`_equal_micro_batch_counts`)
                            self._idle_pass(samples, backward=True)
                            continue
                        tokens = self._micro_batch_tensors([samples[i] for i in micro], advantages[micro])
                        logp, entropy = self.response_logp([samples[i] for i in micro])
                        if self.fidelity:
                            self.fidelity.record(metrics, torch.cat([recomputed[i] for i in micro]), logp, entropy, tokens,
                                                 version, index, len(plans), micro is next(m for m in plan if m),
                                                 lambda anchor: self.loss(logp, anchor, tokens)[0])
                        if recompute:
                            prox = torch.cat([recomputed[i] for i in micro])
                        else:
                            with approximation_time.span():
                                prox = self.approximate_prox(tokens["behave"], logp, tokens["versions"], version,
                                                             position=index / len(plans))
                                finite_flags.append(all_finite(prox))
                        loss, stats = self.loss(logp, prox, tokens)
                        weight = logp.numel() / n_tokens  # token mean over the whole minibatch, every rank's shard
                        (loss * weight).backward()
                        minibatch_loss = minibatch_loss + loss.detach() * weight
                        metrics.add({**stats, "actor/entropy": entropy.mean()}, n_tokens=logp.numel())
                grad_norm = local_value(clip_gradients(self.policy, self.train.grad_clip, self.dist.world > 1))
                # one host sync per minibatch, before the update: nothing non-finite reaches the weights
                check_update(finite_flags, minibatch_loss, grad_norm, version, index, len(plans), self.dist)
                self.optimizer.step()
                metrics.add({"actor/grad_norm": grad_norm, "actor/loss": minibatch_loss})
        self.optimizer.zero_grad(set_to_none=True)
        if not recompute:
            self.timer.add("prox_logp", approximation_time.seconds())
        return metrics.result(across_ranks=self.dist.world > 1)

    def _recomputed_prox(self, samples: list[Sample], plans, recompute: bool) -> dict[int, torch.Tensor]:
        """The recompute forward when this step trains against it (timed as `prox_logp`), or
        when approximation errors are logged against it (timed apart, as `prox_reference`)."""
        if recompute:
            with self.timer.phase("prox_logp"):
                return self.recompute_prox_logp(samples, plans)
        if self.fidelity:
            with self.timer.phase("prox_reference"):
                return self.recompute_prox_logp(samples, plans)
        return {}

    def loss(self, logp: torch.Tensor, prox: torch.Tensor, tokens: Mapping[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's decoupled loss (a3po.maths.loss) and its metrics as 0-dim tensors."""
        return decoupled_loss(logp, prox, tokens["behave"], tokens["advantages"], tokens["seq_index"], tokens["mask"],
                              objective=self.objective, correction=self.correction)

    def _micro_batch_tensors(self, samples: list[Sample], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
        """A micro-batch's per-token inputs, concatenated sample by sample, on the device."""
        behave = self._to_device(torch.cat([s.behave_logp for s in samples]))
        sizes = [s.response_ids.numel() for s in samples]
        seq_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        return {
            "behave": behave,
            "seq_index": self._to_device(seq_index),
            "versions": self._to_device(torch.cat([s.versions for s in samples])),
            "advantages": self._to_device(torch.cat([a.expand(n) for a, n in zip(advantages, sizes)])),
            "mask": torch.ones_like(behave, dtype=torch.bool),
        }

    def approximate_prox(self, behave: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor,
                         version: int, position: float = 0.0) -> torch.Tensor:
        """One micro-batch's proximal log-probs without a forward pass, in minibatch k of m
        (`position` = k/m): the method's anchor strategy (a3po.learner.anchors)."""
        return self.anchor.approximate(behave, logp, versions, version, position)

    def _decide(self, samples: list[Sample], plans: list[list[list[int]]], version: int, metrics: StepMetrics) -> bool:
        """Whether this step trains against recompute's forward: the anchor strategy decides (the
        hybrid's drift probe: the step's first micro-batch, in eval mode as recompute's, timed as `prox_logp`)."""
        def probe() -> torch.Tensor:
            self.policy.eval()
            with self.timer.phase("prox_logp"):
                return drift_ess(self.response_logp, [samples[i] for i in next(m for plan in plans for m in plan if m)])
        recompute, decided = self.anchor.decide(version, probe)
        metrics.add(decided)
        return recompute

