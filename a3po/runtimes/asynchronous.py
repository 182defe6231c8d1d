"""`runtime=async`: rollout runs concurrently with training, its staleness bounded by eta.

Why a thread and not a process: the heavy work on both sides is torch kernels, which release
the GIL, so a thread overlaps them (docs/benchmarks.md, "Rollout engines and runtimes");
the GIL only shows when both sides are Python-bound (the tiny test model). A process would
have to receive every update through serialisation or shared memory (vLLM 0.32's multiprocess
engine cannot take tensors through `collective_rpc` at all), where a thread hands over a
memory copy (HF) or a by-reference in-place reload (vLLM), and stops with a join.

Admission is AReaL's `StalenessManager` rule: a rollout may start only while
`accepted + running < (eta + version + 1) * batch_size`. Here a rollout is one prompt group
and the worker admits the `batch_size` groups of one training step together, which is the
same rule applied to each of them in turn. Batches are consumed in the order they were
started, so batch k starts at a trainer version v >= k - eta and is trained at version k:
no token is ever staler than eta. Each token's version is stamped by the engine when the
token is generated, never read after the request returns.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Callable

from a3po.batch import RolloutBatch
from a3po.rollout.base import GenerationCancelled
from a3po.rollout.producer import Rollout, as_rollout
from a3po.timer import PhaseTimer, same_cuda_device
from a3po.runtimes.staleness import staleness_metrics

log = logging.getLogger(__name__)


class StalenessManager:
    """AReaL's admission control, counted in rollouts (prompt groups).

    `accepted` counts every rollout ever accepted (consumed or waiting), so the bound is on
    how far generation may run ahead of training, not on the queue length.
    """

    def __init__(self, max_staleness: int, batch_size: int, accepted: int = 0) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 and batch_size={batch_size} >= 1")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.accepted = accepted
        self.running = 0

    def capacity(self, version: int) -> int:
        return (self.max_staleness + version + 1) * self.batch_size - (self.accepted + self.running)

    def can_start(self, n_rollouts: int, version: int) -> bool:
        return self.capacity(version) >= n_rollouts

    def on_started(self, n_rollouts: int) -> None:
        self.running += n_rollouts

    def on_accepted(self, n_rollouts: int) -> None:
        self.running -= n_rollouts
        self.accepted += n_rollouts

    def on_rejected(self, n_rollouts: int) -> None:
        self.running -= n_rollouts


def _count_tokens(batch: RolloutBatch) -> int:
    return sum(s.response_ids.numel() for s in batch.samples)


class AsyncRuntime:
    """Generates batches in a background thread, at most `max_staleness` versions ahead.

    `produce(step)` makes one batch with `engine`, which must own its weights (HFCopyEngine,
    VLLMEngine: built with `concurrent=True`). `rollout_timer` is the producer's own timer,
    popped here after each batch; its phases are charged to the trainer's `step_timer` when
    the trainer takes that batch, from the training thread, so `time/rollout` means the same
    in every runtime and the trainer's timer never receives rollout time at random.
    """

    def __init__(self, produce: Callable[[int], Rollout], *, total_steps: int, max_staleness: int,
                 batch_size: int, engine, rollout_timer: PhaseTimer | None = None,
                 step_timer: PhaseTimer | None = None, shutdown_timeout_s: float = 120.0) -> None:
        self.produce = produce
        self.total_steps = total_steps
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.shutdown_timeout_s = shutdown_timeout_s
        self.engine = engine  # only to cancel a generation in flight at shutdown
        self.rollout_timer = rollout_timer
        self.step_timer = step_timer
        self._rollout_phases: dict[int, dict[str, float]] = {}
        self.shared_device = self._warn_if_shared_device()
        self.manager = StalenessManager(max_staleness, batch_size)
        self.next_to_generate = 0
        self._ready: dict[int, Rollout] = {}
        self._version = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._closed = False

    def _warn_if_shared_device(self) -> bool:
        """Whether rollout (its timer's device) and training (the step timer's) share one CUDA
        device: then each thread's phase timers also wait for the other's kernels
        (a3po.timer.same_cuda_device), so `time/rollout`, `time/prox_logp` and `time/train`
        overlap. Said once here, and on every step as `runtime/shared_device` = 1."""
        devices = [getattr(timer, "device", None) for timer in (self.rollout_timer, self.step_timer)]
        shared = same_cuda_device(*devices)
        if shared:
            log.warning("runtime=async with rollout and training on one CUDA device (%s): each phase's time "
                        "includes the other thread's kernels; its metrics carry runtime/shared_device=1, and "
                        "time/rollout, time/prox_logp and time/train are not comparable with a lagged run's. "
                        "Set rollout.device to another GPU for clean timings.", devices[1])
        return shared

    # ------------------------------------------------------------------ trainer side
    def batch_for(self, step: int, version: int) -> Rollout:
        """Block until the batch for `step` is ready; `version` (the trainer's) opens capacity.
        Returns it with its metrics: the producer's, the worker's and the hand-off's (the wait
        and the staleness the batch has now)."""
        if self._closed:
            raise RuntimeError("async runtime: batch_for called after close()")
        started = time.perf_counter()
        with self._cond:
            self._version = version
            self._cond.notify_all()
        self._ensure_worker()
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"async runtime: rollout failed while the trainer waited for step {step}") from self._error
                if step < self.next_to_generate or not self._worker.is_alive():
                    raise RuntimeError(f"async runtime: the batch for step {step} will never arrive "
                                       f"(generated up to {self.next_to_generate}, worker alive: {self._worker.is_alive()})")
                self._cond.wait(timeout=1.0)
            batch, metrics = self._ready.pop(step)
            phases = self._rollout_phases.pop(step, {})
        for name, seconds in phases.items():
            if self.step_timer is not None:
                self.step_timer.add(name, seconds)
            else:
                metrics[f"time/{name}"] = seconds
        metrics["time/wait_data"] = time.perf_counter() - started
        if self.shared_device:
            metrics["runtime/shared_device"] = 1.0
        metrics.update(staleness_metrics(batch.samples, version, detail=True))
        return batch, metrics

    def _ensure_worker(self) -> None:
        """Started at the first request, not at construction, so a checkpoint's queue is loaded first."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="a3po-rollout", daemon=True)
            self._worker.start()
            atexit.register(self.close)

    # ------------------------------------------------------------------ rollout side
    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    if self.next_to_generate >= self.total_steps:
                        return
                    waited_from = time.perf_counter()
                    while not self._stop.is_set() and not self.manager.can_start(self.batch_size, self._version):
                        self._cond.wait()
                    if self._stop.is_set():
                        return
                    step = self.next_to_generate
                    wait_capacity = time.perf_counter() - waited_from
                    start_version = self._version
                    self.manager.on_started(self.batch_size)
                try:
                    began = time.perf_counter()
                    batch, metrics = self.produce(step)
                    seconds = time.perf_counter() - began
                except BaseException:
                    with self._cond:
                        self.manager.on_rejected(self.batch_size)
                    raise
                phases = {"rollout": seconds}
                if self.rollout_timer is not None:
                    phases.update({name.removeprefix("time/"): value for name, value in self.rollout_timer.pop().items()})
                metrics.update({"time/wait_capacity": wait_capacity,
                                "rollout/tokens_per_s": _count_tokens(batch) / max(seconds, 1e-9),
                                "rollout/admitted_at_version": float(start_version)})
                with self._cond:
                    self._ready[step] = (batch, metrics)
                    self._rollout_phases[step] = phases
                    self.next_to_generate = step + 1
                    self.manager.on_accepted(self.batch_size)
                    self._cond.notify_all()
        except GenerationCancelled:
            if not self._stop.is_set():
                self._fail(RuntimeError("rollout was cancelled while the runtime was still running"))
        except BaseException as err:  # handed to the trainer thread, which raises it
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()

    # ------------------------------------------------------------------ lifecycle
    def state_dict(self) -> dict:
        """Finished batches only: one still generating is regenerated after a resume."""
        with self._cond:
            return {"queue": [self._ready[k] for k in sorted(self._ready)], "next_to_generate": self.next_to_generate}

    def load_state_dict(self, state: dict) -> None:
        if self._worker is not None:
            raise RuntimeError("async runtime: load_state_dict must come before the first batch_for")
        self._ready = {rollout[0].step: rollout for rollout in map(as_rollout, state["queue"])}
        self.next_to_generate = state["next_to_generate"]
        self.manager = StalenessManager(self.max_staleness, self.batch_size, accepted=self.next_to_generate * self.batch_size)

    def close(self) -> None:
        """Stop the worker, cancelling a generation in flight, and wait for it to end."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        cancel = getattr(self.engine, "cancel", None)
        if self._worker is not None and self._worker.is_alive() and callable(cancel):
            cancel()
        with self._cond:
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=self.shutdown_timeout_s)
            if self._worker.is_alive():
                log.error("async runtime: the rollout thread did not stop within %.0f s", self.shutdown_timeout_s)
            atexit.unregister(self.close)
        with self._cond:
            self._ready.clear()
            self._rollout_phases.clear()
