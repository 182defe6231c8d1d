"""`make demo` (experiments/demo.py): the shape follows the precision `auto` resolves to, two runs
go at once on one thread each, and the sweep ends in the paper's figures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CONF_DIR, compose_config

REPO = Path(__file__).resolve().parents[1]


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo_entry", REPO / "experiments" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bf16_faster, experiment", [(True, "demo"), (False, "demo_fp32")])
def test_the_shape_follows_the_precision_auto_gives(monkeypatch, bf16_faster, experiment):
    monkeypatch.setattr("a3po.device.bf16_is_faster", lambda device: bf16_faster)
    monkeypatch.setattr("a3po.device.resolve_device", lambda name: torch.device("cpu"))
    demo = _demo_module()
    assert demo.shape() == experiment
    assert demo.shape(["precision=fp32"]) == "demo_fp32"  # an override's precision decides


def test_two_runs_at_once_split_the_cores():
    demo = _demo_module()
    assert [demo.threads_per_job(cores, 2) for cores in (1, 2, 3, 8)] == [1, 1, 1, 4]
    assert demo.JOBS == {"demo": 2, "demo_fp32": 2}


def test_the_fp32_shape_is_the_demo_made_cheaper():
    """demo_fp32 keeps the demo's grid and task and trains fewer, smaller steps."""
    demo, cheap = compose_config(["experiment=demo"], with_hydra=True), compose_config(["experiment=demo_fp32"],
                                                                                       with_hydra=True)
    assert cheap.hydra.sweeper.params == demo.hydra.sweeper.params
    assert (cheap.experiment_name, cheap.task, cheap.model) == ("demo_fp32", demo.task, demo.model)
    steps = lambda c: c.train.total_steps * c.train.n_prompts * c.train.n_samples  # noqa: E731
    assert steps(cheap) <= steps(demo) / 2 and cheap.train.eval_every == cheap.train.total_steps
    assert (CONF_DIR / "experiment" / "demo_fp32.yaml").is_file()


def test_the_demo_runs_two_at_once_and_draws_its_figures(tmp_path):
    out = tmp_path / "outputs"
    tiny = ["model=tiny", "precision=fp32", "logger=none", "train.total_steps=2", "train.n_prompts=2",
            "train.n_samples=2", "train.eval_every=2", "train.eval_size=2", "rollout.max_new_tokens=8",
            "train.token_budget=256", f"output_root={out}"]
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "demo.py"), *tiny], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import os
    cores = len(os.sched_getaffinity(0))
    jobs = min(2, cores)  # the tiny model's runs are fp32: demo_fp32's two at once
    assert f"{jobs} runs at once x {max(1, cores // jobs)} thread(s)" in done.stdout
    sweep = out / _demo_module().shape(["precision=fp32"])  # the tiny model's runs are fp32: demo_fp32
    runs = sorted(p.name for p in sweep.iterdir() if (p / "finished.json").is_file())
    assert runs == sorted(f"{algo}-d{d}-s0" for algo in ("coupled", "recompute", "loglinear") for d in (2, 4))
    figures = sweep / "figures"
    assert (figures / "summary.md").is_file() and len(list(figures.glob("*.png"))) >= 5
