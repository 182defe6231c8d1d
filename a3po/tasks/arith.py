"""Procedural arithmetic: a task with no data to download and a tunable starting accuracy.

RL only learns when a group of samples has mixed rewards, so the default level is chosen
for the embedded SmolLM2-135M-Instruct at temperature 1 with 32 new tokens. Measured with
`python -m a3po.rollout.calibrate`: level 1 starts at 0.31-0.35 mean reward, level 2 at 0.07,
level 3 at 0.02.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from a3po.errors import ConfigError
from a3po.tasks.base import Problem, RewardResult
from a3po.tasks.reward import numeric_reward
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION, eval_rng, is_held_out, step_rng

# Phrasing measured best of several ("What is a + b?", "a + b = ?", "Add a and b.").
QUESTION_TEMPLATE = "Calculate {expression}."
# Ops of level 3 and how they print; `*` prints as `*` because the answer is checked by
# recomputing the printed expression with ordinary precedence.
MIXED_OPS = ("+", "-", "*")


def _single_digit_addition() -> Iterator[str]:
    for left, right in itertools.product(range(10), repeat=2):
        yield f"{left} + {right}"


def _two_digit_addition() -> Iterator[str]:
    for left, right in itertools.product(range(10, 100), repeat=2):
        yield f"{left} + {right}"


def _mixed_operations() -> Iterator[str]:
    for first, second, third in itertools.product(range(1, 13), repeat=3):
        for first_op, second_op in itertools.product(MIXED_OPS, repeat=2):
            yield f"{first} {first_op} {second} {second_op} {third}"


def evaluate_expression(expression: str) -> int:
    """Integer value of `a op b [op c ...]` with `*` binding tighter than `+` and `-`."""
    tokens = expression.split()
    terms: list[int] = [int(tokens[0])]
    signs: list[int] = [1]
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = int(operand)
        if op == "*":
            terms[-1] *= value
        elif op in ("+", "-"):
            terms.append(value)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r} in {expression!r}")
    return sum(sign * term for sign, term in zip(signs, terms))


# Every level is a small finite space (100, 8,100 and 15,552 expressions), enumerated once:
# that makes the held-out split exact and training a uniform draw from its complement,
# with no rejection loops.
LEVELS: dict[int, Callable[[], Iterator[str]]] = {
    1: _single_digit_addition,
    2: _two_digit_addition,
    3: _mixed_operations,
}


@functools.lru_cache(maxsize=None)
def level_problems(level: int) -> tuple[Problem, ...]:
    return tuple(
        Problem(question=QUESTION_TEMPLATE.format(expression=e), answer=str(evaluate_expression(e)))
        for e in LEVELS[level]()
    )


@functools.lru_cache(maxsize=None)
def level_split(
    level: int, held_out_fraction: float
) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """Held-out problems come in a fixed shuffled order so a small eval still spans the level."""
    problems = level_problems(level)
    train = tuple(p for p in problems if not is_held_out(p.question, held_out_fraction))
    held_out = [p for p in problems if is_held_out(p.question, held_out_fraction)]
    order = eval_rng(level).permutation(len(held_out))
    return train, tuple(held_out[int(i)] for i in order)


@dataclass
class ArithTask:
    level: int
    seed: int
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(
                f"task.level={self.level!r} is not a level; allowed: {sorted(LEVELS)}"
            )
        train, held_out = level_split(self.level, self.held_out_fraction)
        self._train, self._held_out = list(train), list(held_out)
        if not self._train or not self._held_out:
            raise ConfigError(
                f"task.held_out_fraction={self.held_out_fraction} leaves {len(self._train)} "
                f"training and {len(self._held_out)} held-out problems at level {self.level}; "
                "both must be non-empty"
            )

    def train_batch(self, step: int, n_prompts: int) -> list[Problem]:
        """Uniform draws (with replacement) from the training split, seeded by (seed, step)."""
        indices = step_rng(self.seed, step).integers(0, len(self._train), size=n_prompts)
        return [self._train[int(i)] for i in indices]

    def eval_problems(self, n: int) -> list[Problem]:
        """The first `n` held-out problems, the same for every seed.

        Level 1 has only 100 distinct problems, so its held-out split is about 20: asking for
        more returns the whole split rather than repeating problems (which would weight some
        of them twice in `eval/reward`).
        """
        return self._held_out[:n]

    def reward(self, completion: str, answer: str) -> RewardResult:
        return numeric_reward(completion, answer)
