"""The run's typed config (a3po/run_config.py): built once at the door from the composed config,
frozen, each default held once; a mapping normalises at a function's entry; below the door no
module imports DictConfig."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.config import parse_config
from a3po.rollout.engines import engine_spec
from a3po.run_config import ModelConfig, TaskConfig
from a3po.schema import TrainConfig, VLLMRolloutConfig
from a3po.tasks.gsm8k import DEFAULT_HUB_CONFIG, DEFAULT_HUB_ID
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION
from a3po.tasks.words import OPERATIONS

REPO = Path(__file__).resolve().parents[1]
# The doors: they hold the composed DictConfig (the run's, the benchmark's) before it is typed.
DOORS = {"a3po/run/main.py", "a3po/config.py", "a3po/benchmark/cli.py", "a3po/benchmark/workload.py"}


def test_the_run_config_is_the_composed_one_typed_and_frozen(tiny_cfg):
    cfg = tiny_cfg("algo=hybrid", "correction=icepop", "train.lr=3e-5", "rollout=vllm", "+rollout.batch_size=4")
    typed = parse_config(cfg).with_values(precision="fp32")
    assert isinstance(typed.train, TrainConfig) and typed.train.lr == 3e-5
    assert isinstance(typed.rollout, VLLMRolloutConfig)  # the chosen engine's keys only: batch_size is hf's
    assert typed.algo.name == "hybrid" and typed.algo.as_dict() == {"name": "hybrid", **OmegaConf.to_container(cfg.algo)}
    assert typed.correction.params == {"lo": 0.5, "hi": 2.0} and typed.precision == "fp32"
    assert typed.resolved == {**OmegaConf.to_container(cfg, resolve=True), "precision": "fp32"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.train = None  # type: ignore[misc]
    assert typed.with_values(precision="bf16").resolved["precision"] == "bf16"  # what records it follows
    swapped = typed.with_values(algo={"name": "recompute"})  # an axis replaced: a Choice, and its record
    assert swapped.algo.name == "recompute" and swapped.resolved["algo"] == {"name": "recompute"}


def test_a_mapping_normalises_at_entry_with_its_defaults_and_names_an_unknown_key():
    assert TaskConfig.of({"name": "words"}).operations == ("add", "sub", "mul")
    assert ModelConfig.of({"source": "tiny"}).dtype == "float32"
    with pytest.raises(ConfigError, match=r"task.levle is not a key of task"):
        TaskConfig.of({"name": "arith", "levle": 2}, "task")
    with pytest.raises(ConfigError, match=r"rollout.name='sglang' is not allowed"):
        engine_spec("sglang")
    with pytest.raises(ConfigError, match=r"model.hidden_size='x' is not allowed"):  # typed as it is built
        ModelConfig.of({"hidden_size": "x"}, "model")


def test_task_defaults_are_the_tasks_own():
    defaults = TaskConfig()
    assert (defaults.hub_id, defaults.hub_config, defaults.held_out_fraction) == \
        (DEFAULT_HUB_ID, DEFAULT_HUB_CONFIG, DEFAULT_HELD_OUT_FRACTION)
    assert tuple(defaults.operations) == OPERATIONS


def test_a_run_leaves_the_callers_config_as_it_was(tiny_cfg):
    from a3po.run.main import run

    cfg = tiny_cfg("train.total_steps=1", "train.eval_every=0", "precision=auto")
    assert cfg.precision == "auto"
    run(cfg)
    assert cfg.precision == "auto"  # resolved on the run's own copy (bf16 or fp32 by this CPU)


def test_nothing_below_the_door_reads_a_dictconfig():
    offenders = []
    for path in sorted((REPO / "a3po").rglob("*.py")):
        name = str(path.relative_to(REPO))
        if name in DOORS:
            continue
        text = path.read_text()
        if re.search(r"^\s*from omegaconf import .*DictConfig|cfg_get\(|\bcfg\.(train|rollout|model|runtime|task)\.get\(",
                     text, re.MULTILINE):
            offenders.append(name)
    assert not offenders


def test_below_the_door_the_config_is_typed_and_never_parsed_again():
    """The issue's rule: one parse (a3po.config.parse_config); no signature in a3po/ takes an
    untyped `cfg: Any` or `*_cfg: Any`."""
    offenders = []
    for path in sorted((REPO / "a3po").rglob("*.py")):
        text = path.read_text()
        if re.search(r"RunConfig\.of\(|\bcfg: Any\b|_cfg: Any\b", text):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders


def test_a_partial_configs_top_level_values_are_config_yamls(tiny_cfg):
    from a3po.run_config import TOP_LEVEL

    cfg = tiny_cfg()
    composed = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "config.yaml"))
    assert {key: composed[key] for key in TOP_LEVEL if key != "run_name"} == \
        {key: value for key, value in TOP_LEVEL.items() if key != "run_name"}
    partial = {key: cfg[key] for key in ("algo", "schedule", "correction", "objective", "model", "rollout", "train")}
    typed = parse_config(partial)
    assert typed.runtime.name == "lagged" and typed.task == TaskConfig() and typed.seed == 0
