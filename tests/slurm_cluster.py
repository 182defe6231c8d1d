"""A real single-node SLURM for the slurm-marked tests, and the few operations they need.

The cluster is the one `slurm/local_cluster.sh` starts, in a fresh state directory per test
session: job ids restart from 1 there, so nothing a test looks for can be confused with an
earlier session's jobs. A sweep is launched exactly as a user launches it (a subprocess
running a Hydra app with `-m hydra/launcher=slurm_local`), so the tests exercise the same
submitit pickling, sbatch script and requeue path as a cluster run.

Typical use in a test module (importing `local_slurm` is what makes the fixture visible
there; several modules importing it still share one cluster)::

    from slurm_cluster import REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401

    pytestmark = [pytest.mark.slurm, requires_slurm]

    def test_sweep(local_slurm: LocalSlurm, tmp_path):
        sweep = local_slurm.start_multirun(["experiments/train.py", "-m", ...,
                                            "hydra/launcher=slurm_local"], cwd=REPO_ROOT)
        job_id = local_slurm.wait_for_running_job(timeout_s=120)
        local_slurm.preempt(job_id)
        result = sweep.finish(timeout_s=600)
        assert result.returncode == 0, result.stdout
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO_ROOT / "slurm" / "local_cluster.sh"
CONF_DIR = REPO_ROOT / "conf"
PARTITION = "local"

# sacct states after which a job will not run again. REQUEUED, PENDING, RUNNING and the
# transient COMPLETING/SUSPENDED are deliberately absent: a requeued job comes back.
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "PREEMPTED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def _find_program(name: str) -> str | None:
    # slurmctld lives in /usr/sbin, which is not on every user's PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slurm_unavailable_reason() -> str | None:
    """Why the local cluster cannot run here, or None when it can."""
    missing = [name for name in ("sbatch", "slurmctld", "slurmdbd", "munged", "mariadbd") if not _find_program(name)]
    if missing:
        return f"local SLURM not installed ({', '.join(missing)} absent): run slurm/install_local_cluster.sh"
    if os.geteuid() != 0:
        return "slurm/local_cluster.sh runs its daemons as root"
    return None


_UNAVAILABLE_REASON = slurm_unavailable_reason()
requires_slurm = pytest.mark.skipif(_UNAVAILABLE_REASON is not None, reason=_UNAVAILABLE_REASON or "")


def _base_state(sacct_state: str) -> str:
    # sacct prints "CANCELLED by 0" for cancellations.
    return sacct_state.split()[0] if sacct_state else sacct_state


@dataclass
class LocalSlurm:
    """Handle on a running local cluster: its state directory and the client environment."""

    state_dir: Path
    slurm_conf: Path
    partition: str = PARTITION
    # Submitting processes started here; any still alive at teardown is killed, since it
    # would otherwise poll a stopped cluster forever.
    multiruns: list[Multirun] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for SLURM clients and for submitting processes (SLURM_CONF set)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.slurm_conf)
        env["A3PO_SLURM_DIR"] = str(self.state_dir)
        env.update(extra or {})
        return env

    def run(self, *command: str, check: bool = True, timeout_s: float = 60) -> str:
        """Run a SLURM client (sbatch, sacct, scancel, ...) against this cluster; stdout."""
        completed = subprocess.run(
            list(command), env=self.env(), capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and completed.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
            )
        return completed.stdout

    def sbatch(self, *args: str) -> str:
        """Submit with sbatch; the job id."""
        return self.run("sbatch", "--parsable", f"--partition={self.partition}", *args).strip().split(";")[0]

    def job_states(self, job_ids: Sequence[str]) -> dict[str, str]:
        """sacct's state of each job's latest attempt (array tasks appear as `<array>_<task>`)."""
        if not job_ids:
            return {}
        output = self.run("sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids))
        states: dict[str, str] = {}
        for line in output.splitlines():
            if "|" in line:
                job_id, state = line.split("|", 1)
                states[job_id] = _base_state(state)
        return states

    def job_state_history(self, job_id: str) -> list[str]:
        """Every attempt's state of one job, oldest first (REQUEUED rows for requeues)."""
        output = self.run("sacct", "-X", "-n", "-P", "-D", "-o", "JobID,State", "-j", job_id)
        return [_base_state(line.split("|", 1)[1]) for line in output.splitlines() if "|" in line]

    def wait_for_jobs(self, job_ids: Sequence[str], timeout_s: float = 300) -> dict[str, str]:
        """Block until every job (array ids cover all their tasks) reached a terminal state.

        Reads sacct rather than squeue: a requeued job briefly leaves squeue's running list,
        and sacct is what submitit itself trusts.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.job_states(job_ids)
            # A still-pending array prints one row such as `12_[1-2]`, never terminal.
            if states and all(state in TERMINAL_STATES for state in states.values()):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs {list(job_ids)} not finished after {timeout_s}s: {states}\n{self.diagnostics()}")
            time.sleep(0.5)

    def wait_for_state(self, job_id: str, wanted: str = "RUNNING", timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.job_states([job_id]).get(job_id) != wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not {wanted} after {timeout_s}s\n{self.diagnostics()}")
            time.sleep(0.2)

    def wait_for_running_job(self, timeout_s: float = 120) -> str:
        """The id of the first job seen running, e.g. one job of a sweep to preempt."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = self.run("squeue", "-h", "-r", "-t", "RUNNING", "-o", "%i").split()
            if running:
                return running[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no job running after {timeout_s}s\n{self.diagnostics()}")
            time.sleep(0.2)

    def preempt(self, job_id: str) -> None:
        """What a preempting scheduler (or a nearing time limit) does to a submitit job:
        USR2 to the job's steps, on which submitit checkpoints and requeues it."""
        self.run("scancel", "--signal=USR2", job_id)

    def start_multirun(
        self, args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, log_path: Path | None = None
    ) -> Multirun:
        """Launch `python <args>` (a Hydra app and its `-m` overrides) in the background.

        The submitting process blocks until the whole sweep ends, so a test that preempts
        one of its jobs must not wait on it first. Output goes to a file, not a pipe that
        nobody drains while the sweep runs.
        """
        log_path = log_path or self.state_dir / f"multirun-{time.time_ns()}.log"
        with open(log_path, "w") as log_file:
            # The child holds its own copy of the descriptor; ours can close at once.
            process = subprocess.Popen(
                [sys.executable, *args], cwd=cwd, env=self.env(env), stdout=log_file, stderr=subprocess.STDOUT
            )
        multirun = Multirun(process=process, log_path=log_path, cluster=self)
        self.multiruns.append(multirun)
        return multirun

    def kill_multiruns(self) -> None:
        for multirun in self.multiruns:
            if multirun.process.poll() is None:
                multirun.process.kill()
                multirun.process.wait()

    def submit_multirun(
        self, args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 600
    ) -> subprocess.CompletedProcess:
        """Run a Hydra multirun to its end (the submitting process returns once every job has)."""
        return self.start_multirun(args, cwd, env).finish(timeout_s)

    def diagnostics(self) -> str:
        """Queue, node and daemon log tails, for failure messages."""
        parts = []
        for command in (["squeue", "-a"], ["sinfo", "-N", "-l"], ["sacct", "-a", "-X", "-D", "-o", "JobID,JobName,State,ExitCode,Elapsed"]):
            try:
                parts.append(f"$ {' '.join(command)}\n{self.run(*command, check=False, timeout_s=20)}")
            except (subprocess.SubprocessError, OSError) as error:
                parts.append(f"$ {' '.join(command)}: {error}")
        for log in sorted((self.state_dir / "log").glob("slurm*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"---- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)


@dataclass
class Multirun:
    """A Hydra multirun submitting process started by `LocalSlurm.start_multirun`."""

    process: subprocess.Popen
    log_path: Path
    cluster: LocalSlurm

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def finish(self, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """Wait for the submitting process; its exit code and combined stdout/stderr."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise TimeoutError(
                f"multirun still running after {timeout_s}s:\n{self.output()}\n{self.cluster.diagnostics()}"
            ) from None
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout=self.output(), stderr="")


def _cluster_script(command: str, state_dir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, A3PO_SLURM_DIR=str(state_dir))
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), command], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def start_local_slurm(state_dir: Path) -> LocalSlurm:
    """Start a cluster under `state_dir` (stopping whatever came up if start fails)."""
    started = _cluster_script("start", state_dir, timeout_s=180)
    if started.returncode != 0:
        _cluster_script("stop", state_dir, timeout_s=120)
        raise RuntimeError(f"slurm/local_cluster.sh start failed:\n{started.stdout}\n{started.stderr}")
    export_line = started.stdout.strip().splitlines()[-1]
    slurm_conf = Path(export_line.removeprefix("export SLURM_CONF="))
    return LocalSlurm(state_dir=state_dir, slurm_conf=slurm_conf)


def stop_local_slurm(state_dir: Path) -> None:
    """Stop every daemon of the cluster by its pid file, then drop the bulky state.

    The database and spool directories are removed (pytest keeps its last three temp
    roots); logs and configs stay for post-mortems.
    """
    stopped = _cluster_script("stop", state_dir, timeout_s=180)
    if stopped.returncode != 0:
        raise RuntimeError(f"slurm/local_cluster.sh stop failed:\n{stopped.stdout}\n{stopped.stderr}")
    for bulky in ("mysql", "state"):
        shutil.rmtree(state_dir / bulky, ignore_errors=True)


# Several test modules may import the `local_slurm` fixture; pytest then holds one session
# fixture per module, so the cluster itself is shared and stopped with the last user.
_shared_cluster: LocalSlurm | None = None
_shared_users = 0


def _stop_shared_cluster() -> None:
    global _shared_cluster, _shared_users
    if _shared_cluster is not None:
        cluster = _shared_cluster
        _shared_cluster = None
        _shared_users = 0
        cluster.kill_multiruns()
        stop_local_slurm(cluster.state_dir)


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A running local cluster for the whole session, stopped at its end even on failure."""
    global _shared_cluster, _shared_users
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    if _shared_cluster is None:
        _shared_cluster = start_local_slurm(tmp_path_factory.mktemp("slurm"))
        # Last resort if the session dies without running fixture teardown.
        atexit.register(_stop_shared_cluster)
    _shared_users += 1
    try:
        yield _shared_cluster
    finally:
        _shared_users -= 1
        if _shared_users == 0:
            atexit.unregister(_stop_shared_cluster)
            _stop_shared_cluster()
