"""Data-parallel training (a3po.distributed) on CPU with gloo: 2 processes under torchrun train
the tiny model to the same weights and log the same metrics as 1 process; a 2-process run
stopped after a step resumes to the same result; a world size too large for the minibatch
fails at start.

The runs are subprocesses of this file itself (`python tests/test_distributed.py RUN_DIR
OVERRIDES...`, under torchrun or not): a random tiny model never earns the arith task's
reward, so the worker scores a sample by the share of its response tokens with an even id,
which gives every GRPO group mixed rewards and the step a non-zero gradient.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import comparable

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
# 3 x 3 = 9 samples in minibatches of 5 and 4: the ranks' shards of the first are 3 and 2
# samples, so rank 1 runs an idle micro-batch. Prompts are 45 tokens and responses <= 8, so a
# budget of 64 holds exactly one sample per micro-batch for 1 and 2 processes alike, and even
# the per-micro-batch metrics (offpolicy/ess_*) are comparable. log_prox_errors adds the
# recompute forward (no-grad idle passes) and the prox_error/* metrics. At lr 1e-4 the 6
# AdamW updates move weights by up to 6e-4, far above the tolerance.
RUN_OVERRIDES = ["precision=fp32", "train.n_prompts=3", "train.n_samples=3", "train.n_minibatches=2", "train.token_budget=64",
                 "train.lr=1e-4", "train.log_prox_errors=true", "train.save_final_model=true", "staleness=2",
                 "device=cpu"]
# Measured: max |weight difference| 4.2e-8, metrics within 1.1e-6 (actor/importance_weight/max ~ 1):
# float32 sums in another order (two shards, a reduce-scatter), nothing more.
WEIGHT_TOLERANCE = 1e-6
# prox_error/<schedule>/<error>/H1-H3 (a3po.learner.fidelity): present in both, not compared
ENTROPY_TERCILES = ("/H1", "/H2", "/H3")
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)


def _env() -> dict[str, str]:
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _launch(run_dir: Path, *overrides: str, processes: int, script: Path = Path(__file__),
            timeout: int = 300) -> subprocess.CompletedProcess:
    prefix = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    args = [str(run_dir)] if script == Path(__file__) else []
    return subprocess.run([*prefix, str(script), *args, *overrides], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _train(run_dir: Path, *overrides: str, processes: int) -> Path:
    proc = _launch(run_dir, *RUN_OVERRIDES, *overrides, processes=processes)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final_model" / "model.safetensors")


def _largest_update(run_dir: Path) -> float:
    """Max |final - initial| weight: the tiny model's initial weights are a function of the seed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import TINY_OVERRIDES, compose_config

    from a3po.models import load_policy

    initial = load_policy(compose_config(TINY_OVERRIDES).model, seed=0)[0].state_dict()
    final = _weights(run_dir)
    return max(float((final[k] - initial[k]).abs().max()) for k in final)


def _comparable(record: dict) -> dict:
    return comparable([record])[0]


def weight_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def metric_differences(a: Path, b: Path) -> dict[str, float]:
    """Largest |difference| per metric over the steps (timings excluded)."""
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    diffs: dict[str, float] = {}
    for x, y in zip(ra, rb):
        x, y = _comparable(x), _comparable(y)
        assert x.keys() == y.keys()
        for k in x:
            diffs[k] = max(diffs.get(k, 0.0), abs(x[k] - y[k]))
    return diffs


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """The same 3 steps with 1 process and with 2 (both written under one temporary folder)."""
    root = tmp_path_factory.mktemp("distributed")
    return _train(root / "one", processes=1), _train(root / "two", processes=2)


def test_two_processes_match_one(reference_runs):
    one, two = reference_runs
    assert [r["step"] for r in _records(two)] == [0, 1, 2]  # rank 0 alone logs: one line per step
    assert json.loads((two / "finished.json").read_text())["steps"] == 3
    assert weight_difference(one, two) < WEIGHT_TOLERANCE
    assert _largest_update(one) > 100 * WEIGHT_TOLERANCE  # the training moved the weights well past it
    ra, rb = _records(one), _records(two)
    for x, y in zip(ra, rb):
        x, y = _comparable(x), _comparable(y)
        assert x.keys() == y.keys()
        for k in x:
            if k.endswith(ENTROPY_TERCILES):
                continue  # a token's tercile is a step function of its entropy: 1e-7 moves it across a cut
            assert x[k] == pytest.approx(y[k], rel=METRIC_RTOL, abs=METRIC_ATOL), (x["step"], k)


def test_two_processes_resume_to_the_same_result(reference_runs, tmp_path):
    _, two = reference_runs
    resumed = _train(tmp_path / "resumed", "train.max_steps_this_run=1", processes=2)
    assert [r["step"] for r in _records(resumed)] == [0]
    assert (resumed / "checkpoints" / "last.pt").exists()
    _train(resumed, processes=2)  # the same command again (without the cap) resumes
    assert [r["step"] for r in _records(resumed)] == [0, 1, 2]
    assert weight_difference(two, resumed) < WEIGHT_TOLERANCE
    for k, d in metric_differences(two, resumed).items():
        assert d <= METRIC_ATOL + METRIC_RTOL * abs(_records(two)[-1][k]), k


def test_activation_checkpointing_under_fsdp2_changes_no_result(reference_runs, tmp_path):
    """Checkpointing is applied before fully_shard; the recomputed forward is the same one."""
    _, two = reference_runs
    checkpointed = _train(tmp_path / "checkpointed", "train.activation_checkpointing=true", processes=2)
    assert weight_difference(two, checkpointed) < WEIGHT_TOLERANCE
    for k, d in metric_differences(two, checkpointed).items():
        assert d <= METRIC_ATOL + METRIC_RTOL * abs(_records(two)[-1][k]), k


def test_fsdp2_mixed_precision_gathers_bf16_weights_and_trains_like_autocast(tmp_path):
    """`train.fsdp_mixed_precision`: bf16 weights in the forward (all of them, norms and embedding
    included) instead of autocast's casts of the matmuls' inputs: another rounding of the same
    training, so close to the autocast run but not equal to it."""
    autocast_run = _train(tmp_path / "autocast", "precision=bf16", processes=2)
    mixed = _train(tmp_path / "mixed", "precision=bf16", "train.fsdp_mixed_precision=true", processes=2)
    ours, theirs = _records(mixed), _records(autocast_run)
    assert [r["step"] for r in ours] == [0, 1, 2]
    assert weight_difference(autocast_run, mixed) > 0  # the key reached FSDP2: another rounding
    for x, y in zip(ours, theirs):  # staleness 2: all three batches come from the initial weights
        assert x["reward/mean"] == y["reward/mean"]
        assert x["actor/entropy"] == pytest.approx(y["actor/entropy"], rel=1e-3)
        assert x["actor/grad_norm"] == pytest.approx(y["actor/grad_norm"], rel=0.1)  # measured: within 5.1%
    for name, tensor in _weights(mixed).items():
        assert tensor.dtype == torch.float32, name  # the master weights stay float32


def test_a_world_larger_than_a_minibatch_fails_at_start(tmp_path):
    # 2 x 2 samples in 4 minibatches of 1: 2 ranks cannot share one sample
    proc = _launch(tmp_path, "model=tiny", "logger=none", "device=cpu", "train.n_prompts=2", "train.n_samples=2",
                   "train.n_minibatches=4", f"output_root={tmp_path}", processes=2,
                   script=REPO / "experiments" / "train.py", timeout=180)
    assert proc.returncode != 0
    assert "config error: train.n_minibatches=4 is not allowed with a world size of 2 processes" in proc.stderr, \
        proc.stderr[-3000:]
    assert "allowed: train.n_minibatches <= 2 at 2 processes, or at most 1 processes" in proc.stderr
    # it failed before claiming a run directory (Hydra's own .hydra/ folder is written first)
    assert not [p for p in tmp_path.rglob("config.yaml") if ".hydra" not in p.parts]


def test_a_multi_task_submitit_job_is_a_distributed_run(monkeypatch):
    """hydra.launcher.tasks_per_node=N: each SLURM task becomes a rank (slurm/README.md)."""
    from a3po.distributed import launched_world

    # submitit's export writes os.environ directly (not through monkeypatch): restore it all,
    # or a later test in this process would think it is rank 3 of 7
    saved = dict(os.environ)
    try:
        _check_submitit_tasks_become_ranks(monkeypatch, launched_world)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_submitit_tasks_become_ranks(monkeypatch, launched_world) -> None:
    """Works on os.environ directly; the caller restores it whole."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "7", "SLURM_PROCID": "3",
                       "SLURM_LOCALID": "3", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1",
                       "SLURM_JOB_NODELIST": "gpu-node-1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert launched_world() == 7
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == ("3", "3", "gpu-node-1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # every task sees the rollout GPU too
    os.environ["SLURM_NTASKS"] = "1"
    for key in ("RANK", "WORLD_SIZE"):
        del os.environ[key]
    assert launched_world() == 1  # a one-task job (every profile's default) stays one process


# ---------------------------------------------------------------------- the worker
def _worker(run_dir: str, overrides: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import TINY_OVERRIDES, compose_config, even_token_share

    import a3po.rollout.producer
    import a3po.run.main
    from a3po.errors import ConfigError

    a3po.rollout.producer.RolloutProducer.score = even_token_share
    cfg = compose_config([*TINY_OVERRIDES, *overrides])
    try:
        a3po.run.main.run(cfg, run_dir=run_dir)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
