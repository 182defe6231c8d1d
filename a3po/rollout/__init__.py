"""Rollout engines, keyed by the `rollout.name` config value: their specs are
a3po.rollout.engines (one registry), built here."""

from __future__ import annotations

import torch

from a3po.rollout.base import GenerationCancelled, RolloutEngine
from a3po.rollout.engines import (ENGINES, EngineSpec, check_vllm_platform, engine_spec, register_engine,
                                  sequences_in_flight, vllm_placement)


def check_engine_device(rollout_cfg, device: torch.device) -> None:
    """At start, before the run directory is claimed: the engine can run on `device` (the
    resolved rollout device); for vLLM, installed and built for that kind of device."""
    engine_spec(rollout_cfg.name).check_device(rollout_cfg, device)


def build_engine(rollout_cfg, policy, tokenizer, device, *, concurrent: bool = False,
                 interruptible: bool = False, precision: str = "fp32", trainer_device=None,
                 world: int | None = None, max_sequences: int | None = None) -> RolloutEngine:
    """The engine `rollout.name` names (`rollout_cfg`: its typed group, a3po.schema), on `device`.
    `concurrent`: it will generate while the trainer trains (runtime=async), so it must own its
    weights. `interruptible`: an engine that can load new weights between decode steps does so
    (vllm); others ignore it. `precision`: the run's resolved precision (a3po.device), which the
    engine samples under. `trainer_device` (default: `device`) and `world` (default:
    torch.distributed's, 1 outside it) decide where vLLM runs (`vllm_placement`);
    `max_sequences`, the most one `generate` sends, its `max_num_seqs` where the config leaves it
    null (`sequences_in_flight`)."""
    spec = engine_spec(rollout_cfg.name)
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    engine = spec.build(rollout_cfg, policy, tokenizer, device, concurrent=concurrent, precision=precision,
                        trainer_device=trainer_device, world=world, max_sequences=max_sequences)
    if hasattr(engine, "interruptible"):
        engine.interruptible = bool(interruptible)
    return engine


__all__ = ["ENGINES", "EngineSpec", "GenerationCancelled", "RolloutEngine", "build_engine", "check_engine_device",
           "check_vllm_platform", "engine_spec", "register_engine", "sequences_in_flight", "vllm_placement"]
