"""Rollout engines, keyed by the `rollout.name` config value."""

from __future__ import annotations

from typing import Callable

from a3po.errors import ConfigError
from a3po.rollout.base import Generation, GenerationCancelled, RolloutEngine


def _build_hf(rollout_cfg, policy, tokenizer, device) -> RolloutEngine:
    from a3po.rollout.hf import HFEngine

    return HFEngine(policy, tokenizer, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                    max_new_tokens=rollout_cfg.max_new_tokens, batch_size=rollout_cfg.get("batch_size"))


def _build_vllm(rollout_cfg, policy, tokenizer, device) -> RolloutEngine:
    from a3po.rollout.vllm_engine import VLLMEngine  # imported lazily: vllm is optional

    return VLLMEngine.from_config(rollout_cfg, policy, tokenizer, device)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _build_hf, "vllm": _build_vllm}


def build_engine(rollout_cfg, policy, tokenizer, device) -> RolloutEngine:
    if rollout_cfg.name not in ENGINES:
        raise ConfigError(f"rollout.name={rollout_cfg.name!r} is not allowed; allowed: {sorted(ENGINES)}")
    return ENGINES[rollout_cfg.name](rollout_cfg, policy, tokenizer, device)


__all__ = ["ENGINES", "Generation", "GenerationCancelled", "RolloutEngine", "build_engine"]
