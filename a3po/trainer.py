"""One GRPO training step with a pluggable proximal policy.

advantages (GRPO group norm) -> prox logp (by algo) -> n_minibatches optimizer updates, each
accumulated over token-budget micro-batches -> grad clip -> optimizer step. Every phase is
timed with the DESIGN.md section 3 names. The maths lives in a3po.loss and a3po.proximal;
this file only moves tensors between them and the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from a3po.errors import ConfigError
from a3po.loss import grpo_advantages, ppo_actor_loss, token_logprobs_and_entropy
from a3po.proximal import approximate_prox_logp, approximation_errors, staleness_stats, validate_schedule
from a3po.timer import PhaseTimer


@dataclass
class Sample:
    """One response with everything the loss needs; tensors are 1-D over response tokens."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    behave_logp: torch.Tensor
    versions: torch.Tensor
    group: int
    reward: float

    @property
    def length(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()


@dataclass
class RolloutBatch:
    """The samples for one training step: n_prompts groups of n_samples, in group order."""

    step: int
    samples: list[Sample]
    n_prompts: int
    n_samples: int
    stats: dict[str, float] = field(default_factory=dict)


def split_minibatches(n_items: int, n_minibatches: int, generator: torch.Generator) -> list[list[int]]:
    """A seeded shuffle cut into n_minibatches near-equal parts: each sample is used once a step."""
    order = torch.randperm(n_items, generator=generator).tolist()
    return [part.tolist() for part in torch.tensor(order).tensor_split(n_minibatches) if part.numel()]


def pack_micro_batches(lengths: Mapping[int, int], token_budget: int) -> list[list[int]]:
    """Group sample indices so each padded micro-batch (count x longest) fits the budget.

    Longest first, so a micro-batch's samples have similar lengths and padding stays small.
    """
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    micro_batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if lengths[index] > token_budget:
            raise ConfigError(
                f"train.token_budget={token_budget} is not allowed: a sequence of {lengths[index]} tokens "
                "(prompt + response) does not fit one micro-batch; raise the budget or shorten responses"
            )
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > token_budget:
            micro_batches.append(current)
            current = []
        current.append(index)
    if current:
        micro_batches.append(current)
    return micro_batches


class Trainer:
    def __init__(self, policy: torch.nn.Module, *, algo_cfg, schedule_cfg: Mapping[str, Any], train_cfg,
                 temperature: float, pad_id: int, device: torch.device, timer: PhaseTimer) -> None:
        self.policy = policy
        self.algo = algo_cfg
        self.prox_method = algo_cfg.prox
        self.schedule = schedule_cfg["name"]
        self.schedule_params = validate_schedule(self.schedule, schedule_cfg)
        self.error_schedules = {name: dict(params or {}) for name, params in (algo_cfg.get("error_schedules") or {}).items()}
        self.cfg = train_cfg
        self.temperature = float(temperature)
        self.pad_id = pad_id
        self.device = device
        self.timer = timer
        self.optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad],
            lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
            weight_decay=train_cfg.weight_decay,
        )
        # The lm_head is applied only at response positions: most positions of a sequence are
        # prompt, and a [tokens, vocab] logits tensor is the largest thing in the step.
        self._decoder = policy.get_decoder() if hasattr(policy, "get_decoder") else None
        self._lm_head = policy.get_output_embeddings()

    # ------------------------------------------------------------------ forward
    def response_logp(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (with grad if enabled) and entropy of every response token, concatenated
        sample by sample in order; one padded forward of the micro-batch."""
        width = max(s.length for s in samples)
        input_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        predicts_response = torch.zeros((len(samples), width), dtype=torch.bool)
        for row, s in enumerate(samples):
            n_prompt, n_resp = s.prompt_ids.numel(), s.response_ids.numel()
            input_ids[row, :n_prompt] = s.prompt_ids
            input_ids[row, n_prompt:n_prompt + n_resp] = s.response_ids
            attention_mask[row, :n_prompt + n_resp] = 1
            # the logits at position i predict token i + 1
            predicts_response[row, n_prompt - 1:n_prompt + n_resp - 1] = True
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        predicts_response = predicts_response.to(self.device)
        targets = torch.cat([s.response_ids for s in samples]).to(self.device)
        if self._decoder is not None:
            hidden = self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            logits = self._lm_head(hidden[predicts_response])
        else:
            logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[predicts_response]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return token_logprobs_and_entropy(logits, targets)

    # ------------------------------------------------------------------ step
    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
        rewards = (rewards + self.cfg.reward_bias) * self.cfg.reward_scaling
        advantages = grpo_advantages(rewards.view(batch.n_prompts, batch.n_samples), norm_std=self.cfg.adv_norm_std).view(-1)
        if self.cfg.get("adv_batch_norm", False):
            # token-weighted, as a normalisation over the batch's response tokens would be
            lengths = torch.tensor([s.response_ids.numel() for s in batch.samples], dtype=torch.float32)
            mean = (advantages * lengths).sum() / lengths.sum()
            std = (((advantages - mean) ** 2 * lengths).sum() / lengths.sum()).sqrt()
            advantages = (advantages - mean) / (std + 1e-5)
        return advantages

    def step(self, batch: RolloutBatch, version: int, generator: torch.Generator) -> dict[str, float]:
        """Train on one batch at trainer version `version`; returns the step's scalar metrics."""
        samples = batch.samples
        advantages = self.advantages(batch)
        minibatches = split_minibatches(len(samples), self.cfg.n_minibatches, generator)
        plans = [pack_micro_batches({i: samples[i].length for i in mb}, self.cfg.token_budget) for mb in minibatches]

        prox_by_sample: dict[int, torch.Tensor] = {}
        if self.prox_method == "recompute":
            # The weights as they are at the START of the step, frozen for every minibatch.
            with self.timer.phase("prox_logp"), torch.no_grad():
                for plan in plans:
                    for micro in plan:
                        logp, _ = self.response_logp([samples[i] for i in micro])
                        for i, piece in zip(micro, logp.split([samples[i].response_ids.numel() for i in micro])):
                            prox_by_sample[i] = piece

        all_versions = torch.cat([s.versions for s in samples])
        scalars: dict[str, list[torch.Tensor]] = {}
        counts: list[torch.Tensor] = []
        grad_norms: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []

        def keep(name: str, value: torch.Tensor) -> None:
            scalars.setdefault(name, []).append(value.detach().float().reshape(()))

        self.policy.train()
        with self.timer.phase("train"):
            for plan in plans:
                n_tokens = sum(samples[i].response_ids.numel() for micro in plan for i in micro)
                self.optimizer.zero_grad(set_to_none=True)
                minibatch_loss = torch.zeros((), device=self.device)
                for micro in plan:
                    micro_samples = [samples[i] for i in micro]
                    sizes = [s.response_ids.numel() for s in micro_samples]
                    logp, entropy = self.response_logp(micro_samples)
                    behave = torch.cat([s.behave_logp for s in micro_samples]).to(self.device)
                    versions = torch.cat([s.versions for s in micro_samples]).to(self.device)
                    token_adv = torch.cat([advantages[i].expand(n) for i, n in zip(micro, sizes)]).to(self.device)
                    mask = torch.ones_like(behave, dtype=torch.bool)
                    prox = self._prox_logp(micro, sizes, prox_by_sample, behave, logp, versions, version)
                    loss, stats = ppo_actor_loss(
                        logp, prox, behave, token_adv, mask, eps_clip=self.cfg.eps_clip,
                        eps_clip_higher=self.cfg.eps_clip_higher, behave_weight_cap=self.cfg.behave_weight_cap,
                    )
                    weight = logp.numel() / n_tokens  # token mean over the whole minibatch
                    (loss * weight).backward()
                    minibatch_loss = minibatch_loss + loss.detach() * weight
                    counts.append(torch.tensor(float(logp.numel()), device=self.device))
                    for name in ("importance_weight/max", "importance_weight/min", "importance_weight/mean",
                                 "behave_weight/max", "behave_weight/min", "behave_weight/mean",
                                 "behave_weight/capped_tokens", "clipped_tokens", "approx_kl/mean"):
                        keep(name, stats[name])
                    keep("entropy", entropy.mean())
                    if self.algo.name == "metrics":
                        errors = approximation_errors(prox, behave, logp.detach(), versions, version, mask, self.error_schedules)
                        for name, value in errors.items():
                            keep(name, value)
                grad_norms.append(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.grad_clip))
                self.optimizer.step()
                losses.append(minibatch_loss)
        self.optimizer.zero_grad(set_to_none=True)
        return self._reduce(scalars, counts, grad_norms, losses, all_versions, version, batch)

    def _prox_logp(self, micro: list[int], sizes: list[int], prox_by_sample: dict[int, torch.Tensor],
                   behave: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, version: int) -> torch.Tensor:
        if self.prox_method == "recompute":
            return torch.cat([prox_by_sample[i] for i in micro])
        with self.timer.phase("prox_logp"):
            if self.prox_method == "behave":
                return behave
            return approximate_prox_logp(behave, logp.detach(), versions, version, method=self.prox_method,
                                         schedule=self.schedule, **self.schedule_params)

    @staticmethod
    def _reduce(scalars, counts, grad_norms, losses, all_versions, version, batch) -> dict[str, float]:
        """Combine per-micro-batch reductions into per-step metrics with one host transfer."""
        weights = torch.stack(counts)
        total = weights.sum()
        stacked = {name: torch.stack(values) for name, values in scalars.items()}
        out: dict[str, torch.Tensor] = {
            "actor/importance_weight/max": stacked["importance_weight/max"].max(),
            "actor/importance_weight/min": stacked["importance_weight/min"].min(),
            "actor/importance_weight/mean": (stacked["importance_weight/mean"] * weights).sum() / total,
            "actor/behave_weight/max": stacked["behave_weight/max"].max(),
            "actor/behave_weight/min": stacked["behave_weight/min"].min(),
            "actor/behave_weight/mean": (stacked["behave_weight/mean"] * weights).sum() / total,
            "actor/behave_weight/capped_tokens": stacked["behave_weight/capped_tokens"].sum(),
            "actor/clipped_tokens": stacked["clipped_tokens"].sum(),
            "actor/clip_ratio": stacked["clipped_tokens"].sum() / total,
            "actor/approx_kl": (stacked["approx_kl/mean"] * weights).sum() / total,
            "actor/entropy": (stacked["entropy"] * weights).sum() / total,
            "actor/grad_norm": torch.stack([g.detach().float() for g in grad_norms]).mean(),
            "actor/loss": torch.stack(losses).mean(),
            "actor/valid_tokens": total,
        }
        for name, values in stacked.items():
            if name.startswith("prox_error/"):
                out[name] = (values * weights).sum() / total
        out.update({name: value.to(total.device) for name, value in staleness_stats(all_versions, version).items()})
        values = torch.stack([v.detach().float().reshape(()) for v in out.values()]).tolist()
        metrics = dict(zip(out.keys(), values))
        metrics.update(batch.stats)
        return metrics
