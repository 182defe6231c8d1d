"""The words task (a3po.tasks.words) and the held-out eval's standard error."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from a3po.errors import ConfigError
from a3po.rollout.producer import eval_metrics
from a3po.tasks import build_task
from a3po.tasks.words import OPERATIONS, word_problems, words_split
from conftest import REPO


def test_the_task_has_thousands_of_distinct_problems_and_a_disjoint_held_out_split():
    problems = word_problems(OPERATIONS)
    assert len(problems) == 12 * 10 * 2 * (64 + 28 + 64)  # names x objects x phrasings x number pairs
    assert len({p.question for p in problems}) == len(problems)
    train, held_out = words_split(OPERATIONS, 0.2)
    assert len(train) >= 2000 and len(held_out) >= 500
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len(train) + len(held_out) == len(problems)


def test_every_answer_is_the_questions_arithmetic():
    for problem in word_problems(OPERATIONS)[::97]:
        a, b = (int(x) for x in re.findall(r"\b\d\b", problem.question)[:2])
        if "gives away" in problem.question or "lost" in problem.question:
            expected = a - b
        elif "more" in problem.question:
            expected = a + b
        else:
            expected = a * b
        assert problem.answer == str(expected), problem


def test_training_draws_replay_by_seed_and_step_and_eval_is_the_same_for_every_seed():
    task, again, other = (build_task({"name": "words"}, seed) for seed in (0, 0, 1))
    assert task.train_batch(3, 8) == again.train_batch(3, 8) != other.train_batch(3, 8)
    assert task.eval_problems(300) == other.eval_problems(300)
    first = task.eval_problems(300)
    assert {p.question.split()[0] for p in first} == {"Sara", "Tom", "Maya", "Ben", "Lena", "Omar", "Ana", "Leo", "Zoe",
                                                      "Sam", "Nia", "Raj"}  # the shuffled order spans the names


def test_operations_select_the_problems_and_bad_ones_fail_with_the_key():
    task = build_task({"name": "words", "operations": ["sub"]}, 0)
    assert all(("gives away" in p.question or "lost" in p.question) for p in task.eval_problems(50))
    with pytest.raises(ConfigError, match=r"task.operations=\['div'\] is not allowed"):
        build_task({"name": "words", "operations": ["div"]}, 0)
    with pytest.raises(ConfigError, match="task.operations"):
        build_task({"name": "words", "operations": []}, 0)


def test_the_gsm8k_export_loads_as_gsm8k_and_grades_alike(tmp_path):
    path = tmp_path / "words.jsonl"
    done = subprocess.run([sys.executable, "-m", "a3po.tasks.words", "--export", str(path), "--operations", "mul"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 12 * 10 * 2 * 64 and records[0]["answer"].startswith("#### ")
    gsm8k = build_task({"name": "gsm8k", "path": str(path)}, 0)
    words = build_task({"name": "words", "operations": ["mul"]}, 0)
    assert gsm8k.eval_problems(288) == words.eval_problems(288)  # the same problems, in the same order
    problem = gsm8k.eval_problems(1)[0]
    for completion in (f"So it is {problem.answer}. #### {problem.answer}", "#### 1000", "no number"):
        assert gsm8k.reward(completion, problem.answer) == words.reward(completion, problem.answer)


def test_the_eval_standard_error_takes_the_problems_as_units():
    rewards = [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
    metrics = eval_metrics(rewards)
    means = [2 / 3, 0.0, 2 / 3, 1.0]
    mean = sum(means) / 4
    assert metrics["eval/reward"] == pytest.approx(mean)
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / 3)
    assert metrics["eval/reward_se"] == pytest.approx(sd / 2)
    one_sample = eval_metrics([[1.0], [0.0], [0.0], [1.0]])  # one sample a problem: the binomial SE (n - 1)
    assert one_sample["eval/reward_se"] == pytest.approx(math.sqrt(0.25 * 4 / 3 / 4))


def test_a_run_logs_the_eval_and_its_standard_error(tiny_cfg):
    from a3po.run.main import run, run_dir_of
    from a3po.run.metrics_log import read_metrics

    cfg = tiny_cfg("task=words", "train.total_steps=2", "train.eval_every=2", "train.eval_size=6",
                   "train.eval_samples=2", "rollout.max_new_tokens=4")
    run(cfg)
    last = read_metrics(run_dir_of(cfg) / "metrics.jsonl")[-1]
    assert 0.0 <= last["eval/reward"] <= 1.0 and math.isfinite(last["eval/reward_se"])


def test_the_memory_check_knows_the_longest_word_problem(tiny_cfg):
    from a3po.config import parse_config
    from a3po.run.memory_check import longest_prompt_tokens

    cfg = parse_config(tiny_cfg("task=words"))
    tokens, how = longest_prompt_tokens(cfg.task, cfg.model)
    assert how == "the task's longest question, tokenized"
    assert 40 < tokens < 120  # a one-line question in SmolLM2's chat template, not the 400-token bound
