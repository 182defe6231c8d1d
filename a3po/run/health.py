"""How a run ended when it did not simply learn: divergence (stopped) and collapse (flagged).

Divergence. A non-finite loss or gradient norm in a minibatch means the update would write
NaN or Inf into the weights, and every later step would train on garbage. The trainer checks
both before `optimizer.step` (`NonFiniteUpdate`), so that step is never taken: the weights
and the last checkpoint stay those of the last good state. The loop then records the
outcome in `<run_dir>/diverged.json` (`write_divergence`) and stops with `RunDiverged`,
which `experiments/train.py` turns into exit status 3 for a single run (1 is a crash, 2 a
config error) and into a logged line for a job of a sweep, whose other runs go on. A
diverged run is an outcome of its config, not a failure to retry: rerunning it reports
the same divergence at once.

Collapse. A policy whose entropy has fallen to ~0 and whose gradient is 0 no longer
learns: every sample of a group is the same answer, every advantage is 0. That is a result
worth seeing, not an error, so the run goes on and each step carries `health/collapsed`
(0/1) and, while collapsed, `health/collapse_step`, the step the collapse began
(`CollapseWatch`). The analysis counts diverged and collapsed runs per cell and leaves them
out of the means.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from a3po.errors import EXIT_CONFIG_ERROR  # noqa: F401  (experiments/train.py reads it here)
from a3po.learner.update import NonFiniteUpdate  # noqa: F401  (raised by the trainer, recorded here)
from a3po.metrics import COLLAPSE_STEP, COLLAPSED

DIVERGED_MARKER = "diverged.json"
# Exit statuses of experiments/train.py: 0 done, 1 a crash (Python's), 2 a config error
# (a3po.errors.EXIT_CONFIG_ERROR, every entry point's), 3 the run diverged (in diverged.json).
EXIT_DIVERGED = 3


class RunDiverged(Exception):
    """The run stopped at a non-finite update; `record` is what diverged.json holds."""

    def __init__(self, run_dir: Path, record: Mapping[str, Any]) -> None:
        self.run_dir, self.record = Path(run_dir), dict(record)
        checkpoint = record.get("last_checkpoint_step")
        kept = (f"checkpoints/last.pt (step {checkpoint}) holds the last good state" if checkpoint is not None
                else "no checkpoint was written before it")
        super().__init__(f"the run in {run_dir} diverged at step {record['step']}, minibatch {record['minibatch']}: "
                         f"{record['reason']}; nothing non-finite reached the weights, {kept}; recorded in "
                         f"{Path(run_dir) / DIVERGED_MARKER} (delete it to retry from that checkpoint)")


def divergence_record(error: NonFiniteUpdate, wall_time: float, last_checkpoint_step: int | None) -> dict[str, Any]:
    """diverged.json's content: where, why, when, and which checkpoint survives. Values that
    are not finite are written as strings ("nan", "inf"): JSON has no NaN."""
    return {"step": error.step, "minibatch": error.minibatch, "n_minibatches": error.n_minibatches,
            "reason": error.reason, "non_finite": error.non_finite, "loss": repr(error.loss),
            "grad_norm": repr(error.grad_norm), "last_checkpoint_step": last_checkpoint_step,
            "wall_time": wall_time, "time": datetime.now().astimezone().isoformat(timespec="seconds")}


def write_divergence(run_dir: Path, record: Mapping[str, Any]) -> Path:
    """Atomically, as finished.json: a reader never sees half of it."""
    path = Path(run_dir) / DIVERGED_MARKER
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(record)) + "\n")
    os.replace(tmp, path)
    return path


def read_divergence(run_dir: Path) -> dict[str, Any] | None:
    """The run's divergence record, or None when it has not diverged."""
    path = Path(run_dir) / DIVERGED_MARKER
    if not path.exists():
        return None
    return json.loads(path.read_text())


@dataclass(frozen=True)
class CollapseRule:
    """A step is collapse-like when its entropy is below `entropy_below` and its gradient
    norm at most `grad_norm_at_most` (0: exactly zero); `steps` such steps in a row are a
    collapse (`train.collapse_entropy`, `train.collapse_grad_norm`, `train.collapse_steps`)."""

    entropy_below: float = 1e-3
    grad_norm_at_most: float = 0.0
    steps: int = 3

    @classmethod
    def from_train_cfg(cls, train: Any) -> "CollapseRule":
        """The rule a run's `train` config (a3po.schema.TrainConfig) asks for; a null key is this
        class's default."""
        defaults = cls()

        def value(given: float | None, default: float) -> float:
            return default if given is None else given

        return cls(entropy_below=float(value(train.collapse_entropy, defaults.entropy_below)),
                   grad_norm_at_most=float(value(train.collapse_grad_norm, defaults.grad_norm_at_most)),
                   steps=int(value(train.collapse_steps, defaults.steps)))

    def matches(self, entropy: float | None, grad_norm: float | None) -> bool:
        """Both known and finite (a null in the log is not evidence of a collapse), and both low."""
        if entropy is None or grad_norm is None or not (math.isfinite(entropy) and math.isfinite(grad_norm)):
            return False
        return entropy < self.entropy_below and grad_norm <= self.grad_norm_at_most


class CollapseWatch:
    """Follows a run step by step; `update` gives the step's `health/*` metrics. The state is
    only the current streak, so a resumed run replays its log (`replay`) and flags exactly as
    an uninterrupted one."""

    def __init__(self, rule: CollapseRule) -> None:
        self.rule = rule
        self.streak_start: int | None = None  # first step of the current run of collapse-like steps
        self.last_step: int | None = None

    def update(self, step: int, entropy: float | None, grad_norm: float | None) -> dict[str, int]:
        consecutive = self.last_step is not None and step == self.last_step + 1
        self.last_step = step
        if not self.rule.matches(entropy, grad_norm):
            self.streak_start = None
        elif self.streak_start is None or not consecutive:
            self.streak_start = step
        if self.streak_start is None or step - self.streak_start + 1 < self.rule.steps:
            return {COLLAPSED: 0}
        return {COLLAPSED: 1, COLLAPSE_STEP: self.streak_start}

    def replay(self, records: Iterable[Mapping[str, Any]]) -> "CollapseWatch":
        """Feed the steps already logged (a resumed run's kept lines), in step order."""
        for record in sorted(records, key=lambda r: r.get("step", -1)):
            if isinstance(record.get("step"), int) and "actor/entropy" in record:
                self.update(record["step"], record.get("actor/entropy"), record.get("actor/grad_norm"))
        return self

