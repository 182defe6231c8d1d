"""S6's tiers B and C are still to run, and they run from a commit of main (docs/studies/s6.md,
Deviations). A run directory means one config (a3po.run.rundir), so today's conf/ must compose,
for every run tier B has ended, the config that run ran (else the resumed sweep refuses at
start), and for tier A's runs the config tier C repeats at d = 2 (tier C is tier A's design at
another staleness). A config change that is not result-neutral fails here, not at the resume.
Each check applies while its tier is unfinished: its running archive exists, or its final one
does not yet."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import yaml

from a3po.run.rundir import config_differences
from a3po.config import parse_config

from conftest import REPO, compose_config

LOGS = REPO / "docs" / "logs"
TIER_B_RUNNING, TIER_B_DONE = LOGS / "running" / "s6_stress.tar.xz", LOGS / "s6_stress.tar.xz"
TIER_A, TIER_C_DONE = LOGS / "s6.tar.xz", LOGS / "s6_d2.tar.xz"


def run_configs(archive: Path) -> dict[str, dict]:
    """Each run's config.yaml in a log archive, by run directory."""
    with tarfile.open(archive) as tar:
        return {Path(m.name).parent.name: yaml.safe_load(tar.extractfile(m).read())
                for m in tar.getmembers() if m.isfile() and Path(m.name).name == "config.yaml"}


def sweep_overrides(config: dict) -> list[str]:
    """The overrides by which the study's sweep names this run: its experiment, staleness, seed
    and variant, and for tier B the cell (learning rate, minibatches)."""
    algo = config["algo"]["name"]
    variant = algo if algo == "recompute" else f"{algo}-{config['schedule']['name']}"
    overrides = [f"experiment={config['experiment_name']}", f"staleness={config['staleness']}",
                 f"seed={config['seed']}", f"+variant={variant}", f"output_root={config['output_root']}"]
    if config["experiment_name"] == "s6_stress":
        overrides += [f"train.lr={config['train']['lr']}", f"train.n_minibatches={config['train']['n_minibatches']}"]
    return overrides


def composed_now(config: dict) -> dict:
    return parse_config(compose_config(sweep_overrides(config))).resolved


def changed_runs(configs: dict[str, dict]) -> dict[str, list]:
    """Each run whose config today's conf/ no longer composes, with the keys that differ."""
    return {name: diffs for name, config in configs.items() if (diffs := config_differences(config, composed_now(config)))}


def test_sweep_overrides_name_the_run():
    config = {"algo": {"name": "loglinear"}, "schedule": {"name": "step_start"}, "experiment_name": "s6_stress",
              "staleness": 8, "seed": 101, "output_root": "outputs", "train": {"lr": 3.0e-5, "n_minibatches": 8}}
    assert sweep_overrides(config) == ["experiment=s6_stress", "staleness=8", "seed=101", "+variant=loglinear-step_start",
                                       "output_root=outputs", "train.lr=3e-05", "train.n_minibatches=8"]
    recompute = {**config, "algo": {"name": "recompute"}, "experiment_name": "s6"}
    assert sweep_overrides(recompute)[3] == "+variant=recompute" and len(sweep_overrides(recompute)) == 5


@pytest.mark.skipif(not TIER_B_RUNNING.exists() or TIER_B_DONE.exists(), reason="tier B has ended")
def test_tier_b_ended_runs_compose_unchanged():
    configs = run_configs(TIER_B_RUNNING)
    assert configs, f"{TIER_B_RUNNING} holds no run"
    changed = changed_runs(configs)
    assert changed == {}, f"conf/ now composes another config for these tier B runs: {changed}"


@pytest.mark.skipif(TIER_C_DONE.exists(), reason="tier C has ended")
def test_tier_a_runs_compose_unchanged_so_tier_c_repeats_them():
    configs = run_configs(TIER_A)
    assert len(configs) == 24
    changed = changed_runs(configs)
    assert changed == {}, f"conf/ now composes another config for these tier A runs: {changed}"


def test_a_changed_setting_is_caught():
    """The check can fail: a tier A run whose learning rate differs from what conf/ composes."""
    name, config = next(iter(run_configs(TIER_A).items()))
    altered = {**config, "train": {**config["train"], "lr": config["train"]["lr"] * 3}}
    assert [key for key, _, _ in changed_runs({name: altered})[name]] == ["train.lr"]
