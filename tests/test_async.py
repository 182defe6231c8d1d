"""Async runtime: no token staler than eta, and a clean end however a run ends.

The first tests drive `AsyncRuntime` with a fake producer (no model, milliseconds); the rest
run the real training loop on the tiny model with the HF engine, which the async runtime gives
its own copy of the weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from a3po.runtimes.asynchronous import AsyncRuntime, StalenessManager
from a3po.rollout.hf import HFCopyEngine
from a3po.rollout import GenerationCancelled
from a3po.batch import RolloutBatch, Sample

from conftest import REPO, comparable


def _rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "a3po-rollout" and t.is_alive()]


class FakeEngine:
    """Stamps tokens with the version it holds when it generates them, like a real engine."""

    def __init__(self) -> None:
        self.version = 0
        self.cancelled = threading.Event()

    def update_weights(self, policy, version: int) -> None:
        self.version = version

    def cancel(self) -> None:
        self.cancelled.set()


class FakeProducer:
    def __init__(self, engine: FakeEngine, n_prompts: int = 2, seconds: float = 0.0, fail_at: int | None = None,
                 block_at: int | None = None) -> None:
        self.engine, self.n_prompts, self.seconds, self.fail_at, self.block_at = engine, n_prompts, seconds, fail_at, block_at
        self.started: list[tuple[int, int]] = []  # (step, version) at the start of each batch

    def __call__(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        self.started.append((step, self.engine.version))
        if step == self.fail_at:
            raise ValueError(f"reward function crashed at step {step}")
        if step == self.block_at:
            while not self.engine.cancelled.wait(0.01):
                pass
            raise GenerationCancelled("cancelled")
        time.sleep(self.seconds)
        samples = [Sample(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3, 4, 5]),
                          behave_logp=torch.zeros(3), versions=torch.full((3,), self.engine.version), reward=0.0)
                   for g in range(self.n_prompts)]
        return RolloutBatch(step=step, samples=samples, n_prompts=self.n_prompts, n_samples=1), {}


def _train(runtime: AsyncRuntime, engine: FakeEngine, steps: int, train_seconds: float
           ) -> list[tuple[RolloutBatch, dict[str, float]]]:
    rollouts = []
    for step in range(steps):
        rollout = runtime.batch_for(step, version=step)
        time.sleep(train_seconds)
        engine.update_weights(None, step + 1)
        rollouts.append(rollout)
    return rollouts


def test_staleness_manager_is_areals_rule():
    manager = StalenessManager(max_staleness=1, batch_size=4)
    assert manager.capacity(version=0) == 8
    manager.on_started(8)
    assert not manager.can_start(1, version=0) and manager.can_start(4, version=1)
    manager.on_accepted(4)
    manager.on_rejected(4)
    assert (manager.accepted, manager.running) == (4, 0)
    assert manager.capacity(version=0) == 4 and manager.capacity(version=2) == 12
    with pytest.raises(ValueError):
        StalenessManager(max_staleness=-1, batch_size=4)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_fast_rollout_runs_exactly_eta_versions_ahead_and_no_further(eta):
    engine = FakeEngine()
    producer = FakeProducer(engine)
    runtime = AsyncRuntime(producer, total_steps=8, max_staleness=eta, batch_size=2, engine=engine)
    try:
        rollouts = _train(runtime, engine, 8, train_seconds=0.02)
    finally:
        runtime.close()
    staleness = [int((b.step - torch.cat([s.versions for s in b.samples])).max()) for b, _ in rollouts]
    assert max(staleness) <= eta
    # Rollout is much faster than training, so it always fills the window eta allows.
    assert staleness == [min(step, eta) for step in range(8)]
    for step, version in producer.started:
        assert version >= step - eta
    for b, metrics in rollouts:
        d = b.step - int(b.samples[0].versions[0])
        assert metrics[f"staleness/hist/{d}"] == 6.0
        assert metrics["staleness/max"] == metrics["staleness/min"] == d
        for key in ("time/wait_data", "time/wait_capacity", "time/rollout", "rollout/tokens_per_s"):
            assert metrics[key] >= 0
    assert not _rollout_threads()


def test_slow_rollout_makes_the_trainer_wait_and_overlaps_training():
    engine = FakeEngine()
    runtime = AsyncRuntime(FakeProducer(engine, seconds=0.1), total_steps=6, max_staleness=1, batch_size=2, engine=engine)
    started = time.perf_counter()
    try:
        rollouts = _train(runtime, engine, 6, train_seconds=0.1)
    finally:
        runtime.close()
    elapsed = time.perf_counter() - started
    assert sum(metrics["time/wait_data"] for _, metrics in rollouts[1:]) < 0.5 * 5 * 0.1 + 0.1
    assert elapsed < 6 * 0.2 - 0.2, "rollout and training did not overlap"


def test_a_rollout_error_reaches_the_trainer_instead_of_a_hang():
    engine = FakeEngine()
    runtime = AsyncRuntime(FakeProducer(engine, fail_at=2), total_steps=6, max_staleness=2, batch_size=2, engine=engine)
    try:
        with pytest.raises(RuntimeError, match="rollout failed") as err:
            _train(runtime, engine, 6, train_seconds=0.0)
        assert isinstance(err.value.__cause__, ValueError)
    finally:
        runtime.close()
    assert not _rollout_threads()


def test_close_cancels_a_generation_in_flight():
    engine = FakeEngine()
    runtime = AsyncRuntime(FakeProducer(engine, block_at=1), total_steps=6, max_staleness=2, batch_size=2, engine=engine)
    runtime.batch_for(0, version=0)
    deadline = time.time() + 10
    while len(runtime.produce.started) < 2 and time.time() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    runtime.close()
    assert engine.cancelled.is_set() and time.perf_counter() - started < 5
    assert not _rollout_threads()
    with pytest.raises(RuntimeError, match="after close"):
        runtime.batch_for(1, version=1)


def test_state_dict_resumes_with_the_finished_batches():
    engine = FakeEngine()
    runtime = AsyncRuntime(FakeProducer(engine), total_steps=6, max_staleness=2, batch_size=2, engine=engine)
    runtime.batch_for(0, version=0)
    deadline = time.time() + 10
    while runtime.next_to_generate < 3 and time.time() < deadline:
        time.sleep(0.01)
    state = runtime.state_dict()
    runtime.close()
    assert [batch.step for batch, _ in state["queue"]] == [1, 2] and state["next_to_generate"] == 3

    resumed = AsyncRuntime(FakeProducer(engine), total_steps=6, max_staleness=2, batch_size=2, engine=engine)
    resumed.load_state_dict(state)
    assert resumed.manager.accepted == 6
    try:
        assert [resumed.batch_for(step, version=step)[0].step for step in range(1, 6)] == [1, 2, 3, 4, 5]
    finally:
        resumed.close()


def test_hf_copy_engine_stages_an_update_that_arrives_mid_generation():
    from omegaconf import OmegaConf

    from a3po.models import load_policy

    from conftest import CONF_DIR

    policy, tokenizer = load_policy(OmegaConf.load(CONF_DIR / "model" / "tiny.yaml"), seed=0)
    engine = HFCopyEngine(policy, tokenizer, max_new_tokens=6)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(policy.parameters(), engine.policy.parameters()))
    pushed = {}

    def push_once(module, args):
        if not pushed:
            with torch.no_grad():
                for param in policy.parameters():
                    param.add_(1.0)
            pushed["at"] = engine.version
            engine.update_weights(policy, 1)  # from inside generation: must not change the weights now

    handle = engine.policy.get_decoder().register_forward_pre_hook(push_once)  # the decode loop's per-token call
    generations = engine.generate([[1, 2, 3]], 2, seed=0)
    handle.remove()
    assert all(torch.all(g.versions == 0) for g in generations[0])
    assert not torch.equal(next(policy.parameters()), next(engine.policy.parameters()))
    after = engine.generate([[1, 2, 3]], 2, seed=0)
    assert all(torch.all(g.versions == 1) for g in after[0])
    assert torch.equal(next(policy.parameters()), next(engine.policy.parameters()))
    engine.cancel()
    with pytest.raises(GenerationCancelled):
        engine.generate([[1, 2, 3]], 1, seed=0)
    engine.close()


# ---------------------------------------------------------------------- the real loop
ASYNC = ["runtime=async", "train.total_steps=5", "train.eval_every=2"]


@pytest.mark.parametrize("eta", [0, 2])
def test_async_run_never_exceeds_eta_and_leaves_no_thread(tiny_cfg, eta):
    from a3po.run.metrics_log import read_metrics
    from a3po.run.main import run, run_dir_of

    cfg = tiny_cfg(*ASYNC, f"staleness={eta}")
    assert cfg.runtime.max_staleness == eta
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for record in records:
        assert 0 <= record["staleness/min"] <= record["staleness/max"] <= eta
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in record.items() if k.startswith("staleness/hist/")}
        assert hist and max(hist) <= eta and sum(hist.values()) == record["actor/valid_tokens"]
        for key in ("time/wait_data", "time/wait_capacity", "rollout/tokens_per_s"):
            assert key in record
        assert record["time/rollout"] > 0  # the batch's generation time, charged to the step that trains on it
    assert not _rollout_threads()


# What only one runtime logs (async: its admission and queue; lagged: its queue fill), left
# out of the comparison; and the clocks, which differ between any two runs.
ASYNC_ONLY_PREFIXES = ("staleness/hist/", "staleness/inflight_", "staleness/queued_", "rollout/admitted_at_version",
                       "rollout/tokens_per_s", "time/wait_", "rollout/batches_generated")


def _comparable(record: dict) -> dict:
    return comparable([record], *ASYNC_ONLY_PREFIXES)[0]


def test_async_at_staleness_zero_equals_lagged_at_staleness_zero(tiny_cfg):
    """With max_staleness 0 the async runtime generates each batch with the weights it is
    trained at, as lagged does at staleness 0, so every non-timing metric agrees.

    Bit for bit: the async runtime's engine samples from a private copy that keeps the
    trainer's requires_grad flags, so its behaviour log-probs are the trainer's module's
    (`test_copy_engine_samples_the_trainers_log_probs_bit_for_bit`).
    """
    from a3po.run.metrics_log import read_metrics
    from a3po.run.main import run, run_dir_of

    common = ("staleness=0", "train.total_steps=4", "train.eval_every=2")
    lagged = tiny_cfg("runtime=lagged", "experiment_name=lagged", *common)
    concurrent = tiny_cfg("runtime=async", "runtime.max_staleness=0", "experiment_name=async", *common)
    for cfg in (lagged, concurrent):
        run(cfg)
    lagged_records = read_metrics(run_dir_of(lagged) / "metrics.jsonl")
    async_records = read_metrics(run_dir_of(concurrent) / "metrics.jsonl")
    assert [r["step"] for r in lagged_records] == [r["step"] for r in async_records] == [0, 1, 2, 3]
    for expected, got in zip(lagged_records, async_records):
        expected, got = _comparable(expected), _comparable(got)
        assert set(got) == set(expected), (expected["step"], set(got) ^ set(expected))
        assert got == expected, expected["step"]


def test_copy_engine_samples_the_trainers_log_probs_bit_for_bit():
    """The async runtime's engine samples from a copy of the policy; its behaviour log-probs
    should be the ones the trainer's own module gives (lagged's engine), bit for bit. The
    copy must keep the trainer's requires_grad flags for that (generation runs under
    no_grad, so the flags cost nothing): matmul picks its kernel by them."""
    from omegaconf import OmegaConf

    from a3po.models import load_policy
    from a3po.rollout.hf import HFEngine

    from conftest import CONF_DIR

    policy, tokenizer = load_policy(OmegaConf.load(CONF_DIR / "model" / "tiny.yaml"), seed=0)
    with torch.no_grad():  # away from the initialisation, as after a few training steps
        noise = torch.Generator().manual_seed(1)
        for param in policy.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=noise))
    copy_engine = HFCopyEngine(policy, tokenizer, max_new_tokens=6)
    assert [q.requires_grad for q in copy_engine.policy.parameters()] == [p.requires_grad for p in policy.parameters()]
    prompts = [tokenizer.encode("What is 12 + 7? Answer:"), tokenizer.encode("Compute 3 * 9 please")]
    own = HFEngine(policy, tokenizer, max_new_tokens=6).generate(prompts, 2, seed=5)
    copied = copy_engine.generate(prompts, 2, seed=5)
    copy_engine.close()
    for a, b in zip((s for group in own for s in group), (s for group in copied for s in group)):
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.behave_logp, b.behave_logp)


def test_async_run_resumes_from_its_checkpoint(tiny_cfg):
    from a3po.run.metrics_log import read_metrics
    from a3po.run.main import run, run_dir_of

    cfg = tiny_cfg(*ASYNC, "train.max_steps_this_run=2", "train.checkpoint_every=1")
    run(cfg)
    run(tiny_cfg(*ASYNC, "train.checkpoint_every=1"))
    assert [r["step"] for r in read_metrics(run_dir_of(cfg) / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert not _rollout_threads()


def test_an_exception_in_the_trainer_stops_rollout(tiny_cfg, monkeypatch):
    from a3po.run.main import run
    from a3po.learner.trainer import Trainer

    real_step = Trainer.step
    calls = {"n": 0}

    def failing_step(self, batch, version, generator):
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("loss is nan")
        return real_step(self, batch, version, generator)

    monkeypatch.setattr(Trainer, "step", failing_step)
    started = time.perf_counter()
    with pytest.raises(FloatingPointError):
        run(tiny_cfg(*ASYNC, "staleness=3"))
    assert time.perf_counter() - started < 120
    assert not _rollout_threads()


def test_sigterm_checkpoints_and_exits_cleanly(tiny_cfg, tmp_path):
    from omegaconf import OmegaConf

    from a3po.run.checkpoint import load_checkpoint
    from a3po.run.metrics_log import read_metrics
    from a3po.run.main import run_dir_of

    cfg = tiny_cfg("runtime=async", "train.total_steps=400", "train.eval_every=0", "train.checkpoint_every=0",
                   "staleness=2")
    config_path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    script = textwrap.dedent(f"""
        from omegaconf import OmegaConf
        from a3po.run.main import run
        run(OmegaConf.load({str(config_path)!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = run_dir_of(cfg) / "metrics.jsonl"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and len(read_metrics(metrics)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the default action of SIGTERM, after the checkpoint: exit 128 + 15, so a sweep stops too
    assert proc.returncode == 128 + signal.SIGTERM, output.decode()[-3000:]
    assert b"stopped at step" in output
    checkpoint = load_checkpoint(run_dir_of(cfg))
    assert 2 <= checkpoint["step"] < 400
    assert len(read_metrics(metrics)) == checkpoint["step"]


def test_staleness_split_in_flight_vs_queued():
    from a3po.runtimes.staleness import staleness_split

    def sample(versions):
        n = len(versions)
        return Sample(prompt_ids=torch.tensor([1]), response_ids=torch.zeros(n, dtype=torch.long),
                      behave_logp=torch.zeros(n), versions=torch.tensor(versions))

    # at trainer version 5: one sequence crossed an update (versions 3, 3, 4: ages 2, 2, 1),
    # two were generated by one version each (ages 3, 3 and 1)
    split = staleness_split([sample([3, 3, 4]), sample([2, 2]), sample([4])], version=5)
    assert split["staleness/inflight_frac"] == pytest.approx(3 / 6)
    assert split["staleness/inflight_mean"] == pytest.approx(5 / 3)
    assert split["staleness/queued_mean"] == pytest.approx(7 / 3)
    # an engine that loads weights only between batches (hf) never has tokens in flight
    assert staleness_split([sample([2, 2])], version=3) == {"staleness/inflight_frac": 0.0, "staleness/queued_mean": 1.0}


def test_a_queue_saved_before_metrics_travelled_beside_batches_still_loads():
    """Checkpoints written before (batch, metrics) pairs hold batches carrying `stats`."""
    from a3po.runtimes.lagged import LaggedRuntime

    old = RolloutBatch(step=1, samples=[], n_prompts=1, n_samples=1)
    old.__dict__["stats"] = {"reward/mean": 0.5}
    runtime = LaggedRuntime(staleness=1, total_steps=3, produce=lambda step: None)
    runtime.load_state_dict({"queue": [old], "next_to_generate": 2})
    batch, metrics = runtime.queue[0]
    assert batch.step == 1 and metrics == {"reward/mean": 0.5} and "stats" not in batch.__dict__
