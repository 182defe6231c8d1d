"""Divergence stops a run, collapse flags it (a3po.run.health).

Divergence is injected into the real training loop on the tiny model: from the second
minibatch of step 1 on, either the loss is NaN (a NaN constant added to it: the gradient
stays finite, so only the loss check can catch it) or one parameter's gradient is +inf
(the loss stays finite). With weight decay every optimizer step moves the weights (the tiny
model's rewards, hence its gradients, are 0), so a checkpoint or an update of the diverged
state would show.
"""

from __future__ import annotations

import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a3po.run.checkpoint import load_checkpoint
from a3po.errors import ConfigError
from a3po.run.health import (COLLAPSE_STEP, DIVERGED_MARKER, EXIT_DIVERGED, CollapseRule, CollapseWatch, NonFiniteUpdate,
                             RunDiverged, read_divergence)
from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of

from conftest import REPO

# lr 1e-2 and weight decay 0.1: AdamW multiplies every weight by 0.999 per update.
DIVERGE_OVERRIDES = ["train.total_steps=4", "train.checkpoint_every=1", "train.eval_every=0", "train.lr=1e-2",
                     "train.weight_decay=0.1"]


# ---------------------------------------------------------------------- collapse, pure
def collapse_flags(steps, entropies, grad_norms, rule: CollapseRule = CollapseRule()) -> list[int | None]:
    """Per step, the step its collapse began (None where not collapsed): CollapseWatch over a log."""
    watch = CollapseWatch(rule)
    return [watch.update(s, e, g).get(COLLAPSE_STEP) for s, e, g in zip(steps, entropies, grad_norms)]


def test_collapse_needs_the_given_number_of_consecutive_low_steps():
    rule = CollapseRule(entropy_below=1e-3, grad_norm_at_most=0.0, steps=3)
    entropy = [0.5, 1e-4, 1e-4, 1e-4, 1e-4, 0.5, 1e-4, 1e-4, 1e-4]
    grad = [0.0] * 9
    assert collapse_flags(range(9), entropy, grad, rule) == [None, None, None, 1, 1, None, None, None, 6]


@pytest.mark.parametrize("entropy, grad_norm, collapsed", [
    (1e-4, 0.0, True),
    (1e-4, 1e-12, False),     # the default grad threshold is exactly zero
    (1e-3, 0.0, False),       # entropy must be strictly below the threshold
    (None, 0.0, False),       # a null in the log (non-finite) is no evidence of a collapse
    (math.nan, 0.0, False),
    (1e-4, None, False),
])
def test_a_collapse_like_step_is_low_entropy_and_zero_gradient(entropy, grad_norm, collapsed):
    assert CollapseRule().matches(entropy, grad_norm) is collapsed


def test_collapse_thresholds_are_configurable_and_a_gap_in_the_steps_restarts_the_count():
    rule = CollapseRule(entropy_below=0.1, grad_norm_at_most=1e-6, steps=2)
    assert collapse_flags([0, 1, 2], [0.05, 0.05, 0.05], [1e-7, 1e-7, 2e-6], rule) == [None, 0, None]
    # steps 4 and 6 are not consecutive: the streak that 6 starts is one step long
    assert collapse_flags([4, 6, 7], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], rule) == [None, None, 6]


def test_collapse_watch_metrics_and_replay_equal_a_straight_pass():
    rule = CollapseRule(steps=2)
    watch = CollapseWatch(rule)
    assert watch.update(0, 1e-5, 0.0) == {"health/collapsed": 0}
    assert watch.update(1, 1e-5, 0.0) == {"health/collapsed": 1, "health/collapse_step": 0}
    logged = [{"step": 0, "actor/entropy": 1e-5, "actor/grad_norm": 0.0},
              {"step": 1, "actor/entropy": 1e-5, "actor/grad_norm": 0.0}]
    resumed = CollapseWatch(rule).replay(reversed(logged))  # order of the lines does not matter
    assert resumed.update(2, 1e-5, 0.0) == watch.update(2, 1e-5, 0.0) == {"health/collapsed": 1,
                                                                        "health/collapse_step": 0}


# ---------------------------------------------------------------------- collapse, end to end
def test_a_collapsed_run_is_flagged_not_stopped_and_resume_keeps_the_count(tiny_cfg):
    # the random tiny model's gradient is exactly 0 (rewards are all 0) and its entropy ~10.8
    # nats: an entropy threshold above that makes every step collapse-like
    overrides = ["train.collapse_entropy=100", "train.collapse_steps=2", "train.total_steps=3"]
    cfg = tiny_cfg(*overrides, "train.max_steps_this_run=1")
    run(cfg)
    run(tiny_cfg(*overrides))  # resumed after step 0: the streak is replayed from the log
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["health/collapsed"] for r in records] == [0, 1, 1]
    assert [r.get("health/collapse_step") for r in records] == [None, 0, 0]
    assert (run_dir_of(cfg) / "finished.json").exists()


def test_a_healthy_run_logs_collapsed_zero(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=2")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["health/collapsed"] for r in records] == [0, 0]
    assert not any("health/collapse_step" in r or "health/diverged" in r for r in records)


def test_a_run_directory_from_before_the_collapse_keys_is_still_the_same_run(tiny_cfg):
    import yaml

    cfg = tiny_cfg("train.total_steps=1")
    run(cfg)
    path = run_dir_of(cfg) / "config.yaml"
    old = yaml.safe_load(path.read_text())
    for key in ("collapse_entropy", "collapse_grad_norm", "collapse_steps"):
        del old["train"][key]  # as every run directory written before them
    path.write_text(yaml.safe_dump(old))
    assert run(tiny_cfg("train.total_steps=1")) == {}  # finished: returns at once, no config conflict


@pytest.mark.parametrize("override, key", [
    ("train.collapse_entropy=-1", "train.collapse_entropy=-1"),
    ("train.collapse_grad_norm=abc", "train.collapse_grad_norm='abc'"),
    ("train.collapse_steps=0", "train.collapse_steps=0"),
    ("train.collapse_steps=1.5", "train.collapse_steps=1.5"),
])
def test_bad_collapse_settings_fail_at_start(tiny_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(tiny_cfg(override))


# ---------------------------------------------------------------------- divergence
def poison(monkeypatch, kind: str, at_step: int = 1) -> dict:
    """From the second minibatch of `at_step` on, a NaN loss (`kind="loss"`) or an inf gradient
    (`kind="grad"`). Returns what it saw: the weights when that step began, and the trainer."""
    from a3po.learner.trainer import Trainer

    seen: dict = {}
    original_step, original_loss = Trainer.step, Trainer.loss

    def step(self, batch, version, generator):
        if version != at_step:
            return original_step(self, batch, version, generator)
        seen["before"] = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        seen["trainer"] = self
        update = self.optimizer.step

        def update_then_poison(*args, **kwargs):
            result = update(*args, **kwargs)
            self.poisoned = True
            if kind == "grad":
                next(self.policy.parameters()).register_hook(lambda grad: torch.full_like(grad, math.inf))
            return result

        self.optimizer.step = update_then_poison
        try:
            return original_step(self, batch, version, generator)
        finally:
            del self.optimizer.step

    def loss(self, *args, **kwargs):
        value, stats = original_loss(self, *args, **kwargs)
        if kind == "loss" and getattr(self, "poisoned", False):
            value = value + math.nan  # the loss is NaN, its gradient is not
        return value, stats

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Trainer, "loss", loss)
    return seen


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_a_non_finite_update_stops_the_run_before_it_reaches_the_weights(tiny_cfg, monkeypatch, kind):
    seen = poison(monkeypatch, kind)
    cfg = tiny_cfg(*DIVERGE_OVERRIDES)
    run_dir = run_dir_of(cfg)
    with pytest.raises(RunDiverged, match=r"diverged at step 1, minibatch 1") as raised:
        run(cfg)

    record = read_divergence(run_dir)
    assert record == raised.value.record
    assert (record["step"], record["minibatch"], record["n_minibatches"]) == (1, 1, 2)
    assert record["non_finite"] == (["loss"] if kind == "loss" else ["grad_norm"])
    assert ("minibatch loss is nan" if kind == "loss" else "gradient norm is inf") in record["reason"]
    assert record["last_checkpoint_step"] == 1 and record["time"] and record["wall_time"] > 0

    # the last good checkpoint stays: written after step 0, holding the weights step 1 began with
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint["step"] == 1
    assert all(torch.equal(checkpoint["model"][k], v) for k, v in seen["before"].items())
    # minibatch 0 of step 1 was applied (weight decay moved the weights), minibatch 1 never was
    weights = seen["trainer"].policy.state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert any(not torch.equal(weights[k], v) for k, v in seen["before"].items())

    # the log: step 0 in full, then the diverged step's one line, nothing after it
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["health/collapsed"] == 0 and "actor/loss" in records[0]
    assert records[1]["health/diverged"] == 1 and "actor/loss" not in records[1] and "reward/mean" not in records[1]
    assert not (run_dir / "finished.json").exists()

    # and the analysis counts it, leaving it out of the means
    from analysis.load import load_runs
    from analysis.summary import summary_table

    table = summary_table(load_runs(run_dir))
    assert (table["n_seeds"].tolist(), table["n_diverged"].tolist()) == ([0], [1])


def test_a_diverged_run_reports_it_again_at_once_and_a_restart_clears_it(tiny_cfg, monkeypatch):
    poison(monkeypatch, "loss")
    cfg = tiny_cfg(*DIVERGE_OVERRIDES)
    with pytest.raises(RunDiverged):
        run(cfg)
    monkeypatch.undo()
    lines = (run_dir_of(cfg) / "metrics.jsonl").read_text()

    from a3po.learner.trainer import Trainer

    def must_not_train(*args, **kwargs):
        raise AssertionError("a diverged run was trained again")

    monkeypatch.setattr(Trainer, "step", must_not_train)
    with pytest.raises(RunDiverged, match="diverged at step 1"):
        run(tiny_cfg(*DIVERGE_OVERRIDES))  # the outcome of this config: nothing is retried
    assert (run_dir_of(cfg) / "metrics.jsonl").read_text() == lines
    monkeypatch.undo()

    # another config in the same directory, with on_config_change=restart: a fresh run
    restarted = tiny_cfg(*DIVERGE_OVERRIDES, "train.weight_decay=0.0", "on_config_change=restart")
    run(restarted)
    assert not (run_dir_of(cfg) / DIVERGED_MARKER).exists()
    assert [r["step"] for r in read_metrics(run_dir_of(cfg) / "metrics.jsonl")] == [0, 1, 2, 3]


def test_the_error_names_step_minibatch_and_both_values():
    error = NonFiniteUpdate(7, 0, 4, loss=math.nan, grad_norm=math.inf)
    assert str(error) == ("step 7, minibatch 0 (of 0..3): the minibatch loss is nan and the gradient norm is inf; "
                          "its optimizer step was not taken")
    assert error.non_finite == ["loss", "grad_norm"]


# ---------------------------------------------------------------------- the command line
def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """experiments/train.py in a subprocess, with the loss poisoned at step 1 for seed 0."""
    return subprocess.run([sys.executable, __file__, "--poisoned-cli", *args, "model=tiny", "precision=fp32", "logger=none",
                           "train.n_prompts=2", "train.n_samples=2", "train.token_budget=256",
                           "rollout.max_new_tokens=8", *DIVERGE_OVERRIDES, "train.total_steps=2",
                           "train.warmup=false", f"output_root={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_exit_status_3_for_a_diverged_run_and_a_sweep_goes_on(tmp_path):
    single = _cli(tmp_path / "single")
    assert single.returncode == EXIT_DIVERGED, single.stderr[-3000:]
    assert "diverged: the run in" in single.stderr and "at step 1, minibatch 1" in single.stderr
    assert "Traceback" not in single.stderr
    assert read_divergence(tmp_path / "single" / "default" / "loglinear-d2-s0")["step"] == 1

    # a local sweep runs its jobs in this one process: seed 0 diverges, seed 1 still runs
    sweep = _cli(tmp_path / "sweep", "-m", "seed=0,1")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    runs = tmp_path / "sweep" / "default"
    assert read_divergence(runs / "loglinear-d2-s0")["step"] == 1
    assert (runs / "loglinear-d2-s1" / "finished.json").exists()
    assert not (runs / "loglinear-d2-s1" / DIVERGED_MARKER).exists()


def _poisoned_cli(argv: list[str]) -> None:
    """Run experiments/train.py with the loss NaN from the second minibatch of step 1 of seed 0."""
    import a3po.run.loop

    original = a3po.run.loop.train_step

    def train_step(parts, step):
        trainer = parts.trainer
        if parts.cfg.seed == 0 and step == 1:
            original_loss = type(trainer).loss
            calls = []

            def nan_loss(*loss_args, **loss_kwargs):  # one micro-batch per minibatch here
                value, stats = original_loss(trainer, *loss_args, **loss_kwargs)
                calls.append(1)
                return value + (math.nan if len(calls) > 1 else 0.0), stats

            trainer.loss = nan_loss
        return original(parts, step)

    a3po.run.loop.train_step = train_step
    sys.argv = [str(REPO / "experiments" / "train.py"), *argv]
    runpy.run_path(str(REPO / "experiments" / "train.py"), run_name="__main__")


if __name__ == "__main__" and sys.argv[1:2] == ["--poisoned-cli"]:
    sys.path.insert(0, str(REPO))
    _poisoned_cli(sys.argv[2:])
