"""A real training sweep on the local SLURM, with one job preempted mid-run.

Two identical tiny runs (differing only in experiment_name, so in run directory) go through
`hydra/launcher=slurm_local`; one is sent USR2 while it trains. Its trainer finishes the
step, writes last.pt, hands the signal to submitit, which requeues it; the requeued job
resumes. Both must end complete, with no gap and no duplicate step, and with equal metrics
(timings aside): the preemption changed nothing but the clock.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from a3po.run.metrics_log import read_metrics
from conftest import comparable

try:
    from slurm_cluster import REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401
except ImportError:
    from tests.slurm_cluster import REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401

pytestmark = [pytest.mark.slurm, requires_slurm]

TOTAL_STEPS = 12


def _wait_for_progress(paths: list[Path], min_steps: int, multirun, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(len(read_metrics(p)) >= min_steps for p in paths):
        if multirun.process.poll() is not None:
            raise AssertionError(f"the sweep ended before any run trained:\n{multirun.output()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no run reached step {min_steps}:\n{multirun.output()}")
        time.sleep(0.3)


def test_preempted_training_job_resumes_without_gap_or_change(local_slurm: LocalSlurm, tmp_path):
    out = tmp_path / "outputs"
    args = [
        "experiments/train.py", "-m", "hydra/launcher=slurm_local",
        "experiment_name=slurm_a,slurm_b", "algo=loglinear", "staleness=2",
        "model=tiny", "precision=fp32", "logger=none", f"output_root={out}",
        f"train.total_steps={TOTAL_STEPS}", "train.n_prompts=2", "train.n_samples=2",
        "train.n_minibatches=2", "train.token_budget=256", "rollout.max_new_tokens=8",
        "train.eval_every=4", "train.eval_size=2", "train.checkpoint_every=0",
        "hydra.launcher.timeout_min=30",
    ]
    runs = [out / name / "loglinear-d2-s0" / "metrics.jsonl" for name in ("slurm_a", "slurm_b")]
    sweep = local_slurm.start_multirun(args, cwd=REPO_ROOT)
    _wait_for_progress(runs, 2, sweep)
    job_id = local_slurm.wait_for_running_job()
    local_slurm.preempt(job_id)
    result = sweep.finish(timeout_s=900)
    assert result.returncode == 0, result.stdout
    assert "REQUEUED" in local_slurm.job_state_history(job_id), local_slurm.diagnostics()

    records = [read_metrics(path) for path in runs]
    for run_records in records:
        assert [r["step"] for r in run_records] == list(range(TOTAL_STEPS))
    assert comparable(records[0]) == comparable(records[1])
