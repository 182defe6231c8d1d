"""The training loop: for each step, the runtime's batch (and its metrics) -> the trainer's
step at version t -> weight sync (version t + 1) -> eval when due -> checkpoint -> one log
line. Every rank runs it; rank 0 alone logs, checkpoints and finishes the run directory.
The checkpoint goes before the log line and carries it: a death in between re-logs the step
on resume, so the log has no gap and no duplicate."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from a3po.run.checkpoint import checkpoint_path
from a3po.distributed import any_rank, broadcast_object
from a3po.run.health import EXIT_DIVERGED, CollapseRule, CollapseWatch, NonFiniteUpdate, RunDiverged, divergence_record, write_divergence
from a3po.allocator import release_freed_memory
from a3po.memory.machine import host_resident, process_memory
from a3po.run.metrics_log import MetricsLogger, read_metrics
from a3po.run.parts import RunParts
from a3po.run.preemption import GracefulStop
from a3po.run.resume import finish, save_resume_state
from a3po.seeds import Stream, stream_seed
from a3po.timer import DIAGNOSTIC_PHASES
from a3po.metrics import COLLAPSE_STEP, COLLAPSED, DIVERGED

__all__ = ["train_step", "train_loop"]

log = logging.getLogger(__name__)


def train_step(parts: RunParts, step: int) -> dict[str, Any]:
    """One step: batch -> trainer -> weight sync, then eval if due. `time/step` and
    `time/step_cpu` (this process's CPU seconds, every thread) cover the training phases only,
    not eval, the checkpoint or the diagnostic phases (a3po.timer.DIAGNOSTIC_PHASES): on a
    shared machine the CPU figure is the one that survives. A step that finds the process's
    resident memory above `parts.host_ceiling` starts by handing the heap's freed pages back,
    within its timing (the pages it then faults in again are its own cost). `memory/*` is read
    after the step and its eval (a3po.memory.machine.process_memory).
    Distributed: rank 0's runtime makes the batch and every rank gets it; the figures are rank 0's."""
    cfg, dist, timer = parts.cfg, parts.dist, parts.timer
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    released = _release_above(parts.host_ceiling)
    batch, metrics = broadcast_object(parts.runtime.batch_for(step, version=step) if dist.is_main else None, dist)
    generator = torch.Generator().manual_seed(stream_seed(cfg.seed, Stream.MINIBATCH, step))
    metrics = {**parts.trainer.step(batch, version=step, generator=generator), **metrics}
    with timer.phase("weight_sync"):
        parts.sync(step + 1)
    diagnostic_wall, diagnostic_cpu = timer.spent(DIAGNOSTIC_PHASES)
    metrics["time/step"] = time.perf_counter() - wall_start - diagnostic_wall
    metrics["time/step_cpu"] = time.process_time() - cpu_start - diagnostic_cpu
    metrics["machine/threads"] = float(torch.get_num_threads())  # what the CPU time is held against
    total_steps, every = cfg.train.total_steps, cfg.train.eval_every
    if dist.is_main and every and ((step + 1) % every == 0 or step + 1 == total_steps):
        with timer.phase("eval"):
            metrics.update(parts.producer.evaluate(step))
    metrics.update(timer.pop())
    if dist.is_main:
        metrics.update(process_memory(str(parts.trainer.device)))
    if parts.host_ceiling is not None:
        metrics["memory/heap_released"] = float(released)
    return metrics


def _release_above(ceiling: int | None) -> bool:
    """Hand the heap's freed pages back where the process's resident memory is above `ceiling`
    (a3po.run.memory_check.host_ceiling; None: never); whether it did."""
    if ceiling is None or (host_resident() or 0) <= ceiling:
        return False
    return release_freed_memory()


def _diverged(parts: RunParts, logger: MetricsLogger | None, error: NonFiniteUpdate, run_start: float,
              saved_at: int) -> RunDiverged:
    """The diverged step's one line in metrics.jsonl (`health/diverged`, no trainer metric: the
    step never completed), so every reader of the log (analysis, wandb) sees the outcome; then
    diverged.json, written last as finished.json is: a death in between resumes and diverges
    again. No checkpoint: the state is mid-step."""
    last_saved = saved_at if checkpoint_path(parts.run_dir).exists() else None
    record = divergence_record(error, time.perf_counter() - run_start, last_saved)
    if parts.dist.is_main:
        logger.log({"step": record["step"], "version": record["step"], "wall_time": record["wall_time"], DIVERGED: 1})
        write_divergence(parts.run_dir, record)
    return RunDiverged(parts.run_dir, record)


def _collapse_metrics(collapse: CollapseWatch, step: int, metrics: dict[str, Any]) -> dict[str, int]:
    """The step's `health/*` collapse metrics, with a warning on the step a collapse is found."""
    health = collapse.update(step, metrics.get("actor/entropy"), metrics.get("actor/grad_norm"))
    if health.get(COLLAPSE_STEP) is not None and collapse.rule.steps == step - health[COLLAPSE_STEP] + 1:
        rule = collapse.rule
        log.warning("the policy collapsed: entropy < %g and grad norm <= %g for %d steps in a row since step %d; "
                    "the run goes on, flagged (%s)", rule.entropy_below, rule.grad_norm_at_most, rule.steps,
                    health[COLLAPSE_STEP], COLLAPSED)
    return health


class _Progress:
    """Where the loop stands: the next step, the last step saved, when the run started (its
    wall clock continues across resumes) and the warm-up seconds still to log."""

    def __init__(self, start_step: int, wall_offset: float, warmup_seconds: float | None) -> None:
        self.step, self.saved_at = start_step, start_step
        self.run_start = time.perf_counter() - wall_offset
        self.warmup_seconds = warmup_seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.run_start


def train_loop(parts: RunParts, logger: MetricsLogger | None, start_step: int, wall_offset: float,
               warmup_seconds: float | None = None) -> dict[str, Any]:
    """Steps from `start_step` until the run ends, `train.max_steps_this_run` is reached or a
    signal asks to stop; returns the last step's metrics. `time/warmup` (this invocation's
    warm-up, already inside `wall_offset`) goes on the first step it logs."""
    cfg, dist, train = parts.cfg, parts.dist, parts.cfg.train
    limit = train.max_steps_this_run
    stop_after = train.total_steps if limit is None else min(train.total_steps, start_step + limit)
    at = _Progress(start_step, wall_offset, warmup_seconds)
    # Collapse is judged over consecutive steps: a resumed run replays the steps it keeps.
    collapse = CollapseWatch(CollapseRule.from_train_cfg(train)).replay(read_metrics(logger.path)) if dist.is_main else None
    # Always shown, in a terminal and in a SLURM log alike: one line per step is the progress.
    progress = tqdm(total=train.total_steps, initial=start_step, desc=cfg.run_name, unit="step", dynamic_ncols=True,
                    mininterval=0, disable=not dist.is_main)
    metrics: dict[str, Any] = {}
    exit_code = 1
    try:
        with GracefulStop() as stop:
            def stop_requested() -> bool:  # a signal that reached any rank stops every rank at the same step
                return any_rank(stop.requested, dist)

            while at.step < stop_after and not stop_requested():
                metrics = _one_step(parts, logger, at, collapse, stop_after, stop_requested)
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.1f}")
            _end(parts, at)
            exit_code = 0
            if stop_requested():
                log.warning("stopped at step %d by a signal; checkpoint written; rerun the same command to resume", at.step)
                if logger is not None:
                    logger.close(exit_code=0)
                progress.close()
                stop.hand_over()  # submitit's USR2 handler requeues and exits here
    except RunDiverged:
        exit_code = EXIT_DIVERGED
        raise
    finally:
        progress.close()
        if logger is not None:
            logger.close(exit_code=exit_code)
    return metrics


def _one_step(parts: RunParts, logger: MetricsLogger | None, at: _Progress, collapse: CollapseWatch | None,
              stop_after: int, stop_requested) -> dict[str, Any]:
    """Train step `at.step`, then checkpoint (when due) and log it."""
    train = parts.cfg.train
    try:
        metrics = train_step(parts, at.step)
    except NonFiniteUpdate as error:  # every rank raises it at the same minibatch
        raise _diverged(parts, logger, error, at.run_start, at.saved_at) from None
    record = {"step": at.step, "version": at.step, **metrics}
    if at.warmup_seconds is not None:
        record["time/warmup"], at.warmup_seconds = at.warmup_seconds, None
    if collapse is not None:
        record.update(_collapse_metrics(collapse, at.step, metrics))
    at.step += 1
    due = at.step == stop_after or stop_requested() or (train.checkpoint_every and at.step % train.checkpoint_every == 0)
    keep = at.step < train.total_steps or train.keep_checkpoint
    record["wall_time"] = at.elapsed()
    record["time/checkpoint"] = save_resume_state(parts, at.step, record, at.run_start) if due and keep else 0.0
    at.saved_at = at.step if due and keep else at.saved_at
    if parts.dist.is_main:
        logger.log(record)
    return metrics


def _end(parts: RunParts, at: _Progress) -> None:
    """A checkpoint if a signal came between the last check and the loop's end; the finished
    marker (rank 0) once every step has run."""
    if at.step < parts.cfg.train.total_steps and at.saved_at != at.step:
        save_resume_state(parts, at.step, None, at.run_start)
    if at.step >= parts.cfg.train.total_steps and parts.dist.is_main:
        finish(parts, at.step, at.elapsed())
