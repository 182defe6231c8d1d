"""One writer per run directory: an advisory lock on `<run_dir>/.lock`, held for the life of
the process that claims the run (a3po.run.rundir.claim_run_dir), released by the kernel when
that process ends however it ends, so kill -9 never leaves a stale lock."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from a3po.errors import ConfigError

__all__ = ["LOCK_FILE", "lock_run_dir", "release_run_dir"]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# How long a process that found the lock taken waits for the holder to write who it is: the
# holder writes right after it locks, so an empty lock file means it is just starting.
HOLDER_NOTE_WAIT_S = 2.0

# The run-directory locks this process holds: resolved run dir -> the open lock file. The
# open descriptor is the lock (flock belongs to the open file), so it lasts until
# `release_run_dir` or the end of the process, however it ends: the kernel drops it on exit,
# kill -9 included, and no stale lock file ever needs deleting.
_HELD: dict[Path, int] = {}


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
