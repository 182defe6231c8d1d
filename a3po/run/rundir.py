"""A run directory means one config.

The directory of a run is Hydra's output directory for its job (`hydra.run.dir`, or
`hydra.sweep.dir`/`hydra.sweep.subdir` in a sweep); its default name is `run_name`, a function
of the run's identity record (a3po.identity: `<label>-d<staleness>-s<seed>`), with no
timestamp, so a requeued job finds its run again. Starting a run in a directory that holds a
run of a different config would either mislabel the old results (a finished run) or resume
its checkpoint under the new config (an unfinished one), so `claim_run_dir` refuses, naming
every differing key, unless `on_config_change=restart` asks to start afresh.

A run directory also has one writer at a time: `claim_run_dir` first takes an advisory lock
on `<run_dir>/.lock` (a3po.run.lock), before it compares or writes `config.yaml` and before
the caller reads a checkpoint, so a second process started for the same run (a double
launch, a requeued job whose first instance still runs) stops at start naming the holder,
and never deletes (`on_config_change=restart`), resumes or appends to a live run.

A finished run keeps `config.yaml`, `metrics.jsonl` and a small completion marker
(`finished.json`); its resume checkpoint is removed unless `train.keep_checkpoint=true`.

A run refused at start (a ConfigError: a bad value, the memory check) leaves no directory:
Hydra creates the job's directory, its `.hydra/` and the job's log before a3po runs, and
`remove_refused_job_dir` takes them away again where that is all the directory holds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import yaml
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.identity import DERIVED_KEYS, EXTENSIBLE_KEY, LEGACY_VALUES, MOVED_KEYS, RESULT_NEUTRAL_KEYS
from a3po.run.lock import lock_run_dir, release_run_dir
from a3po.schema import as_plain

log = logging.getLogger(__name__)

FINISHED_MARKER = "finished.json"
# What Hydra writes into a job's directory before the job runs (hydra.output_subdir).
HYDRA_SUBDIR, HYDRA_FILES = ".hydra", frozenset({"config.yaml", "hydra.yaml", "overrides.yaml"})


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _neutral(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in RESULT_NEUTRAL_KEYS + DERIVED_KEYS)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key that changes results (DERIVED_KEYS are none); a
    missing key shows as `<absent>`, and is no difference where the other side is null (a key added
    since, at its null default). Growing `train.total_steps` is not a difference; shrinking it is."""
    old_flat, new_flat = flatten(old), flatten(new)
    diffs = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if _neutral(key) or (key in MOVED_KEYS and key not in new_flat):
            continue
        before, after = old_flat.get(key, LEGACY_VALUES.get(key, "<absent>")), new_flat.get(key, "<absent>")
        if before == after or (before, after) in (("<absent>", None), (None, "<absent>")):
            continue  # a key added since the run started, at its null default, changes nothing
        if key == EXTENSIBLE_KEY and isinstance(before, int) and isinstance(after, int) and after > before:
            continue
        diffs.append((key, before, after))
    return diffs


def _conflict_message(run_dir: Path, diffs: list[tuple[str, Any, Any]]) -> str:
    lines = "\n".join(f"  {key}: {before!r} in the existing run, {after!r} now" for key, before, after in diffs)
    return (
        f"the run directory {run_dir} holds a run with a different config:\n{lines}\n"
        "A run directory means one config. Either write this run elsewhere (another experiment_name=, "
        "output_root=, or hydra.run.dir/hydra.sweep.dir), or start this directory afresh with "
        "on_config_change=restart (this deletes the old run's metrics and checkpoint)."
    )


def clear_run(run_dir: Path) -> None:
    """Delete what a run wrote (not the directory itself: Hydra keeps its .hydra/ there)."""
    for name in ("metrics.jsonl", FINISHED_MARKER, "config.yaml", "diverged.json"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("checkpoints", "wandb", "final_model"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def claim_run_dir(run_dir: Path, config: Mapping[str, Any]) -> None:
    """Lock `run_dir` for this process, check that it is empty or holds the run of `config` (the
    resolved config as plain Python: a3po.run_config.RunConfig.resolved), then write config.yaml.

    The lock comes first (`lock_run_dir`): a directory in use by another process raises
    ConfigError naming that process before anything is compared, deleted or written. Then a
    ConfigError names each differing key (both values) and the ways out; with
    `on_config_change=restart` the old run is deleted instead. Writes atomically. On a
    ConfigError the lock is given back. The lock is otherwise held until
    `release_run_dir(run_dir)` or the end of the process.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir)
    try:
        _check_and_write_config(run_dir, config)
    except ConfigError:
        release_run_dir(run_dir)
        raise


def _check_and_write_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    new = as_plain(config)
    path = run_dir / "config.yaml"
    if path.exists():
        old = yaml.safe_load(path.read_text()) or {}
        diffs = config_differences(old, new)
        if diffs and new.get("on_config_change", "error") == "restart":  # a record, not the run's config
            log.warning("on_config_change=restart: deleting the run in %s (%d keys differ)", run_dir, len(diffs))
            clear_run(run_dir)
        elif diffs:
            raise ConfigError(_conflict_message(run_dir, diffs))
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(new))  # OmegaConf's YAML, as every earlier config.yaml was written
    os.replace(tmp, path)


def finished_steps(run_dir: Path) -> int | None:
    """The step count a run finished with, or None if it has not finished."""
    path = Path(run_dir) / FINISHED_MARKER
    if not path.exists():
        return None
    return int(json.loads(path.read_text())["steps"])


def mark_finished(run_dir: Path, steps: int, wall_time: float) -> None:
    path = Path(run_dir) / FINISHED_MARKER
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"steps": steps, "wall_time": wall_time}) + "\n")
    os.replace(tmp, path)


def holds_only_hydra_output(run_dir: Path, job_log: str) -> bool:
    """Whether `run_dir` holds nothing but what Hydra wrote for a job before it ran: `.hydra/`
    with its three files, and the job's log (`<job name>.log`). A run's own files (config.yaml,
    .lock, metrics.jsonl, checkpoints/) or anything else a person put there say no."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    for entry in run_dir.iterdir():
        if entry.name == job_log and entry.is_file() and not entry.is_symlink():
            continue
        if entry.name == HYDRA_SUBDIR and entry.is_dir() and not entry.is_symlink() \
                and all(f.name in HYDRA_FILES and f.is_file() and not f.is_symlink() for f in entry.iterdir()):
            continue
        return False
    return True


def _close_log_files_in(directory: Path) -> None:
    """Close and detach the logging handlers writing into `directory` (Hydra's job log)."""
    for logger in [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]:
        for handler in list(getattr(logger, "handlers", [])):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == directory:
                handler.close()
                logger.removeHandler(handler)


def remove_refused_job_dir(run_dir: Path, job_log: str, stop_at: Path | None = None) -> bool:
    """After a run was refused at start (a ConfigError), remove the job directory Hydra made for
    it, where it holds only Hydra's own files (`holds_only_hydra_output`): a directory with a
    run's files in it (an existing run, another process's claim) is never touched. Then remove
    its parents that are left empty, up to `stop_at` (output_root; exclusive), where the
    directory lies under it. Returns whether the job directory was removed."""
    run_dir = Path(run_dir).resolve()
    if not holds_only_hydra_output(run_dir, job_log):
        return False
    _close_log_files_in(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    if stop_at is not None:
        stop_at = Path(stop_at).resolve()
        parent = run_dir.parent
        while stop_at in parent.parents:
            try:
                parent.rmdir()  # only an empty one: another job's directory keeps it
            except OSError:
                break
            parent = parent.parent
    return not run_dir.exists()
