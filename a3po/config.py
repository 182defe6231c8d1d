"""Start-up validation of the composed Hydra config; importing it registers the resolvers
that build the run's identity record and name (a3po.identity).

Validation runs before any model or data set loads, so a typo in a sweep fails in a second
with the key, the value and what is allowed, not twenty minutes later in a traceback.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from a3po.device import BF16_GEMMS, DEVICES, PRECISIONS, RESOLVED_PRECISIONS
from a3po.errors import ConfigError
from a3po.identity import register_resolvers
from a3po.maths.corrections import check_combination, check_correction
from a3po.maths.objectives import check_objective
from a3po.maths.proximal import ALGOS
from a3po.maths.schedules import schedule_of, validate_schedule
from a3po.run_config import AXES, ROLLOUT_SCHEMAS, RUNTIMES, TOP_LEVEL
from a3po.schema import LoggerConfig, TrainConfig, as_plain, check_group, field_names
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


def _validate_axes(cfg: DictConfig) -> None:
    """Each ablation axis's choice and its parameters, read from its spec (a3po.maths.spec),
    and the one combination across axes that has no meaning (a correction beside coupled)."""
    checks = [lambda: ALGOS.lookup(cfg.algo.name).check(as_plain(cfg.algo), "algo"),
              lambda: validate_schedule(cfg.schedule.get("name"), as_plain(cfg.schedule)),
              lambda: check_correction(cfg.correction.get("name"), as_plain(cfg.correction)),
              lambda: check_objective(cfg.objective.get("name"), as_plain(cfg.objective)),
              lambda: check_combination(cfg.correction.name, cfg.algo.name)]
    if cfg.train.log_prox_errors:
        for name, params in (cfg.train.get("prox_error_schedules") or {}).items():
            where = f"train.prox_error_schedules.{name}"
            checks.append(lambda name=name, params=params, where=where:
                          validate_schedule(schedule_of(name, as_plain(params)), as_plain(params), where))
    for check in checks:
        try:
            check()
        except ValueError as err:
            raise ConfigError(str(err)) from None


def validate_world(cfg: DictConfig, world: int) -> None:
    """Every rank of a distributed run (a3po.distributed) needs at least one sample of every
    minibatch: the smallest of the step's n_minibatches parts must hold `world` samples."""
    _require(world == 1 or not cfg.train.get("grad_fidelity_every", 0), "train.grad_fidelity_every",
             cfg.train.get("grad_fidelity_every"), f"0 with a world size of {world} processes (it compares one rank's "
             "whole gradient; FSDP shards it)")
    _require(world == 1 or not cfg.train.get("compile", False), "train.compile", cfg.train.get("compile"),
             f"false with a world size of {world} processes (compiled layers are not validated with FSDP2 yet)")
    _validate_collective_timeout(cfg, world)
    train = cfg.train
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


def _validate_collective_timeout(cfg: DictConfig, world: int) -> None:
    """Under torchrun with rollout=vllm the other ranks wait in a collective while rank 0 starts
    the vLLM child (up to a3po.rollout.vllm_child.START_TIMEOUT_S): a shorter timeout fails them."""
    minutes = cfg.train.get("collective_timeout_min")
    if world == 1 or minutes is None or cfg.rollout.name != "vllm":
        return
    from a3po.rollout.vllm_child import START_TIMEOUT_S

    start = START_TIMEOUT_S / 60
    _require(minutes > start, "train.collective_timeout_min", minutes,
             f"more than {start:g} minutes with rollout=vllm at a world size of {world} processes (the other ranks "
             f"wait in a collective while rank 0 starts the vLLM child, which may take {start:g}), or null for 30")


def validate_resolved(cfg: Any) -> None:
    """The checks that need the resolved `precision` (a3po.device.resolve_precision), on the
    typed config (a3po.run_config.RunConfig)."""
    mixed = cfg.train.fsdp_mixed_precision
    _require(not mixed or cfg.precision == "bf16", "train.fsdp_mixed_precision", mixed,
             f"false with precision={cfg.precision} (it gathers the weights in bf16: set precision=bf16)")


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no model, tokenizer or data: each fixed group against its typed
    schema (a3po.schema), the ablation axes against their specs, then the rules that cross
    keys or groups. Raises ConfigError."""
    from a3po.models import validate_model_cfg
    from a3po.tasks import validate_task_cfg

    check_group(as_plain(cfg.train), TrainConfig, "train")
    _validate_axes(cfg)
    _validate_top(cfg)
    _validate_train(cfg.train)
    _validate_rollout(cfg.rollout, cfg.train)
    _validate_runtime_and_logger(cfg)
    validate_model_cfg(cfg.model)
    validate_task_cfg(cfg.task)


def memory_check_mode(value: Any) -> Any:
    """`memory_check` as a mode: YAML reads an unquoted `off` as false, which means off."""
    return "off" if value is False else value


# Every key a composed config has at its top: conf/config.yaml's values, its groups, and what
# Hydra and the run's identity add. Anything else is a typo such as `+stalness=4`.
TOP_LEVEL_KEYS = frozenset({*TOP_LEVEL, *AXES, "model", "task", "rollout", "runtime", "logger", "train",
                            "identity", "hydra"})


def _validate_top(cfg: DictConfig) -> None:
    for key in sorted(set(cfg.keys()) - TOP_LEVEL_KEYS):
        _require(False, key, cfg.get(key),
                 f"it is not a key of the config; the top-level keys are {sorted(TOP_LEVEL_KEYS - {'hydra'})}")
    _require(_is_int(cfg.staleness) and cfg.staleness >= 0, "staleness", cfg.staleness, "it must be an integer >= 0")
    _require(_is_int(cfg.seed) and cfg.seed >= 0, "seed", cfg.seed, "it must be an integer >= 0")
    _require(cfg.device in DEVICES, "device", cfg.device, f"allowed: {list(DEVICES)}")
    precision = cfg.get("precision", "auto")
    _require(precision in PRECISIONS or precision in RESOLVED_PRECISIONS, "precision", precision,
             f"allowed: {list(PRECISIONS)}")
    gemms = cfg.get("bf16_gemms")
    _require(gemms in BF16_GEMMS, "bf16_gemms", gemms,
             f"allowed: {list(BF16_GEMMS)} (null: the faster for this CPU; bf16: oneDNN's bf16 GEMM everywhere; "
             "float32: bf16 operands in the float32 GEMM everywhere)")
    _require(cfg.on_config_change in ON_CONFIG_CHANGE, "on_config_change", cfg.on_config_change,
             f"allowed: {list(ON_CONFIG_CHANGE)}")
    memory_check = memory_check_mode(cfg.get("memory_check", "error"))  # absent (an older config): the default
    _require(memory_check in MEMORY_CHECK_MODES, "memory_check", memory_check,
             f"allowed: {list(MEMORY_CHECK_MODES)} (error: refuse a run that cannot fit; warn: only say so; off: no estimate)")
    wait = cfg.get("memory_check_wait_min", 0)
    _require(isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < float("inf"),
             "memory_check_wait_min", wait, "it must be a number of minutes >= 0 (0: refuse at once)")


def _validate_train(train: DictConfig) -> None:
    """What crosses train's keys (each key on its own: TrainConfig)."""
    _require(train.n_prompts * train.n_samples >= train.n_minibatches, "train.n_minibatches", train.n_minibatches,
             f"it must be <= train.n_prompts * train.n_samples = {train.n_prompts * train.n_samples}")
    every = train.grad_fidelity_every
    _require(every == 0 or train.log_prox_errors, "train.grad_fidelity_every", every,
             "it needs train.log_prox_errors=true (the recomputed anchor it compares against)")


def _validate_rollout(rollout: DictConfig, train: DictConfig) -> None:
    from a3po.rollout import ENGINES

    _require(rollout.name in ENGINES, "rollout.name", rollout.name, f"allowed: {sorted(ENGINES)}")
    check_group(as_plain(rollout), ROLLOUT_SCHEMAS[rollout.name], "rollout", tolerate=field_names(*ROLLOUT_SCHEMAS.values()))
    # A sequence is at least one prompt token plus the longest response; a micro-batch must hold one.
    _require(train.token_budget > rollout.max_new_tokens, "train.token_budget", train.token_budget,
             f"it must exceed rollout.max_new_tokens={rollout.max_new_tokens} so one sequence fits a micro-batch")


def _validate_runtime_and_logger(cfg: DictConfig) -> None:
    _require(cfg.runtime.name in RUNTIMES, "runtime.name", cfg.runtime.name, f"allowed: {list(RUNTIMES)}")
    check_group(as_plain(cfg.runtime), RUNTIMES[cfg.runtime.name], "runtime")
    check_group(as_plain(cfg.logger), LoggerConfig, "logger")
