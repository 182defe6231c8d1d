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
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def wandb_run_id(experiment_name: str, run_name: str) -> str:
    """Derived from the run identity, so a requeued or re-launched job continues the same run."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{experiment_name}-{run_name}")[:128]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping an incomplete line in %s", path)
    return records


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: DictConfig, start_step: int, pending: dict[str, Any] | None = None) -> None:
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
                config=OmegaConf.to_container(cfg, resolve=True),
            )

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=int(record["step"]))

    def close(self, exit_code: int = 0) -> None:
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
