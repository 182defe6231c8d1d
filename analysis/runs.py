"""Who a run is, for the analysis: its identity record, and the columns and order it is drawn in.

The record (a3po.identity) is the one source of every identity column: a run's
config.yaml (or its wandb config) holds it under `identity`, and a config written before the
record existed gets it built from its groups by the trainer's own function, so old and new
runs read alike. No name is ever read: not the run name, not the directory's.

The label is the record's (`loglinear-exponential0.5`, `recompute-icepop0.5_2`,
`loglinear-tis2-gspo`, `loglinear-bf16`): every parameter is in it, so only runs that differ
in nothing but the staleness and the seed share one, and are averaged over seeds. Async runs
are drawn as `<label> (async)`, never averaged with lagged ones.

Runs made before the `correction`, `objective` and `precision` keys read as `none`, `ppo` and
`fp32` (a3po.identity.LEGACY_VALUES).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pandas as pd

from a3po.maths.corrections import CORRECTIONS as CORRECTION_REGISTRY
from a3po.identity import (
    ASYNC,
    DEFAULT_CORRECTION,
    DEFAULT_OBJECTIVE,
    DEFAULT_SCHEDULE,  # also re-exported: the default the claims compare under
    RECORD_KEY,
    correction_group,
    group_label,
    identity_record,
    join_label,
    run_name,
    schedule_label,
)
from a3po.identity import LEGACY_VALUES

# Correction names (the trainer's registry) in the order the corrections figure draws them.
CORRECTIONS = list(CORRECTION_REGISTRY)

# Legend and table order: the baseline, the paper's method, the other interpolation, coupled;
# `metrics` names runs logged before it became the flag train.log_prox_errors.
ALGO_ORDER = ["recompute", "loglinear", "linear", "coupled", "metrics"]

ASYNC_SUFFIX = " (async)"
RECORD_FIELDS = ("method", "schedule", "correction", "objective", "runtime", "staleness", "precision", "seed", "label")


def lookup(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """Read `a.b` from a nested config, or from a flattened one (`a.b` or `a/b` keys),
    because wandb stores whatever shape the logger handed it."""
    for flat_key in (dotted, dotted.replace(".", "/")):
        if flat_key in config:
            return unwrap(config[flat_key])
    node: Any = config
    for part in dotted.split("."):
        node = unwrap(node)
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return unwrap(node)


def unwrap(value: Any) -> Any:
    """wandb's raw run config wraps each entry as {"value": ..., "desc": ...}."""
    if isinstance(value, Mapping) and set(value) <= {"value", "desc"} and "value" in value:
        return value["value"]
    return value


def _subtree(config: Mapping[str, Any], key: str) -> Any:
    """The value under `key` as plain nested data, whatever shape it was stored in: nested,
    value-wrapped, or flattened (`correction.name`, `identity/schedule/name` config keys);
    None when absent."""
    node = lookup(config, key)
    if isinstance(node, Mapping):
        return {k: _subtree(node, k) for k in node}
    if node is not None:
        return node
    flat = {k[len(key) + 1:]: v for k, v in config.items() if k.startswith((f"{key}.", f"{key}/"))}
    if not flat:
        return None
    return {k: _subtree(flat, k) for k in dict.fromkeys(re.split(r"[./]", k, maxsplit=1)[0] for k in flat)}


def record_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's identity record: the one its config holds, or, for a config written before
    the record existed, the one the trainer would have written, built from its groups."""
    stored = _subtree(config, RECORD_KEY)
    if isinstance(stored, Mapping) and set(RECORD_FIELDS) <= set(stored):
        return {**stored, "correction": correction_group(stored["correction"])}  # its keys may come back sorted
    return identity_record(_subtree(config, "algo") or "", _subtree(config, "schedule"),
                           _subtree(config, "correction"), _subtree(config, "objective"),
                           _subtree(config, "runtime"), lookup(config, "staleness"), lookup(config, "seed"),
                           lookup(config, "precision", LEGACY_VALUES["precision"]))


def _int_or(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _columns(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's fields as the frame's identity columns (analysis.frame.IDENTITY_COLUMNS)."""
    schedule, runtime = record["schedule"], record["runtime"]
    is_async = runtime["name"] == ASYNC
    # an async run is grouped by its bound, which is what the async runtime obeys
    staleness = _int_or(runtime.get("max_staleness") if is_async else None, _int_or(record["staleness"], -1))
    suffix = ASYNC_SUFFIX if is_async else ""
    return {
        "label": record["label"] + suffix,
        "variant": f"{record['label']}-d{staleness}{suffix}",
        "algo": record["method"],
        "schedule": schedule_label(schedule) if schedule else "",
        "correction": group_label(record["correction"], DEFAULT_CORRECTION),
        "objective": group_label(record["objective"], DEFAULT_OBJECTIVE),
        "runtime": runtime["name"],
        "staleness": staleness,
        "max_staleness": staleness,
        "seed": _int_or(record["seed"], -1),
        "precision": record["precision"],
        "schedule_name": schedule["name"] if schedule else "",
        "correction_name": record["correction"]["name"],
        "label_prefix": "",
    }


def run_identity(config: Mapping[str, Any], fallback_experiment: str = "") -> dict:
    """Everything that tells one run from another, from its config's identity record.

    `label` groups runs over seeds and names curves; `variant` is the label plus the
    staleness. Async runs carry " (async)" in both, and their `staleness` is the bound
    `runtime.max_staleness`. `max_staleness` is the D whose first D steps are ramp-up: the
    exact staleness of a lagged run, the bound of an async one (the same number as
    `staleness`, kept under its own name for the steady-state filter). `run` is the config's
    `run_name` (a custom one included), else the record's; `label_prefix` is empty until
    `analysis.load.disambiguate` sets it.
    """
    record = record_of(config)
    total_steps = lookup(config, "train.total_steps")
    return {
        "run": str(lookup(config, "run_name") or run_name(record)),
        "experiment": str(lookup(config, "experiment_name") or fallback_experiment),
        **_columns(record),
        "total_steps": _int_or(total_steps, -1) if total_steps is not None else None,
    }


def label(algo: str, schedule: str | None = None, correction: str | None = None,
          objective: str | None = None, precision: str | None = None) -> str:
    """The label of a run with these column values (schedule, correction and objective as
    their labels: `exponential0.5`, `tis2`), as the record would give it."""
    return join_label(str(algo), schedule or None, correction or DEFAULT_CORRECTION,
                      objective or DEFAULT_OBJECTIVE, precision or LEGACY_VALUES["precision"])


def natural_key(text: str) -> tuple:
    """`tis2` before `tis10`: numbers inside labels compare as numbers."""
    return tuple((0, float(part)) if re.fullmatch(r"\d+(?:\.\d+)?", part) else (1, part)
                 for part in re.split(r"(\d+(?:\.\d+)?)", text) if part)


def _column(frame: pd.DataFrame, name: str, default: Any) -> pd.Series:
    return frame[name] if name in frame.columns else pd.Series(default, index=frame.index)


def label_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per label of `frame` (columns label, algo, schedule_name, label_prefix; a
    hand-made frame without the last two reads as its `schedule` and no prefix), in table
    and legend order: known algorithms in ALGO_ORDER (recompute, loglinear, linear,
    coupled), the plain label of each right before its variants, unknown algorithms last,
    and the labels an `<experiment>/` prefix keeps apart grouped by experiment first."""
    rows = pd.DataFrame({"label": frame["label"], "algo": frame["algo"],
                         "schedule_name": _column(frame, "schedule_name", None).fillna(_column(frame, "schedule", "")),
                         "label_prefix": _column(frame, "label_prefix", "")}).drop_duplicates("label")

    def key(row) -> tuple:
        rank = ALGO_ORDER.index(row.algo) if row.algo in ALGO_ORDER else len(ALGO_ORDER)
        plain = row.label == (f"{row.label_prefix}/{row.algo}" if row.label_prefix else row.algo)
        # within one prefix the prefixed labels compare as their bare parts do
        return (row.label_prefix, rank, not plain, natural_key(row.label))

    order = sorted(range(len(rows)), key=lambda i: key(rows.iloc[i]))
    return rows.iloc[order].reset_index(drop=True)


def label_order(frame: pd.DataFrame) -> list[str]:
    """The labels of `frame` in table and legend order (`label_rows`)."""
    return list(label_rows(frame)["label"])


def correction_order(frame: pd.DataFrame) -> list[str]:
    """The corrections figure's x order of `frame`'s correction labels, by the correction's
    name: none, tis, icepop, seq_tis, seq_mis, m2po, others; parameters in natural order."""
    names = _column(frame, "correction_name", None).fillna(frame["correction"])
    pairs = set(zip(frame["correction"], names))

    def key(pair) -> tuple:
        correction, name = pair
        return (CORRECTIONS.index(name) if name in CORRECTIONS else len(CORRECTIONS), natural_key(correction))

    return [correction for correction, _ in sorted(pairs, key=key)]


def schedule_arm(row: pd.Series) -> str | None:
    """A run's arm in the paper's setup (lagged, no correction, ppo): `recompute`, the loglinear
    schedule's label (`inverse`, `exponential0.5`; runs logged before the record have none and
    ran `inverse`), or `behave` for coupled (its anchor is the behaviour policy, bit for bit);
    None for any other run."""
    if row["runtime"] != "lagged" or row["correction"] != "none" or row["objective"] != "ppo":
        return None
    if row["algo"] == "recompute":
        return "recompute"
    if row["algo"] == "coupled":
        return "behave"
    if row["algo"] == "loglinear":
        return row["schedule"] or DEFAULT_SCHEDULE
    return None
