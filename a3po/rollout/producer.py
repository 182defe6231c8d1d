"""Task problems in, a scored batch and its rollout metrics out: what every runtime calls to
make the batch for a step, with the engine's current weights."""

from __future__ import annotations

import math

from typing import Any

from a3po.batch import RolloutBatch
from a3po.run_config import RunConfig
from a3po.seeds import Stream, stream_seed
from a3po.timer import PhaseTimer

__all__ = ["Rollout", "RolloutProducer", "as_rollout"]

# A batch and the metrics that describe it (reward/*, response/*; a runtime adds its own).
Rollout = tuple[RolloutBatch, dict[str, float]]


def as_rollout(entry: Rollout | RolloutBatch) -> Rollout:
    """A runtime queue's entry as (batch, metrics). Checkpoints written before the metrics
    travelled beside the batch hold batches that carry them as `stats`."""
    if isinstance(entry, RolloutBatch):
        return entry, entry.__dict__.pop("stats", {})
    return entry


class RolloutProducer:
    """`producer(step)` -> (batch, metrics) for `step`; `evaluate(after_step)` -> held-out reward."""

    def __init__(self, cfg: RunConfig, task: Any, tokenizer: Any, engine: Any, timer: PhaseTimer) -> None:
        from a3po.tasks import encode_prompt

        self.cfg = cfg
        self.task, self.tokenizer, self.engine, self.timer = task, tokenizer, engine, timer
        self.encode_prompt = encode_prompt  # the same encoder as python -m a3po.rollout.calibrate

    def encode(self, question: str) -> list[int]:
        return self.encode_prompt(self.tokenizer, question)

    def score(self, problems, groups) -> int:
        """Set every sample's reward; returns how many answers were malformed."""
        malformed = 0
        for problem, group in zip(problems, groups):
            for sample in group:
                result = self.task.reward(self.tokenizer.decode(sample.response_ids, skip_special_tokens=True),
                                          problem.answer)
                sample.reward = float(result.score)
                malformed += int(result.malformed)
        return malformed

    def __call__(self, step: int) -> Rollout:
        train = self.cfg.train
        with self.timer.phase("rollout"):
            problems = self.task.train_batch(step, train.n_prompts)
            groups = self.engine.generate([self.encode(p.question) for p in problems], train.n_samples,
                                          seed=stream_seed(self.cfg.seed, Stream.ROLLOUT, step))
            malformed = self.score(problems, groups)
        samples = [sample for group in groups for sample in group]
        n = len(samples)
        metrics = {
            "reward/mean": sum(s.reward for s in samples) / n,
            "reward/malformed": malformed / n,
            "response/length_mean": sum(s.response_ids.numel() for s in samples) / n,
            "response/truncated": sum(not s.finished for s in samples) / n,
        }
        return RolloutBatch(step=step, samples=samples, n_prompts=train.n_prompts, n_samples=train.n_samples), metrics

    def evaluate(self, after_step: int) -> dict[str, float]:
        """The current policy on the task's first `train.eval_size` held-out problems,
        `train.eval_samples` samples each: `eval/reward`, the mean, and `eval/reward_se`, its
        standard error with the problems as the units (the standard deviation of the
        per-problem means over the square root of their count: a problem's samples are not
        independent draws of the task)."""
        problems = self.task.eval_problems(self.cfg.train.eval_size)
        samples = self.cfg.train.eval_samples
        groups = self.engine.generate([self.encode(p.question) for p in problems], samples,
                                      seed=stream_seed(self.cfg.seed, Stream.EVAL, after_step))
        self.score(problems, groups)
        return eval_metrics([[s.reward for s in group] for group in groups])


def eval_metrics(rewards: list[list[float]]) -> dict[str, float]:
    """`eval/reward` and `eval/reward_se` from each problem's samples' rewards."""
    means = [sum(group) / len(group) for group in rewards]
    n = len(means)
    mean = sum(means) / n
    variance = sum((m - mean) ** 2 for m in means) / (n - 1) if n > 1 else math.nan
    return {"eval/reward": mean, "eval/reward_se": math.sqrt(variance / n)}
