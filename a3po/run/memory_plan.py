"""`python -m a3po.run.memory_plan [--gpu-memory-gib G] [--world N] [overrides]`: the memory
estimate's breakdown for a config, on this machine or planned for GPUs it does not have.

Without `--gpu-memory-gib` the estimate is the start-up check's (a3po.run.memory_check) on this
machine's devices. With it, the run is planned as it would start on GPUs of that size: the
trainer on `cuda:0` (rank 0 of `--world` torchrun processes), the rollout on `rollout.device`,
`precision=auto` as bf16 (every GPU of that size runs it natively), each GPU empty at start; the
verdict is the one the start-up check would give there (exit 2 where it would refuse). This is
how docs/scaling.md's tables are made and how a layout is tried before a job is queued.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from a3po.errors import EXIT_CONFIG_ERROR, ConfigError, composition_error
from a3po.memory.estimate import estimate_memory
from a3po.rollout.engines import engine_spec
from a3po.run_config import RunConfig
from a3po.run.memory_check import architecture_of, estimate_run, longest_prompt_tokens, verdict
from a3po.memory.parts import GIB, SHARED_MEMORY, Architecture, Estimate

__all__ = ["planned_estimate", "plan", "main"]


def _planned_device(name: str | None, default: str) -> str:
    """A device name as the run would resolve it on a GPU machine (`auto`/`cuda` -> `cuda:0`)."""
    if name is None or name in ("auto", "cuda"):
        return default
    device = torch.device(name)
    return f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"


def planned_estimate(cfg: RunConfig, arch: Architecture, *, gpu_bytes: int, world: int = 1) -> Estimate:
    """The estimate of rank 0 of `cfg` on GPUs of `gpu_bytes` each."""
    from a3po.allocator import MMAP_THRESHOLD
    from a3po.models.loading import attn_implementation

    cfg = cfg.with_values(precision="bf16") if cfg.precision == "auto" else cfg
    trainer = _planned_device(cfg.device, "cuda:0")
    rollout = _planned_device(cfg.rollout.device, trainer)
    prompt, _ = longest_prompt_tokens(cfg.task, cfg.model)
    return estimate_memory(cfg, arch, rollout_parts=engine_spec(cfg.rollout.name).memory_parts, prompt_tokens=prompt, trainer_device=trainer, rollout_device=rollout,
                           world=world, device_total=gpu_bytes,
                           eager_attention=attn_implementation(cfg.model) == "eager", mmap_threshold=MMAP_THRESHOLD)


def plan(cfg: RunConfig, arch: Architecture, *, gpu_bytes: int, world: int = 1,
         host_bytes: int | None = None) -> tuple[Estimate, str, str | None]:
    """(estimate, level, message): the start-up check's verdict on empty GPUs of `gpu_bytes`
    (and `host_bytes` of host memory, where given)."""
    estimate = planned_estimate(cfg, arch, gpu_bytes=gpu_bytes, world=world)
    available = {device: (gpu_bytes, f"{gpu_bytes / GIB:.1f} GiB planned") for device in estimate.devices()
                 if device.startswith("cuda")}
    if host_bytes is not None:
        available["cpu"] = (host_bytes, f"{host_bytes / GIB:.1f} GiB of host memory planned")
        # /dev/shm: a tmpfs's default size, half the memory (a container's is smaller: --shm-size)
        available[SHARED_MEMORY] = (host_bytes // 2, f"{SHARED_MEMORY} at half the planned host memory, tmpfs's default")
    level, message = verdict(estimate, available)
    return estimate, level, message


def _compose(overrides: Sequence[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _check(args: argparse.Namespace, overrides: Sequence[str]) -> RunConfig:
    """The composed config, typed, after every check that needs no model: the flags' ranges, no
    misspelt flag left over for Hydra, the config as a run's start checks it
    (a3po.config.parse_config, and validate_world for `--world` processes). Raises
    ConfigError naming the flag or key."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from a3po.config import parse_config, validate_world

    flags = [word for word in overrides if word.startswith("-")]
    if flags:
        raise ConfigError(f"{flags[0]} is not a flag of python -m a3po.run.memory_plan; its flags: --gpu-memory-gib, "
                          "--world, --host-memory-gib (the other arguments are Hydra overrides, key=value)")
    if args.world < 1:
        raise ConfigError(f"--world={args.world!r} is not allowed; it must be an integer >= 1")
    for flag in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{flag.replace('_', '-')}={value!r} is not allowed; it must be a number > 0 (GiB)")
    try:
        cfg = parse_config(_compose(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise composition_error(err, overrides) from None
    validate_world(cfg, args.world)
    return cfg


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m a3po.run.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-gib", type=float, help="plan for GPUs of this many GiB (79.6: an H100 80GB)")
    parser.add_argument("--world", type=int, default=1, help="torchrun processes (trainer GPUs) when planning")
    parser.add_argument("--host-memory-gib", type=float, help="host memory to hold the host-side parts against")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:  # bad input fails here, before any estimate (exit 2, one line)
        cfg = _check(args, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    arch, source = architecture_of(cfg.model)
    if arch is None:
        raise SystemExit(f"no estimate: {source}")
    if args.gpu_memory_gib is None:
        from a3po.device import resolve_device, resolve_precision

        device = resolve_device(cfg.device)
        cfg = cfg.with_values(precision=resolve_precision(cfg.precision, device, cfg.model.dtype))
        estimate, level, message = estimate_run(cfg, arch, device), "ok", None
        precision = cfg.precision
    else:
        host = int(args.host_memory_gib * GIB) if args.host_memory_gib is not None else None
        estimate, level, message = plan(cfg, arch, gpu_bytes=int(args.gpu_memory_gib * GIB), world=args.world,
                                        host_bytes=host)
        precision = "bf16" if cfg.precision == "auto" else cfg.precision  # as planned_estimate plans it
    prompt, how = longest_prompt_tokens(cfg.task, cfg.model)
    print(f"architecture: {source}; {arch.n_params:,} params; longest prompt {prompt} tokens ({how}); "
          f"precision {precision}; world {args.world}")
    for name in estimate.devices():
        print(f"\n[{name}]\n{estimate.table(name)}")
    if message:
        print(f"\n{level}: {message}")
    if level == "error":
        raise SystemExit(2)


if __name__ == "__main__":
    main()
