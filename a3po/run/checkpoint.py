"""`checkpoints/last.pt`: everything a run needs to continue as if it had never stopped.

Written at step boundaries only (periodically, at exit and on a preemption signal): in the
middle of a step the weights are half-updated, and a checkpoint of that would not resume to
the same numbers. Written to a temporary file and renamed, so a kill mid-write leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / "last.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    path = checkpoint_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run's resume state, or None. A file that cannot be read (a copy cut short, a full
    disk) is a ConfigError naming it and the choice, not torch's zip-reader traceback."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    try:
        # Our own file: it holds the runtime's queued batches (dataclasses), not only tensors.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... by damage
        from a3po.errors import ConfigError

        raise ConfigError(
            f"the checkpoint {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "delete it to restart this run from step 0, or restore it from a copy"
        ) from None


def remove_checkpoint(run_dir: Path) -> None:
    """A finished run needs no resume state: model + AdamW moments are ~12 bytes a parameter."""
    path = checkpoint_path(run_dir)
    path.unlink(missing_ok=True)
    path.with_suffix(".pt.tmp").unlink(missing_ok=True)
    if path.parent.exists() and not any(path.parent.iterdir()):
        path.parent.rmdir()
