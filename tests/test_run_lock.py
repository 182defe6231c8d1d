"""One writer per run directory: the advisory lock that `claim_run_dir` takes.

The unit tests hold the lock in a small helper process; the end-to-end tests start real
`experiments/train.py` processes on the tiny model: two at once for one run, and a holder
killed with SIGKILL mid-run whose rerun resumes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.run.metrics_log import read_metrics
from a3po.run.lock import LOCK_FILE, release_run_dir
from a3po.run.rundir import claim_run_dir

from conftest import REPO, TINY_OVERRIDES

# Holds `claim_run_dir(argv[1], {"seed": argv[2]})` until its stdin closes.
HOLDER = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
from a3po.run.rundir import claim_run_dir
claim_run_dir(Path(sys.argv[1]), OmegaConf.create({"seed": int(sys.argv[2])}))
print("held", flush=True)
sys.stdin.read()
"""


def _config(seed: int = 0, **extra):
    return OmegaConf.create({"seed": seed, **extra})


def _hold(run_dir: Path, seed: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(seed)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


def _end(proc: subprocess.Popen, sig: int | None = None) -> None:
    if sig is None:
        proc.stdin.close()
    else:
        os.kill(proc.pid, sig)
    proc.wait(timeout=60)


def test_a_held_run_dir_refuses_a_second_process_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = _hold(run_dir)
    try:
        with pytest.raises(ConfigError) as err:
            claim_run_dir(run_dir, _config())
        message = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}, since " in message
        assert str(run_dir) in message and f"kill {holder.pid}" in message and "rerun" in message
        note = json.loads((run_dir / LOCK_FILE).read_text())
        assert (note["pid"], note["host"]) == (holder.pid, socket.gethostname())
    finally:
        _end(holder)
    claim_run_dir(run_dir, _config())  # the holder ended: the directory is free
    release_run_dir(run_dir)


def test_the_lock_comes_before_the_config_is_compared_or_deleted(tmp_path):
    run_dir = tmp_path / "run"
    holder = _hold(run_dir, seed=0)
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        config_before = (run_dir / "config.yaml").read_text()
        for cfg in (_config(seed=1), _config(seed=1, on_config_change="restart")):
            with pytest.raises(ConfigError, match=rf"in use by another process: pid {holder.pid} "):
                claim_run_dir(run_dir, cfg)
        assert (run_dir / "config.yaml").read_text() == config_before  # neither compared nor rewritten
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'  # the live run was not deleted
    finally:
        _end(holder)


def test_a_holder_killed_with_sigkill_leaves_the_lock_free(tmp_path):
    run_dir = tmp_path / "run"
    _end(_hold(run_dir), signal.SIGKILL)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"]  # its note stays, its lock does not
    claim_run_dir(run_dir, _config())
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    release_run_dir(run_dir)


def test_one_process_may_claim_its_own_dir_again_and_release_it(tmp_path):
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, _config())
    claim_run_dir(run_dir, _config())  # the same process: no conflict with itself
    release_run_dir(run_dir)
    assert (run_dir / LOCK_FILE).read_text() == ""  # released: nobody is named as the holder
    _end(_hold(run_dir))  # another process can take it now
    release_run_dir(run_dir)  # not held: a no-op


def test_a_failed_claim_gives_the_lock_back(tmp_path):
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, _config(seed=0))
    release_run_dir(run_dir)
    with pytest.raises(ConfigError, match="different config"):
        claim_run_dir(run_dir, _config(seed=1))
    _end(_hold(run_dir, seed=0))  # the refused claim did not keep the directory


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, _config())
    child = os.fork()
    if child == 0:  # the child outlives the lock's holder by a sleep; it must not hold the lock
        time.sleep(30)
        os._exit(0)
    try:
        release_run_dir(run_dir)
        _end(_hold(run_dir))  # free although the child still has its copy of the descriptor
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# ------------------------------------------------------------------ end to end, the CLI
def _train_command(root: Path) -> list[str]:
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("train.total_steps")]
    return [sys.executable, "experiments/train.py", *overrides, "experiment_name=c", "train.total_steps=6",
            f"output_root={root}"]


def _start(root: Path) -> subprocess.Popen:
    return subprocess.Popen(_train_command(root), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, procs, what: str, timeout: float = 300) -> None:
    """Poll until `condition()`; fail naming `what` if every process in `procs` ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if all(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            outputs = "\n".join(p.communicate()[1][-2000:] for p in procs if p.poll() is not None)
            pytest.fail(f"never saw {what}; the processes ended:\n{outputs}")
        time.sleep(0.01)


def _holder_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_two_processes_for_one_run_one_trains_the_other_exits_2(tmp_path):
    run_dir = tmp_path / "c" / "loglinear-d2-s0"
    procs = [_start(tmp_path), _start(tmp_path)]
    try:
        _wait_for(lambda: _holder_pid(run_dir) in {p.pid for p in procs}, procs, "a process holding the lock")
        holder = next(p for p in procs if p.pid == _holder_pid(run_dir))
        other = next(p for p in procs if p is not holder)
        # Paused, the holder cannot finish before the other process reaches its claim.
        os.kill(holder.pid, signal.SIGSTOP)
        _, other_err = other.communicate(timeout=300)
        os.kill(holder.pid, signal.SIGCONT)
        _, holder_err = holder.communicate(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert holder.returncode == 0, holder_err[-2000:]
    assert other.returncode == 2, other_err[-2000:]
    assert f"config error: the run directory {run_dir} is in use by another process: pid {holder.pid} on host " \
           f"{socket.gethostname()}" in other_err
    assert "Traceback" not in other_err
    assert _steps(run_dir) == [0, 1, 2, 3, 4, 5]
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == 6


def test_a_run_killed_with_sigkill_mid_run_resumes_on_rerun(tmp_path):
    run_dir = tmp_path / "c" / "loglinear-d2-s0"
    first = _start(tmp_path)
    try:
        _wait_for(lambda: len(_steps(run_dir)) >= 1, [first], "the first step logged")
        first.kill()  # SIGKILL: no handler runs, nothing is released by the run itself
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert not (run_dir / "finished.json").exists()  # killed mid-run, not after it
    assert _holder_pid(run_dir) == first.pid  # the dead holder's note is still there
    rerun = subprocess.run(_train_command(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _steps(run_dir) == [0, 1, 2, 3, 4, 5]
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == 6
