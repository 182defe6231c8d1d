"""Start-up validation of the composed Hydra config; importing it registers the resolvers
that build the run's identity record and name (a3po.identity).

Validation runs before any model or data set loads, so a typo in a sweep fails in a second
with the key, the value and what is allowed, not twenty minutes later in a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from a3po.device import BF16_GEMMS, DEVICES, PRECISIONS, RESOLVED_PRECISIONS
from a3po.errors import ConfigError
from a3po.identity import register_resolvers
from a3po.maths.corrections import check_combination, check_correction
from a3po.maths.objectives import check_objective
from a3po.maths.proximal import ALGOS
from a3po.maths.schedules import schedule_of, validate_schedule
from a3po.rollout.engines import ENGINES, engine_spec
from a3po.run_config import AXES, RUNTIMES, TOP_LEVEL, Choice, ModelConfig, RunConfig, TaskConfig
from a3po.schema import LoggerConfig, TrainConfig, as_plain, field_names
# A run directory that holds another config's run: stop (error) or start it afresh (restart).
ON_CONFIG_CHANGE = ("error", "restart")
# Before anything loads, a run's estimated peak memory against the machine's (a3po.run.memory_check):
# refuse a run that cannot fit (error), only say so (warn), or make no estimate (off).
MEMORY_CHECK_MODES = ("error", "warn", "off")

register_resolvers()


def _require(condition: bool, key: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r} is not allowed; {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_axes(plain: Mapping[str, Any], train: TrainConfig) -> None:
    """Each ablation axis's choice and its parameters, read from its spec (a3po.maths.spec),
    and the one combination across axes that has no meaning (a correction beside coupled)."""
    algo, schedule, correction, objective = (plain[axis] for axis in AXES)
    checks = [lambda: ALGOS.lookup(algo.get("name")).check(algo, "algo"),
              lambda: validate_schedule(schedule.get("name"), schedule),
              lambda: check_correction(correction.get("name"), correction),
              lambda: check_objective(objective.get("name"), objective),
              lambda: check_combination(correction["name"], algo["name"])]
    if train.log_prox_errors:
        for name, params in (train.prox_error_schedules or {}).items():
            where = f"train.prox_error_schedules.{name}"
            params = params or {}
            checks.append(lambda name=name, params=params, where=where:
                          validate_schedule(schedule_of(name, params), params, where))
    for check in checks:
        try:
            check()
        except ValueError as err:
            raise ConfigError(str(err)) from None


def validate_world(config: RunConfig, world: int) -> None:
    """Every rank of a distributed run (a3po.distributed) needs at least one sample of every
    minibatch: the smallest of the step's n_minibatches parts must hold `world` samples."""
    train = config.train
    _require(world == 1 or not train.grad_fidelity_every, "train.grad_fidelity_every",
             train.grad_fidelity_every, f"0 with a world size of {world} processes (it compares one rank's "
             "whole gradient; FSDP shards it)")
    _require(world == 1 or not train.compile, "train.compile", train.compile,
             f"false with a world size of {world} processes (compiled layers are not validated with FSDP2 yet)")
    _validate_collective_timeout(config, world)
    n = train.n_prompts * train.n_samples
    smallest = n // train.n_minibatches
    if world <= smallest:
        return
    allowed = (f"allowed: train.n_minibatches <= {n // world} at {world} processes, or at most {smallest} processes "
               f"(torchrun --nproc-per-node) at train.n_minibatches={train.n_minibatches}"
               if n >= world else f"raise train.n_prompts * train.n_samples (now {n}) to at least {world}, or run fewer processes")
    raise ConfigError(
        f"train.n_minibatches={train.n_minibatches} is not allowed with a world size of {world} processes: "
        f"train.n_prompts * train.n_samples = {n} samples cut into {train.n_minibatches} minibatches leaves "
        f"{smallest} in the smallest, and each of the {world} ranks needs at least one; {allowed}"
    )


def _validate_collective_timeout(config: RunConfig, world: int) -> None:
    """Under torchrun the other ranks wait in a collective while rank 0 starts its rollout engine
    (up to the engine's `start_timeout_s`: the vLLM child's a3po.rollout.vllm_child.START_TIMEOUT_S):
    a shorter timeout fails them."""
    minutes = config.train.collective_timeout_min
    start_s = engine_spec(config.rollout.name).start_timeout_s()
    if world == 1 or minutes is None or start_s is None:
        return
    start = start_s / 60
    _require(minutes > start, "train.collective_timeout_min", minutes,
             f"more than {start:g} minutes with rollout={config.rollout.name} at a world size of {world} processes "
             f"(the other ranks wait in a collective while rank 0 starts the engine, which may take {start:g}), "
             "or null for 30")


def validate_resolved(config: RunConfig) -> None:
    """The checks that need the resolved `precision` (a3po.device.resolve_precision)."""
    mixed = config.train.fsdp_mixed_precision
    _require(not mixed or config.precision == "bf16", "train.fsdp_mixed_precision", mixed,
             f"false with precision={config.precision} (it gathers the weights in bf16: set precision=bf16)")


def parse_config(cfg: Mapping[str, Any]) -> RunConfig:
    """The door: the composed config (Hydra's DictConfig, or a plain mapping) as the run's one
    typed, frozen RunConfig, with every check that needs no model, tokenizer or data. Each
    group is checked as it is built (a3po.schema: the key, the value and what is allowed), the
    ablation axes against their specs, then the rules that cross keys or groups. A partial
    config (a test's, the benchmark's) takes conf/config.yaml's top-level values (`TOP_LEVEL`)
    and the groups' defaults where it has none; the axes, model, rollout and train groups it
    must have. Raises ConfigError. Nothing below it sees a DictConfig."""
    from a3po.models import validate_model_cfg
    from a3po.tasks import validate_task_cfg

    plain = {**TOP_LEVEL, **as_plain({key: cfg[key] for key in cfg if key != "hydra"})}
    for group in ("train", "rollout", "model", *AXES):
        _require(isinstance(plain.get(group), Mapping), group, plain.get(group), "the config must have this group")
    train = TrainConfig.of(plain["train"], "train")
    _validate_axes(plain, train)
    _validate_top(plain)
    _validate_train(train)
    rollout = _parse_rollout(plain["rollout"], train)
    runtime, logger = _parse_runtime(plain.get("runtime", {"name": "lagged"})), LoggerConfig.of(plain.get("logger", {}), "logger")
    model, task = ModelConfig.of(plain["model"], "model"), TaskConfig.of(plain.get("task", {}), "task")
    validate_model_cfg(model)
    validate_task_cfg(task)
    return RunConfig(**{key: plain[key] for key in TOP_LEVEL},
                     algo=Choice.of(plain["algo"]), schedule=Choice.of(plain["schedule"]),
                     correction=Choice.of(plain["correction"]), objective=Choice.of(plain["objective"]),
                     model=model, task=task, rollout=rollout, runtime=runtime, logger=logger, train=train,
                     resolved=plain)


def memory_check_mode(value: Any) -> Any:
    """`memory_check` as a mode: YAML reads an unquoted `off` as false, which means off."""
    return "off" if value is False else value


# Every key a composed config has at its top: conf/config.yaml's values, its groups, and what
# Hydra and the run's identity add. Anything else is a typo such as `+stalness=4`.
TOP_LEVEL_KEYS = frozenset({*TOP_LEVEL, *AXES, "model", "task", "rollout", "runtime", "logger", "train",
                            "identity", "hydra"})


def _validate_top(plain: Mapping[str, Any]) -> None:
    for key in sorted(set(plain) - TOP_LEVEL_KEYS):
        _require(False, key, plain[key],
                 f"it is not a key of the config; the top-level keys are {sorted(TOP_LEVEL_KEYS - {'hydra'})}")
    staleness, seed = plain["staleness"], plain["seed"]
    _require(_is_int(staleness) and staleness >= 0, "staleness", staleness, "it must be an integer >= 0")
    _require(_is_int(seed) and seed >= 0, "seed", seed, "it must be an integer >= 0")
    _require(plain["device"] in DEVICES, "device", plain["device"], f"allowed: {list(DEVICES)}")
    precision = plain["precision"]
    _require(precision in PRECISIONS or precision in RESOLVED_PRECISIONS, "precision", precision,
             f"allowed: {list(PRECISIONS)}")
    gemms = plain["bf16_gemms"]
    _require(gemms in BF16_GEMMS, "bf16_gemms", gemms,
             f"allowed: {list(BF16_GEMMS)} (null: the faster for this CPU; bf16: oneDNN's bf16 GEMM everywhere; "
             "float32: bf16 operands in the float32 GEMM everywhere)")
    _require(plain["on_config_change"] in ON_CONFIG_CHANGE, "on_config_change", plain["on_config_change"],
             f"allowed: {list(ON_CONFIG_CHANGE)}")
    memory_check = memory_check_mode(plain["memory_check"])
    _require(memory_check in MEMORY_CHECK_MODES, "memory_check", memory_check,
             f"allowed: {list(MEMORY_CHECK_MODES)} (error: refuse a run that cannot fit; warn: only say so; off: no estimate)")
    wait = plain["memory_check_wait_min"]
    _require(isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < float("inf"),
             "memory_check_wait_min", wait, "it must be a number of minutes >= 0 (0: refuse at once)")


def _validate_train(train: TrainConfig) -> None:
    """What crosses train's keys (each key on its own: TrainConfig)."""
    _require(train.n_prompts * train.n_samples >= train.n_minibatches, "train.n_minibatches", train.n_minibatches,
             f"it must be <= train.n_prompts * train.n_samples = {train.n_prompts * train.n_samples}")
    every = train.grad_fidelity_every
    _require(every == 0 or train.log_prox_errors, "train.grad_fidelity_every", every,
             "it needs train.log_prox_errors=true (the recomputed anchor it compares against)")


def _parse_rollout(group: Mapping[str, Any], train: TrainConfig):
    """`rollout` as its engine's schema (a3po.rollout.engines), from the chosen engine's keys: an
    experiment may set another engine's (vLLM's `rollout.dtype` under `rollout=hf`), which are dropped."""
    spec = engine_spec(group.get("name"))
    rollout = spec.schema.of(group, "rollout", tolerate=field_names(*(s.schema for s in ENGINES.values())))
    # A sequence is at least one prompt token plus the longest response; a micro-batch must hold one.
    _require(train.token_budget > rollout.max_new_tokens, "train.token_budget", train.token_budget,
             f"it must exceed rollout.max_new_tokens={rollout.max_new_tokens} so one sequence fits a micro-batch")
    return rollout


def _parse_runtime(group: Mapping[str, Any]):
    name = group.get("name")
    _require(name in RUNTIMES, "runtime.name", name, f"allowed: {list(RUNTIMES)}")
    return RUNTIMES[name].of(group, "runtime")
