"""metrics.jsonl (always) and wandb (offline by default) with one vocabulary of names.

The jsonl file is the source of truth for analysis/: one complete JSON object per line,
flushed every step. On resume it is cut back to the steps before the checkpoint, so a run
that died between logging a step and checkpointing it has no duplicate and no gap.
"""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

from a3po.run_config import RunConfig

log = logging.getLogger(__name__)


def wandb_run_id(experiment_name: str, run_name: str) -> str:
    """Derived from the run identity, so a requeued or re-launched job continues the same run."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{experiment_name}-{run_name}")[:128]


class SkippedMetricsWarning(UserWarning):
    """Logged metrics that could not be read (a truncated line, a run with no metrics) were skipped."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl ([] when there is none yet). A line that does not
    parse (a run killed mid-write leaves a truncated last line) is skipped with a warning
    naming the file and line."""
    records: list[dict[str, Any]] = []
    if not Path(path).is_file():
        return records
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                warnings.warn(f"{path}:{line_number}: skipped an unparsable line ({error.msg})",
                              SkippedMetricsWarning, stacklevel=2)
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                warnings.warn(f"{path}:{line_number}: skipped a line that is not a JSON object",
                              SkippedMetricsWarning, stacklevel=2)
    return records


def jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every non-finite float as JSON null (NaN and +-Inf are not JSON), with
    a warning naming the keys: a null in the log is a value that was not a number."""
    bad = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if bad:
        log.warning("step %s: non-finite values logged as null: %s", record.get("step"),
                    ", ".join(f"{key}={record[key]}" for key in bad))
    return {key: (None if key in bad else value) for key, value in record.items()}


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: RunConfig, start_step: int, pending: dict[str, Any] | None = None) -> None:
        """Keeps the lines of steps before `start_step`. `pending` is the record the resume
        checkpoint carries (the step it was written after): a run that died between writing
        the checkpoint and logging that step gets the line back, with its checkpoint time
        unknown (null)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", math.inf) < start_step]
        if pending is not None and pending.get("step") == start_step - 1 and not any(r.get("step") == start_step - 1 for r in kept):
            kept.append({**pending, "time/checkpoint": None})
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        if cfg.logger.mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode,
                id=wandb_run_id(cfg.experiment_name, cfg.run_name), name=cfg.run_name,
                group=cfg.experiment_name, resume="allow", dir=str(run_dir),
                config=dict(cfg.resolved),
            )

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=int(record["step"]))

    def close(self, exit_code: int = 0) -> None:
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
