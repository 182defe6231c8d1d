"""Run identity and the checkpoint lifecycle: a run directory means one config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from a3po.run.checkpoint import checkpoint_path
from a3po.errors import ConfigError
from a3po.run.metrics_log import read_metrics
from a3po.run.rundir import config_differences
from a3po.run.main import run, run_dir_of

from conftest import REPO, TINY_OVERRIDES


def test_config_differences_ignores_neutral_keys_and_growing_steps():
    old = {"train": {"lr": 1e-5, "total_steps": 4, "max_steps_this_run": None}, "logger": {"mode": "offline"},
           "runtime": {"name": "lagged"}}
    new = {"train": {"lr": 0.5, "total_steps": 8, "max_steps_this_run": 2}, "logger": {"mode": "disabled"},
           "runtime": {"name": "async", "max_staleness": 2}}
    assert config_differences(old, new) == [
        ("runtime.max_staleness", "<absent>", 2), ("runtime.name", "lagged", "async"), ("train.lr", 1e-5, 0.5)]
    shrink = {**old, "train": {**old["train"], "total_steps": 3}}
    assert config_differences(old, shrink) == [("train.total_steps", 4, 3)]
    # a key added to the config since the run started, at its null default, is no difference
    newer = {**old, "rollout": {"device": None}}
    assert config_differences(old, newer) == []
    assert config_differences(old, {**old, "rollout": {"device": "cuda:1"}}) == [("rollout.device", "<absent>", "cuda:1")]
    # a list value (task.operations) that changes, appears or goes is a difference, named as any other
    ops = {**old, "task": {"operations": ["add", "sub"]}}
    assert config_differences(ops, {**old, "task": {"operations": ["add", "sub", "mul"]}}) == [
        ("task.operations", ["add", "sub"], ["add", "sub", "mul"])]
    assert config_differences(old, ops) == [("task.operations", "<absent>", ["add", "sub"])]
    assert config_differences(ops, old) == [("task.operations", ["add", "sub"], "<absent>")]
    assert config_differences(ops, ops) == []


def test_finished_run_with_another_config_refuses_and_keeps_its_files(tiny_cfg):
    cfg = tiny_cfg("staleness=2")
    run(cfg)
    run_dir = run_dir_of(cfg)
    config_before = (run_dir / "config.yaml").read_text()
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    other = tiny_cfg("staleness=2", "runtime=async", "train.lr=0.5")
    assert run_dir_of(other) == run_dir  # the same default name: the case that used to mislabel results
    with pytest.raises(ConfigError) as err:
        run(other)
    message = str(err.value)
    assert "train.lr: 2e-06 in the existing run, 0.5 now" in message
    assert "runtime.name: 'lagged' in the existing run, 'async' now" in message
    assert "on_config_change=restart" in message and "experiment_name" in message
    assert (run_dir / "config.yaml").read_text() == config_before
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


def test_unfinished_run_with_another_config_does_not_resume(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=4", "train.max_steps_this_run=2")
    run(cfg)
    with pytest.raises(ConfigError, match=r"train\.lr"):
        run(tiny_cfg("train.total_steps=4", "train.lr=0.5"))
    assert torch.load(checkpoint_path(run_dir_of(cfg)), weights_only=False)["step"] == 2


def test_restart_deletes_the_old_run(tiny_cfg):
    run(tiny_cfg("train.total_steps=2"))
    cfg = tiny_cfg("train.total_steps=2", "train.lr=1e-4", "on_config_change=restart")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert "lr: 0.0001" in (run_dir_of(cfg) / "config.yaml").read_text()


def test_extending_total_steps_resumes(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=3", "train.max_steps_this_run=2")
    run(cfg)
    longer = tiny_cfg("train.total_steps=5")
    run(longer)
    assert [r["step"] for r in read_metrics(run_dir_of(longer) / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert "total_steps: 5" in (run_dir_of(longer) / "config.yaml").read_text()


def test_extending_a_finished_run_needs_its_checkpoint(tiny_cfg):
    run(tiny_cfg("train.total_steps=2", "experiment_name=gone"))
    with pytest.raises(ConfigError, match=r"train\.total_steps=3 .*finished at 2 steps.*keep_checkpoint"):
        run(tiny_cfg("train.total_steps=3", "experiment_name=gone"))
    run(tiny_cfg("train.total_steps=2", "train.keep_checkpoint=true", "experiment_name=kept"))
    cfg = tiny_cfg("train.total_steps=3", "experiment_name=kept")
    run(cfg)
    assert [r["step"] for r in read_metrics(run_dir_of(cfg) / "metrics.jsonl")] == [0, 1, 2]


def test_finished_run_is_small_and_skipped(tiny_cfg, monkeypatch):
    cfg = tiny_cfg("train.save_final_model=true")
    run(cfg)
    run_dir = run_dir_of(cfg)
    assert not checkpoint_path(run_dir).exists()
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == 3
    assert list((run_dir / "final_model").glob("*.safetensors"))
    import a3po.models

    monkeypatch.setattr(a3po.models, "load_policy", lambda *a, **k: pytest.fail("a finished run loaded its model"))
    assert run(cfg) == {}


def test_unreadable_checkpoint_fails_at_start_with_its_path(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=3", "train.max_steps_this_run=1")
    run(cfg)
    path = checkpoint_path(run_dir_of(cfg))
    path.write_bytes(path.read_bytes()[:1000])  # a copy cut short
    with pytest.raises(ConfigError, match=rf"{str(path)!s}.*cannot be read.*delete it"):
        run(cfg)


def test_a_death_between_checkpoint_and_log_loses_no_step(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=4", "train.max_steps_this_run=2", "train.checkpoint_every=0")
    run(cfg)
    path = run_dir_of(cfg) / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n")  # step 1 was checkpointed but never logged
    run(tiny_cfg("train.total_steps=4", "train.checkpoint_every=0"))
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1]["time/checkpoint"] is None  # re-logged from the checkpoint: its own write time unknown
    assert records[1]["reward/mean"] == json.loads(lines[1])["reward/mean"]


def _cli(tmp_path, *args):
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("train.total_steps")]
    return subprocess.run([sys.executable, "experiments/train.py", *args, *overrides, "train.total_steps=1",
                           f"output_root={tmp_path / 'default_root'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_hydra_run_and_sweep_dirs_hold_the_runs(tmp_path):
    single = tmp_path / "single"
    proc = _cli(tmp_path, f"hydra.run.dir={single}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(single / "metrics.jsonl")] == [0]
    sweep = tmp_path / "scratch"
    proc = _cli(tmp_path, "-m", "staleness=0,1", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("loglinear-d0-s0", "loglinear-d1-s0"):
        assert (sweep / name / "metrics.jsonl").exists() and (sweep / name / "finished.json").exists()
    assert not (tmp_path / "default_root").exists()  # nothing went to output_root


def test_cli_refuses_a_changed_config_with_exit_2(tmp_path):
    target = tmp_path / "one"
    assert _cli(tmp_path, f"hydra.run.dir={target}").returncode == 0
    proc = _cli(tmp_path, f"hydra.run.dir={target}", "train.lr=0.5")
    assert proc.returncode == 2
    assert "train.lr: 2e-06 in the existing run, 0.5 now" in proc.stderr
    assert "Traceback" not in proc.stderr
