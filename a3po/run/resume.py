"""Where a run stands when it starts, and what it leaves behind: the run directory's verdict
(finished, diverged, resuming from which step), the resume checkpoint read and written, and
the finished run's marker."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any


from a3po.errors import ConfigError
from a3po.run.checkpoint import load_checkpoint, remove_checkpoint, save_checkpoint
from a3po.seeds import rng_state, set_rng_state
from a3po.run_config import RunConfig
from a3po.distributed import DistInfo, broadcast_object, full_optimizer_state_dict, full_state_dict, load_full_state
from a3po.run.health import DIVERGED_MARKER, read_divergence
from a3po.run.parts import RunParts
from a3po.run.rundir import claim_run_dir, finished_steps, mark_finished

__all__ = ["open_run_dir", "restore", "save_resume_state", "finish"]

log = logging.getLogger(__name__)


def open_run_dir(cfg: RunConfig, run_dir: Path, dist: DistInfo) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Rank 0 claims the run directory and reads its checkpoint; every rank gets the verdict
    (finished? diverged? resuming from which step?), and a ConfigError raises on every rank alike."""
    checkpoint, verdict = None, None
    if dist.is_main:
        try:
            claim_run_dir(run_dir, cfg.resolved)
            checkpoint = load_checkpoint(run_dir)
            _check_world(run_dir, checkpoint, dist)
            verdict = {"finished": _already_finished(run_dir, checkpoint, cfg.train.total_steps),
                       "diverged": _divergence_of(run_dir),
                       "resume_step": checkpoint["step"] if checkpoint else None,
                       "wall_time": checkpoint["wall_time"] if checkpoint else 0.0}
        except ConfigError as err:
            if dist.world == 1:
                raise
            verdict = {"error": str(err)}
    verdict = broadcast_object(verdict, dist)
    if "error" in verdict:
        raise ConfigError(verdict["error"])
    return checkpoint, verdict


def _check_world(run_dir: Path, checkpoint: dict[str, Any] | None, dist: DistInfo) -> None:
    written_by = checkpoint.get("world", 1) if checkpoint else dist.world
    if written_by != dist.world:
        raise ConfigError(
            f"a world size of {dist.world} processes is not allowed for resuming {run_dir}: its checkpoint "
            f"was written by {written_by} (the optimizer state's layout differs); resume with "
            f"torchrun --nproc-per-node {written_by}" + (" or without torchrun" if written_by == 1 else ""))


def _divergence_of(run_dir: Path) -> dict[str, Any] | None:
    """The run's divergence record (a3po.run.health), if it has one. A record beside no
    metrics.jsonl belongs to a run that `on_config_change=restart` cleared (a diverged run
    always has its log): it is removed, and this config's run starts afresh."""
    record = read_divergence(run_dir)
    if record is not None and not (run_dir / "metrics.jsonl").exists():
        log.warning("%s: removing diverged.json left by a run whose files were cleared", run_dir)
        (run_dir / DIVERGED_MARKER).unlink()
        return None
    return record


def _already_finished(run_dir: Path, checkpoint: dict[str, Any] | None, total_steps: int) -> bool:
    """True when the run in `run_dir` has all `total_steps`; a finished run whose resume state
    was removed cannot be extended, and says so."""
    done = finished_steps(run_dir)
    if done is None and checkpoint is not None:
        done = checkpoint["step"] if checkpoint["step"] >= total_steps else None
    if done is None:
        return False
    if done >= total_steps:
        return True
    if checkpoint is None:
        raise ConfigError(
            f"train.total_steps={total_steps} is not allowed here: the run in {run_dir} finished at {done} steps "
            "and its resume checkpoint was removed (train.keep_checkpoint=false), so it cannot be extended; "
            "run it with on_config_change=restart to start afresh, or keep checkpoints next time"
        )
    return False


def restore(parts: RunParts, checkpoint: dict[str, Any] | None, resuming: bool) -> None:
    """Load a resume checkpoint into the run's parts. Distributed, rank 0 alone has read the
    file (`resuming` tells the others): its full model and AdamW state go to every rank's
    shards, and its runtime queue and RNG state stay with it (the other ranks draw nothing
    from their RNGs, which are seeded from (seed, rank))."""
    policy, optimizer = parts.policy, parts.trainer.optimizer
    if parts.dist.world > 1 and resuming:
        load_full_state(policy, optimizer, checkpoint and checkpoint["model"], checkpoint and checkpoint["optimizer"])
    if checkpoint is None:
        return
    if parts.dist.world == 1:
        policy.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    parts.runtime.load_state_dict(checkpoint["runtime"])
    set_rng_state(checkpoint["rng"])


def save_resume_state(parts: RunParts, next_step: int, record: dict[str, Any] | None, run_start: float) -> float:
    """Write last.pt; returns the seconds it took. Every rank calls it: distributed, the full
    model and AdamW state are gathered to rank 0, which alone writes."""
    started = time.perf_counter()
    policy, optimizer, dist = parts.policy, parts.trainer.optimizer, parts.dist
    if dist.world == 1:
        model, optimizer_state = policy.state_dict(), optimizer.state_dict()
    else:
        model, optimizer_state = full_state_dict(policy), full_optimizer_state_dict(policy, optimizer)
    if dist.is_main:
        save_checkpoint(parts.run_dir, {
            "model": model, "optimizer": optimizer_state, "step": next_step,
            "runtime": parts.runtime.state_dict(), "rng": rng_state(), "wall_time": started - run_start,
            "run_name": parts.cfg.run_name, "record": record, "world": dist.world})
    return time.perf_counter() - started


def finish(parts: RunParts, steps: int, wall_time: float) -> None:
    """Final weights (if asked), the completion marker, then the resume state goes (rank 0;
    the rollout policy is a module with the full weights)."""
    cfg, run_dir = parts.cfg, parts.run_dir
    if cfg.train.save_final_model:
        parts.sync.rollout_policy.save_pretrained(run_dir / "final_model", safe_serialization=True)
        parts.tokenizer.save_pretrained(run_dir / "final_model")
    mark_finished(run_dir, steps, wall_time)
    if not cfg.train.keep_checkpoint:
        remove_checkpoint(run_dir)
