"""Tasks: where prompts and rewards come from, chosen by `task.name` (conf/task/*.yaml)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from a3po.errors import ConfigError
from a3po.run_config import TaskConfig
from a3po.tasks.arith import LEVELS, ArithTask
from a3po.tasks.base import ANSWER_INSTRUCTION, Problem, RewardResult, Task, encode_prompt, render_prompt
from a3po.tasks.gsm8k import GSM8KTask, local_path_missing
from a3po.tasks.reasoning_gym import ReasoningGymTask, check_dataset
from a3po.tasks.words import WordsTask, check_operations

__all__ = [
    "ANSWER_INSTRUCTION",
    "TASKS",
    "Problem",
    "RewardResult",
    "Task",
    "build_task",
    "encode_prompt",
    "render_prompt",
    "validate_task_cfg",
]


def _build_arith(task_cfg: TaskConfig, seed: int) -> ArithTask:
    return ArithTask(level=task_cfg.level, seed=seed, held_out_fraction=task_cfg.held_out_fraction)


def _build_gsm8k(task_cfg: TaskConfig, seed: int) -> GSM8KTask:
    return GSM8KTask(seed=seed, path=task_cfg.path, hub_id=task_cfg.hub_id, hub_config=task_cfg.hub_config,
                     held_out_fraction=task_cfg.held_out_fraction)


def _build_words(task_cfg: TaskConfig, seed: int) -> WordsTask:
    return WordsTask(operations=tuple(task_cfg.operations), seed=seed, held_out_fraction=task_cfg.held_out_fraction)


def _build_reasoning_gym(task_cfg: TaskConfig, seed: int) -> ReasoningGymTask:
    return ReasoningGymTask(dataset=task_cfg.dataset, seed=seed, config=task_cfg.config, size=task_cfg.size,
                            held_out_fraction=task_cfg.held_out_fraction)


TASKS: dict[str, Callable[[TaskConfig, int], Task]] = {"arith": _build_arith, "gsm8k": _build_gsm8k,
                                                        "words": _build_words, "reasoning_gym": _build_reasoning_gym}


def validate_task_cfg(task_cfg: TaskConfig | Mapping[str, Any]) -> None:
    """The checks that need no data, so a bad config fails before the model loads. `task_cfg`: a
    TaskConfig, or a mapping of its keys."""
    task_cfg = TaskConfig.of(task_cfg, "task")
    name = task_cfg.name
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r} is not a known task; allowed: {sorted(TASKS)}")
    fraction = task_cfg.held_out_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(
            f"task.held_out_fraction={fraction!r}: must be a number strictly between 0 and 1"
        )
    if name == "arith":
        level = task_cfg.level
        if level not in LEVELS:
            raise ConfigError(f"task.level={level!r} is not a level; allowed: {sorted(LEVELS)}")
    if name == "words":
        check_operations(task_cfg.operations)
    if name == "reasoning_gym":
        check_dataset(task_cfg.dataset, task_cfg.config, task_cfg.size, fraction)
    if name == "gsm8k":
        path = task_cfg.path
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"task.path={path!r}: must be null (use the hub) or a local path")
        if local_path_missing(path):
            raise ConfigError(
                f"task.path={path!r} does not exist; give a GSM8K jsonl/parquet file, a directory "
                "with train and test files, or null to load openai/gsm8k from the hub"
            )


def build_task(task_cfg: TaskConfig | Mapping[str, Any], seed: int) -> Task:
    """The task `task_cfg` (a TaskConfig, or a mapping of its keys) names, validated first."""
    task_cfg = TaskConfig.of(task_cfg, "task")
    validate_task_cfg(task_cfg)
    return TASKS[task_cfg.name](task_cfg, seed)
