"""Measure a task's starting mean reward under the trainer's sampling settings.

GRPO learns nothing from a group whose rewards are all equal, so a task level is only
useful if the starting policy succeeds sometimes but not always. This samples through the hf
rollout engine itself (`HFEngine.generate`: the trainer's temperature, top_p, no top-k, stop
tokens and seeding), so it measures exactly what training samples, and prints the mean reward
with its standard error, e.g.

    python -m a3po.rollout.calibrate --level 1 --prompts 32 --samples 4
    python -m a3po.rollout.calibrate --task reasoning_gym --dataset leg_counting \
        --dataset-config min_animals=2 --dataset-config max_animals=3 --prompts 32 --samples 4

`--split train` (the default) scores the run's step-0 training batch; `--split held_out` the
first `--prompts` held-out problems, the ones `train.eval_size` evaluates, which is what a study's
"starts at 0.15-0.45 held out" reads (for a small problem space the two differ: docs/testbed.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, Sequence

import torch
import yaml

from a3po.errors import EXIT_CONFIG_ERROR, ConfigError
from a3po.models import load_policy
from a3po.rollout.hf import HFEngine
from a3po.run_config import TaskConfig
from a3po.schema import RolloutConfig
from a3po.tasks import ANSWER_INSTRUCTION, build_task, encode_prompt, validate_task_cfg


def measure_mean_reward(
    model,
    tokenizer,
    task,
    *,
    n_prompts: int,
    n_samples: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int | None = None,
    seed: int = 0,
    instruction: str = ANSWER_INSTRUCTION,
    precision: str = "fp32",
    split: str = "train",
) -> dict:
    """Mean reward of `n_samples` samples for each of `n_prompts` problems: a run's step-0 training
    batch (`split="train"`: the task's `train_batch(0, n_prompts)`) or the first held-out ones
    (`split="held_out"`: `eval_problems(n_prompts)`, all of them where the split holds fewer).
    `batch_size`: sequences per `generate` call, None = all at once (the trainer's default,
    `rollout.batch_size` unset)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; allowed: {list(SPLITS)}")
    problems = task.train_batch(0, n_prompts) if split == "train" else task.eval_problems(n_prompts)
    engine = HFEngine(model, tokenizer, temperature=temperature, top_p=top_p,
                      max_new_tokens=max_new_tokens, batch_size=batch_size, precision=precision)
    groups = engine.generate([encode_prompt(tokenizer, p.question, instruction) for p in problems],
                             n_samples, seed=seed)
    scores, malformed, truncated, examples = [], 0, 0, []
    for problem, group in zip(problems, groups):
        for sample in group:
            truncated += not sample.finished
            completion = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            result = task.reward(completion, problem.answer)
            scores.append(result.score)
            malformed += result.malformed
            if len(examples) < 4:
                examples.append((problem.question, problem.answer, completion, result.score))
    mean = sum(scores) / len(scores)
    return {
        "mean_reward": mean,
        "standard_error": math.sqrt(mean * (1 - mean) / len(scores)),
        "malformed_rate": malformed / len(scores),
        "truncated_rate": truncated / len(scores),
        "n": len(scores),
        "examples": examples,
    }


SPLITS = ("train", "held_out")  # --split: the step-0 training batch, or the held-out problems a run evaluates
# The flags that are the trainer's rollout settings, each held to `rollout.<key>`'s rule
# (a3po.schema), so calibration samples nothing a run would refuse.
ROLLOUT_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "max_new_tokens": "--max-new-tokens"}
# task.<key> -> the flag that sets it
TASK_FLAGS = {"name": "--task", "level": "--level", "path": "--path", "operations": "--operations",
              "dataset": "--dataset", "config": "--dataset-config", "size": "--size"}


def dataset_config(pairs: Sequence[str] | None) -> dict[str, Any] | None:
    """`--dataset-config KEY=VALUE` flags as task.config (each value read as YAML, as Hydra reads
    an override's: 3 an int, [1, 2] a list); None where there are none."""
    if not pairs:
        return None
    config = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--dataset-config={pair!r} is not allowed; it must be KEY=VALUE, a key of the dataset's "
                              "config (task.config.KEY)")
        config[key.strip()] = yaml.safe_load(value)
    return config


def task_config(args: argparse.Namespace) -> dict[str, Any]:
    """The task.* keys the flags set (the reasoning_gym flags only where an older caller's
    Namespace has them)."""
    task_cfg = {"name": args.task, "level": args.level, "path": args.path}
    if args.operations:
        task_cfg["operations"] = args.operations.split(",")
    if args.task == "reasoning_gym":
        for key in ("dataset", "size"):
            if getattr(args, key, None) is not None:
                task_cfg[key] = getattr(args, key)
        task_cfg["config"] = dataset_config(getattr(args, "dataset_config", None))
    return task_cfg


def task_label(task_cfg: dict[str, Any]) -> str:
    """How the result line names the task: its name and the keys that pick its problems."""
    task = TaskConfig.of(task_cfg, "task")
    if task.name == "reasoning_gym":
        return f"task=reasoning_gym dataset={task.dataset} config={task.config or {}}"
    return f"task={task.name} level={task.level}"


def check_args(args: argparse.Namespace) -> dict:
    """The task config the flags ask for, after every check that needs no model: the counts,
    the sampling settings (as the training config's rollout group allows them) and the task
    (a3po.tasks.validate_task_cfg). Raises ConfigError naming the flag."""
    for flag in ("prompts", "samples", "threads"):
        value = getattr(args, flag)
        if value < 1:
            raise ConfigError(f"--{flag}={value!r} is not allowed; it must be an integer >= 1")
    if args.seed < 0:
        raise ConfigError(f"--seed={args.seed!r} is not allowed; it must be an integer >= 0")
    rules = {f.name: f.metadata for f in dataclasses.fields(RolloutConfig)}
    for key, flag in ROLLOUT_FLAGS.items():
        value = getattr(args, key)
        if not rules[key]["ok"](value):
            raise ConfigError(f"{flag}={value!r} is not allowed; {rules[key]['allowed']} (as rollout.{key})")
    task_cfg = task_config(args)
    try:
        validate_task_cfg(task_cfg)
    except ConfigError as err:  # it names task.<key> (task.config.<key>): name the flag that set it as well
        key = str(err).split("=")[0].split(" ")[0].removeprefix("task.").split(".")[0]
        flag = TASK_FLAGS.get(key)
        raise ConfigError(f"{flag}: {err}" if flag else str(err)) from None
    return task_cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m a3po.rollout.calibrate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="arith")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--operations", default=None, help="words: comma-separated, e.g. add,sub")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the engine's, as a run's")
    parser.add_argument("--path", default=None, help="local GSM8K file or directory")
    parser.add_argument("--dataset", default=None, help="reasoning_gym: the reasoning-gym dataset (task.dataset)")
    parser.add_argument("--dataset-config", action="append", metavar="KEY=VALUE",
                        help="reasoning_gym: one of the dataset's config keys (task.config.KEY); repeat for more")
    parser.add_argument("--size", type=int, default=None, help="reasoning_gym: problems generated (task.size)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train", choices=SPLITS,
                        help="train: the step-0 training batch; held_out: the first --prompts held-out problems")
    parser.add_argument("--instruction", default=ANSWER_INSTRUCTION, help="to try other prompts")
    parser.add_argument("--threads", type=int, default=1)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:  # bad input fails here, before the model loads (exit 2, one line)
        task_cfg = check_args(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(
        {"name": "smollm2_135m", "source": "smollm2_gguf", "dtype": "float32"}
    )
    model.eval()
    task = build_task(task_cfg, seed=args.seed)
    started = time.perf_counter()
    result = measure_mean_reward(
        model,
        tokenizer,
        task,
        n_prompts=args.prompts,
        n_samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        instruction=args.instruction,
        precision=args.precision,
        split=args.split,
    )
    for question, answer, completion, score in result["examples"]:
        print(f"{question!r} (gold {answer}) -> {completion!r} score={score}")
    print(
        f"{task_label(task_cfg)} split={args.split} n={result['n']} "
        f"mean_reward={result['mean_reward']:.3f} +- {result['standard_error']:.3f} "
        f"malformed={result['malformed_rate']:.3f} truncated={result['truncated_rate']:.3f} "
        f"({time.perf_counter() - started:.0f}s)"
    )


if __name__ == "__main__":
    main()
