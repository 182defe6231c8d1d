"""Typed config for the groups whose fields are fixed: one dataclass per group, each field with
its type, its default (equal to the group's YAML: tests/test_schema.py) and, beside it, what
its values must be. `check_group` holds a composed group to its dataclass at start, key by key,
with the suite's config-error message (`<key>=<value> is not allowed; <what is>`, exit 2); the
rules that cross groups stay in a3po.config, and the ablation axes' parameters are their
specs' `Param`s (a3po.maths.spec), model and task groups validated by their own packages.

Why not Hydra's ConfigStore: a structured config type-checks at composition, before a3po runs,
and fails there with exit 1 and only the type (`Value 'abc' of type 'str' could not be
converted to Float`), without the range or the allowed values, which the suite's contract
(exit 2, the key, the value and what is allowed) promises. The dataclasses here are the same
schema, read by the suite's own check instead.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Mapping

from a3po.errors import ConfigError

__all__ = ["TrainConfig", "RolloutGroup", "RolloutConfig", "VLLMRolloutConfig", "LaggedRuntime", "AsyncRuntime", "LoggerConfig",
           "Group", "as_plain", "check_group", "field_names", "schema_defaults"]

Check = Callable[[Any], bool]


def rule(default: Any, allowed: str, ok: Check = lambda v: True) -> Any:
    """A field: its default, what its values must be in words, and that as a predicate (the
    type from the annotation is checked first)."""
    metadata = {"allowed": allowed, "ok": ok}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _int_at_least(n: int, default: Any, extra: str = "") -> Any:
    return rule(default, f"it must be an integer >= {n}{extra}", lambda v: v >= n)


def as_plain(value: Any) -> Any:
    """A config value as plain Python: mappings (an OmegaConf DictConfig is one) as dicts, sequences
    (ListConfig) as lists, recursively; reading a node resolves its interpolations."""
    if isinstance(value, Mapping):
        return {str(k): as_plain(value[k]) for k in value}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [as_plain(v) for v in value]
    return value


class Group:
    """`Schema.of(group)`: the group as this frozen dataclass, from a mapping of its keys (plain
    or an OmegaConf node) or as is when it already is one. An unknown key is a ConfigError
    naming it; a missing one takes the field's default, held here once."""

    @classmethod
    def of(cls, group: Any, where: str | None = None, tolerate: typing.Iterable[str] = ()) -> Any:
        """Checked key by key as it is built (`check_group`: the key, the value and what is
        allowed); keys in `tolerate` (another choice's, e.g. vLLM's under `rollout=hf`) are dropped."""
        if isinstance(group, cls):
            return group
        values = as_plain(group)
        check_group(values, cls, where or cls.__name__, tolerate)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in names})


POSITIVE = "it must be > 0"
# `rollout.model_runner` (vLLM) -> VLLM_USE_V2_MODEL_RUNNER, which vLLM 0.32 reads as it starts
MODEL_RUNNERS = {"v1": "0", "v2": "1"}
FLAG = "it must be true or false"


@dataclass(frozen=True)
class TrainConfig(Group):
    """`train.*` (conf/config.yaml)."""

    total_steps: int = _int_at_least(1, 20)
    n_prompts: int = _int_at_least(1, 8)
    n_samples: int = _int_at_least(1, 4)
    n_minibatches: int = _int_at_least(1, 2)
    token_budget: int = _int_at_least(1, 2048)
    lr: float = rule(2.0e-6, POSITIVE, lambda v: v > 0)
    weight_decay: float = rule(0.0, "it must be >= 0", lambda v: v >= 0)
    adam_betas: list[float] = rule([0.9, 0.999], "it must be two numbers in [0, 1)",
                                   lambda v: len(v) == 2 and all(0 <= b < 1 for b in v))
    adam_eps: float = rule(1.0e-8, POSITIVE, lambda v: v > 0)
    grad_clip: float = rule(1.0, POSITIVE, lambda v: v > 0)
    reward_scaling: float = rule(1.0, "it must be a finite number", math.isfinite)
    reward_bias: float = rule(0.0, "it must be a finite number", math.isfinite)
    adv_norm_std: bool = rule(True, FLAG)
    adv_std_unbiased: bool = rule(True, FLAG)
    adv_eps: float = rule(1.0e-5, POSITIVE, lambda v: v > 0)
    adv_batch_norm: bool = rule(False, FLAG)
    eval_every: int = _int_at_least(0, 5, " (0 disables)")
    eval_size: int = _int_at_least(1, 32)
    eval_samples: int = _int_at_least(1, 1)
    checkpoint_every: int = _int_at_least(0, 5, " (0 disables)")
    max_steps_this_run: int | None = rule(None, "it must be an integer >= 1, or null", lambda v: v >= 1)
    keep_checkpoint: bool = rule(False, FLAG)
    save_final_model: bool = rule(False, FLAG)
    warmup: bool = rule(True, FLAG)
    activation_checkpointing: bool = rule(False, FLAG)
    compile: bool = rule(False, FLAG)
    fsdp_mixed_precision: bool = rule(False, FLAG)
    collective_timeout_min: float | None = rule(  # null: a3po.distributed.COLLECTIVE_TIMEOUT_MIN
        None, "it must be a number of minutes > 0, or null for 30", lambda v: 0 < v < math.inf)
    collapse_entropy: float | None = rule(
        None, "it must be a number >= 0 (nats per token; 0 never flags a collapse), or null for 1e-3", lambda v: v >= 0)
    collapse_grad_norm: float | None = rule(
        None, "it must be a number >= 0 (0: a gradient norm of exactly zero), or null for 0", lambda v: v >= 0)
    collapse_steps: int | None = rule(None, "it must be an integer >= 1 (consecutive steps), or null for 3",
                                      lambda v: v >= 1)
    log_prox_errors: bool = rule(False, FLAG)
    grad_fidelity_every: int = _int_at_least(0, 0, " (0: off)")
    prox_error_schedules: dict = rule(
        {"inverse": {}, "inverse_sqrt": {}, "exponential": {"gamma": 0.5}, "linear_decay": {"horizon": 8},
         "constant": {"c": 0.5}, "behave": {}, "target": {}, "step_start": {}},
        "it must map schedule labels to their parameters (each checked by its schedule's spec)")


def _device(value: Any) -> bool:
    return value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", str(value)) is not None


@dataclass(frozen=True)
class RolloutGroup(Group):
    """What every engine's group has; the engine name is checked against a3po.rollout.ENGINES
    by a3po.config."""

    name: str = rule("hf", "it must name an engine")
    temperature: float = rule(1.0, POSITIVE, lambda v: v > 0)
    top_p: float = rule(1.0, "it must be in (0, 1]", lambda v: 0 < v <= 1)
    max_new_tokens: int = _int_at_least(1, 32)
    device: str | None = rule(None, "allowed: null (the trainer's device), ['auto', 'cpu', 'cuda'] or cuda:<index>",
                              _device)
    logprob_check: float | None = rule(  # a3po.run.engine_check; changes no result
        None, "it must be a number >= 0 (the largest |engine - trainer| log-prob gap a run starts with; 0 skips "
        "the check), or null for the precision's (fp32 1e-3, bf16 0.1)", lambda v: 0 <= v < math.inf)


@dataclass(frozen=True)
class RolloutConfig(RolloutGroup):
    """`rollout.*` for `rollout=hf` (conf/rollout/hf.yaml)."""

    batch_size: int | None = rule(None, "it must be an integer >= 1, or null (every prompt in one call)",
                                  lambda v: v >= 1)


@dataclass(frozen=True)
class VLLMRolloutConfig(RolloutGroup):
    """`rollout.*` for `rollout=vllm` (conf/rollout/vllm.yaml)."""

    name: str = rule("vllm", "it must name an engine")
    dtype: str | None = rule(None, "allowed: null (the run's precision), auto, float32, float16 or bfloat16",
                             lambda v: v in ("auto", "float32", "float16", "bfloat16"))
    enforce_eager: bool = rule(True, FLAG)
    max_model_len: int = _int_at_least(1, 2048)
    gpu_memory_utilization: float = rule(0.5, "it must be in (0, 1]", lambda v: 0 < v <= 1)
    cpu_kv_cache_gib: float = rule(1, POSITIVE, lambda v: v > 0)
    max_num_seqs: int | None = rule(256, "it must be an integer >= 1, or null", lambda v: v >= 1)
    max_num_batched_tokens: int | None = rule(None, "it must be an integer >= 1, or null", lambda v: v >= 1)
    enable_prefix_caching: bool = rule(True, FLAG)
    seed_per_request: bool = rule(True, FLAG)
    seed: int = _int_at_least(0, 0)
    model_runner: str | None = rule("v1", "allowed: v1 (the runner vLLM's CPU worker is built on, which the CPU "
                                    "tests run), v2 (vLLM's default on a GPU with Triton), or null (vLLM's choice)",
                                    lambda v: v in MODEL_RUNNERS)


@dataclass(frozen=True)
class LaggedRuntime(Group):
    """`runtime=lagged` (conf/runtime/lagged.yaml): the exact staleness is the top-level key."""

    name: str = rule("lagged", "it must name a runtime")


@dataclass(frozen=True)
class AsyncRuntime(Group):
    """`runtime=async` (conf/runtime/async.yaml)."""

    name: str = rule("async", "it must name a runtime")
    max_staleness: int = _int_at_least(0, "${staleness}")
    interruptible: bool = rule(True, FLAG)
    shutdown_timeout_s: float = rule(120, POSITIVE, lambda v: v > 0)


@dataclass(frozen=True)
class LoggerConfig(Group):
    """`logger.*` (conf/logger/*.yaml)."""

    name: str = rule("wandb", "allowed: ['none', 'wandb']", lambda v: v in ("none", "wandb"))
    mode: str = rule("offline", "allowed: ['offline', 'online', 'disabled']",
                     lambda v: v in ("offline", "online", "disabled"))
    project: str = rule("a3po", "it must be a wandb project name")
    entity: str | None = rule(None, "it must be a wandb entity, or null")


def _type_ok(value: Any, annotation: Any) -> bool:
    """Whether `value` (a plain config value) has the annotated type; an int is a float, a bool
    is neither."""
    if annotation is typing.Any:
        return True
    args = typing.get_args(annotation)
    if type(None) in args:
        return value is None or _type_ok(value, next(a for a in args if a is not type(None)))
    origin = typing.get_origin(annotation) or annotation
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_type_ok(v, args[0]) for v in value) if args else True
    return isinstance(value, origin)


def check_group(group: Mapping[str, Any], schema: type, where: str, tolerate: typing.Iterable[str] = ()) -> None:
    """ConfigError for a key `schema` does not have (other than `tolerate`: another choice's
    keys an experiment sets for the group, e.g. vLLM's `rollout.dtype` under `rollout=hf`), or
    the first value whose type or range is not its field's, naming `<where>.<key>`, the value
    and what is allowed. `group` is plain (`as_plain`); a missing key reads as its
    default."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = sorted(set(group) - set(fields) - set(tolerate))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not a key of {where}; its keys: {sorted(fields)}")
    hints = typing.get_type_hints(schema)
    for name, spec in fields.items():
        if name not in group:
            continue
        value = group[name]
        ok = spec.metadata.get("ok", lambda v: True)
        if not (_type_ok(value, hints[name]) and (value is None or ok(value))):
            allowed = spec.metadata.get("allowed", f"it must be of type {hints[name]}")
            raise ConfigError(f"{where}.{name}={value!r} is not allowed; {allowed}")


def schema_defaults(schema: type) -> dict[str, Any]:
    """Every field's default, as the group's YAML must hold it (tests/test_schema.py)."""
    return {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(schema)}


def field_names(*schemas: type) -> set[str]:
    return {f.name for schema in schemas for f in dataclasses.fields(schema)}
