"""A run directory means one config.

The directory of a run is Hydra's output directory for its job (`hydra.run.dir`, or
`hydra.sweep.dir`/`hydra.sweep.subdir` in a sweep); its default name is `run_name`, a function
of the run's identity record (a3po.run.identity: `<label>-d<staleness>-s<seed>`), with no
timestamp, so a requeued job finds its run again. Starting a run in a directory that holds a
run of a different config would either mislabel the old results (a finished run) or resume
its checkpoint under the new config (an unfinished one), so `claim_run_dir` refuses, naming
every differing key, unless `on_config_change=restart` asks to start afresh.

A run directory also has one writer at a time: `claim_run_dir` first takes an advisory lock
on `<run_dir>/.lock` (`lock_run_dir`), before it compares or writes `config.yaml` and before
the caller reads a checkpoint, so a second process started for the same run (a double
launch, a requeued job whose first instance still runs) stops at start naming the holder,
and never deletes (`on_config_change=restart`), resumes or appends to a live run.

A finished run keeps `config.yaml`, `metrics.jsonl` and a small completion marker
(`finished.json`); its resume checkpoint is removed unless `train.keep_checkpoint=true`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import yaml
from omegaconf import DictConfig, OmegaConf

from a3po.errors import ConfigError

log = logging.getLogger(__name__)

# Keys whose value does not change a run's results, so a run may be resumed or re-entered
# with a different value: where it logs, how often it checkpoints, how far this invocation
# goes, what is kept at the end, and what happens on a conflict. `train.total_steps` may grow
# (extending a run); any other difference is a different run.
RESULT_NEUTRAL_KEYS = (
    "logger",
    "output_root",
    "on_config_change",
    "train.max_steps_this_run",
    "train.checkpoint_every",
    "train.keep_checkpoint",
    "train.save_final_model",
    "train.warmup",
    "train.collapse_entropy",  # the collapse rule flags runs; it changes no number a run computes
    "train.collapse_grad_norm",
    "train.collapse_steps",
    "runtime.shutdown_timeout_s",
)
EXTENSIBLE_KEY = "train.total_steps"
DERIVED_KEYS = ("identity",)  # built from the other keys (a3po.run.identity): compared through them, never itself
# A key a run's config.yaml lacks because it was written before the key existed, compared as
# the value that run actually used: every run before `precision` computed in float32 on a CPU.
LEGACY_VALUES = {"precision": "fp32"}
ON_CONFIG_CHANGE = ("error", "restart")
FINISHED_MARKER = "finished.json"
LOCK_FILE = ".lock"
# How long a process that found the lock taken waits for the holder to write who it is: the
# holder writes right after it locks, so an empty lock file means it is just starting.
HOLDER_NOTE_WAIT_S = 2.0

# The run-directory locks this process holds: resolved run dir -> the open lock file. The
# open descriptor is the lock (flock belongs to the open file), so it lasts until
# `release_run_dir` or the end of the process, however it ends: the kernel drops it on exit,
# kill -9 included, and no stale lock file ever needs deleting.
_HELD: dict[Path, int] = {}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _neutral(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in RESULT_NEUTRAL_KEYS + DERIVED_KEYS)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key that changes results (DERIVED_KEYS are none); a
    missing key shows as `<absent>`, and is no difference where the other side is null (a key added
    since, at its null default). Growing `train.total_steps` is not a difference; shrinking it is."""
    old_flat, new_flat = flatten(old), flatten(new)
    diffs = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if _neutral(key):
            continue
        before, after = old_flat.get(key, LEGACY_VALUES.get(key, "<absent>")), new_flat.get(key, "<absent>")
        if before == after or {before, after} == {"<absent>", None}:
            continue  # a key added since the run started, at its null default, changes nothing
        if key == EXTENSIBLE_KEY and isinstance(before, int) and isinstance(after, int) and after > before:
            continue
        diffs.append((key, before, after))
    return diffs


def _conflict_message(run_dir: Path, diffs: list[tuple[str, Any, Any]]) -> str:
    lines = "\n".join(f"  {key}: {before!r} in the existing run, {after!r} now" for key, before, after in diffs)
    return (
        f"the run directory {run_dir} holds a run with a different config:\n{lines}\n"
        "A run directory means one config. Either write this run elsewhere (another experiment_name=, "
        "output_root=, or hydra.run.dir/hydra.sweep.dir), or start this directory afresh with "
        "on_config_change=restart (this deletes the old run's metrics and checkpoint)."
    )


def clear_run(run_dir: Path) -> None:
    """Delete what a run wrote (not the directory itself: Hydra keeps its .hydra/ there)."""
    for name in ("metrics.jsonl", FINISHED_MARKER, "config.yaml", "diverged.json"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("checkpoints", "wandb", "final_model"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def _holder_note() -> bytes:
    """Who holds the lock, for the message of a process that finds it taken."""
    note = {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.now().astimezone().isoformat(timespec="seconds")}
    if os.environ.get("SLURM_JOB_ID"):
        note["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return (json.dumps(note) + "\n").encode()


def _read_holder(fd: int) -> dict[str, Any] | None:
    """The holder's note from the lock file, waiting briefly for a holder that has locked
    but not yet written it; None if there is still none (or it is not a note)."""
    deadline = time.monotonic() + HOLDER_NOTE_WAIT_S
    while True:
        try:
            note = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            if isinstance(note, dict) and "pid" in note:
                return note
        except (ValueError, OSError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _busy_message(run_dir: Path, lock_path: Path, holder: dict[str, Any] | None) -> str:
    """Who holds the directory and the ways out, for the process that found it taken."""
    if holder is None:
        who, stop = f"a process that has not written who it is into {lock_path}", "stop it"
    else:
        host, pid = holder.get("host", "?"), holder.get("pid", "?")
        job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
        who = f"pid {pid} on host {host}, since {holder.get('since', '?')}{job}"
        stop = f"stop it (`kill {pid}` on {host}" + (f", or `scancel {holder['slurm_job_id']}`" if job else "") + \
            "; it checkpoints and exits)"
    return (
        f"the run directory {run_dir} is in use by another process: {who}.\nA run directory has one writer "
        "at a time, so this start stops before reading or writing anything there. Wait for that process to "
        f"finish, or {stop}; then rerun this command, which resumes the run (or returns at once if it "
        "finished). A holder that died, even by kill -9, frees the lock by itself: there is no lock file to "
        "delete. To run both, give this one another directory (experiment_name=, output_root=, or "
        "hydra.run.dir/hydra.sweep.dir)."
    )


def _still_held(run_dir: Path, fd: int) -> bool:
    """True if `fd` is the lock file that is in `run_dir` now (the directory was not deleted
    and made anew since this process locked it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(run_dir / LOCK_FILE))
    except OSError:
        return False


def lock_run_dir(run_dir: Path) -> None:
    """Take the run directory's advisory lock for the rest of this process (see `_HELD`), or
    raise ConfigError naming the holder (host, pid, since when) and what to do.

    Taking it again in the process that holds it is a no-op, so one process may run the
    same directory more than once (a resumed run in a test, a sweep revisiting a run).

    Filesystems: the lock is `flock(2)` on `<run_dir>/.lock`. On a local filesystem it is
    exact. On NFS, Linux emulates flock with a whole-file fcntl byte-range lock, which NFSv4
    (and NFSv3 with a working lockd/NLM) enforces across clients, so two nodes of a cluster
    exclude each other; for that emulation this process never opens the lock file a second
    time (closing any other descriptor of the file would drop a POSIX lock). Where locks are
    local only (NFSv3 mounted with `nolock`/`local_lock`, some FUSE filesystems), two
    processes on different hosts are not excluded; where the filesystem refuses locks
    (ENOLCK, EOPNOTSUPP), the run goes on unlocked with a warning saying so. The holder's
    pid is that of its own pid namespace (a container's pid, for a containerised run).
    """
    key = Path(run_dir).resolve()
    held = _HELD.get(key)
    if held is not None:
        if _still_held(key, held):
            return
        os.close(_HELD.pop(key))  # the directory was made anew: lock the lock file now in it
    lock_path = key / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise ConfigError(_busy_message(run_dir, lock_path, holder)) from None
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            log.warning("cannot lock %s (%s): this filesystem does not support flock, so nothing stops a second "
                        "process from writing this run directory at the same time", lock_path, error)
            return
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_note(), 0)
    _HELD[key] = fd


def release_run_dir(run_dir: Path) -> None:
    """Give the run directory's lock back (a no-op where this process holds none). The note
    is cleared first, so a finished holder is not named as the holder afterwards."""
    fd = _HELD.pop(Path(run_dir).resolve(), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the only descriptor of the open file drops the flock


def _forget_locks_in_child() -> None:
    """A forked child does not hold its parent's run directories: its copies of the lock
    descriptors are closed (not unlocked, which would unlock the parent's too), so the lock
    ends with the process that took it, not with the last of its children."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def claim_run_dir(run_dir: Path, cfg: DictConfig) -> None:
    """Lock `run_dir` for this process, check that it is empty or holds this config's run,
    then write config.yaml.

    The lock comes first (`lock_run_dir`): a directory in use by another process raises
    ConfigError naming that process before anything is compared, deleted or written. Then a
    ConfigError names each differing key (both values) and the ways out; with
    `on_config_change=restart` the old run is deleted instead. Writes atomically. On a
    ConfigError the lock is given back. The lock is otherwise held until
    `release_run_dir(run_dir)` or the end of the process.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir)
    try:
        _check_and_write_config(run_dir, cfg)
    except ConfigError:
        release_run_dir(run_dir)
        raise


def _check_and_write_config(run_dir: Path, cfg: DictConfig) -> None:
    new = OmegaConf.to_container(cfg, resolve=True)
    path = run_dir / "config.yaml"
    if path.exists():
        old = yaml.safe_load(path.read_text()) or {}
        diffs = config_differences(old, new)
        if diffs and cfg.get("on_config_change", "error") == "restart":
            log.warning("on_config_change=restart: deleting the run in %s (%d keys differ)", run_dir, len(diffs))
            clear_run(run_dir)
        elif diffs:
            raise ConfigError(_conflict_message(run_dir, diffs))
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(tmp, path)


def finished_steps(run_dir: Path) -> int | None:
    """The step count a run finished with, or None if it has not finished."""
    path = Path(run_dir) / FINISHED_MARKER
    if not path.exists():
        return None
    return int(json.loads(path.read_text())["steps"])


def mark_finished(run_dir: Path, steps: int, wall_time: float) -> None:
    path = Path(run_dir) / FINISHED_MARKER
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"steps": steps, "wall_time": wall_time}) + "\n")
    os.replace(tmp, path)
