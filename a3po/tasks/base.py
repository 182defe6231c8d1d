"""What every task hands the trainer: problems with a canonical answer, and a prompt format.

A task's training prompts are a pure function of `(seed, step)` so that a run resumed
from a checkpoint sees exactly the prompts it would have seen had it never stopped; no
task keeps RNG state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# One short line because the trainer's default budget is 32 new tokens: the answer has to
# arrive before the cut-off, and `####` is the GSM8K convention the reward looks for. Of the
# instructions tried on arith level 1 (n=128 each) this scored best: 0.33, against 0.22-0.23
# for "Answer in one short line that ends with #### and the number.", "Solve it and put the
# final answer after ####." and "Write the sum, then the final answer after ####.".
ANSWER_INSTRUCTION = "Put the final answer after ####."


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


@dataclass(frozen=True)
class RewardResult:
    score: float
    malformed: bool


class Task(Protocol):
    def train_batch(self, step: int, n_prompts: int) -> list[Problem]:
        ...

    def eval_problems(self, n: int) -> list[Problem]:
        ...

    def reward(self, completion: str, answer: str) -> RewardResult:
        ...


def render_prompt(tokenizer, question: str, instruction: str = ANSWER_INSTRUCTION) -> str:
    """The exact text the policy sees; chat models are far more accurate in their own format."""
    content = f"{question}\n{instruction}" if instruction else question
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return f"Question: {content}\nAnswer:"


def encode_prompt(tokenizer, question: str, instruction: str = ANSWER_INSTRUCTION) -> list[int]:
    """`render_prompt`'s token ids, as a rollout engine takes them (the template adds any
    special tokens itself, so the tokenizer adds none)."""
    return tokenizer(render_prompt(tokenizer, question, instruction), add_special_tokens=False).input_ids
