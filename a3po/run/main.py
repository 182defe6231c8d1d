"""`run(cfg)`: one training run, from a composed config to metrics.jsonl and last.pt.

Parse the config once (a3po.config.parse_config, before anything heavy loads) -> check that the
run fits the machine's memory (a3po.run.memory_check) -> claim the run directory and read where it
stands (a3po.run.resume) -> build the parts (a3po.run.parts) -> restore the checkpoint -> warm up
-> check the engine against the trainer (a3po.run.engine_check) -> the loop (a3po.run.loop).
Re-running the same command resumes from `checkpoints/last.pt`; a finished run returns at once, and
a diverged one (a3po.run.health) raises `RunDiverged` again at once.

Under torchrun (a3po.distributed, docs/distributed.md) every rank runs this: rank 0 alone
generates (and broadcasts each batch), evaluates, logs and writes the run directory; every
rank trains on its shard of each minibatch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from a3po.allocator import expandable_cuda_segments, retain_freed_memory
from a3po.config import parse_config, validate_resolved, validate_world
from a3po.device import pin_bf16_gemms, resolve_device, resolve_precision
from a3po.distributed import DistInfo, close_distributed, init_distributed, launched_world, rank_device
from a3po.run.fetch import check_offline_cache
from a3po.run.engine_check import check_engine_logprobs
from a3po.run.health import RunDiverged
from a3po.run.loop import train_loop
from a3po.run.memory_check import check_memory, host_ceiling
from a3po.run.metrics_log import MetricsLogger
from a3po.rollout import check_engine_device
from a3po.rollout.engines import engine_spec
from a3po.run_config import RunConfig
from a3po.run.parts import build_parts, rollout_device, warm_up
from a3po.run.resume import open_run_dir, restore
from a3po.run.lock import release_run_dir
from a3po.seeds import rank_seed, seed_everything

__all__ = ["run", "run_dir_of"]

log = logging.getLogger(__name__)


def run_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.output_root) / cfg.experiment_name / cfg.run_name


def run(composed: Mapping[str, Any], run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train in `run_dir` (Hydra's output directory; default output_root/experiment_name/run_name).
    Returns the last step's metrics (empty if the run had already finished). The door: the
    composed config (Hydra's DictConfig) is parsed once into the typed, frozen RunConfig
    (a3po.config.parse_config), its precision resolved, and from here on the run holds that."""
    cfg = parse_config(composed)  # every check that needs no model, before anything heavy loads
    validate_world(cfg, launched_world())
    check_offline_cache(cfg)  # HF_HUB_OFFLINE=1: what the run reads from the hub must be cached (a3po.run.fetch)
    device = resolve_device(cfg.device)
    # before the memory check touches CUDA
    expandable_cuda_segments(device, engine_spec(cfg.rollout.name).expandable_segments)
    # The resolved precision is what the run records (config.yaml, wandb): `auto` may mean bf16
    # on one machine and fp32 on another, and those are different runs (the identity and run
    # name resolve it alike: a3po.identity.name_precision).
    cfg = cfg.with_values(precision=resolve_precision(cfg.precision, device, cfg.model.dtype))
    validate_resolved(cfg)
    pin_bf16_gemms(cfg.bf16_gemms, device)  # before the memory check, which counts the GEMMs' operands
    # Will it fit? Before the run directory is claimed and any weight loads, so a config too large
    # for the machine stops in seconds with a config error instead of the OOM killer's exit 137.
    # Every rank checks its own device (a refused rank ends a torchrun job).
    world = launched_world()
    rank_here = rank_device(device, DistInfo(world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0"))))
    is_main = int(os.environ.get("RANK", "0")) == 0
    ceiling = host_ceiling(check_memory(cfg, rank_here, world, is_main=is_main), rank_here.type, world)
    if is_main:  # rank 0 alone holds the rollout engine
        check_engine_device(cfg.rollout, rollout_device(cfg, rank_here))
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(cfg)
    dist = init_distributed(device, cfg.train.collective_timeout_min)
    try:
        return _run(cfg, run_dir, rank_device(device, dist), dist, ceiling)
    finally:
        release_run_dir(run_dir)  # a no-op on ranks > 0, which never claim it
        close_distributed(dist)


def _run(cfg: RunConfig, run_dir: Path, device: torch.device, dist: DistInfo, ceiling: int | None) -> dict[str, Any]:
    checkpoint, verdict = open_run_dir(cfg, run_dir, dist)
    if verdict["finished"]:
        log.info("%s already finished (%d steps); nothing to do", run_dir, cfg.train.total_steps)
        return {}
    if verdict["diverged"] is not None:  # an outcome of this config: rerunning would only repeat it
        raise RunDiverged(run_dir, verdict["diverged"])
    seed_everything(rank_seed(cfg.seed, dist.rank))
    retain_freed_memory()  # a step's re-allocations reuse host memory instead of faulting it in again
    parts = build_parts(cfg, run_dir, device, dist, host_ceiling=ceiling)
    restore(parts, checkpoint, resuming=verdict["resume_step"] is not None)
    # The restored checkpoint holds a copy of the weights and AdamW's moments (~12 bytes a
    # parameter, 18.6 GB at 1.5B): only its pending metrics record outlives the restore.
    pending = checkpoint.get("record") if checkpoint else None
    del checkpoint
    start_step = verdict["resume_step"] or 0
    if verdict["resume_step"] is not None:
        log.info("resuming %s from step %d", run_dir, start_step)
    parts.sync(start_step)
    warmup_seconds = warm_up(parts) if cfg.train.warmup else None
    check_engine_logprobs(parts)  # the engine samples with the policy the trainer trains (rollout.logprob_check)
    logger = MetricsLogger(run_dir, cfg, start_step, pending=pending) if dist.is_main else None
    try:
        return train_loop(parts, logger, start_step, verdict["wall_time"] + (warmup_seconds or 0.0), warmup_seconds)
    finally:
        parts.close()
