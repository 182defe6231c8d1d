"""Tasks from reasoning-gym, the procedural task library (pinned in pyproject.toml): any of its
datasets as a task, graded by the dataset's own `score_answer`. docs/reasoning_gym.md.

    task=reasoning_gym task.dataset=leg_counting 'task.config={min_animals: 2, max_animals: 3}'

`task.dataset` names the dataset; `task.config` holds its own config keys (the fields of its
config dataclass but `seed` and `size`, which this task sets), null for its defaults;
`task.size` is how many problems are generated for the two splits (default 2,000).

What "held out" means here. The task generates `task.size` problems, the dataset's items 0 to
size - 1 with the generator seed `POOL_SEED`: item i is drawn from a generator seeded POOL_SEED + i
(every reasoning-gym dataset but acre, which draws all its items from one stream). The first
`round(size * held_out_fraction)` items are the held-out split, the rest the training split, so
the two come from disjoint generator seeds. A generator can repeat itself (a small space, e.g.
coin_flip or basic_arithmetic with one-digit operands), so the question text decides as well: a
training problem whose question is a held-out problem's is dropped, as is a repeat within the
held-out split. No held-out question appears in training, and each is evaluated once. Nothing
here depends on the run seed: the held-out problems keep the generator's order (independent
draws, so the first `train.eval_size` are a uniform sample), the same for every run seed and for
every `task.size` whose held-out split holds them. Training draws uniformly from its split,
seeded by (run seed, step).

The answer. The prompt is the dataset's question with the suite's instruction
(a3po.tasks.base.ANSWER_INSTRUCTION: "Put the final answer after ####."), and the model's answer
is read by the suite's convention. Where the problem's answer is a number ("142", "-4", "0.3125",
"737/960"), it is GSM8K's rule (a3po.tasks.reward.extract_answer): the number after the last
`####`, else the last number anywhere, separators and currency dropped; no number at all is
malformed. Any other answer (an expression, a list, a grid, a sentence) is everything after the
last `####`, whitespace trimmed; no `####`, or nothing after it, is malformed. The answer goes to
the dataset's `score_answer` with the problem's own entry (its answer and metadata), and the
reward is that score: 1 right, 0 wrong, or the partial credit the dataset gives (gsm_symbolic
0.01 for a wrong number). A malformed completion scores 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from a3po.errors import ConfigError
from a3po.tasks.base import Problem, RewardResult
from a3po.tasks.reward import ANSWER_MARKER, NUMBER_PATTERN, extract_answer
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION, EVAL_SEED, FixedSplits

__all__ = ["DEFAULT_SIZE", "MAX_SIZE", "POOL_SEED", "OracleAnswer", "ReasoningGymTask", "check_dataset",
           "config_keys", "dataset_names", "marked_answer", "model_answer", "problem_split"]

# The generator seed of every run's problems: a constant, so every run seed has the same splits.
POOL_SEED = EVAL_SEED
DEFAULT_SIZE = 2000
MAX_SIZE = 1_000_000
# Config keys the task sets itself, and why.
MANAGED_KEYS = {"seed": "the task's fixed generator seed (what keeps the held-out split fixed)",
                "size": "task.size"}
# Datasets that are not one task here, and why.
UNSUPPORTED = {"composite": "it mixes datasets from specs of their own; pick one dataset"}


def _registry() -> Mapping[str, tuple[type, type]]:
    """reasoning-gym's datasets, name -> (dataset class, config class); imported on first use."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def dataset_names() -> list[str]:
    return sorted(name for name in _registry() if name not in UNSUPPORTED)


def config_keys(dataset: str) -> list[str]:
    """The keys `task.config` may set for `dataset`: its config dataclass's fields but the managed ones."""
    return sorted(f.name for f in dataclasses.fields(_registry()[dataset][1]) if f.name not in MANAGED_KEYS)


def held_out_count(size: int, held_out_fraction: float) -> int:
    """How many of the `size` generated problems are held out: at least one, and one fewer than size."""
    count = round(size * held_out_fraction)
    if not 1 <= count < size:
        raise ConfigError(f"task.size={size} with task.held_out_fraction={held_out_fraction} holds out {count} of "
                          f"{size} problems; both splits must be non-empty: raise task.size")
    return count


def _source_config(dataset: str, config: Mapping[str, Any], size: int) -> Any:
    """The dataset's config dataclass for `config`, after the dataset's own check (its `validate`)."""
    config_cls = _registry()[dataset][1]
    try:
        source_config = config_cls(**config, seed=POOL_SEED, size=size)
        if callable(getattr(source_config, "validate", None)):
            source_config.validate()
    except (AssertionError, TypeError, ValueError, KeyError, AttributeError) as error:
        reason = " ".join(str(error).split()) or "a value out of its range"
        defaults = {key: getattr(config_cls(), key) for key in config_keys(dataset)}
        raise ConfigError(f"task.config={dict(config)!r} is not allowed by {dataset}'s own check "
                          f"({type(error).__name__}: {reason}); its keys and their defaults: {defaults}") from None
    return source_config


def check_dataset(dataset: Any, config: Any, size: Any, held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION
                  ) -> dict[str, Any]:
    """`task.dataset`, `task.config` and `task.size` checked without generating a problem; the
    dataset config as a plain dict. Raises ConfigError naming the key, the value and what is allowed."""
    names = dataset_names()
    if not isinstance(dataset, str) or dataset not in names:
        reason = f" ({UNSUPPORTED[dataset]})" if dataset in UNSUPPORTED else ""
        raise ConfigError(f"task.dataset={dataset!r} is not a reasoning-gym dataset{reason}; allowed: {names}")
    if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= MAX_SIZE:
        raise ConfigError(f"task.size={size!r} is not allowed; it must be an integer from 2 to {MAX_SIZE} "
                          "(the problems generated for the training and held-out splits together)")
    held_out_count(size, held_out_fraction)
    keys = config_keys(dataset)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"task.config={config!r} is not allowed; it must be a mapping of {dataset}'s config keys, "
                          f"or null for its defaults; its keys: {keys}")
    for key in config:
        if key in MANAGED_KEYS:
            raise ConfigError(f"task.config.{key} is not allowed; the task sets it: {MANAGED_KEYS[key]}; "
                              f"{dataset}'s keys: {keys}")
        if key not in keys:
            raise ConfigError(f"task.config.{key} is not a key of {dataset}'s config; its keys: {keys}")
    _source_config(dataset, config, size)
    return dict(config)


class OracleAnswer(str):
    """A problem's answer as the suite carries it (`Problem.answer`, handed back to `reward`): the
    dataset's answer as text ("" where a dataset has none and its scorer checks the answer itself,
    e.g. graph_color), carrying the entry (answer and metadata) that `score_answer` grades against."""

    entry: Mapping[str, Any]

    def __new__(cls, text: str, entry: Mapping[str, Any]) -> "OracleAnswer":
        answer = super().__new__(cls, text)
        answer.entry = entry
        return answer

    def __getnewargs__(self) -> tuple[str, Mapping[str, Any]]:  # copies and pickles keep the entry
        return str(self), self.entry

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> "OracleAnswer":
        return cls("" if entry.get("answer") is None else str(entry["answer"]), entry)


@contextlib.contextmanager
def _global_rngs_kept():
    """A block after which Python's and numpy's global generators are where they were: a few
    generators seed and draw from numpy's (pool_matrix), and a task draws nothing from the run's."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@functools.lru_cache(maxsize=8)
def _source(dataset: str, config_json: str, size: int) -> Any:
    """The dataset's generator for a checked config (as sorted JSON, so it can key the cache)."""
    from reasoning_gym import create_dataset

    with _global_rngs_kept():
        return create_dataset(dataset, **json.loads(config_json), seed=POOL_SEED, size=size)


def _problems(source: Any, dataset: str, indices: range) -> list[Problem]:
    problems = []
    with _global_rngs_kept():
        for index in indices:
            try:
                entry = source[index]
            except Exception as error:  # a config the dataset's check lets through but its generator cannot serve
                raise ConfigError(f"task.dataset={dataset} cannot generate problem {index} with this task.config "
                                  f"({type(error).__name__}: {error}); change task.config") from None
            problems.append(Problem(question=entry["question"], answer=OracleAnswer.of(entry)))
    return problems


@functools.lru_cache(maxsize=8)
def problem_split(dataset: str, config_json: str, size: int, held_out_fraction: float
                  ) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """(train, held out) of a checked config, as the module docstring defines them."""
    source = _source(dataset, config_json, size)
    count = held_out_count(size, held_out_fraction)
    held_out: dict[str, Problem] = {}
    for problem in _problems(source, dataset, range(count)):
        held_out.setdefault(problem.question, problem)
    train = tuple(p for p in _problems(source, dataset, range(count, size)) if p.question not in held_out)
    if not train:
        raise ConfigError(f"task.dataset={dataset} with task.config={json.loads(config_json)} repeats itself: every "
                          f"training problem of task.size={size} is a held-out question; widen task.config")
    return train, tuple(held_out.values())


def marked_answer(completion: str) -> str | None:
    """Everything after the last `####`, whitespace trimmed; None where there is no answer there."""
    marker_at = completion.rfind(ANSWER_MARKER)
    if marker_at < 0:
        return None
    return completion[marker_at + len(ANSWER_MARKER):].strip() or None


def model_answer(completion: str, answer: str) -> str | None:
    """The model's answer to a problem whose answer is `answer`, as the module docstring reads it;
    None where it gave none (malformed)."""
    if NUMBER_PATTERN.fullmatch(answer.strip()) is None:
        return marked_answer(completion)
    try:
        return extract_answer(completion)
    except Exception:  # as numeric_reward: a completion the pattern cannot read is malformed, never a crash
        return None


@dataclass
class ReasoningGymTask(FixedSplits):
    dataset: str
    seed: int
    config: Mapping[str, Any] | None = None
    size: int = DEFAULT_SIZE
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION

    def __post_init__(self) -> None:
        self.config = check_dataset(self.dataset, self.config, self.size, self.held_out_fraction)
        key = json.dumps(self.config, sort_keys=True)
        self._source = _source(self.dataset, key, self.size)
        self._train, self._held_out = problem_split(self.dataset, key, self.size, self.held_out_fraction)

    @property
    def train(self) -> tuple[Problem, ...]:
        return self._train

    def reward(self, completion: str, answer: str) -> RewardResult:
        """The dataset's `score_answer` of the model's answer. An `answer` that is plain text, not
        this task's OracleAnswer, is graded against that text alone (no metadata). A scorer that
        raises on the model's answer scores it 0: a wrong answer, never a crashed run."""
        predicted = model_answer(completion, answer)
        if predicted is None:
            return RewardResult(score=0.0, malformed=True)
        entry = answer.entry if isinstance(answer, OracleAnswer) else {"question": "", "answer": str(answer),
                                                                       "metadata": {}}
        try:
            score = float(self._source.score_answer(predicted, entry))
        except Exception:
            score = 0.0
        return RewardResult(score=score if math.isfinite(score) else 0.0, malformed=False)
