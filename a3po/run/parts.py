"""The parts one invocation of a run is made of, built from the config: the task, the policy,
the rollout engine, the trainer, the producer, the runtime and the weight sync between them.
Under torchrun every rank builds the trainer; rank 0 alone builds the rollout side."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from a3po.device import resolve_device
from a3po.learner.trainer import Trainer
from a3po.learner.build import trainer_from
from a3po.rollout.engines import engine_spec
from a3po.rollout.producer import RolloutProducer
from a3po.run_config import RunConfig
from a3po.distributed import DistInfo, full_state_dict
from a3po.timer import PhaseTimer

__all__ = ["RunParts", "WeightSync", "build_parts", "build_runtime", "warm_up"]

# A fixed level-1 question: the warm-up's prompt is the same on every rank and every run.
WARMUP_QUESTION = "What is 12 + 30?"
# Phases every step logs, 0.0 when they did not run (docs/design.md, "Timing keys").
ALWAYS_TIMED = ("rollout", "prox_logp", "train", "weight_sync", "eval")


class WeightSync:
    """The trainer's weights to the rollout engine (rank 0) after every step.

    One process, rollout on the trainer's device: the engine reads the trainer's module.
    Otherwise the engine reads a private copy (`rollout_policy`, on the rollout device; on the
    host for vLLM, which holds its own) that is loaded from the weights gathered from every
    rank's shards; that copy also serves `train.save_final_model`.
    """

    def __init__(self, policy, engine, rollout_policy, dist: DistInfo) -> None:
        self.policy, self.engine, self.rollout_policy, self.dist = policy, engine, rollout_policy, dist

    def __call__(self, version: int) -> None:
        if self.rollout_policy is self.policy:
            self.engine.update_weights(self.policy, version)
            return
        state = full_state_dict(self.policy) if self.dist.world > 1 else self.policy.state_dict()
        if self.dist.is_main:
            self.rollout_policy.load_state_dict(state)
            self.engine.update_weights(self.rollout_policy, version)


@dataclass
class RunParts:
    """What the loop drives. `engine`, `producer` and `runtime` are None on ranks > 0.
    `host_ceiling`: the resident bytes past which a step starts by handing the heap's freed
    pages back (a3po.run.memory_check.host_ceiling; None: never)."""

    cfg: RunConfig
    run_dir: Path
    dist: DistInfo
    timer: PhaseTimer
    policy: torch.nn.Module
    tokenizer: Any
    trainer: Trainer
    sync: WeightSync
    engine: Any = None
    producer: RolloutProducer | None = None
    runtime: Any = None
    host_ceiling: int | None = None

    def close(self) -> None:
        if self.dist.is_main:
            self.runtime.close()
            self.engine.close()


def rollout_device(cfg: RunConfig, trainer_device: torch.device) -> torch.device:
    """`rollout.device`, or the trainer's (rank 0's) device when null."""
    name = cfg.rollout.device
    if name is None:
        return trainer_device
    device = resolve_device(name, key="rollout.device")
    same = device.type == trainer_device.type and (device.index or 0) == (trainer_device.index or 0)
    return trainer_device if same else device  # `cuda` and `cuda:0` are one device: no copy for it


def needs_own_policy(cfg: RunConfig, on_device: torch.device, trainer_device: torch.device, world: int) -> bool:
    """Whether the rollout side holds a policy of its own (filled by each weight sync) instead of
    the trainer's module: under torchrun, on another device, or where its engine says so (a vLLM
    child process receives its weights through host shared memory: a3po.rollout.vllm_child)."""
    if world > 1 or on_device != trainer_device:
        return True
    return engine_spec(cfg.rollout.name).own_policy(on_device, trainer_device, world)


def build_runtime(cfg: RunConfig, produce: RolloutProducer, engine, step_timer: PhaseTimer):
    """The lagged runtime calls `produce` in the training thread; the async one in its own,
    with the producer's private timer charged back to `step_timer` per batch."""
    if cfg.runtime.name == "lagged":
        from a3po.runtimes.lagged import LaggedRuntime

        return LaggedRuntime(cfg.staleness, cfg.train.total_steps, produce)
    from a3po.runtimes.asynchronous import AsyncRuntime

    return AsyncRuntime(produce, total_steps=cfg.train.total_steps, max_staleness=cfg.runtime.max_staleness,
                        batch_size=cfg.train.n_prompts, engine=engine, rollout_timer=produce.timer,
                        step_timer=step_timer, shutdown_timeout_s=cfg.runtime.shutdown_timeout_s)


def build_parts(cfg: RunConfig, run_dir: Path, device: torch.device, dist: DistInfo,
                host_ceiling: int | None = None) -> RunParts:
    """The task first (a bad data file fails in a second, not after the model loads), then the
    same weights on every rank, then rank 0's rollout side: from its own copy of the policy
    unless it can share the trainer's module."""
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.tasks import build_task

    on_device = rollout_device(cfg, device)
    timer = PhaseTimer(device, always=ALWAYS_TIMED)
    task = build_task(cfg.task, cfg.seed) if dist.is_main else None
    policy, tokenizer = load_policy(cfg.model, device=device, seed=cfg.seed)
    trainer = trainer_from(cfg, policy, pad_id=tokenizer.pad_token_id, device=device, timer=timer, dist=dist)
    if not dist.is_main:
        return RunParts(cfg, run_dir, dist, timer, policy, tokenizer, trainer, WeightSync(policy, None, None, dist),
                        host_ceiling=host_ceiling)
    concurrent = cfg.runtime.name == "async"
    rollout_policy = policy
    if needs_own_policy(cfg, on_device, device, dist.world):  # loaded where it lives: no transient copy on `device`
        host = engine_spec(cfg.rollout.name).policy_on_host
        rollout_policy = load_policy(cfg.model, device="cpu" if host else on_device,
                                     seed=cfg.seed)[0]  # the trainer's requires_grad flags: see HFCopyEngine
    engine = build_engine(cfg.rollout, rollout_policy, tokenizer, on_device, concurrent=concurrent,
                          interruptible=concurrent and cfg.runtime.interruptible, precision=cfg.precision,
                          trainer_device=device, world=dist.world,
                          max_sequences=max(cfg.train.n_prompts * cfg.train.n_samples, cfg.train.eval_size))
    # Rollout in another thread times itself on a timer of its own (see build_runtime).
    producer = RolloutProducer(cfg, task, tokenizer, engine, PhaseTimer(on_device) if concurrent else timer)
    runtime = build_runtime(cfg, producer, engine, step_timer=timer)
    return RunParts(cfg, run_dir, dist, timer, policy, tokenizer, trainer,
                    WeightSync(policy, engine, rollout_policy, dist), engine, producer, runtime, host_ceiling)


def warm_up(parts: RunParts) -> float:
    """One generate (rank 0) and one training forward + backward (every rank) before the first
    step, outside `time/step`; returns its seconds. The first call of each pays for faulting in
    the memory-mapped weights and for kernel set-up, which would otherwise land in step 0 and
    pull every measured speedup toward 1. It changes no weight, optimizer state, RNG stream or
    engine version, so a run's metrics are the same with and without it (tested)."""
    from a3po.tasks import encode_prompt

    started = time.perf_counter()
    prompt = encode_prompt(parts.tokenizer, WARMUP_QUESTION)
    if parts.dist.is_main:
        parts.engine.generate([prompt], 2, seed=0)
    parts.trainer.warm_up(prompt)
    return time.perf_counter() - started
