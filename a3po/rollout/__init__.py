"""Rollout engines, keyed by the `rollout.name` config value."""

from __future__ import annotations

from typing import Callable

from a3po.errors import ConfigError
from a3po.rollout.base import GenerationCancelled, RolloutEngine


def _build_hf(rollout_cfg, policy, tokenizer, device, concurrent: bool, precision: str) -> RolloutEngine:
    from a3po.rollout.hf import HFCopyEngine, HFEngine

    # Concurrent generation needs weights the optimizer does not change mid-sequence.
    engine_class = HFCopyEngine if concurrent else HFEngine
    return engine_class(policy, tokenizer, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                        max_new_tokens=rollout_cfg.max_new_tokens, batch_size=rollout_cfg.get("batch_size"),
                        precision=precision)


def _build_vllm(rollout_cfg, policy, tokenizer, device, concurrent: bool, precision: str) -> RolloutEngine:
    """In this process, unless it belongs to a torch.distributed group of several processes
    (torchrun): then in a child process of its own (a3po.rollout.vllm_child says why). Either
    owns its weights. (An in-process vLLM's own group has one process.)"""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from a3po.rollout.vllm_child import ChildVLLMEngine

        return ChildVLLMEngine(rollout_cfg, policy, tokenizer, device, precision=precision)
    from a3po.rollout.vllm_engine import VLLMEngine  # imported lazily: vllm is optional

    return VLLMEngine.from_config(rollout_cfg, policy, tokenizer, device, precision=precision)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _build_hf, "vllm": _build_vllm}


def build_engine(rollout_cfg, policy, tokenizer, device, *, concurrent: bool = False,
                 interruptible: bool = False, precision: str = "fp32") -> RolloutEngine:
    """The engine `rollout.name` names. `concurrent`: it will generate while the trainer
    trains (runtime=async), so it must own its weights. `interruptible`: an engine that can
    load new weights between decode steps does so (vllm); others ignore it. `precision`: the
    run's resolved precision (a3po.device), which the engine samples under."""
    if rollout_cfg.name not in ENGINES:
        raise ConfigError(f"rollout.name={rollout_cfg.name!r} is not allowed; allowed: {sorted(ENGINES)}")
    engine = ENGINES[rollout_cfg.name](rollout_cfg, policy, tokenizer, device, concurrent, precision)
    if hasattr(engine, "interruptible"):
        engine.interruptible = bool(interruptible)
    return engine


__all__ = ["ENGINES", "GenerationCancelled", "RolloutEngine", "build_engine"]
