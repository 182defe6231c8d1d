"""Who a run is, as data: one identity record per run, and its name as a function of it.

The record is a plain mapping, built from the config's groups by the `a3po_identity`
resolver (conf/config.yaml's `identity:` key), so it is written once, resolved, into the run's
config.yaml and the wandb config with the rest of the config:

    method:     loglinear                        # algo.name
    method_params: {every: 4, min_ess: null}     # only for a method whose spec has parameters (hybrid)
    schedule:   {name: exponential, gamma: 0.5}  # null where the method uses none (a3po.maths.proximal)
    correction: {name: icepop, lo: 0.5, hi: 2.0}
    objective:  {name: gspo, eps_clip: 0.0003, eps_clip_higher: 0.0004}
    runtime:    {name: async, max_staleness: 2, interruptible: true}  # {name: lagged}
    staleness:  2                                # the top-level `staleness`
    precision:  fp32                             # resolved: never `auto`
    seed:       0
    label:      loglinear-exponential0.5-icepop0.5_2-gspo0.0003_0.0004

Each group keeps its parameters as configured (the correction's in its registry's order,
the runtime's result-neutral ones left out: `RESULT_NEUTRAL_KEYS`, below). `label` is
`<method>[-<schedule>][-<correction>][-<objective>][-<precision>]`: each part its name and
numeric parameters (`%g`; a method's only where its spec has some: `hybrid4`), the defaults (`inverse`, `none`, `ppo`, `fp32`) left out, the
runtime never in it. `run_name` is `<label>-d<staleness>-s<seed>`. The analysis (analysis.runs) reads the record, or
builds it from an older config.yaml with `identity_record`; nothing reads a name back.
"""

from __future__ import annotations

from typing import Any, Mapping

from omegaconf import OmegaConf

from a3po.schema import as_plain
from a3po.device import RESOLVED_PRECISIONS, resolve_device, resolve_precision
from a3po.errors import ConfigError
from a3po.maths.corrections import CORRECTIONS
from a3po.maths.proximal import ALGOS
from a3po.maths.schedules import SCHEDULES

# Keys whose value does not change a run's results, so a run may be resumed or re-entered
# with a different value: where it logs, how often it checkpoints, how far this invocation
# goes, what is kept at the end, and what happens on a conflict. `train.total_steps` may grow
# (extending a run); any other difference is a different run.
RESULT_NEUTRAL_KEYS = (
    "logger",
    "output_root",
    "on_config_change",
    "memory_check",  # whether a run that may not fit starts; a run that starts computes the same
    "memory_check_wait_min",  # how long it waits for memory first
    "train.max_steps_this_run",
    "train.checkpoint_every",
    "train.keep_checkpoint",
    "train.save_final_model",
    "train.warmup",
    "train.activation_checkpointing",  # the same forward, run again in backward
    "train.collapse_entropy",  # the collapse rule flags runs; it changes no number a run computes
    "train.collapse_grad_norm",
    "train.collapse_steps",
    "runtime.shutdown_timeout_s",
    "train.collective_timeout_min",  # how long ranks wait for each other; no number changes
    "rollout.logprob_check",  # whether a run whose engine disagrees with its trainer starts
)
EXTENSIBLE_KEY = "train.total_steps"
DERIVED_KEYS = ("identity",)  # built from the other keys (a3po.identity): compared through them, never itself
# A key a run's config.yaml lacks because it was written before the key existed, compared as
# the value that run actually used: every run before `precision` computed in float32 on a CPU.
# model.attn_implementation: every run before the key existed computed attention with eager.
# train.fsdp_mixed_precision: every run before the key gathered float32 weights under autocast.
# train.eval_samples: every run before the key sampled each held-out problem once.
# train.compile: every run before the key ran its trainer's forwards through eager layers.
# rollout.model_runner: every vLLM run before the key ran the runner vLLM chose (null).
LEGACY_VALUES = {"precision": "fp32", "model.attn_implementation": "eager", "train.fsdp_mixed_precision": False,
                 "train.eval_samples": 1, "train.compile": False, "rollout.model_runner": None}
# Keys an older config.yaml holds that have moved, with their new home. The old key's value
# was interpolated into the new home (conf/objective/ppo.yaml, conf/correction/none.yaml), or
# unused beside another objective or correction, so the new home alone is compared.
MOVED_KEYS = {"train.eps_clip": "objective.eps_clip", "train.eps_clip_higher": "objective.eps_clip_higher",
              "train.behave_weight_cap": "correction.cap"}

RECORD_KEY = "identity"  # where the record lives in the config (conf/config.yaml)
# The part each group shows in a label when it is not its default.
DEFAULT_SCHEDULE, DEFAULT_CORRECTION, DEFAULT_OBJECTIVE, DEFAULT_PRECISION = "inverse", "none", "ppo", "fp32"
DEFAULT_RUNTIME = "lagged"
ASYNC = "async"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"true", "1", "yes"}
    return bool(value)


def as_group(group: Mapping[str, Any] | str | None, default: str) -> dict[str, Any]:
    """A config group as a plain dict with a `name`: a bare name string, or `default` when
    the group is absent (configs written before the group existed)."""
    if group is None:
        return {"name": default}
    if isinstance(group, str):
        return {"name": group}
    group = dict(group)
    group["name"] = str(group.get("name") or default)
    return group


def schedule_label(schedule: Mapping[str, Any]) -> str:
    """`exponential0.5`, `linear_decay8`, `inverse`, `rational0.5_0.1_1`: the schedule's name
    and the parameters its spec declares (a3po.maths.schedules), joined by `_` where there are
    several, so two sweeps over gamma never share a run directory."""
    name = schedule["name"]
    params = SCHEDULES[name].params if name in SCHEDULES else ()
    return name + "_".join(f"{float(schedule[p]):g}" for p in params if p in schedule)


def group_label(group: Mapping[str, Any], default: str) -> str:
    """`icepop0.5_2`, `gspo0.0003_0.0004`: a correction's or objective's name and its numeric
    parameters in the group's order (`%g`, joined by `_`); the bare `default` name for the default
    group, whatever its parameters (`none` carries its cap, `ppo` the clip)."""
    if group["name"] == default:
        return default
    values = [f"{float(v):g}" for k, v in group.items() if k != "name" and _is_number(v)]
    return f"{group['name']}{'_'.join(values)}"


def join_label(method: str, schedule: str | None, correction: str, objective: str, precision: str) -> str:
    """`<method>[-<schedule>][-<correction>][-<objective>][-<precision>]` from the parts'
    labels, each left out at its default (`inverse`, `none`, `ppo`, `fp32`) and the schedule
    where there is none (None or "")."""
    parts = [method, schedule if schedule and schedule != DEFAULT_SCHEDULE else None,
             correction if correction != DEFAULT_CORRECTION else None,
             objective if objective != DEFAULT_OBJECTIVE else None,
             precision if precision != DEFAULT_PRECISION else None]
    return "-".join(p for p in parts if p)


def _method_params(algo: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a method's spec declares (hybrid's `every`, `min_ess`), as configured."""
    name = algo["name"]
    return {key: algo.get(key) for key in (ALGOS[name].params if name in ALGOS else ())}


def method_label(record: Mapping[str, Any]) -> str:
    """`loglinear`, `hybrid4`, `hybrid0_0.5`: the method and its set parameters (`%g`, joined by `_`)."""
    values = [f"{float(v):g}" for v in (record.get("method_params") or {}).values() if v is not None]
    return record["method"] + "_".join(values)


def record_label(record: Mapping[str, Any]) -> str:
    """The label of a record's method (with its parameters), schedule, correction, objective
    and precision."""
    schedule = record["schedule"]
    return join_label(method_label(record), schedule_label(schedule) if schedule else None,
                      group_label(record["correction"], DEFAULT_CORRECTION),
                      group_label(record["objective"], DEFAULT_OBJECTIVE), record["precision"])


def uses_schedule(algo: Mapping[str, Any]) -> bool:
    """Whether the method's proximal policy depends on the schedule: the registry decides;
    an unknown method (`metrics`, from before the registry) by its config's `uses_schedule`."""
    name = algo["name"]
    return ALGOS[name].uses_schedule if name in ALGOS else _as_bool(algo.get("uses_schedule", False))


def correction_group(correction: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The correction group with its parameters in the registry's order (lo before hi), as
    the composed config has them: a config stored with sorted keys (a YAML or JSON dump that
    sorts them) gives the record, label and name the run was made with."""
    group = as_group(correction, DEFAULT_CORRECTION)
    known = [key for key in (CORRECTIONS[group["name"]].params if group["name"] in CORRECTIONS else {}) if key in group]
    return {"name": group["name"], **{key: group[key] for key in known},
            **{key: value for key, value in group.items() if key != "name" and key not in known}}


def _runtime(runtime: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The runtime group without its result-neutral keys (how long to wait at shutdown)."""
    group = as_group(runtime, DEFAULT_RUNTIME)
    return {k: v for k, v in group.items() if f"runtime.{k}" not in RESULT_NEUTRAL_KEYS}


def identity_record(algo: Mapping[str, Any] | str, schedule: Mapping[str, Any] | str | None,
                    correction: Mapping[str, Any] | str | None, objective: Mapping[str, Any] | str | None,
                    runtime: Mapping[str, Any] | str | None, staleness: Any, seed: Any,
                    precision: str) -> dict[str, Any]:
    """The record of a run from its config's groups (plain values: resolve a DictConfig
    first). A group that is absent reads as its default, so configs written before the
    correction, objective or runtime groups existed give the record those runs had;
    `precision` must be resolved (`name_precision`)."""
    algo = as_group(algo, "")
    method_params = _method_params(algo)
    record = {
        "method": algo["name"],
        **({"method_params": method_params} if method_params else {}),
        "schedule": as_group(schedule, DEFAULT_SCHEDULE) if uses_schedule(algo) else None,
        "correction": correction_group(correction),
        "objective": as_group(objective, DEFAULT_OBJECTIVE),
        "runtime": _runtime(runtime),
        "staleness": staleness,
        "precision": str(precision),
        "seed": seed,
    }
    record["label"] = record_label(record)
    return record


def run_name(record: Mapping[str, Any]) -> str:
    """`<label>-d<staleness>-s<seed>`. No timestamp: a requeued job finds its run again."""
    return f"{record['label']}-d{record['staleness']}-s{record['seed']}"


def name_precision(precision: str, device: str, weights_dtype: str = "float32") -> str:
    """The precision a record carries: `auto` resolved on this machine (a3po.device), so a
    bf16 run and an fp32 run never share a directory. A value that does not resolve is kept
    as given (validation reports it)."""
    if precision in RESOLVED_PRECISIONS:
        return precision
    try:
        return resolve_precision(precision, resolve_device(device), weights_dtype)
    except ConfigError:
        return str(precision)


def _identity_resolver(algo, schedule, correction, objective, runtime, staleness, seed, precision="fp32",
                       device="cpu", weights_dtype="float32"):
    record = identity_record(as_plain(algo), as_plain(schedule), as_plain(correction), as_plain(objective), as_plain(runtime),
                             staleness, seed, name_precision(str(precision), str(device), str(weights_dtype)))
    return OmegaConf.create(record)  # a node: cfg.identity.label reads like any other key


def register_resolvers() -> None:
    """`${a3po_identity:<groups...>}` builds the record, `${a3po_run_name:${identity}}` names
    it (conf/config.yaml). An unknown method, schedule or precision is named as given:
    validation (a3po.config) reports it."""
    if not OmegaConf.has_resolver("a3po_identity"):
        OmegaConf.register_new_resolver("a3po_identity", _identity_resolver)
    if not OmegaConf.has_resolver("a3po_run_name"):
        OmegaConf.register_new_resolver("a3po_run_name", lambda record: run_name(as_plain(record)))
