"""The cluster path of the sweeps, on a real single-node SLURM (slurm/local_cluster.sh).

What a cluster run relies on, each proven here end to end: a batch job runs; submitit gets
a Python function's result back and sacct records the job (submitit reads job states from
sacct); a USR2 preemption makes a submitit Checkpointable checkpoint, requeue and finish
from where it stopped (the mechanism a training run uses to resume from last.pt); and a
Hydra multirun through `hydra/launcher=slurm_local` keeps every job's results when one
job fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

submitit = pytest.importorskip("submitit")  # a bare GPU image has no submitit: skip, not a collection error

try:
    from slurm_cluster import CONF_DIR, REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.slurm_cluster import CONF_DIR, REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401

pytestmark = [pytest.mark.slurm, requires_slurm]

SLURM_APP = Path(__file__).resolve().parent / "fixtures" / "slurm_app" / "app.py"


@pytest.fixture
def submitit_executor(local_slurm: LocalSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A submitit executor on the local cluster, with its own folder (job ids repeat
    across cluster sessions, so a shared folder could hand back another run's pickles)."""
    # submitit calls sbatch/sacct from this process's environment.
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.slurm_conf))
    # Functions and classes of this module are pickled by value: the job's Python cannot
    # import a pytest test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit" / "%j", cluster="slurm")
    # timeout_min >= 30: submitit calls a USR2 a timeout once min(0.8 T, T - 10 min) has
    # passed, and a timeout of a job that may not time out again is not requeued.
    executor.update_parameters(slurm_partition=local_slurm.partition, cpus_per_task=1, mem_gb=1, timeout_min=30)
    yield executor
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def add(left: int, right: int) -> dict:
    return {"sum": left + right, "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


class CountingCheckpointable(submitit.helpers.Checkpointable):
    """Counts to `total_steps`, one step per `step_s`, keeping its progress on the object.

    On USR2 submitit calls `checkpoint()` (from `Checkpointable`) and pickles this object,
    progress included, into the requeued job: the counterpart of a trainer that writes
    last.pt on USR2 and resumes from it. Each attempt appends a line to `progress_file`
    so the test can see where the requeued attempt started and when.
    """

    def __init__(self, progress_file: Path, total_steps: int, step_s: float):
        self.progress_file = progress_file
        self.total_steps = total_steps
        self.step_s = step_s
        self.completed_steps = 0

    def _record(self, event: str) -> None:
        record = {
            "event": event,
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "completed_steps": self.completed_steps,
            "time": time.time(),
        }
        with open(self.progress_file, "a") as progress:
            progress.write(json.dumps(record) + "\n")

    def __call__(self) -> dict:
        self._record("start")
        while self.completed_steps < self.total_steps:
            time.sleep(self.step_s)
            self.completed_steps += 1
            self._record("step")
        return {"completed_steps": self.completed_steps, "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}


def _read_records(progress_file: Path) -> list[dict]:
    if not progress_file.exists():
        return []
    return [json.loads(line) for line in progress_file.read_text().splitlines() if line.strip()]


def test_node_advertises_the_machine_and_allows_requeue(local_slurm: LocalSlurm):
    node = dict(
        field.split("=", 1) for field in local_slurm.run("scontrol", "-o", "show", "node").split() if "=" in field
    )
    assert node["State"].startswith("IDLE") or node["State"].startswith("MIXED"), node
    assert int(node["CPUTot"]) in {os.cpu_count(), len(os.sched_getaffinity(0))}, node
    mem_total_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    assert 0.9 * mem_total_mb <= int(node["RealMemory"]) <= mem_total_mb, node
    config = local_slurm.run("scontrol", "show", "config")
    assert "JobRequeue              = 1" in config


def test_start_is_idempotent(local_slurm: LocalSlurm):
    def daemon_pids() -> dict[str, str]:
        run_dir = local_slurm.state_dir / "run"
        return {pid_file.name: pid_file.read_text().strip() for pid_file in run_dir.glob("*.pid")}

    before = daemon_pids()
    assert len(before) == 5, before
    again = local_slurm.run("bash", str(REPO_ROOT / "slurm" / "local_cluster.sh"), "start")
    assert again.strip() == f"export SLURM_CONF={local_slurm.slurm_conf}"
    assert daemon_pids() == before
    status = local_slurm.run("bash", str(REPO_ROOT / "slurm" / "local_cluster.sh"), "status")
    assert "slurmd: running" in status and local_slurm.partition in status


def test_sbatch_job_runs(local_slurm: LocalSlurm, tmp_path: Path):
    output = tmp_path / "job.out"
    job_id = local_slurm.sbatch(f"--output={output}", "--wrap", "echo ran as job $SLURM_JOB_ID on $SLURM_JOB_PARTITION")
    assert local_slurm.wait_for_jobs([job_id], timeout_s=120) == {job_id: "COMPLETED"}
    assert output.read_text().strip() == f"ran as job {job_id} on {local_slurm.partition}"


def test_submitit_function_returns_its_result_and_sacct_records_it(local_slurm: LocalSlurm, submitit_executor):
    job = submitit_executor.submit(add, 2, 3)
    result = job.result()
    assert result == {"sum": 5, "slurm_job_id": job.job_id}
    # sacct hears of the end a moment after submitit sees the result pickle.
    assert local_slurm.wait_for_jobs([job.job_id], timeout_s=60) == {job.job_id: "COMPLETED"}


def test_usr2_preemption_requeues_a_checkpointable_which_resumes(
    local_slurm: LocalSlurm, submitit_executor, tmp_path: Path
):
    progress_file = tmp_path / "progress.jsonl"
    job = submitit_executor.submit(CountingCheckpointable(progress_file, total_steps=16, step_s=0.5))

    deadline = time.monotonic() + 120
    while sum(record["event"] == "step" for record in _read_records(progress_file)) < 3:
        assert time.monotonic() < deadline, f"job never made progress\n{local_slurm.diagnostics()}"
        time.sleep(0.2)
    preempted_at = time.time()
    local_slurm.preempt(job.job_id)

    result = job.result()
    records = _read_records(progress_file)
    starts = [record for record in records if record["event"] == "start"]
    assert [start["restart_count"] for start in starts] == [0, 1], records
    # The requeued attempt continued from the checkpointed object, not from zero.
    assert starts[1]["completed_steps"] >= 3, records
    assert result == {"completed_steps": 16, "restart_count": 1}
    # submitit returns once the result pickle exists; sacct hears of the end a moment later.
    assert local_slurm.wait_for_jobs([job.job_id], timeout_s=60) == {job.job_id: "COMPLETED"}
    assert local_slurm.job_state_history(job.job_id) == ["REQUEUED", "COMPLETED"]
    print(f"USR2 -> requeued attempt running: {starts[1]['time'] - preempted_at:.1f}s")


def test_hydra_multirun_on_slurm_keeps_results_beside_a_failing_job(local_slurm: LocalSlurm, tmp_path: Path):
    sweep_dir = tmp_path / "sweep"
    completed = local_slurm.submit_multirun(
        [
            str(SLURM_APP),
            "-m",
            "hydra/launcher=slurm_local",
            f"hydra.searchpath=[file://{CONF_DIR}]",
            f"hydra.sweep.dir={sweep_dir}",
            "value=1,2,3",
            "fail_on=2",
        ],
        cwd=tmp_path,
        timeout_s=300,
    )

    # The sweep reports the failure, but only after every job has run.
    assert completed.returncode != 0, completed.stdout
    assert "slurm_app fails on purpose for value=2" in completed.stdout
    for value in (1, 3):
        result = json.loads((sweep_dir / f"value={value}" / "result.json").read_text())
        assert result["square"] == value * value
        assert result["slurm_job_id"], "the job did not run under SLURM"
    assert not (sweep_dir / "value=2" / "result.json").exists()

    # One array of three tasks, whose folders (`<array>_<task>`) are inside this sweep.
    task_dirs = [path.name for path in (sweep_dir / ".submitit").glob("*/*_*") if path.is_dir()]
    array_ids = {name.split("_")[0] for name in task_dirs}
    assert len(array_ids) == 1 and sorted(name.split("_")[1] for name in task_dirs) == ["0", "1", "2"], task_dirs
    (array_id,) = array_ids
    # Hydra catches the job's exception and returns it, so SLURM sees three clean exits.
    # Ask for the tasks by id: accounting may still list the array under its bare id for a
    # moment after the sweep returns (seen once in CI as {'4': 'COMPLETED'}).
    task_ids = [f"{array_id}_{task}" for task in range(3)]
    deadline = time.monotonic() + 60
    states = local_slurm.wait_for_jobs(task_ids, timeout_s=60)
    while set(states) != set(task_ids) and time.monotonic() < deadline:
        time.sleep(1)
        states = local_slurm.job_states(task_ids)
    assert states == {task_id: "COMPLETED" for task_id in task_ids}, states


def test_driver_job_runs_a_sweep_from_inside_slurm(local_slurm: LocalSlurm, tmp_path: Path):
    sweep_dir = tmp_path / "sweep"
    driver_log = tmp_path / "driver.out"
    driver_id = local_slurm.sbatch(
        f"--chdir={tmp_path}",
        f"--output={driver_log}",
        str(REPO_ROOT / "slurm" / "driver.sbatch"),
        sys.executable,
        str(SLURM_APP),
        "-m",
        "hydra/launcher=slurm_local",
        f"hydra.searchpath=[file://{CONF_DIR}]",
        f"hydra.sweep.dir={sweep_dir}",
        "value=4,5",
    )
    states = local_slurm.wait_for_jobs([driver_id], timeout_s=300)
    assert states == {driver_id: "COMPLETED"}, driver_log.read_text()
    for value in (4, 5):
        result = json.loads((sweep_dir / f"value={value}" / "result.json").read_text())
        assert result["square"] == value * value
        # A job of its own, not the driver's allocation.
        assert result["slurm_job_id"] not in {None, driver_id}
