"""A sweep's jobs are validated before any is launched (a3po/run/sweep_check.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from a3po.run.sweep_check import CheckSweepConfigs, sweep_jobs
from conftest import CONF_DIR, REPO, TINY_OVERRIDES


def test_the_jobs_are_the_basic_sweepers_product_in_launch_order():
    jobs = sweep_jobs({"seed": "0,1"}, ["staleness=2,4", "model=tiny"])
    assert jobs == [["seed=0", "staleness=2", "model=tiny"], ["seed=0", "staleness=4", "model=tiny"],
                    ["seed=1", "staleness=2", "model=tiny"], ["seed=1", "staleness=4", "model=tiny"]]
    assert sweep_jobs({}, ["model=tiny"]) == [["model=tiny"]]


def _check(overrides: list[str]) -> None:
    """The callback as Hydra calls it when a multirun starts, on the composed sweep config."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        CheckSweepConfigs().on_multirun_start(config=config)


def test_every_job_of_the_demo_sweep_passes():
    _check(["experiment=demo"])


@pytest.mark.slow  # composes each of some 400 jobs (minutes)
@pytest.mark.parametrize("experiment", sorted(path.stem for path in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_job_of_every_shipped_experiment_passes(experiment):
    _check([f"experiment={experiment}"])


def test_a_bad_value_in_an_experiments_grid_stops_the_sweep_naming_the_job(capsys):
    with pytest.raises(SystemExit) as stop:
        _check(["experiment=demo", "hydra.sweeper.params.staleness='2,-1'"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "config error: job #3 of 6" in err and "staleness=-1 is not allowed" in err
    assert "nothing was launched" in err


def test_the_cli_stops_before_the_first_job_trains(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "train.py"), "-m", *TINY_OVERRIDES,
                           f"output_root={tmp_path}", "staleness=1,-1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "job #1 of 2" in done.stderr and "staleness=-1 is not allowed" in done.stderr
    assert not any(tmp_path.rglob("metrics.jsonl"))  # job #0 never ran
