"""The train / held-out partition and the per-step sampling every task shares.

Held-out membership is a pure function of the question text (a stable hash), not of the
run seed: every seed of a sweep is evaluated on the same problems, so seed-to-seed
differences in `eval/reward` are differences between policies, not between eval sets, and
a question can never be in both splits whichever way it was generated.
"""

from __future__ import annotations

import hashlib

import numpy as np

from a3po.seeds import Stream, task_rng

DEFAULT_HELD_OUT_FRACTION = 0.2
# Seed of the eval order: constant for the reason given in the module docstring.
EVAL_SEED = 20240917


def is_held_out(question: str, held_out_fraction: float) -> bool:
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < held_out_fraction


def step_rng(seed: int, step: int, *extra: int) -> np.random.Generator:
    """A generator that depends on (seed, step) alone, so resumed runs replay the same prompts."""
    return task_rng(Stream.TASK_TRAIN, seed, step, *extra)


def eval_rng(*extra: int) -> np.random.Generator:
    return task_rng(Stream.TASK_EVAL, EVAL_SEED, *extra)


def in_eval_order(held_out: list) -> list:
    """The held-out problems in a fixed shuffled order (seeded by their count alone), so the first
    n a run evaluates are a uniform sample of the split whatever order its source listed them in."""
    order = eval_rng(len(held_out)).permutation(len(held_out))
    return [held_out[int(i)] for i in order]


class FixedSplits:
    """A task's two fixed splits, read as every run reads them: `train_batch` draws uniformly (with
    replacement) from `_train`, seeded by (seed, step); `eval_problems` is the first n of
    `_held_out`, the same for every seed (the whole split where it holds fewer). A task sets
    `seed`, `_train` and `_held_out`."""

    @property
    def held_out(self) -> tuple:
        return self._held_out

    def train_batch(self, step: int, n_prompts: int) -> list:
        indices = step_rng(self.seed, step).integers(0, len(self._train), size=n_prompts)
        return [self._train[int(i)] for i in indices]

    def eval_problems(self, n: int) -> list:
        return list(self._held_out[:n])

