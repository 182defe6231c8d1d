"""Procedural one-step word problems in GSM8K's answer format: the testbed of the claims study.

"Sara has 7 coins. She gives away 5 coins. How many coins does she have left?" Every problem is
one operation (+, - or x) on two numbers from 2 to 9, told about a person and a kind of object
in one of a few phrasings per operation. The space is enumerated (names x objects x phrasings x
numbers), so the held-out split is exact (a stable hash of the question, a3po.tasks.splits) and
training draws uniformly from the rest. The answer is a whole number, graded like GSM8K's
(`#### N`, a3po.tasks.reward). `python -m a3po.tasks.words --export FILE.jsonl` writes the
problems as GSM8K-format records (`question`, `answer` ending in `#### N`), which `task=gsm8k
task.path=FILE.jsonl` loads.

Calibration (SmolLM2-135M-Instruct, temperature 1, `python -m a3po.rollout.calibrate --task words`):
docs/testbed.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from dataclasses import dataclass

from a3po.errors import ConfigError
from a3po.tasks.base import Problem, RewardResult
from a3po.tasks.reward import numeric_reward
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION, FixedSplits, in_eval_order, is_held_out

__all__ = ["OPERATIONS", "WordsTask", "word_problems", "words_split"]

NAMES = (("Sara", "she"), ("Tom", "he"), ("Maya", "she"), ("Ben", "he"), ("Lena", "she"), ("Omar", "he"),
         ("Ana", "she"), ("Leo", "he"), ("Zoe", "she"), ("Sam", "he"), ("Nia", "she"), ("Raj", "he"))
OBJECTS = ("coins", "apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "stamps")
NUMBERS = range(2, 10)
# {n} name, {p} pronoun, {P} capitalised, {o} objects, {a} {b} the numbers. `sub` keeps a > b.
PHRASINGS = {
    "add": ("{n} has {a} {o}. {P} gets {b} more {o}. How many {o} does {p} have now?",
            "{n} had {a} {o} and found {b} more. How many {o} does {n} have?"),
    "sub": ("{n} has {a} {o}. {P} gives away {b} {o}. How many {o} does {p} have left?",
            "{n} had {a} {o} and lost {b} of them. How many {o} are left?"),
    "mul": ("{n} has {a} boxes with {b} {o} in each box. How many {o} does {p} have?",
            "{n} buys {a} packs of {o}. Each pack has {b} {o}. How many {o} does {n} buy?"),
}
OPERATIONS = tuple(PHRASINGS)
_APPLY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}


def _problems_of(operation: str) -> tuple[Problem, ...]:
    out = []
    for (name, pronoun), objects, phrasing, a, b in itertools.product(NAMES, OBJECTS, PHRASINGS[operation],
                                                                      NUMBERS, NUMBERS):
        if operation == "sub" and a <= b:
            continue
        question = phrasing.format(n=name, p=pronoun, P=pronoun.capitalize(), o=objects, a=a, b=b)
        out.append(Problem(question=question, answer=str(_APPLY[operation](a, b))))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def word_problems(operations: tuple[str, ...]) -> tuple[Problem, ...]:
    """Every problem of the given operations, in a fixed order."""
    return tuple(p for operation in operations for p in _problems_of(operation))


@functools.lru_cache(maxsize=None)
def words_split(operations: tuple[str, ...], held_out_fraction: float
                ) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """(train, held out); the held-out problems in a fixed shuffled order, so the first n of them
    span every operation, name and object."""
    problems = word_problems(operations)
    train = tuple(p for p in problems if not is_held_out(p.question, held_out_fraction))
    held_out = [p for p in problems if is_held_out(p.question, held_out_fraction)]
    return train, tuple(in_eval_order(held_out))


def check_operations(operations) -> tuple[str, ...]:
    ops = tuple(operations)
    unknown = [op for op in ops if op not in OPERATIONS]
    if not ops or unknown or len(set(ops)) != len(ops):
        raise ConfigError(f"task.operations={list(ops)!r} is not allowed; allowed: a non-empty list of distinct "
                          f"operations from {list(OPERATIONS)}")
    return ops


@dataclass
class WordsTask(FixedSplits):
    operations: tuple[str, ...]
    seed: int
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION

    def __post_init__(self) -> None:
        self.operations = check_operations(self.operations)
        self._train, self._held_out = words_split(self.operations, self.held_out_fraction)

    def reward(self, completion: str, answer: str) -> RewardResult:
        return numeric_reward(completion, answer)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m a3po.tasks.words", description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="write every problem as GSM8K-format jsonl to this file")
    parser.add_argument("--operations", default=",".join(OPERATIONS))
    args = parser.parse_args(argv)
    problems = word_problems(check_operations(args.operations.split(",")))
    with open(args.export, "w") as handle:
        for problem in problems:
            handle.write(json.dumps({"question": problem.question, "answer": f"#### {problem.answer}"}) + "\n")
    print(f"{len(problems)} problems -> {args.export}")


if __name__ == "__main__":
    main()
