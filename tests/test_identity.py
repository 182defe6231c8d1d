"""Identity as data: the record a run writes (config.yaml, wandb), the name that is a function
of it, old run directories without it (resumed, and analysed alike), and an analysis that
never reads a name."""

from __future__ import annotations

import json
import sys
import types

import pytest
import yaml
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.identity import identity_record, run_name
from a3po.run.main import run, run_dir_of
from a3po.run.metrics_log import MetricsLogger, read_metrics
from a3po.run.rundir import claim_run_dir, config_differences, release_run_dir
from analysis.runs import record_of, run_identity
from analysis.load import load_runs
from a3po.config import parse_config


def old_config(cfg, *drop: str) -> dict:
    """The config.yaml a run wrote before the record existed (and, with "precision", before
    that key existed too)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for key in ("identity", *drop):
        config.pop(key)
    return config


# --- the record and the name ------------------------------------------------------------

def test_the_record_of_a_composed_config(tiny_cfg):
    cfg = tiny_cfg("correction=icepop", "objective=gspo", "staleness=4", "seed=3")
    assert OmegaConf.to_container(cfg.identity) == {
        "method": "loglinear", "schedule": {"name": "inverse"},
        "correction": {"name": "icepop", "lo": 0.5, "hi": 2.0},
        "objective": {"name": "gspo", "eps_clip": 0.0003, "eps_clip_higher": 0.0004},
        "runtime": {"name": "lagged"}, "staleness": 4, "precision": "fp32", "seed": 3,
        "label": "loglinear-icepop0.5_2-gspo0.0003_0.0004"}
    assert cfg.run_name == run_name(OmegaConf.to_container(cfg.identity)) == "loglinear-icepop0.5_2-gspo0.0003_0.0004-d4-s3"
    recompute = tiny_cfg("algo=recompute", "schedule=exponential", "runtime=async", "runtime.max_staleness=5")
    assert recompute.identity.schedule is None  # recompute uses no schedule: none in its record or name
    # the runtime's parameters that change results, not how long it waits at shutdown
    assert OmegaConf.to_container(recompute.identity.runtime) == {"name": "async", "max_staleness": 5, "interruptible": True}
    assert recompute.run_name == "recompute-d2-s0"


def test_the_record_carries_the_resolved_precision(tiny_cfg, monkeypatch):
    monkeypatch.setattr("torch.cpu._is_amx_tile_supported", lambda: True)  # a CPU where bf16 is the faster
    cfg = tiny_cfg("precision=auto", "device=cpu")
    assert (cfg.identity.precision, cfg.identity.label, cfg.run_name) == ("bf16", "loglinear-bf16", "loglinear-bf16-d2-s0")


@pytest.mark.parametrize("groups, expected", [
    (("loglinear", {"name": "inverse"}, None, None, None, 2, 0, "fp32"), "loglinear-d2-s0"),
    (("loglinear", {"name": "exponential", "gamma": 0.5}, None, None, None, 4, 1, "fp32"),
     "loglinear-exponential0.5-d4-s1"),
    (("linear", {"name": "linear_decay", "horizon": 8}, {"name": "tis", "cap": 2.0}, {"name": "cispo", "eps_clip": 1.0,
                                                                                      "eps_clip_higher": 4.0},
      {"name": "async", "max_staleness": 1}, 1, 0, "bf16"), "linear-linear_decay8-tis2-cispo1_4-bf16-d1-s0"),
    (("recompute", {"name": "constant", "c": 0.5}, {"name": "none", "cap": 3.0}, {"name": "ppo", "eps_clip": 0.3}, None,
      8, 2, "fp32"), "recompute-d8-s2"),  # the defaults are left out, whatever their parameters
    (({"name": "metrics", "uses_schedule": True}, {"name": "exponential", "gamma": 0.7}, None, None, None, 2, 0, "fp32"),
     "metrics-exponential0.7-d2-s0"),  # from before the registry: the config says whether it used a schedule
])
def test_run_name_is_a_function_of_the_record(groups, expected):
    record = identity_record(*groups)
    assert run_name(record) == expected
    assert run_name(json.loads(json.dumps(record))) == expected  # plain data: the same after a round trip


# --- where it is written ----------------------------------------------------------------

def test_the_record_goes_into_config_yaml_and_the_wandb_config(tiny_cfg, tmp_path, monkeypatch):
    cfg = tiny_cfg("correction=tis", "logger=wandb_offline")
    record = OmegaConf.to_container(cfg.identity)
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, cfg)
    try:
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["identity"] == record
    finally:
        release_run_dir(run_dir)
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kwargs: seen.update(kwargs) or types.SimpleNamespace(finish=lambda **k: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricsLogger(run_dir, parse_config(cfg), start_step=0).close()
    assert seen["config"]["identity"] == record and seen["name"] == run_name(record) == "loglinear-tis2-d2-s0"


# --- old run directories ----------------------------------------------------------------

def test_an_old_config_yaml_compares_equal_and_a_real_change_is_still_refused(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    new = OmegaConf.to_container(cfg, resolve=True)
    assert config_differences(old_config(cfg), new) == []
    assert config_differences(old_config(cfg, "precision"), new) == []  # from before `precision`: fp32
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    changed = old_config(cfg)
    changed["train"]["lr"] = 0.5
    (run_dir / "config.yaml").write_text(yaml.safe_dump(changed))
    with pytest.raises(ConfigError) as err:
        claim_run_dir(run_dir, cfg)
    assert "train.lr: 0.5 in the existing run, 2e-06 now" in str(err.value) and "identity" not in str(err.value)


def test_an_old_run_directory_resumes(tiny_cfg):
    cfg = tiny_cfg("train.total_steps=2", "train.max_steps_this_run=1", "train.eval_every=0")
    run(cfg)
    run_dir = run_dir_of(cfg)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old_config(cfg, "precision")))  # as a run of before wrote it
    run(tiny_cfg("train.total_steps=2", "train.eval_every=0"))
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["identity"]["label"] == "loglinear"


# --- the analysis reads the record, never a name -----------------------------------------

def write_run(root, directory: str, config: dict, steps: int = 3):
    run_dir = root / directory
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "wall_time": t + 1.0, "reward/mean": 0.5})
                                                   + "\n" for t in range(steps)))
    return run_dir


def test_old_and_new_config_yaml_load_with_the_same_identity(tiny_cfg, tmp_path):
    cfg = tiny_cfg("+variant=loglinear-exponential", "correction=icepop", "objective=gspo", "runtime=async",
                   "train.total_steps=3")
    new = OmegaConf.to_container(cfg, resolve=True)
    write_run(tmp_path / "new", "a", new)
    write_run(tmp_path / "old", "a", old_config(cfg, "precision"))
    frames = [load_runs(tmp_path / which) for which in ("new", "old")]
    columns = ["run", "label", "variant", "algo", "schedule", "correction", "objective", "runtime", "staleness",
               "seed", "precision", "complete"]
    first, second = (frame[columns].drop_duplicates().to_dict("records") for frame in frames)
    assert first == second == [{
        "run": "loglinear-exponential0.5-icepop0.5_2-gspo0.0003_0.0004-d2-s0",
        "label": "loglinear-exponential0.5-icepop0.5_2-gspo0.0003_0.0004 (async)",
        "variant": "loglinear-exponential0.5-icepop0.5_2-gspo0.0003_0.0004-d2 (async)", "algo": "loglinear",
        "schedule": "exponential0.5", "correction": "icepop0.5_2", "objective": "gspo0.0003_0.0004",
        "runtime": "async", "staleness": 2, "seed": 0, "precision": "fp32", "complete": True}]


def test_a_renamed_run_directory_keeps_its_identity(tiny_cfg, tmp_path):
    """Neither the directory's name nor a custom run_name says who a run is: its record does."""
    cfg = tiny_cfg("algo=recompute", "correction=tis", "staleness=8", "seed=1", "train.total_steps=3")
    config = old_config(cfg)
    config["run_name"] = "loglinear-exponential0.7-d1-s5"  # a misleading custom name
    write_run(tmp_path, "whatever", config)
    row = load_runs(tmp_path).iloc[0]
    assert (row["run"], row["label"], row["algo"], row["correction"], row["staleness"], row["seed"]) == \
        ("loglinear-exponential0.7-d1-s5", "recompute-tis2", "recompute", "tis2", 8, 1)


def test_the_stored_record_is_what_the_analysis_reads(tiny_cfg):
    config = OmegaConf.to_container(tiny_cfg("seed=4"), resolve=True)
    config["identity"]["label"] = "stored-label"
    assert run_identity(config)["label"] == "stored-label"
    # wandb's shapes: value-wrapped at the top, or flattened with dots or slashes
    wrapped = {key: {"value": value, "desc": None} for key, value in config.items()}
    assert record_of(wrapped) == config["identity"]
    flat = {f"identity/{key}": value for key, value in config["identity"].items() if key not in ("correction",)}
    flat.update({f"identity.correction.{key}": value for key, value in config["identity"]["correction"].items()})
    assert record_of(flat) == config["identity"]
