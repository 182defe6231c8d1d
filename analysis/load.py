"""Runs (local run directories or wandb) -> one tidy long DataFrame (`analysis.frame`).

Each row is one (run, step, metric) with the run's identity beside it (`IDENTITY_COLUMNS`,
read from its identity record: `analysis.runs`; never from its name), the step's wall
time, the value and whether the run finished. Every figure and table in `analysis` is
computed from this one frame, so a figure can be regenerated from any mix of sources and the
CSV beside it is always traceable back to the rows here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

# One reader for metrics.jsonl (the trainer's); a run or line that cannot be used is skipped
# with a RunSkippedWarning naming it.
from a3po.run.metrics_log import SkippedMetricsWarning as RunSkippedWarning
from a3po.run.metrics_log import read_metrics

from analysis.frame import IDENTITY_COLUMNS, TIDY_COLUMNS, add_labels, disambiguate, tidy_run  # noqa: F401
from analysis.logs import is_archive, unpacked
from analysis.runs import label, run_identity  # noqa: F401  (re-exported: the loader's public names)

log = logging.getLogger(__name__)


class NoRunsError(FileNotFoundError):
    """Nothing to analyse: raised instead of returning an empty frame, because every
    downstream figure would silently come out blank."""


class UnusableRun(Exception):
    """Why a run directory cannot contribute (its config.yaml or metrics.jsonl cannot be
    read, or it has no step yet), in one line. The loaders turn it into a RunSkippedWarning
    naming the directory, and `load_runs` records it in `df.attrs["skipped"]`."""


def _one_line(error: BaseException) -> str:
    """An exception as `Type: message` on one line (parsers' messages span several)."""
    mark = getattr(error, "problem_mark", None)  # a YAML error: where in the file, and what
    if mark is not None and getattr(error, "problem", None):
        return f"{type(error).__name__}: {error.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _warn_skipped(run_dir: Path, reason: str) -> None:
    warnings.warn(f"{run_dir}: skipped, {reason}", RunSkippedWarning, stacklevel=3)


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Directories holding a config.yaml, searched recursively below each path; a path may
    also be a log archive (`analysis.logs`), read from its extracted copy.

    Hydra also writes `.hydra/config.yaml` inside every run dir; hidden directories
    (and wandb's and the checkpoints' folders) are never runs.
    """
    found: dict[Path, None] = {}
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            warnings.warn(f"{root}: no such path", RunSkippedWarning, stacklevel=2)
            continue
        if is_archive(root):
            try:
                root = unpacked(root)
            except ValueError as error:
                warnings.warn(str(error), RunSkippedWarning, stacklevel=2)
                continue
        if root.is_file():
            root = root.parent
        candidates = [root / "config.yaml", *sorted(root.rglob("config.yaml"))]
        for config_path in candidates:
            if not config_path.is_file():
                continue
            relative = config_path.parent.relative_to(root).parts
            if any(part.startswith(".") or part in ("wandb", "checkpoints") for part in relative):
                continue
            found[config_path.parent.resolve()] = None
    return list(found)


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as a dict ({} when empty). Raises UnusableRun saying why when
    the file cannot be read or parsed, or holds something other than a mapping."""
    try:
        with open(run_dir / "config.yaml", encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise UnusableRun(f"config.yaml is not valid YAML ({_one_line(error)})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UnusableRun(f"config.yaml cannot be read ({_one_line(error)})") from None
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise UnusableRun(f"config.yaml holds a {type(config).__name__}, not a mapping of settings")
    return dict(config)


def load_configs(paths: str | Path | Iterable[str | Path]) -> dict[tuple[str, str], dict[str, Any]]:
    """(experiment, run) -> the resolved config of every run directory below `paths`,
    including runs without metrics; the report reads the settings that matter from here.
    A config that cannot be read is left out with a RunSkippedWarning."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    configs = {}
    for run_dir in find_run_dirs(list(paths)):
        try:
            config = read_config(run_dir)
        except UnusableRun as reason:
            _warn_skipped(run_dir, str(reason))
            continue
        identity = run_identity(config, fallback_experiment=run_dir.parent.name)
        configs[(identity["experiment"], identity["run"])] = config
    return configs


def _run_frame(run_dir: Path) -> pd.DataFrame:
    """One run directory's rows; raises UnusableRun when it has none to contribute."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file() or metrics_path.stat().st_size == 0:
        raise UnusableRun("no metrics.jsonl (or it is empty)")
    config = read_config(run_dir)
    identity = run_identity(config, fallback_experiment=run_dir.parent.name)
    try:
        records = read_metrics(metrics_path)
    except (OSError, UnicodeDecodeError) as error:
        raise UnusableRun(f"metrics.jsonl cannot be read ({_one_line(error)})") from None
    if not records:
        raise UnusableRun("metrics.jsonl holds no readable step")
    frame = tidy_run(identity, records)
    if len(frame) and not frame["complete"].iloc[0]:
        log.info("%s: incomplete, last step %d of %s", identity["run"], frame["step"].max(),
                 identity["total_steps"])
    return frame


def _concat(frames: list[pd.DataFrame], where: str, n_skipped: int = 0) -> pd.DataFrame:
    frames = [frame for frame in frames if frame is not None and not frame.empty]
    if not frames:
        skipped = f"; {n_skipped} run directories were skipped (see the warnings)" if n_skipped else ""
        raise NoRunsError(
            f"no runs found in {where}: expected run directories holding config.yaml and a "
            f"non-empty metrics.jsonl (outputs/<experiment>/<run_name>/){skipped}")
    df = disambiguate(pd.concat(frames, ignore_index=True))
    return df.sort_values(["experiment", "run", "metric", "step"], kind="stable").reset_index(drop=True)


def load_runs(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """The tidy frame of every run below `paths` (sweep dirs, run dirs, or any parent).

    A run directory that cannot contribute (no metrics yet, a config.yaml or metrics.jsonl
    that cannot be read) is skipped with a RunSkippedWarning naming it and why, and listed in
    `df.attrs["skipped"]` as `(run directory, reason)` pairs: the one record of what was left
    out, which the report's provenance states. Raises NoRunsError when nothing usable is
    found, so a typo in a path fails loudly instead of producing empty figures.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    frames, skipped = [], []
    for run_dir in find_run_dirs(paths):
        try:
            frames.append(_run_frame(run_dir))
        except UnusableRun as reason:
            _warn_skipped(run_dir, str(reason))
            skipped.append((str(run_dir), str(reason)))
    df = _concat(frames, ", ".join(str(p) for p in paths) or "(no path given)", len(skipped))
    df.attrs["skipped"] = skipped
    return df


def load_wandb(project: str, entity: str | None = None, api: Any = None) -> pd.DataFrame:
    """The tidy frame of every run in a wandb project, the same shape as `load_runs`.

    The trainer logs `step` and `wall_time` as metrics; wandb's own `_step` and
    `_runtime` stand in for runs logged without them. The full history is scanned (not
    `history()`, which samples) so the CSVs match the local metrics.jsonl exactly.
    """
    if api is None:
        import wandb

        api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    frames = []
    for run in api.runs(path):
        config = dict(run.config or {})
        identity = run_identity(config, fallback_experiment=project)
        records = []
        for row in run.scan_history():
            record = {key: value for key, value in row.items() if not key.startswith("_")}
            if record.get("step") is None and row.get("_step") is not None:
                record["step"] = row["_step"]
            if record.get("wall_time") is None and row.get("_runtime") is not None:
                record["wall_time"] = row["_runtime"]
            records.append(record)
        if not records:
            warnings.warn(f"wandb run {path}/{run.name}: skipped, no history", RunSkippedWarning,
                          stacklevel=2)
            continue
        frames.append(tidy_run(identity, records))
    return _concat(frames, f"wandb project {path}")
