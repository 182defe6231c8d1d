"""The tidy frame every figure and table is computed from: its columns, one run's rows, and
the labels of runs from several experiments kept apart.

Each row is one (run, step, metric) with the run's identity beside it (`IDENTITY_COLUMNS`,
the fields of its identity record: see `analysis.runs`), the step's wall time, the value
and whether the run finished. The frame is long (one row per run, step and metric) rather
than wide because metrics differ between algorithms (eval steps, `prox_error/...` keys) and
a wide frame would be mostly holes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from analysis.runs import label

log = logging.getLogger("analysis.load")

# run, experiment: where the run is; label ... seed: its record's fields as drawn (see
# analysis.runs.run_identity); precision, schedule_name, correction_name: the record's
# own values, which colours and orders are decided from; label_prefix: the `<experiment>`
# that `disambiguate` put before the label, or "".
IDENTITY_COLUMNS = ["run", "experiment", "label", "variant", "algo", "schedule", "correction", "objective",
                    "runtime", "staleness", "max_staleness", "seed", "precision", "schedule_name", "correction_name",
                    "label_prefix"]
TIDY_COLUMNS = IDENTITY_COLUMNS + ["step", "wall_time", "metric", "value", "complete"]


def add_labels(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with every identity column. Frames from `load_runs`/`load_wandb` already
    carry them; a frame built by hand with only `algo`, `schedule` (schedule names) and
    `staleness` gets the label `<algo>[-<schedule>]` and the defaults (no correction, ppo,
    lagged, fp32)."""
    if set(IDENTITY_COLUMNS) <= set(df.columns):
        return df
    out = df.copy()
    if "label" not in out.columns:
        out["label"] = [label(a, s) for a, s in zip(out["algo"], out["schedule"])] if len(out) else []
    defaults = {"correction": "none", "objective": "ppo", "runtime": "lagged", "experiment": "", "precision": "fp32",
                "label_prefix": ""}
    for column, value in defaults.items():
        if column not in out.columns:
            out[column] = value
    for column, source in (("max_staleness", "staleness"), ("schedule_name", "schedule"),
                           ("correction_name", "correction")):
        if column not in out.columns:
            out[column] = out[source]
    if "variant" not in out.columns:
        out["variant"] = out["label"] + "-d" + out["staleness"].astype(str)
    return out


def disambiguate(df: pd.DataFrame) -> pd.DataFrame:
    """Prefix `<experiment>/` to the label of runs whose label, staleness and seed also occur
    in another experiment: two sweeps passed together may both hold `loglinear-d2-s0` made
    with different settings, and those must stay two curves, not two "seeds" of one. The
    prefix is also kept in `label_prefix`."""
    runs = df[["experiment", "label", "staleness", "seed"]].drop_duplicates()
    clashes = runs.groupby(["label", "staleness", "seed"])["experiment"].nunique()
    clashing = {(lab, d) for (lab, d, _), n in clashes.items() if n > 1}
    if not clashing:
        return df
    hit = [(lab, d) in clashing for lab, d in zip(df["label"], df["staleness"])]
    df = df.copy()
    for column in ("label", "variant"):
        df.loc[hit, column] = df.loc[hit, "experiment"] + "/" + df.loc[hit, column]
    df.loc[hit, "label_prefix"] = df.loc[hit, "experiment"]
    log.warning("runs of the same name in several experiments are kept apart by an "
                "<experiment>/ prefix: %s", ", ".join(sorted({lab for lab, _ in clashing})))
    return df


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def tidy_run(identity: Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One run's step records -> its rows of the tidy frame.

    A requeued job resumes from its last checkpoint and logs the steps after it again,
    so when a step appears twice the later record wins: it is the one the surviving
    weights actually took. Non-numeric values (strings, lists) have no place on a curve
    and are dropped.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        flat = _flatten(record)
        step = _numeric(flat.get("step"))
        if step is None or math.isnan(step):
            continue
        by_step[int(step)] = flat
    rows = []
    for step in sorted(by_step):
        flat = by_step[step]
        wall_time = _numeric(flat.get("wall_time"))
        wall_time = math.nan if wall_time is None else wall_time
        for metric, raw in flat.items():
            if metric in ("step", "wall_time"):
                continue
            value = _numeric(raw)
            if value is None or math.isnan(value):
                continue
            rows.append((step, wall_time, metric, value))
    frame = pd.DataFrame(rows, columns=["step", "wall_time", "metric", "value"])
    last_step = max(by_step) if by_step else -1
    total_steps = identity.get("total_steps")
    complete = total_steps is not None and last_step >= int(total_steps) - 1
    for key in IDENTITY_COLUMNS:
        frame[key] = identity[key]
    frame["complete"] = bool(complete)
    frame = frame.astype({"step": "int64", "wall_time": "float64", "value": "float64", "staleness": "int64",
                          "max_staleness": "int64", "seed": "int64", "complete": "bool"})
    return frame[TIDY_COLUMNS]
