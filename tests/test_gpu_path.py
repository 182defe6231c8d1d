"""What a CPU run never exercised on the way to the first multi-GPU run (the issue "The first
8-GPU SLURM run succeeds"):

- every step metric lives on the trainer's device (a3po.learner.step_metrics refuses one that
  does not, in every run), with 'meta' standing in for a GPU, and the hybrid's metrics are made
  there (a CPU `hybrid/recomputed` broke nccl's all-reduce at the first step);
- `train.collective_timeout_min` reaches the process group: a rank-0-only wait longer than a
  short default passes with the key above it (2 gloo processes under torchrun);
- each response token's version is the version of the weights that sampled it, at the position
  the loss reads, across a weight update that arrives in the middle of a generation.

This file is also the torchrun worker of the timeout test (`python tests/test_gpu_path.py ...`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from a3po.config import parse_config

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")


# ---------------------------------------------------------------------- metrics on the device
def test_a_metric_off_the_trainers_device_is_refused_naming_it():
    from a3po.learner.step_metrics import StepMetrics

    metrics = StepMetrics(META)
    metrics.add({"actor/loss": torch.zeros((), device=META), "actor/grad_norm": torch.ones((), device=META)})
    with pytest.raises(RuntimeError, match=r"metric 'actor/entropy' is on cpu, not on meta \(the trainer's device\)"):
        metrics.add({"actor/entropy": torch.tensor(0.5)}, n_tokens=3)
    # Without the trainer's device the first metric's is the step's: two devices are refused all the same.
    inferred = StepMetrics()
    inferred.add({"actor/loss": torch.zeros((), device=META)})
    with pytest.raises(RuntimeError, match=r"metric 'hybrid/recomputed' is on cpu, not on meta \(the step's first"):
        inferred.add({"hybrid/recomputed": torch.tensor(1.0)})


def test_the_multi_rank_reduction_stays_on_the_trainers_device():
    """Every reduction kind, reduced as across ranks (the identity in one process) on 'meta': the
    concatenated vectors the collectives would get are the device's, and so is every result."""
    from a3po.learner.step_metrics import StepMetrics

    metrics = StepMetrics(META)
    for _ in range(2):
        metrics.add({"actor/entropy": torch.ones((), device=META), "actor/clipped_tokens": torch.ones((), device=META),
                     "actor/valid_tokens": torch.ones((), device=META)}, n_tokens=torch.tensor(4, device=META))
        metrics.add({"actor/loss": torch.zeros((), device=META), "actor/grad_norm": torch.ones((), device=META)})
    reduced = metrics._reduce_across_ranks()
    assert set(reduced) == {"actor/entropy", "actor/clipped_tokens", "actor/valid_tokens", "actor/loss",
                            "actor/grad_norm"}
    assert all(value.device == META for value in reduced.values())


def _hybrid(device=None, **params):
    from a3po.learner.anchors import build_anchor
    from a3po.maths.schedules import SCHEDULES
    from a3po.maths.proximal import ALGOS

    spec = ALGOS.lookup("hybrid")
    checked = spec.check({"name": "hybrid", "every": 2, "min_ess": None, **params}, "algo")
    inverse = SCHEDULES.bind({"name": "inverse"})
    return build_anchor(spec, checked, inverse) if device is None else build_anchor(spec, checked, inverse, device)


def test_the_hybrids_metrics_are_made_on_the_trainers_device():
    from a3po.learner.step_metrics import StepMetrics

    for version, recomputes in ((4, True), (5, False)):  # every=2: counted, no probe
        recompute, logged = _hybrid(META).decide(version, lambda: pytest.fail("no probe at every=2"))
        assert recompute is recomputes and logged["hybrid/recomputed"].device == META
        StepMetrics(META).add(logged)  # accepted where a CPU flag is refused
    # The drift probe's ESS is the trainer's forward's (a3po.learner.hybrid, on its device; read on
    # the host here, so not 'meta'); the flag beside it is made on the trainer's device all the same.
    recompute, logged = _hybrid(META, every=0, min_ess=0.5).decide(3, lambda: torch.tensor(0.2))
    assert recompute is True and logged["hybrid/recomputed"].device == META
    assert _hybrid().decide(4, lambda: None)[1]["hybrid/recomputed"].device.type == "cpu"  # the default: a CPU trainer's


# ---------------------------------------------------------------------- per-token versions
PROMPTS = ("What is 12 + 7? Answer:", "Compute 3 * 9 please")


def _train_once(policy: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """A stand-in optimizer step (every weight moved, seeded by the step); the new weights."""
    noise = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    return {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}


def _trainer(cfg):
    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.timer import PhaseTimer

    policy, tokenizer = load_policy(cfg.model, seed=0)
    return trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer())


def _assert_sampled_by_stamped_version(trainer, samples, weights: dict[int, dict[str, torch.Tensor]]) -> None:
    """Token i's behaviour log-prob, as the loss reads it (`_micro_batch_tensors`), is the
    trainer's log-prob at position i (`response_logp`, the loss's positions) under the weights of
    the version the loss reads at i; under any other version's it is not, nor under the version
    one position earlier (an off-by-one between versions and positions would be seen here)."""
    tokens = trainer._micro_batch_tensors(samples, torch.zeros(len(samples)))
    behave, versions = tokens["behave"], tokens["versions"]
    logp = {}
    for version, state in weights.items():
        trainer.policy.load_state_dict(state)
        with torch.no_grad():
            logp[version] = trainer.response_logp(samples, with_entropy=False)[0]
    assert behave.shape == versions.shape == logp[0].shape
    by_version = torch.stack([logp[v] for v in range(len(weights))])
    positions = torch.arange(versions.numel())
    assert (by_version[versions, positions] - behave).abs().max() < 1e-4
    for version in versions.unique().tolist():
        mask = versions == version
        assert all((logp[other][mask] - behave[mask]).abs().max() > 1e-3 for other in weights if other != version)
    if bool((versions[1:] != versions[:-1]).any()):
        previous = torch.cat([versions[:1], versions[:-1]])
        assert (by_version[previous, positions] - behave).abs().max() > 1e-3


def test_each_tokens_version_is_the_weights_that_sampled_it_across_an_update_mid_generation(tiny_cfg):
    """runtime=async, HF engine, eta 1: batch 1 is admitted at version 0 and the trainer's update
    to version 1 lands while it generates (after its 3rd token). The HF engine stages it: batch 1
    is sampled, and stamped, by version 0 to its last token; batch 2 by a later version."""
    from a3po.batch import RolloutBatch
    from a3po.models import load_policy
    from a3po.rollout.hf import HFCopyEngine
    from a3po.runtimes.asynchronous import AsyncRuntime

    trainer = _trainer(cfg := tiny_cfg())
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = HFCopyEngine(policy, tokenizer, max_new_tokens=8)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    weights = {0: {name: tensor.clone() for name, tensor in policy.state_dict().items()}}
    now, mid, updated = {"step": -1, "calls": 0, "after_update": 0}, threading.Event(), threading.Event()

    def produce(step):
        now.update(step=step, calls=0)
        samples = [s for group in engine.generate(prompts, 2, seed=step) for s in group]
        return RolloutBatch(step=step, samples=samples, n_prompts=len(prompts), n_samples=2), {}

    def interrupt(module, args):  # the decode loop's per-token call, on the rollout thread
        now["calls"] += 1
        if now["step"] == 1 and now["calls"] == 3:
            mid.set()
            updated.wait(60)
        now["after_update"] += int(now["step"] == 1 and updated.is_set())

    handle = engine.policy.get_decoder().register_forward_pre_hook(interrupt)
    runtime = AsyncRuntime(produce, total_steps=3, max_staleness=1, batch_size=len(prompts), engine=engine)
    batches = []
    try:
        for step in range(3):
            batches.append(runtime.batch_for(step, version=step)[0])
            assert step or mid.wait(60)  # batch 1 is generating when the update to version 1 comes
            weights[step + 1] = _train_once(policy, step)
            engine.update_weights(policy, step + 1)
            updated.set()
    finally:
        runtime.close()
        handle.remove()
    assert now["after_update"] > 0  # batch 1 went on generating after the update arrived
    stamped = [torch.cat([s.versions for s in batch.samples]) for batch in batches]
    assert torch.all(stamped[0] == 0) and torch.all(stamped[1] == 0)
    assert stamped[2].unique().numel() == 1 and int(stamped[2][0]) in (1, 2)
    for step, batch in enumerate(batches):
        assert 0 <= int((step - stamped[step]).min()) and int((step - stamped[step]).max()) <= 1  # eta
        _assert_sampled_by_stamped_version(trainer, batch.samples, weights)


def test_a_sample_whose_weights_changed_mid_sequence_lines_up_at_the_switch(tiny_cfg):
    """As an interruptible engine (vLLM) hands one over: its first 4 tokens sampled by version 0,
    the rest by version 1 after the prompt and those 4 are prefilled again. The HF engine never
    makes one (it stages updates between batches), so the sample is made of two generations."""
    from a3po.batch import Sample
    from a3po.models import load_policy
    from a3po.rollout.hf import HFEngine

    trainer = _trainer(cfg := tiny_cfg())
    policy, tokenizer = load_policy(cfg.model, seed=0)
    weights = {0: {name: tensor.clone() for name, tensor in policy.state_dict().items()}}
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    first = [s for group in HFEngine(policy, tokenizer, max_new_tokens=4).generate(prompts, 3, seed=0) for s in group]
    weights[1] = _train_once(policy, 0)
    then = HFEngine(policy, tokenizer, max_new_tokens=4, version=1)
    samples = []
    for head in (s for s in first if not s.finished):  # an EOS in the first part ends the sample there
        (tail,), = then.generate([head.prompt_ids.tolist() + head.response_ids.tolist()], 1, seed=1)
        samples.append(Sample(prompt_ids=head.prompt_ids, response_ids=torch.cat([head.response_ids, tail.response_ids]),
                              behave_logp=torch.cat([head.behave_logp, tail.behave_logp]),
                              versions=torch.cat([head.versions, tail.versions])))
    assert len(samples) >= 4 and all(s.versions[:4].eq(0).all() and s.versions[4:].eq(1).all() for s in samples)
    _assert_sampled_by_stamped_version(trainer, samples, weights)


# ---------------------------------------------------------------------- the collective timeout
def test_the_collective_timeout_key_defaults_above_the_vllm_start(tiny_cfg):
    import dataclasses
    from datetime import timedelta

    from a3po.config import validate_world
    from a3po.distributed import COLLECTIVE_TIMEOUT_MIN, collective_timeout
    from a3po.errors import ConfigError
    from a3po.rollout.vllm_child import START_TIMEOUT_S
    from a3po.schema import TrainConfig, check_group

    assert tiny_cfg().train.collective_timeout_min is None  # null: older run directories compare equal
    assert collective_timeout(None) == timedelta(minutes=COLLECTIVE_TIMEOUT_MIN) > timedelta(seconds=START_TIMEOUT_S)
    assert collective_timeout(45) == timedelta(minutes=45)
    allowed = {f.name: f.metadata["allowed"] for f in dataclasses.fields(TrainConfig)}["collective_timeout_min"]
    assert allowed.endswith(f"or null for {COLLECTIVE_TIMEOUT_MIN:g}")
    with pytest.raises(ConfigError, match=r"train.collective_timeout_min=0 is not allowed; it must be a number of "
                                          r"minutes > 0, or null for 30"):
        check_group({"collective_timeout_min": 0}, TrainConfig, "train")
    with pytest.raises(ConfigError, match=r"train.collective_timeout_min=10 is not allowed; more than 15 minutes "
                                          r"with rollout=vllm at a world size of 2"):
        validate_world(tiny_cfg("rollout=vllm", "train.collective_timeout_min=10"), 2)
    validate_world(tiny_cfg("rollout=vllm", "train.collective_timeout_min=10"), 1)  # no group, no timeout
    validate_world(tiny_cfg("rollout=vllm", "train.collective_timeout_min=20"), 2)
    validate_world(tiny_cfg("rollout=vllm"), 2)


SHORT_DEFAULT_MIN = 0.05  # 3 s: stands in for torch's own 10 min default, which rank 0's waits outlast
RANK0_SLEEP_S = 8.0       # rank 0 alone, as while it starts the vLLM child or writes a checkpoint


def _env() -> dict[str, str]:
    launched = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.distributed
@pytest.mark.parametrize("key,passes", [("0.5", True), ("null", False), (str(SHORT_DEFAULT_MIN), False)])
def test_a_slow_rank_0_does_not_time_the_others_out_under_the_key(tmp_path, key, passes):
    """Rank 0 sleeps 8 s after joining while rank 1 waits at a barrier, with the default shortened
    to 3 s: train.collective_timeout_min=0.5 (30 s) lets rank 1 wait; null (the default) and 0.05
    time it out, so the key is what the process group waits by."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               str(tmp_path), str(SHORT_DEFAULT_MIN), key, str(RANK0_SLEEP_S)]
    proc = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert "rank 1: joined" in output, output[-4000:]
    if passes:
        assert proc.returncode == 0 and "rank 1: through the barrier" in output, output[-4000:]
    else:
        assert proc.returncode != 0 and "rank 1: the barrier failed" in output and "Timed out" in output, output[-4000:]
        waited = float(output.split("rank 1: the barrier failed after ")[1].split(" s")[0])
        assert waited < RANK0_SLEEP_S - 2, output[-4000:]  # at the timeout, not when rank 0 went away


def _file_barrier(directory: Path, rank: int, world: int) -> None:
    """Both processes have imported torch: the group's own start is not timed by the imports."""
    (directory / f"ready-{rank}").touch()
    while not all((directory / f"ready-{r}").exists() for r in range(world)):
        time.sleep(0.01)


def _rank_main(sync_dir: str, default_min: str, key: str, sleep_s: str) -> int:
    import a3po.distributed as distributed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    distributed.COLLECTIVE_TIMEOUT_MIN = float(default_min)
    _file_barrier(Path(sync_dir), rank, world)
    info = distributed.init_distributed(torch.device("cpu"), None if key == "null" else float(key))
    print(f"rank {rank}: joined", flush=True)
    if rank == 0:
        time.sleep(float(sleep_s))
    started = time.monotonic()
    try:
        torch.distributed.barrier()
    except RuntimeError as err:
        print(f"rank {rank}: the barrier failed after {time.monotonic() - started:.1f} s: {err}", flush=True)
        return 3
    print(f"rank {rank}: through the barrier", flush=True)
    distributed.close_distributed(info)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(*sys.argv[1:5]))
