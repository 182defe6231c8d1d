"""Who a run is: its identity read from its resolved config, and the label it is drawn under.

The config (`config.yaml`, or a wandb run's config) is the source of truth for every field:
algo, schedule, correction, objective, runtime, staleness, seed. The display label is the
run name without its `-d<staleness>-s<seed>` tail, because the trainer builds the run name
from the config with every parameter in it (`loglinear-exponential0.5`,
`recompute-icepop0.5_2`, `loglinear-tis2-gspo`): two runs that differ in any parameter get
two labels (two curves), and only runs that differ in nothing but the seed share one and are
averaged. A run name that does not end in `-d<staleness>-s<seed>` (a custom `run_name`)
gets a label built from the config fields instead.

Runs made before the `correction` and `objective` groups existed read as `none` and `ppo`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from a3po.maths.proximal import ALGOS
from a3po.maths.corrections import CORRECTIONS as CORRECTION_REGISTRY

# The defaults that labels leave out, so the paper's method reads as plain `loglinear`.
DEFAULT_SCHEDULE = "inverse"
DEFAULT_CORRECTION = "none"
DEFAULT_OBJECTIVE = "ppo"
DEFAULT_RUNTIME = "lagged"

# Correction names (the trainer's registry) in the order the corrections figure draws them.
CORRECTIONS = list(CORRECTION_REGISTRY)

# Legend and table order: the baseline, the paper's method, the other interpolation, coupled;
# `metrics` names runs logged before it became the flag train.log_prox_errors.
ALGO_ORDER = ["recompute", "loglinear", "linear", "coupled", "metrics"]

# Algorithms whose proximal policy depends on the schedule: the trainer's registry.
SCHEDULE_ALGOS = {name for name, algo in ALGOS.items() if algo.uses_schedule}

ASYNC_SUFFIX = " (async)"


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


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"true", "1", "yes"}
    return bool(value)


def _group(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A config group as a dict (`name` plus parameters), whatever shape it was stored in:
    nested, flattened (`correction.name`, `correction.low`), or a bare name string."""
    node = lookup(config, key)
    if isinstance(node, Mapping):
        return {k: unwrap(v) for k, v in node.items()}
    if isinstance(node, str):
        return {"name": node}
    prefixes = (f"{key}.", f"{key}/")
    return {k[len(key) + 1:]: unwrap(v) for k, v in config.items() if k.startswith(prefixes)}


def _params(group: Mapping[str, Any], joiner: str) -> str:
    """The numeric parameters of a group, in config order, formatted like the trainer's run
    names (`%g`): `{name: icepop, low: 0.5, high: 2}` -> `0.5_2`."""
    values = [f"{float(v):g}" for k, v in group.items()
              if k != "name" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return joiner.join(values)


def group_label(config: Mapping[str, Any], key: str, default: str, joiner: str = "_") -> str:
    """`<name><params>` of a config group, or `default` when the group is absent."""
    group = _group(config, key)
    name = str(group.get("name") or default)
    if name == default:
        return default
    return f"{name}{_params(group, joiner)}"


def _segment(segments: list[str], name: str) -> str | None:
    """The run-name segment that spells a group with its parameters (`icepop0.5_2` for
    `icepop`), searched from the right because corrections and objectives come last."""
    for segment in reversed(segments):
        if segment == name or (segment.startswith(name) and not segment[len(name)].isalpha()):
            return segment
    return None


def _strip_tail(run: str, staleness: Any, seed: Any) -> str | None:
    """The label part of a trainer-made run name (before `-d<D>-s<seed>`), or None for a
    custom name or one whose d and seed disagree with the config."""
    match = re.fullmatch(r"(?P<label>.+)-d(?P<d>\d+)-s(?P<s>\d+)", run)
    if not match:
        return None
    if staleness is not None and int(match["d"]) != int(staleness):
        return None
    if seed is not None and int(match["s"]) != int(seed):
        return None
    return match["label"]


def _fields(config: Mapping[str, Any], run: str) -> dict[str, str]:
    """algo, schedule, correction and objective labels; each with its parameters, taken from
    the run name's segment when the name has one (what the user sees in the directory) and
    from the config otherwise."""
    algo = str(lookup(config, "algo.name") or run.split("-", 1)[0])
    # the registry decides; configs written before it carried `algo.uses_schedule`
    uses_schedule = lookup(config, "algo.uses_schedule")
    uses_schedule = algo in SCHEDULE_ALGOS if uses_schedule is None or algo in ALGOS else _as_bool(uses_schedule)
    schedule = group_label(config, "schedule", "", joiner="") if uses_schedule else ""
    correction = group_label(config, "correction", DEFAULT_CORRECTION)
    objective = group_label(config, "objective", DEFAULT_OBJECTIVE)
    segments = run.split("-")[1:]
    if correction != DEFAULT_CORRECTION:
        correction = _segment(segments, str(_group(config, "correction")["name"])) or correction
    if objective != DEFAULT_OBJECTIVE:
        objective = _segment(segments, str(_group(config, "objective")["name"])) or objective
    if uses_schedule and not schedule:
        schedule = DEFAULT_SCHEDULE
    return {"algo": algo, "schedule": schedule, "correction": correction, "objective": objective}


def built_label(fields: Mapping[str, str]) -> str:
    """`<algo>[-<schedule>][-<correction>][-<objective>]`, defaults left out, like the
    trainer's run names; used when a run name does not follow that pattern."""
    parts = [fields["algo"]]
    if fields["schedule"] and fields["schedule"] != DEFAULT_SCHEDULE:
        parts.append(fields["schedule"])
    if fields["correction"] != DEFAULT_CORRECTION:
        parts.append(fields["correction"])
    if fields["objective"] != DEFAULT_OBJECTIVE:
        parts.append(fields["objective"])
    return "-".join(parts)


def _int_or(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def run_identity(config: Mapping[str, Any], fallback_name: str, fallback_experiment: str = "") -> dict:
    """Everything that tells one run from another, from its config.

    `label` groups runs over seeds and names curves; `variant` is the label plus the
    staleness (the run name without `-s<seed>`). Async runs carry " (async)" in both, so an
    async run is never averaged with a lagged one, and their `staleness` is the bound
    `runtime.max_staleness`. `max_staleness` is the D whose first D steps are ramp-up: the
    exact staleness of a lagged run, the bound of an async one (the same number as
    `staleness`, kept under its own name for the steady-state filter).
    """
    run = str(lookup(config, "run_name") or fallback_name)
    named = re.fullmatch(r".+-d(\d+)-s(\d+)", run)
    staleness = lookup(config, "staleness", named[1] if named else None)
    seed = lookup(config, "seed", named[2] if named else None)
    tail = _strip_tail(run, staleness, seed)
    fields = _fields(config, run)
    runtime = str(lookup(config, "runtime.name") or DEFAULT_RUNTIME)
    staleness = _int_or(staleness, -1)
    label = tail or built_label(fields)
    if runtime == "async":
        # grouped by the bound, which is what the async runtime obeys; it follows the
        # top-level staleness unless overridden, and then the run name's d is not the bound
        staleness = _int_or(lookup(config, "runtime.max_staleness"), staleness)
        label += ASYNC_SUFFIX
    variant = f"{label.removesuffix(ASYNC_SUFFIX)}-d{staleness}" + (ASYNC_SUFFIX if runtime == "async" else "")
    max_staleness = staleness
    total_steps = lookup(config, "train.total_steps")
    return {
        "run": run,
        "experiment": str(lookup(config, "experiment_name") or fallback_experiment),
        "label": label,
        "variant": variant,
        **fields,
        "runtime": runtime,
        "staleness": staleness,
        "max_staleness": max_staleness,
        "seed": _int_or(seed, -1),
        "total_steps": _int_or(total_steps, -1) if total_steps is not None else None,
    }


def label(algo: str, schedule: str | None = None, correction: str | None = None,
          objective: str | None = None) -> str:
    """The label of a run with these fields, as `run_identity` would give it."""
    return built_label({"algo": str(algo), "schedule": schedule or "",
                        "correction": correction or DEFAULT_CORRECTION,
                        "objective": objective or DEFAULT_OBJECTIVE})


def base_algo(name: str) -> str:
    """The algorithm a label starts with (after an `<experiment>/` prefix, if any)."""
    name = name.rsplit("/", 1)[-1]
    return name.split("-", 1)[0].split(" ", 1)[0]


def natural_key(text: str) -> tuple:
    """`tis2` before `tis10`: numbers inside labels compare as numbers."""
    return tuple((0, float(part)) if re.fullmatch(r"\d+(?:\.\d+)?", part) else (1, part)
                 for part in re.split(r"(\d+(?:\.\d+)?)", text) if part)


def label_sort_key(name: str) -> tuple:
    """Known algorithms in a fixed order (recompute, loglinear, linear, coupled), each
    plain label right before its variants, unknown labels last; a sweep's tables and
    legends line up with every other sweep's."""
    prefix, _, bare = name.rpartition("/")
    algo = base_algo(bare)
    rank = ALGO_ORDER.index(algo) if algo in ALGO_ORDER else len(ALGO_ORDER)
    return (prefix, rank, bare != algo, natural_key(bare))


def correction_sort_key(correction: str) -> tuple:
    """The corrections figure's x order: none, tis, icepop, seq_tis, seq_mis, m2po, others."""
    names = sorted((n for n in CORRECTIONS if correction.startswith(n)), key=len, reverse=True)
    rank = CORRECTIONS.index(names[0]) if names else len(CORRECTIONS)
    return (rank, natural_key(correction))
