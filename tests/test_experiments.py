"""Every experiment config composes, declares its grid, and trains one step on the tiny model.

An experiment file that no test runs fails here: the set of files is globbed, not listed.
"""

from __future__ import annotations

import itertools
import re

import pytest
from omegaconf import OmegaConf

from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of

from conftest import CONF_DIR, REPO, TINY_OVERRIDES, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# What a CPU test machine cannot have: the hub model, the hub data set, a GPU, vLLM.
CPU_SMOKE = [
    *TINY_OVERRIDES, "train.total_steps=1", "train.eval_every=1", "device=cpu", "rollout=hf",
    "rollout.max_new_tokens=8", "train.token_budget=256", "train.n_prompts=2", "train.n_samples=2",
    "train.n_minibatches=1",
]
GSM8K_FIXTURE = REPO / "tests" / "fixtures" / "gsm8k_sample.jsonl"


def grid(cfg) -> dict[str, list[str]]:
    return {key: str(values).split(",") for key, values in cfg.hydra.sweeper.params.items()}


def test_experiment_list_is_what_we_think():
    assert {"demo", "staleness_sweep", "alpha_schedules", "approx_quality", "paper_gsm8k"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_with_its_grid(name):
    cfg = compose_config([f"experiment={name}"], with_hydra=True)
    params = grid(cfg)
    assert params, f"{name} declares no hydra.sweeper.params"
    assert cfg.experiment_name == name
    # every point of the grid composes and gets its own run directory
    names = set()
    keys = list(params)
    for values in itertools.product(*params.values()):
        point = compose_config([f"experiment={name}", *[f"{k}={v}" for k, v in zip(keys, values)]])
        names.add(point.run_name)
    n_points = 1
    for values in params.values():
        n_points *= len(values)
    seeds = {int(s) for s in params.get("seed", ["0"])}
    assert len(names) == n_points, f"{name}: two grid points share a run directory"
    # every name carries its seed (`-s<seed>`, at the end or before an experiment's own suffix, `-m2`)
    assert {int(re.search(r"-s(\d+)(?:-|$)", n).group(1)) for n in names} == seeds


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_smoke_runs_one_step_on_tiny(name, tmp_path):
    base = compose_config([f"experiment={name}"], with_hydra=True)
    first_point = [f"{k}={v[0]}" for k, v in grid(base).items()]
    overrides = [f"experiment={name}", *first_point, *CPU_SMOKE]
    if base.task.name == "gsm8k":
        overrides += [f"task.path={GSM8K_FIXTURE}", "task.held_out_fraction=0.5"]
    cfg = compose_config(overrides, output_root=tmp_path)
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0]
    assert "eval/reward" in records[0]
    assert run_dir_of(cfg).parent.name == name


def test_alpha_schedules_runs_recompute_once_per_staleness():
    cfg = compose_config(["experiment=alpha_schedules"], with_hydra=True)
    variants = grid(cfg)["+variant"]
    assert "recompute" in variants
    assert sorted(v for v in variants if v != "recompute") == sorted(
        f"loglinear-{p.stem.split('-', 1)[1]}" for p in (CONF_DIR / "variant").glob("loglinear-*.yaml")
    )
    # precision pinned: `auto` is bf16 on some CPUs (a3po.device.bf16_is_faster), and the name carries it
    point = compose_config(["experiment=alpha_schedules", "+variant=loglinear-exponential", "staleness=4",
                            "precision=fp32"])
    assert point.algo.name == "loglinear" and point.schedule.name == "exponential"
    assert point.run_name == "loglinear-exponential0.5-d4-s0"
    bf16 = compose_config(["experiment=alpha_schedules", "+variant=loglinear-exponential", "staleness=4",
                           "precision=bf16"])
    assert bf16.run_name == "loglinear-exponential0.5-bf16-d4-s0"


def test_paper_config_values_are_the_papers():
    cfg = compose_config(["experiment=paper_gsm8k"])
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (cfg.train.n_prompts, cfg.train.n_samples, cfg.train.n_minibatches) == (256, 4, 4)
    assert (cfg.rollout.max_new_tokens, cfg.train.token_budget) == (1024, 10240)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.objective.eps_clip) == (1.7e-5, 0.017, 0.4)
    assert (cfg.train.reward_scaling, cfg.train.reward_bias, cfg.correction.cap) == (10.0, -0.5, 5.0)
    assert OmegaConf.select(cfg, "rollout.temperature") == 1.0
