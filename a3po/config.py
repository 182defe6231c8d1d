"""Start-up validation of the composed Hydra config; importing it registers the resolvers
that build the run's identity record and name (a3po.identity).

Validation runs before any model or data set loads, so a typo in a sweep fails in a second
with the key, the value and what is allowed, not twenty minutes later in a traceback.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig

from a3po.cfg_access import plain
from a3po.device import DEVICES, PRECISIONS, RESOLVED_PRECISIONS
from a3po.errors import ConfigError
from a3po.identity import register_resolvers
from a3po.maths.corrections import check_combination, check_correction
from a3po.maths.objectives import check_objective
from a3po.maths.proximal import ALGOS
from a3po.maths.schedules import schedule_of, validate_schedule

RUNTIMES = ("lagged", "async")
LOGGER_MODES = ("offline", "online", "disabled")
# A run directory that holds another config's run: stop (error) or start it afresh (restart).
ON_CONFIG_CHANGE = ("error", "restart")

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
    checks = [lambda: ALGOS.lookup(cfg.algo.name).check(plain(cfg.algo), "algo"),
              lambda: validate_schedule(cfg.schedule.get("name"), plain(cfg.schedule)),
              lambda: check_correction(cfg.correction.get("name"), plain(cfg.correction)),
              lambda: check_objective(cfg.objective.get("name"), plain(cfg.objective)),
              lambda: check_combination(cfg.correction.name, cfg.algo.name)]
    if cfg.train.log_prox_errors:
        for name, params in (cfg.train.get("prox_error_schedules") or {}).items():
            where = f"train.prox_error_schedules.{name}"
            checks.append(lambda name=name, params=params, where=where:
                          validate_schedule(schedule_of(name, plain(params)), plain(params), where))
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


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no model, tokenizer or data, group by group. Raises ConfigError."""
    from a3po.models import validate_model_cfg
    from a3po.tasks import validate_task_cfg

    _require(isinstance(cfg.train.log_prox_errors, bool), "train.log_prox_errors", cfg.train.log_prox_errors,
             "it must be true or false")
    every = cfg.train.get("grad_fidelity_every", 0)
    _require(_is_int(every) and every >= 0, "train.grad_fidelity_every", every, "it must be an integer >= 0 (0: off)")
    _require(every == 0 or cfg.train.log_prox_errors, "train.grad_fidelity_every", every,
             "it needs train.log_prox_errors=true (the recomputed anchor it compares against)")
    _validate_axes(cfg)
    _validate_top(cfg)
    _validate_train(cfg.train)
    _validate_rollout(cfg.rollout, cfg.train)
    _validate_runtime_and_logger(cfg)
    validate_model_cfg(cfg.model)
    validate_task_cfg(cfg.task)


def _validate_top(cfg: DictConfig) -> None:
    _require(_is_int(cfg.staleness) and cfg.staleness >= 0, "staleness", cfg.staleness, "it must be an integer >= 0")
    _require(_is_int(cfg.seed) and cfg.seed >= 0, "seed", cfg.seed, "it must be an integer >= 0")
    _require(cfg.device in DEVICES, "device", cfg.device, f"allowed: {list(DEVICES)}")
    precision = cfg.get("precision", "auto")
    _require(precision in PRECISIONS or precision in RESOLVED_PRECISIONS, "precision", precision,
             f"allowed: {list(PRECISIONS)}")
    _require(cfg.on_config_change in ON_CONFIG_CHANGE, "on_config_change", cfg.on_config_change,
             f"allowed: {list(ON_CONFIG_CHANGE)}")


def _validate_train(train: DictConfig) -> None:
    for key in ("total_steps", "n_prompts", "n_samples", "n_minibatches", "token_budget"):
        _require(_is_int(train[key]) and train[key] >= 1, f"train.{key}", train[key], "it must be an integer >= 1")
    _require(train.n_prompts * train.n_samples >= train.n_minibatches, "train.n_minibatches", train.n_minibatches,
             f"it must be <= train.n_prompts * train.n_samples = {train.n_prompts * train.n_samples}")
    _require(_is_number(train.lr) and train.lr > 0, "train.lr", train.lr, "it must be > 0")
    _require(_is_number(train.grad_clip) and train.grad_clip > 0, "train.grad_clip", train.grad_clip, "it must be > 0")
    for key in ("eval_every", "checkpoint_every"):
        _require(_is_int(train[key]) and train[key] >= 0, f"train.{key}", train[key], "it must be an integer >= 0 (0 disables)")
    _require(_is_number(train.adv_eps) and train.adv_eps > 0, "train.adv_eps", train.adv_eps, "it must be > 0")
    collapse_entropy, collapse_grad_norm, collapse_steps = (train.get(key) for key in (
        "collapse_entropy", "collapse_grad_norm", "collapse_steps"))
    _require(collapse_entropy is None or (_is_number(collapse_entropy) and collapse_entropy >= 0),
             "train.collapse_entropy", collapse_entropy,
             "it must be a number >= 0 (nats per token; 0 never flags a collapse), or null for 1e-3")
    _require(collapse_grad_norm is None or (_is_number(collapse_grad_norm) and collapse_grad_norm >= 0),
             "train.collapse_grad_norm", collapse_grad_norm,
             "it must be a number >= 0 (0: a gradient norm of exactly zero), or null for 0")
    _require(collapse_steps is None or (_is_int(collapse_steps) and collapse_steps >= 1), "train.collapse_steps",
             collapse_steps, "it must be an integer >= 1 (consecutive steps), or null for 3")
    for key in ("adv_norm_std", "adv_std_unbiased", "adv_batch_norm", "keep_checkpoint", "save_final_model", "warmup"):
        _require(isinstance(train[key], bool), f"train.{key}", train[key], "it must be true or false")
    _require(train.max_steps_this_run is None or (_is_int(train.max_steps_this_run) and train.max_steps_this_run >= 1),
             "train.max_steps_this_run", train.max_steps_this_run, "it must be an integer >= 1, or null")


def _validate_rollout(rollout: DictConfig, train: DictConfig) -> None:
    from a3po.rollout import ENGINES

    _require(rollout.name in ENGINES, "rollout.name", rollout.name, f"allowed: {sorted(ENGINES)}")
    _require(_is_int(rollout.max_new_tokens) and rollout.max_new_tokens >= 1, "rollout.max_new_tokens",
             rollout.max_new_tokens, "it must be an integer >= 1")
    _require(_is_number(rollout.temperature) and rollout.temperature > 0, "rollout.temperature", rollout.temperature, "it must be > 0")
    _require(_is_number(rollout.top_p) and 0 < rollout.top_p <= 1, "rollout.top_p", rollout.top_p, "it must be in (0, 1]")
    rollout_device = rollout.get("device")
    _require(rollout_device is None or rollout_device in DEVICES or re.fullmatch(r"cuda:\d+", str(rollout_device)),
             "rollout.device", rollout_device, f"allowed: null (the trainer's device), {list(DEVICES)} or cuda:<index>")
    # A sequence is at least one prompt token plus the longest response; a micro-batch must hold one.
    _require(train.token_budget > rollout.max_new_tokens, "train.token_budget", train.token_budget,
             f"it must exceed rollout.max_new_tokens={rollout.max_new_tokens} so one sequence fits a micro-batch")


def _validate_runtime_and_logger(cfg: DictConfig) -> None:
    _require(cfg.runtime.name in RUNTIMES, "runtime.name", cfg.runtime.name, f"allowed: {list(RUNTIMES)}")
    if cfg.runtime.name == "async":
        eta = cfg.runtime.get("max_staleness")
        _require(_is_int(eta) and eta >= 0, "runtime.max_staleness", eta, "it must be an integer >= 0")
    _require(cfg.logger.mode in LOGGER_MODES, "logger.mode", cfg.logger.mode, f"allowed: {list(LOGGER_MODES)}")
