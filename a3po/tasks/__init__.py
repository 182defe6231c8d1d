"""Tasks: where prompts and rewards come from, chosen by `task.name` (conf/task/*.yaml)."""

from __future__ import annotations

from typing import Any, Callable

from a3po.cfg_access import cfg_get
from a3po.errors import ConfigError
from a3po.tasks.arith import LEVELS, ArithTask
from a3po.tasks.base import ANSWER_INSTRUCTION, Problem, RewardResult, Task, encode_prompt, render_prompt
from a3po.tasks.gsm8k import DEFAULT_HUB_CONFIG, DEFAULT_HUB_ID, GSM8KTask, local_path_missing
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION
from a3po.tasks.words import OPERATIONS, WordsTask, check_operations

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


def _held_out_fraction(task_cfg: Any) -> float:
    return cfg_get(task_cfg, "held_out_fraction", DEFAULT_HELD_OUT_FRACTION)


def _build_arith(task_cfg: Any, seed: int) -> ArithTask:
    return ArithTask(
        level=cfg_get(task_cfg, "level", 1), seed=seed, held_out_fraction=_held_out_fraction(task_cfg)
    )


def _build_gsm8k(task_cfg: Any, seed: int) -> GSM8KTask:
    return GSM8KTask(
        seed=seed,
        path=cfg_get(task_cfg, "path"),
        hub_id=cfg_get(task_cfg, "hub_id", DEFAULT_HUB_ID),
        hub_config=cfg_get(task_cfg, "hub_config", DEFAULT_HUB_CONFIG),
        held_out_fraction=_held_out_fraction(task_cfg),
    )


def _build_words(task_cfg: Any, seed: int) -> WordsTask:
    return WordsTask(operations=tuple(cfg_get(task_cfg, "operations", OPERATIONS)), seed=seed,
                     held_out_fraction=_held_out_fraction(task_cfg))


TASKS: dict[str, Callable[[Any, int], Task]] = {"arith": _build_arith, "gsm8k": _build_gsm8k, "words": _build_words}


def validate_task_cfg(task_cfg: Any) -> None:
    """The checks that need no data, so a bad config fails before the model loads."""
    name = cfg_get(task_cfg, "name")
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r} is not a known task; allowed: {sorted(TASKS)}")
    fraction = _held_out_fraction(task_cfg)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(
            f"task.held_out_fraction={fraction!r}: must be a number strictly between 0 and 1"
        )
    if name == "arith":
        level = cfg_get(task_cfg, "level", 1)
        if level not in LEVELS:
            raise ConfigError(f"task.level={level!r} is not a level; allowed: {sorted(LEVELS)}")
    if name == "words":
        check_operations(cfg_get(task_cfg, "operations", OPERATIONS))
    if name == "gsm8k":
        path = cfg_get(task_cfg, "path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"task.path={path!r}: must be null (use the hub) or a local path")
        if local_path_missing(path):
            raise ConfigError(
                f"task.path={path!r} does not exist; give a GSM8K jsonl/parquet file, a directory "
                "with train and test files, or null to load openai/gsm8k from the hub"
            )


def build_task(task_cfg: Any, seed: int) -> Task:
    validate_task_cfg(task_cfg)
    return TASKS[cfg_get(task_cfg, "name")](task_cfg, seed)
