"""Measure a task's starting mean reward under the trainer's sampling settings.

GRPO learns nothing from a group whose rewards are all equal, so a task level is only
useful if the starting policy succeeds sometimes but not always. This samples through the hf
rollout engine itself (`HFEngine.generate`: the trainer's temperature, top_p, no top-k, stop
tokens and seeding), so it measures exactly what training samples, and prints the mean reward
with its standard error, e.g.

    python -m a3po.rollout.calibrate --level 1 --prompts 32 --samples 4
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from a3po.models import load_policy
from a3po.rollout.hf import HFEngine
from a3po.tasks import ANSWER_INSTRUCTION, build_task, encode_prompt


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
) -> dict:
    """Mean reward of `n_samples` samples for each of the `n_prompts` problems of a run's step-0
    training batch (the task's `train_batch(0, n_prompts)`). `batch_size`: sequences per `generate` call, None = all at once (the trainer's
    default, `rollout.batch_size` unset)."""
    problems = task.train_batch(0, n_prompts)
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="arith")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--operations", default=None, help="words: comma-separated, e.g. add,sub")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the engine's, as a run's")
    parser.add_argument("--path", default=None, help="local GSM8K file or directory")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instruction", default=ANSWER_INSTRUCTION, help="to try other prompts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(
        {"name": "smollm2_135m", "source": "smollm2_gguf", "dtype": "float32"}
    )
    model.eval()
    task_cfg = {"name": args.task, "level": args.level, "path": args.path}
    if args.operations:
        task_cfg["operations"] = args.operations.split(",")
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
    )
    for question, answer, completion, score in result["examples"]:
        print(f"{question!r} (gold {answer}) -> {completion!r} score={score}")
    print(
        f"task={args.task} level={args.level} n={result['n']} "
        f"mean_reward={result['mean_reward']:.3f} +- {result['standard_error']:.3f} "
        f"malformed={result['malformed_rate']:.3f} truncated={result['truncated_rate']:.3f} "
        f"({time.perf_counter() - started:.0f}s)"
    )


if __name__ == "__main__":
    main()
