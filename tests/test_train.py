"""End-to-end training on the tiny model: every algo, exact staleness, resume, validation."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from a3po.errors import ConfigError
from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of

from conftest import REPO, comparable
from a3po.config import parse_config

REQUIRED_KEYS = [
    "step", "version", "wall_time", "time/step", "time/rollout", "time/prox_logp", "time/train",
    "time/weight_sync", "time/eval", "time/checkpoint", "time/step_cpu", "reward/mean", "actor/entropy", "actor/importance_weight/max",
    "actor/importance_weight/min", "actor/importance_weight/mean", "actor/behave_weight/max",
    "actor/behave_weight/min", "actor/behave_weight/mean", "actor/clipped_tokens", "actor/clip_ratio",
    "actor/grad_norm", "actor/approx_kl", "actor/loss", "staleness/mean", "staleness/max", "staleness/min",
]


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize("algo", ["coupled", "recompute", "loglinear", "linear", "loglinear+errors"])
def test_every_algo_trains_and_logs_every_metric(tiny_cfg, algo, staleness):
    log_errors = algo.endswith("+errors")
    algo = algo.removesuffix("+errors")
    cfg = tiny_cfg(f"algo={algo}", f"staleness={staleness}", f"train.log_prox_errors={log_errors}")
    run(cfg)
    run_dir = run_dir_of(cfg)
    assert run_dir.name == f"{algo}-d{staleness}-s0"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        assert not missing, missing
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in record.values())
        t = record["step"]
        assert record["staleness/max"] == min(t, staleness)
        assert record["staleness/min"] == min(t, staleness)
        # the lagged runtime fills its queue at step 0: batches 0..D, then one a step until T - 1
        expected = staleness + 1 if t == 0 else int(t + staleness < 3)
        assert record["rollout/batches_generated"] == expected
    assert "eval/reward" in records[1] and "eval/reward" in records[2] and "eval/reward" not in records[0]
    if log_errors:  # against the recompute forward, timed apart from time/prox_logp
        assert "prox_error/inverse/logp_abs" in records[0]
        assert "prox_error/exponential-linear/iw_abs" in records[0]
        assert all(r["time/prox_reference"] > 0 for r in records)
    else:
        assert not any(k.startswith("prox_error/") for k in records[0])
    assert (run_dir / "config.yaml").exists()
    # finished: the completion marker stays, the resume state goes (train.keep_checkpoint=false)
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == 3
    assert not (run_dir / "checkpoints" / "last.pt").exists()
    # a checkpoint was written after step 2 (checkpoint_every=2) and timed; none after the others
    assert records[1]["time/checkpoint"] > 0 and records[0]["time/checkpoint"] == 0.0
    assert records[2]["time/checkpoint"] == 0.0
    assert all(r["time/step_cpu"] > 0 for r in records)


def test_behave_logp_equals_trainer_forward_and_loglinear_at_staleness_zero(tiny_cfg):
    from a3po.models import load_policy
    from a3po.maths.proximal import approximate_prox_logp
    from a3po.rollout import build_engine
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer
    from a3po.rollout.producer import RolloutProducer
    from a3po.learner.build import trainer_from

    cfg = tiny_cfg("rollout.max_new_tokens=12", "train.n_prompts=3", "train.n_samples=3")
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, torch.device("cpu"))
    timer = PhaseTimer()
    producer = RolloutProducer(parse_config(cfg), build_task(cfg.task, 0), tokenizer, engine, timer)
    batch, _ = producer(0)
    trainer = trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=timer)
    with torch.no_grad():
        recomputed, _ = trainer.response_logp(batch.samples)
    behave = torch.cat([s.behave_logp for s in batch.samples])
    versions = torch.cat([s.versions for s in batch.samples])
    assert recomputed.shape == behave.shape and behave.numel() > 9
    assert (recomputed - behave).abs().max().item() < 1e-4
    assert torch.equal(approximate_prox_logp(behave, recomputed, versions, 0), behave)


@pytest.mark.parametrize("algo", ["loglinear", "recompute"])
def test_resume_equals_uninterrupted(tiny_cfg, tmp_path, algo):
    overrides = [f"algo={algo}", "staleness=2", "train.total_steps=5", "train.checkpoint_every=0"]
    straight = tiny_cfg(*overrides, "experiment_name=straight")
    run(straight)
    interrupted = tiny_cfg(*overrides, "experiment_name=resumed", "train.max_steps_this_run=2")
    run(interrupted)
    first_part = read_metrics(run_dir_of(interrupted) / "metrics.jsonl")
    assert [r["step"] for r in first_part] == [0, 1]
    run(interrupted)  # the same command again resumes from last.pt
    run(interrupted)
    run(interrupted)  # a finished run is a no-op
    resumed = read_metrics(run_dir_of(interrupted) / "metrics.jsonl")
    expected = read_metrics(run_dir_of(straight) / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert comparable(resumed) == comparable(expected)


def test_resume_drops_steps_logged_after_the_checkpoint(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=4", "train.max_steps_this_run=2", "train.checkpoint_every=0")
    run(cfg)
    path = run_dir_of(cfg) / "metrics.jsonl"
    records = read_metrics(path)
    # simulate a death after step 2 was logged but before it was checkpointed, mid-write
    with open(path, "a") as f:
        f.write(json.dumps({**records[-1], "step": 2}) + "\n" + '{"step": 3, "rew')
    run(tiny_cfg("train.total_steps=4", "train.checkpoint_every=0"))
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]


def test_the_restored_checkpoint_is_freed_before_training_resumes(tiny_cfg, monkeypatch):
    """last.pt's copy of the weights (~4 bytes a parameter, more than the model at 1.5B in
    float32) must not stay alive for the whole resumed run."""
    import gc
    import weakref

    import a3po.run.main as main

    run(tiny_cfg("train.total_steps=3", "train.max_steps_this_run=1", "train.checkpoint_every=0"))
    restored, alive_at_training = [], []
    real_restore, real_loop = main.restore, main.train_loop

    def restore(parts, checkpoint, resuming):
        restored.extend(weakref.ref(t) for t in checkpoint["model"].values())
        real_restore(parts, checkpoint, resuming)

    def train_loop(*args, **kwargs):
        gc.collect()
        alive_at_training.extend(ref for ref in restored if ref() is not None)
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(main, "restore", restore)
    monkeypatch.setattr(main, "train_loop", train_loop)
    run(tiny_cfg("train.total_steps=3", "train.checkpoint_every=0"))
    assert len(restored) > 0 and alive_at_training == []


@pytest.mark.parametrize(
    "override, key",
    [
        ("staleness=-1", "staleness=-1"),
        ("objective.eps_clip=0", "objective.eps_clip=0 is not allowed"),
        ("objective.eps_clip=-0.2", "objective.eps_clip=-0.2 is not allowed"),
        ("schedule=exponential schedule.gamma=2.0", "schedule.gamma=2 is not allowed"),
        ("model.source=hub model.path=/nonexistent/model", "model.path"),
        ("train.token_budget=8", "train.token_budget=8"),
        ("train.n_minibatches=0", "train.n_minibatches=0"),
        ("algo.name=bogus", "algo.name='bogus'"),
        ("runtime.name=bogus", "runtime.name='bogus'"),
        ("logger.mode=sometimes", "logger.mode='sometimes'"),
        ("precision=fp16", "precision='fp16'"),
        ("train.warmup=maybe", "train.warmup='maybe'"),
        ("train.activation_checkpointing=2", "train.activation_checkpointing=2"),
        ("precision=fp32 train.fsdp_mixed_precision=true", "train.fsdp_mixed_precision=True is not allowed; false with precision=fp32"),
    ],
)
def test_bad_config_fails_before_loading(tiny_cfg, override, key, monkeypatch):
    import a3po.models

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before validation")

    monkeypatch.setattr(a3po.models, "load_policy", must_not_load)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(".", r"\.")):
        run(tiny_cfg(*override.split()))


def test_cli_reports_config_errors_cleanly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "experiments/train.py", "model=tiny", "logger=none", "staleness=-3", f"output_root={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "config error: staleness=-3 is not allowed" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "experiments/train.py", "algo=nope"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "algo/nope" in proc.stderr and "loglinear" in proc.stderr  # Hydra lists the allowed options
