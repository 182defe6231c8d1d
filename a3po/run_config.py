"""The run's config as frozen, typed objects, built once at the door (`RunConfig.of` in
`a3po.run.main.run`, after validation) and passed down: no DictConfig, no `.get(key, default)`
below it. The fixed groups are a3po.schema's dataclasses (their YAML mirrors them:
tests/test_schema.py); here are the rest: the model and the task (validated by their own
packages; TaskConfig's defaults are the tasks' own, tests/test_run_config.py), an ablation
axis's chosen entry with its parameters, and the whole run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from a3po.errors import ConfigError
from a3po.schema import (AsyncRuntime, Group, LaggedRuntime, LoggerConfig, RolloutConfig, TrainConfig, VLLMRolloutConfig,
                         as_plain)

__all__ = ["ModelConfig", "TaskConfig", "Choice", "RunConfig", "ROLLOUT_SCHEMAS", "RUNTIMES", "rollout_of"]

RUNTIMES = {"lagged": LaggedRuntime, "async": AsyncRuntime}
ROLLOUT_SCHEMAS = {"hf": RolloutConfig, "vllm": VLLMRolloutConfig}


@dataclass(frozen=True)
class ModelConfig(Group):
    """`model.*` (conf/model/*.yaml); the sizes are the tiny builder's (source `tiny`)."""

    name: str = "tiny"
    source: str = "tiny"
    path: str | None = None
    attn_implementation: str | None = None
    dtype: str = "float32"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None


@dataclass(frozen=True)
class TaskConfig(Group):
    """`task.*` (conf/task/*.yaml): each task reads its own keys."""

    name: str = "arith"
    level: Any = 1
    operations: Any = ("add", "sub", "mul")
    path: Any = None
    hub_id: str = "openai/gsm8k"
    hub_config: str = "main"
    held_out_fraction: Any = 0.2
    # task=reasoning_gym (a3po/tasks/reasoning_gym.py): the dataset, its own config keys (null: its
    # defaults) and how many problems are generated for the two splits
    dataset: Any = "leg_counting"
    config: Any = None
    size: Any = 2000


@dataclass(frozen=True)
class Choice:
    """An ablation axis's chosen entry (`algo`, `schedule`, `correction`, `objective`): its name and
    parameters, as the axis's spec checks them (a3po.maths.spec)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, group: Any) -> "Choice":
        if isinstance(group, cls):
            return group
        values = as_plain(group)
        return cls(str(values.pop("name")), values)

    def as_dict(self) -> dict[str, Any]:
        """`{"name": ..., **params}`: the group as the maths' checks take it."""
        return {"name": self.name, **self.params}


@dataclass(frozen=True)
class RunConfig:
    """One run's config, resolved (`precision` too) and typed. `resolved` is the whole config as
    plain Python, for what records it (config.yaml, wandb) and compares it (a resume)."""

    experiment_name: str
    run_name: str
    seed: int
    staleness: int
    device: str
    precision: str
    bf16_gemms: str | None
    output_root: str
    on_config_change: str
    memory_check: Any
    memory_check_wait_min: float
    algo: Choice
    schedule: Choice
    correction: Choice
    objective: Choice
    model: ModelConfig
    task: TaskConfig
    rollout: RolloutConfig | VLLMRolloutConfig
    runtime: LaggedRuntime | AsyncRuntime
    logger: LoggerConfig
    train: TrainConfig
    resolved: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, cfg: Any, **replaced: Any) -> "RunConfig":
        """From a composed config (an OmegaConf node or plain mapping), with `replaced` top-level
        values (the resolved `precision`); a RunConfig is returned as is, with those replaced. A
        partial config (a test's, the benchmark's without a task) takes conf/config.yaml's
        top-level values (`TOP_LEVEL`) and the groups' defaults where it has none; the axes,
        model, rollout and train groups it must have."""
        if isinstance(cfg, cls):
            if not replaced:
                return cfg
            typed = {key: Choice.of(value) if key in AXES else value for key, value in replaced.items()}
            plain = {key: value.as_dict() if isinstance(value, Choice) else as_plain(value) for key, value in typed.items()}
            return dataclasses.replace(cfg, **typed, resolved={**cfg.resolved, **plain})
        plain = {**TOP_LEVEL, **as_plain({k: cfg[k] for k in cfg if k != "hydra"}), **replaced}
        runtime = plain.get("runtime", {"name": "lagged"})
        return cls(**{key: plain[key] for key in TOP_LEVEL},
                   algo=Choice.of(plain["algo"]), schedule=Choice.of(plain["schedule"]),
                   correction=Choice.of(plain["correction"]), objective=Choice.of(plain["objective"]),
                   model=ModelConfig.of(plain["model"], "model"), task=TaskConfig.of(plain.get("task", {}), "task"),
                   rollout=rollout_of(plain["rollout"]), runtime=RUNTIMES[runtime["name"]].of(runtime, "runtime"),
                   logger=LoggerConfig.of(plain.get("logger", {}), "logger"), train=TrainConfig.of(plain["train"], "train"),
                   resolved=plain)


AXES = ("algo", "schedule", "correction", "objective")  # the groups a Choice holds
# conf/config.yaml's top-level values (tests/test_run_config.py holds them equal), for a partial config.
TOP_LEVEL = {"experiment_name": "default", "run_name": "", "seed": 0, "staleness": 2, "device": "auto",
             "precision": "auto", "bf16_gemms": None, "output_root": "outputs", "on_config_change": "error", "memory_check": "error",
             "memory_check_wait_min": 0}


def rollout_of(group: Any) -> RolloutConfig | VLLMRolloutConfig:
    """`rollout` as its engine's schema (as is when it already is one), from the chosen engine's
    keys only: an experiment may set another engine's, which validation tolerates (a3po.config)."""
    if isinstance(group, (RolloutConfig, VLLMRolloutConfig)):
        return group
    values = as_plain(group)
    if values.get("name") not in ROLLOUT_SCHEMAS:
        raise ConfigError(f"rollout.name={values.get('name')!r} is not allowed; allowed: {sorted(ROLLOUT_SCHEMAS)}")
    schema = ROLLOUT_SCHEMAS[values["name"]]
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{k: v for k, v in values.items() if k in names})
