"""vLLM in a child process of its own, for a trainer process that already belongs to a
torch.distributed group (torchrun).

An in-process engine (a3po.rollout.vllm_engine) finds torch.distributed initialised and
builds its own groups over every trainer rank, which never join: rank 0 waits for ever at
start. Here the same in-process engine runs in a spawned child with the torchrun variables
removed, so vLLM initialises a one-process group of its own, as on a rollout GPU apart from
the trainers. `ChildVLLMEngine` is the trainer's side; it keeps the engine contract and its
semantics:

- `update_weights` returns once the child has loaded the weights, or staged a copy when a
  generation is running (the in-process rule), so a `generate` sent after it always samples
  from them. The tensors travel through shared memory (torch.multiprocessing): the rollout
  copy's storage is moved there once, and later updates only pass its handle.
- `generate` and weight updates use separate pipes, so an update from the trainer thread
  reaches the child while the rollout thread waits for a generation (runtime=async).
- `cancel` ends a generation in flight; `close`, or the parent's death (the pipes close),
  shuts the child's engine down and ends the child. Nothing else does: SLURM's USR2 (and its
  TERM, or a Ctrl-C) reaches every process of the job, and the trainer alone acts on it
  (a3po.run.preemption), so the child ignores them, from its very start.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import threading
from typing import Any, Sequence

import torch
import torch.multiprocessing  # noqa: F401  (registers shared-memory tensor pickling on multiprocessing's pickler)

from a3po.batch import Sample
from a3po.rollout.base import GenerationCancelled

log = logging.getLogger(__name__)

# What torchrun (torch.distributed.run) sets; the child must not see a world it is not part of.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
START_TIMEOUT_S = 900.0
CLOSE_TIMEOUT_S = 60.0
# What SLURM (`--signal`, `scancel --signal=USR2`, a job's end) sends every process of a job
# step, and Ctrl-C a terminal's foreground processes: a3po.run.preemption's list (rollout may
# not import the run package).
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGUSR2", None), signal.SIGTERM, signal.SIGINT) if s is not None)


class _StateDict:
    """The one thing VLLMEngine.update_weights reads from a policy."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def _to_wire(sample: Sample) -> dict[str, Any]:
    """A sample as numpy arrays: pickled by value, not as one shared-memory segment per tensor."""
    return {f.name: (v.numpy() if isinstance(v := getattr(sample, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(sample)}


def _from_wire(fields: dict[str, Any]) -> Sample:
    return Sample(**{k: (torch.from_numpy(v) if hasattr(v, "dtype") else v) for k, v in fields.items()})


def _portable(err: BaseException) -> BaseException:
    """The exception itself where it pickles, else a RuntimeError carrying its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _serve_generations(engine, conn) -> None:
    """The child's generation thread: one request at a time, answered on the same pipe."""
    while True:
        try:
            _, prompt_ids, n_samples, seed = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = engine.generate(prompt_ids, n_samples, seed=seed)
            conn.send(("ok", [[_to_wire(s) for s in group] for group in result]))
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
            conn.send(("error", _portable(err)))


def child_environment(environ: dict[str, str], device: str) -> tuple[dict[str, str], str]:
    """The child's environment and device: torchrun's variables removed, and for `cuda:N` the
    N-th visible GPU made the only one (vLLM takes the first GPU it sees), which is then
    `cuda:0` inside the child."""
    env = {k: v for k, v in environ.items() if k not in _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    target = torch.device(device)
    if target.type != "cuda":
        return env, str(target)
    index = target.index or 0
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
    return env, "cuda:0"


def ignore_stop_signals() -> None:
    """The child's first act: ignore the stop signals, then unblock them (`start_child` blocked
    them; one that arrived meanwhile is discarded). Had USR2 its default action, it would end
    the child while the trainer finishes its step, and the trainer's weight update would then
    meet a dead pipe: no last.pt, no requeue. The child ends when told to close or when its
    pipes close (the trainer is gone); SIGKILL still ends it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def start_child(process: multiprocessing.process.BaseProcess) -> None:
    """`process.start()` with the stop signals blocked in this thread meanwhile. A spawned child
    inherits the mask (measured on Linux: spawn's fork-exec keeps it), so a signal during its
    start-up (a new interpreter, imports, the arguments unpickled: seconds before its target
    runs) waits until `ignore_stop_signals` discards it, instead of ending the child. It matters
    little: the child starts before the training loop handles signals, so one then ends or
    requeues the trainer too; but it is cheap (multiprocessing's resource tracker starts the
    same way). A signal for this process meanwhile goes to another thread, or waits until
    `start()` returns."""
    # The tracker first, where it is not running: starting it within `start()` unblocks INT and TERM.
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _serve(gen_conn, ctrl_conn, rollout_cfg, policy, tokenizer, device, precision: str, threads: int) -> None:
    """The child: start the in-process engine, then answer weight updates on `ctrl_conn`
    while a thread answers generations on `gen_conn`, until told to close or the parent goes."""
    ignore_stop_signals()  # before anything else (start_child holds signals back until here)
    env, device = child_environment(dict(os.environ), device)  # before anything initialises CUDA
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    from a3po.rollout.vllm_engine import VLLMEngine

    try:
        engine = VLLMEngine.from_config(rollout_cfg, policy, tokenizer, device, precision=precision)
    except BaseException as err:  # noqa: BLE001
        ctrl_conn.send(("error", _portable(err)))
        return
    del policy
    ctrl_conn.send(("ok", engine.last_update_seconds))
    threading.Thread(target=_serve_generations, args=(engine, gen_conn), daemon=True,
                     name="a3po-vllm-generate").start()
    try:
        while True:
            try:
                message = ctrl_conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            kind = message[0]
            if kind == "close":
                return
            if kind == "cancel":
                engine.cancel()
            elif kind == "interruptible":
                engine.interruptible = bool(message[1])
            elif kind == "update":
                try:
                    engine.update_weights(_StateDict(message[1]), message[2])
                    ctrl_conn.send(("ok", engine.last_update_seconds))
                except BaseException as err:  # noqa: BLE001
                    ctrl_conn.send(("error", _portable(err)))
    finally:
        engine.close()


def _answer(conn, what: str, timeout: float | None = None):
    """The child's reply to the last request, raising what it raised."""
    if timeout is not None and not conn.poll(timeout):
        raise RuntimeError(f"the vLLM child process did not answer {what} within {timeout:.0f} s")
    try:
        status, value = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError(f"the vLLM child process ended during {what}; its log is above") from None
    if status == "error":
        raise value
    return value


class ChildVLLMEngine:
    """The rollout engine contract, served by an in-process VLLMEngine in a child process."""

    def __init__(self, rollout_cfg, policy: torch.nn.Module, tokenizer, device, precision: str = "fp32") -> None:
        context = multiprocessing.get_context("spawn")
        self._gen, child_gen = context.Pipe()
        self._ctrl, child_ctrl = context.Pipe()
        self._gen_lock = threading.Lock()
        self._ctrl_lock = threading.Lock()
        self._cancelled = threading.Event()
        self._interruptible = False
        self.version = 0
        self._process = context.Process(
            target=_serve, name="a3po-vllm",
            args=(child_gen, child_ctrl, rollout_cfg, policy, tokenizer, str(device), precision,
                  torch.get_num_threads()))
        start_child(self._process)
        child_gen.close()
        child_ctrl.close()
        try:
            self.last_update_seconds = _answer(self._ctrl, "its start", START_TIMEOUT_S)
        except BaseException:
            self._stop()
            raise
        log.info("vLLM engine started in child process %d", self._process.pid)

    @property
    def interruptible(self) -> bool:
        return self._interruptible

    @interruptible.setter
    def interruptible(self, value: bool) -> None:
        self._interruptible = bool(value)
        self._tell(("interruptible", self._interruptible))

    def _tell(self, message: tuple) -> None:
        """A control message that needs no answer; none once the child has ended (a shutdown
        after the child died must still close the parent's side)."""
        with self._ctrl_lock:
            if self._process is None or not self._process.is_alive():
                return
            try:
                self._ctrl.send(message)
            except (BrokenPipeError, ConnectionResetError):
                log.info("the vLLM child process ended before %r reached it", message[0])

    def update_weights(self, policy: torch.nn.Module, version: int) -> None:
        state = {name: tensor.detach() for name, tensor in policy.state_dict().items()}
        with self._ctrl_lock:
            self._ctrl.send(("update", state, int(version)))
            self.last_update_seconds = _answer(self._ctrl, "a weight update")
        self.version = int(version)

    def generate(self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int) -> list[list[Sample]]:
        with self._gen_lock:
            if self._cancelled.is_set():
                raise GenerationCancelled("generation cancelled: the engine is shutting down")
            self._gen.send(("generate", [list(map(int, ids)) for ids in prompt_ids], int(n_samples), int(seed)))
            groups = _answer(self._gen, "a generation")
        return [[_from_wire(fields) for fields in group] for group in groups]

    def cancel(self) -> None:
        """End the current and every later `generate` with GenerationCancelled (shutdown)."""
        self._cancelled.set()
        self._tell(("cancel",))

    def close(self) -> None:
        if self._process is None:
            return
        self.cancel()
        self._tell(("close",))
        self._stop()

    def _stop(self) -> None:
        process, self._process = self._process, None
        process.join(CLOSE_TIMEOUT_S)
        if process.is_alive():
            log.warning("the vLLM child process %d did not end in %.0f s; killing it", process.pid, CLOSE_TIMEOUT_S)
            process.kill()  # SIGKILL: it ignores SIGTERM
            process.join(10)
        self._gen.close()
        self._ctrl.close()
