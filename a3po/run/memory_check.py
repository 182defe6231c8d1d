"""The memory check at start (a3po.run.main.run, `memory_check`, conf/config.yaml): what the
estimate (a3po.memory.estimate) needs that only this machine and the model's files know, the
architecture without a weight, the task's longest prompt, the memory a device can still
give, and the verdict. `python -m a3po.run.memory_plan [overrides]` prints the breakdown."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping

import torch

from a3po.config import memory_check_mode
from a3po.errors import ConfigError
from a3po.memory.estimate import estimate_memory
from a3po.memory.machine import available_memory
from a3po.rollout.engines import engine_spec
from a3po.run_config import ModelConfig, RunConfig, TaskConfig
from a3po.memory.parts import PUBLISHED_CONFIGS, SMOLLM2_135M, Architecture, Estimate, Part, architecture_from, format_bytes

__all__ = ["architecture_of", "longest_prompt_tokens", "verdict", "estimate_run", "check_memory", "WARN_SHARE"]

log = logging.getLogger(__name__)

# An estimate within this share of the limit is close enough to warn about (and go on).
WARN_SHARE = 0.8


def architecture_of(model_cfg: ModelConfig) -> tuple[Architecture | None, str]:
    """The architecture of `model.*` without loading a weight, and where it came from; None and
    the reason where it cannot be known (a hub model that cannot be reached)."""
    from a3po.models import smollm2_cache_dir
    from a3po.models.smollm2 import is_converted
    from a3po.models.tiny import TINY_SIZE_KEYS

    source = model_cfg.source
    if source in ("tiny", "smollm2_gguf"):
        cache = smollm2_cache_dir()
        converted = is_converted(cache)
        smollm2 = json.loads((cache / "config.json").read_text()) if converted else SMOLLM2_135M
        where = str(cache / "config.json") if converted else "a3po.memory.parts.SMOLLM2_135M (not converted yet)"
        if source == "smollm2_gguf":
            return architecture_from(smollm2), where
        # a3po.models.tiny: the given sizes, SmolLM2's tokenizer (its vocabulary), a tied output layer
        sizes = {key: getattr(model_cfg, key) for key in TINY_SIZE_KEYS}
        return architecture_from({**sizes, "vocab_size": smollm2["vocab_size"], "tie_word_embeddings": True}), "model.*"
    path = os.path.expanduser(str(model_cfg.path))
    from transformers import AutoConfig

    try:  # a local copy or the hub's cache first: no network wait on an offline machine
        return architecture_from(AutoConfig.from_pretrained(path, local_files_only=True).to_dict()), f"{path} (config)"
    except Exception:
        if path in PUBLISHED_CONFIGS:
            return architecture_from(PUBLISHED_CONFIGS[path]), f"{path}'s published config (not on this machine)"
    try:
        return architecture_from(AutoConfig.from_pretrained(path).to_dict()), f"{path} (config)"
    except Exception as error:  # offline, gated, a config without these keys: no estimate, no refusal
        return None, f"the config of model.path={path!r} could not be read ({type(error).__name__}: {error})"


# --- the prompt -----------------------------------------------------------------------------------
# Where no tokenizer is at hand: a chat template's tokens around the question (SmolLM2's: 38,
# with its default system prompt), and a token per character of the question (an upper bound
# for ASCII text under byte-level BPE).
TEMPLATE_TOKENS_BOUND = 64
# GSM8K from the hub is not read for the estimate (a download): its longest question is taken
# as this many tokens (an upper bound, not measured here: GSM8K's questions run to a few hundred).
GSM8K_QUESTION_TOKENS_BOUND = 400


def _longest_question(task_cfg: TaskConfig) -> str | None:
    """The task's longest question by characters, where it is cheap to know: every arith
    problem of the level (at most 15,552), every word problem (37,440), a local GSM8K file, a
    reasoning-gym dataset's generated problems; None for GSM8K from the hub."""
    from a3po.tasks import build_task
    from a3po.tasks.arith import level_problems

    name = task_cfg.name
    if name == "arith":
        return max((p.question for p in level_problems(task_cfg.level)), key=len)
    if name == "words":
        from a3po.tasks.words import check_operations, word_problems
        return max((p.question for p in word_problems(check_operations(task_cfg.operations))), key=len)
    if (name == "gsm8k" and task_cfg.path) or name == "reasoning_gym":  # a reasoning-gym build is cached
        task = build_task(task_cfg, seed=0)
        problems = [*task.train, *task.held_out]
        return max((p.question for p in problems), key=len) if problems else None
    return None


def _tokenizer_of(model_cfg: ModelConfig):
    """The model's tokenizer where it is on this machine (no download); None otherwise."""
    from transformers import AutoTokenizer

    from a3po.models import smollm2_cache_dir
    from a3po.models.smollm2 import is_converted

    source = model_cfg.source
    path = smollm2_cache_dir() if source in ("tiny", "smollm2_gguf") else Path(os.path.expanduser(str(model_cfg.path)))
    if source != "hub" and not is_converted(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception:  # not cached locally: the bound below
        return None


def longest_prompt_tokens(task_cfg: TaskConfig, model_cfg: ModelConfig) -> tuple[int, str]:
    """The longest prompt the rollout will see, in tokens, and how it was found: the task's
    longest question rendered and tokenized as the producer does (a3po.tasks.encode_prompt)
    where the tokenizer is on this machine, else a bound (`TEMPLATE_TOKENS_BOUND` plus a token
    per character; GSM8K from the hub: `GSM8K_QUESTION_TOKENS_BOUND`). Remembered per (task,
    model): a test suite or a sweep in one process starts many runs of one task and model."""
    task, model = dataclasses.asdict(task_cfg), dataclasses.asdict(model_cfg)
    return _longest_prompt_tokens(json.dumps(task, sort_keys=True), json.dumps(model, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _longest_prompt_tokens(task_json: str, model_json: str) -> tuple[int, str]:
    from a3po.tasks import ANSWER_INSTRUCTION, encode_prompt

    question = _longest_question(TaskConfig(**json.loads(task_json)))
    tokenizer = _tokenizer_of(ModelConfig(**json.loads(model_json)))
    if tokenizer is not None and question is not None:
        return len(encode_prompt(tokenizer, question)), "the task's longest question, tokenized"
    if tokenizer is not None:
        return len(encode_prompt(tokenizer, "")) + GSM8K_QUESTION_TOKENS_BOUND, "the template plus a bound on the question"
    if question is not None:
        return TEMPLATE_TOKENS_BOUND + len(f"{question}\n{ANSWER_INSTRUCTION}"), "a bound (no tokenizer on this machine)"
    return TEMPLATE_TOKENS_BOUND + GSM8K_QUESTION_TOKENS_BOUND, "a bound (no tokenizer on this machine)"


# --- the check -------------------------------------------------------------------------------------
def _part_line(part: Part) -> str:
    keys = f" ({', '.join(part.keys)})" if part.keys else ""
    return f"{part.name} {format_bytes(part.nbytes)}{keys}"


def verdict(estimate: Estimate, available: Mapping[str, tuple[int, str]], top: int = 4) -> tuple[str, str | None]:
    """("error" | "warn" | "ok", the message) for `estimate` against each device's
    `available` (bytes, where the figure came from): the first device that cannot hold its
    peak is an error; one within WARN_SHARE of its limit a warning."""
    worst, message = "ok", None
    for device in estimate.devices():
        if device not in available:  # planning for GPUs alone (a3po.run.memory_plan)
            continue
        peak = estimate.peak(device)
        room, where = available[device]
        level = "error" if peak > room else "warn" if peak > WARN_SHARE * room else "ok"
        if level == "ok" or (worst == "error"):
            continue
        parts = "; ".join(_part_line(p) for p in estimate.peak_parts(device)[:top])
        text = (f"memory check: this run needs an estimated {format_bytes(peak)} at its peak on {device}, and "
                f"{format_bytes(room)} is available ({where}). The largest parts: {parts}.")
        worst, message = level, text
    return worst, message


def _device_name(device) -> str:
    return f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"


def estimate_run(cfg: RunConfig, arch: Architecture, trainer_device: torch.device | str, world: int = 1) -> Estimate:
    """`estimate_memory` for `cfg` on this machine: the task's longest prompt, where the rollout runs
    (a3po.run.parts.rollout_device), a vLLM GPU's size, the model's attention (`model.attn_implementation`:
    eager keeps each head's seq x seq probabilities), where bf16's GEMMs run in float32."""
    from a3po.allocator import MMAP_THRESHOLD
    from a3po.device import bf16_gemm_in_float32
    from a3po.models.loading import attn_implementation
    from a3po.run.parts import rollout_device

    trainer = torch.device(trainer_device)
    on_rollout = rollout_device(cfg, trainer)
    engine = engine_spec(cfg.rollout.name)
    sized = on_rollout.type == "cuda" and engine.sized_by_device
    device_total = torch.cuda.get_device_properties(on_rollout).total_memory if sized else None
    return estimate_memory(cfg, arch, rollout_parts=engine.memory_parts, prompt_tokens=longest_prompt_tokens(cfg.task, cfg.model)[0],
                           trainer_device=_device_name(trainer), rollout_device=_device_name(on_rollout), world=world,
                           device_total=device_total, eager_attention=attn_implementation(cfg.model) == "eager",
                           mmap_threshold=MMAP_THRESHOLD,  # glibc's, as the run sets it (a3po.allocator)
                           gemms_in_float32=(bf16_gemm_in_float32(trainer), bf16_gemm_in_float32(on_rollout)))


# How often a run that waits for memory (memory_check_wait_min) asks again, in seconds.
WAIT_POLL_S = 30.0


def wait_for_room(estimate: Estimate, devices: list[str], wait_min: float,
                  poll_s: float = WAIT_POLL_S) -> tuple[str, str | None, float]:
    """`verdict` for `devices`, asked again every `poll_s` seconds while it is an error, for at
    most `wait_min` minutes: a task of a SLURM array that starts while another job, or a
    process outside SLURM, still holds the memory it needs. Returns the last verdict and the
    seconds waited."""
    start, waited = time.monotonic(), 0.0
    while True:
        level, message = verdict(estimate, {device: available_memory(device) for device in devices})
        if level != "error" or waited >= 60 * wait_min:
            if waited and level != "error":
                log.warning("memory check: the memory freed after %.1f min of waiting", waited / 60)
            return level, message, waited
        if not waited:
            log.warning("%s Waiting up to %s min for it to free (memory_check_wait_min), asking every %.0f s.",
                        message, wait_min, poll_s)
        time.sleep(min(poll_s, 60 * wait_min - waited))
        waited = time.monotonic() - start


def check_memory(cfg: RunConfig, trainer_device: torch.device | str, world: int = 1, is_main: bool = True) -> Estimate | None:
    """The start-up check (a3po.run.main.run, after precision and device are resolved, before
    the run directory is claimed): ConfigError where the estimated peak exceeds what a device
    has (`memory_check=error`; after waiting up to `memory_check_wait_min` minutes for it to
    free), a warning where it does or comes within 20% of it, nothing with `memory_check=off`.
    Returns the estimate (None where it was skipped). A rank other than rank 0 (`is_main`)
    holds no rollout: it checks its own device and the host only, and never opens a CUDA
    context on the rollout's GPU by asking it for its free memory."""
    mode = memory_check_mode(cfg.memory_check)
    if mode == "off":
        return None
    arch, source = architecture_of(cfg.model)
    if arch is None:
        log.warning("memory check skipped: %s", source)
        return None
    estimate = estimate_run(cfg, arch, trainer_device, world)
    own = {"cpu", _device_name(torch.device(trainer_device))}
    checked = [device for device in estimate.devices() if is_main or device in own]
    wait_min = cfg.memory_check_wait_min if mode == "error" else 0
    level, message, waited_s = wait_for_room(estimate, checked, wait_min)
    if level == "error" and mode == "error":
        waited = f" It waited {waited_s / 60:.1f} min (memory_check_wait_min={wait_min})." if waited_s else ""
        raise ConfigError(f"{message}{waited} Lower the keys that drive the largest parts, set memory_check_wait_min "
                          "to wait for memory another job holds, or set memory_check=warn to start anyway "
                          "(memory_check=off skips the estimate; docs/design.md, \"Memory check\")")
    if level != "ok":
        log.warning("%s%s", message, " Starting anyway (memory_check=warn)." if level == "error" else
                    " Within 20% of the limit: starting.")
    return estimate


def host_ceiling(estimate: Estimate | None, trainer_device: str, world: int) -> int | None:
    """The resident memory past which a run hands its heap's freed pages back at a step's start
    (a3po.allocator.release_freed_memory, a3po.run.loop): the estimate's host peak, for one
    process that trains on the CPU. None otherwise: no estimate (memory_check=off, an unknown
    architecture), a GPU trainer (its host frees little a step), torchrun's ranks (one estimate
    for the host's processes together)."""
    if estimate is None or world != 1 or trainer_device != "cpu" or "cpu" not in estimate.devices():
        return None
    return estimate.peak("cpu")


if __name__ == "__main__":  # the command moved to the module that has it (no import back up to it)
    print("error: the memory plan's command is `python -m a3po.run.memory_plan <overrides>`", file=sys.stderr)
    sys.exit(2)
