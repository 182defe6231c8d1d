"""The run's config as frozen, typed objects, built once at the door (`a3po.config.parse_config`,
called by `a3po.run.main.run` and the other entry points) and passed down: no DictConfig, no
`.get(key, default)` below it. The fixed groups are a3po.schema's dataclasses (their YAML mirrors them:
tests/test_schema.py); here are the rest: the model and the task (validated by their own
packages; TaskConfig's defaults are the tasks' own, tests/test_run_config.py), an ablation
axis's chosen entry with its parameters, and the whole run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from a3po.schema import AsyncRuntime, Group, LaggedRuntime, LoggerConfig, RolloutGroup, TrainConfig, as_plain

__all__ = ["ModelConfig", "TaskConfig", "Choice", "RunConfig", "RUNTIMES", "AXES", "TOP_LEVEL"]

RUNTIMES = {"lagged": LaggedRuntime, "async": AsyncRuntime}


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
    rollout: RolloutGroup  # the engine's own schema (a3po.rollout.engines)
    runtime: LaggedRuntime | AsyncRuntime
    logger: LoggerConfig
    train: TrainConfig
    resolved: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def with_values(self, **replaced: Any) -> "RunConfig":
        """This config with `replaced` top-level values (the resolved `precision`; an axis's group,
        as a Choice or a mapping), its `resolved` record updated alike."""
        typed = {key: Choice.of(value) if key in AXES else value for key, value in replaced.items()}
        plain = {key: value.as_dict() if isinstance(value, Choice) else as_plain(value) for key, value in typed.items()}
        return dataclasses.replace(self, **typed, resolved={**self.resolved, **plain})


AXES = ("algo", "schedule", "correction", "objective")  # the groups a Choice holds
# conf/config.yaml's top-level values (tests/test_run_config.py holds them equal), for a partial config.
TOP_LEVEL = {"experiment_name": "default", "run_name": "", "seed": 0, "staleness": 2, "device": "auto",
             "precision": "auto", "bf16_gemms": None, "output_root": "outputs", "on_config_change": "error", "memory_check": "error",
             "memory_check_wait_min": 0}
