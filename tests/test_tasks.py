"""Tasks: deterministic prompts, disjoint splits, correct answers and a reward that never raises."""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from a3po.errors import ConfigError
from a3po.tasks import (
    ANSWER_INSTRUCTION,
    TASKS,
    Problem,
    RewardResult,
    build_task,
    render_prompt,
    validate_task_cfg,
)
from a3po.tasks.gsm8k import gold_answer
from a3po.tasks.reward import extract_answer

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gsm8k_sample.jsonl"
LEVELS = (1, 2, 3)


def arith(level: int = 1, seed: int = 0):
    return build_task({"name": "arith", "level": level}, seed=seed)


def questions(problems: list[Problem]) -> list[str]:
    return [p.question for p in problems]


# ----------------------------------------------------------------------------- arith


@pytest.mark.parametrize("level", LEVELS)
def test_train_batch_depends_on_seed_and_step_only(level):
    task = arith(level, seed=3)
    later_first = task.train_batch(5, 8)
    assert task.train_batch(0, 8) == arith(level, seed=3).train_batch(0, 8)
    assert task.train_batch(5, 8) == later_first  # call order does not matter
    assert arith(level, seed=3).train_batch(5, 8) == later_first  # a resumed run
    assert task.train_batch(6, 8) != later_first
    assert arith(level, seed=4).train_batch(5, 8) != later_first
    assert len(later_first) == 8


@pytest.mark.parametrize("level", LEVELS)
def test_held_out_problems_never_appear_in_training(level):
    task = arith(level)
    held_out = set(questions(task.eval_problems(32)))
    assert held_out
    trained = {q for step in range(200) for q in questions(task.train_batch(step, 8))}
    assert not held_out & trained


@pytest.mark.parametrize("level", LEVELS)
def test_eval_set_is_fixed_and_shared_by_every_seed(level):
    first = arith(level, seed=0).eval_problems(16)
    assert first == arith(level, seed=9).eval_problems(16)
    assert len(set(questions(first))) == len(first)
    assert arith(level).eval_problems(8) == first[:8]


def test_small_level_returns_its_whole_held_out_split():
    held_out = arith(1).eval_problems(1000)
    # 100 single-digit sums, ~20% held out; no problem repeated.
    assert 5 < len(held_out) < 40
    assert len(set(questions(held_out))) == len(held_out)


def _expression(question: str) -> str:
    match = re.fullmatch(r"Calculate (.+)\.", question)
    assert match, question
    return match.group(1)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate_with_python(expression: str) -> int:
    """An independent check of arith's own evaluator: Python's parser and precedence."""

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise AssertionError(f"unexpected syntax in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize("level", LEVELS)
def test_every_answer_is_correct(level):
    task = arith(level)
    problems = task.eval_problems(32) + [p for s in range(50) for p in task.train_batch(s, 8)]
    for problem in problems:
        assert problem.answer == str(_evaluate_with_python(_expression(problem.question)))


def _operands(problem: Problem) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", problem.question)]


def test_levels_get_harder():
    def sample(level):
        return [p for s in range(30) for p in arith(level).train_batch(s, 8)]

    single = sample(1)
    assert all(0 <= n <= 9 for p in single for n in _operands(p))
    assert all(" + " in p.question and len(_operands(p)) == 2 for p in single)
    double = sample(2)
    assert all(10 <= n <= 99 for p in double for n in _operands(p))
    mixed = sample(3)
    assert all(len(_operands(p)) == 3 for p in mixed)
    assert any("*" in p.question for p in mixed) and any(" - " in p.question for p in mixed)
    assert len({p.answer for p in double}) > len({p.answer for p in single})


def test_arith_reward_uses_the_numeric_grader():
    task = arith()
    assert task.reward("#### 7", "7") == RewardResult(score=1.0, malformed=False)


# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    "completion, answer, score",
    [
        ("#### 12", "12", 1.0),
        ("3 + 9 = 12\n#### 12", "12", 1.0),
        ("#### 13", "12", 0.0),
        ("The answer is 12.", "12", 1.0),  # no marker: the last number
        ("5 + 7 = 12, so the sum is 12", "12", 1.0),
        ("I think 12, no wait, 13", "12", 0.0),
        ("12 is tempting but #### 13", "12", 0.0),  # the marker beats the last number
        ("#### 12\nand some chatter about 99 balloons", "12", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $18", "18", 1.0),
        ("#### -47", "-47", 1.0),
        ("#### 47", "-47", 0.0),
        ("#### 12.0", "12", 1.0),
        ("#### 7 + 5 = 12", "12", 0.0),  # the first number after the marker is the answer
        ("#### nothing here but 12 earlier", "12", 1.0),
        ("#### 2.5", "2.5", 1.0),
        ("#### 1/2", "0.5", 1.0),
        ("#### .5", "0.5", 1.0),
        ("#### \u22125", "-5", 1.0),  # the Unicode minus
        ("#### -$5", "-5", 1.0),
        ("#### $ 18", "18", 1.0),
        ("#### 1,000,000", "1000000", 1.0),
    ],
)
def test_reward_grades_the_final_answer(completion, answer, score):
    result = arith().reward(completion, answer)
    assert result.score == score
    assert not result.malformed


@pytest.mark.parametrize(
    "garbage", ["", "####", "no numbers at all", "#### x####", "\x00\ufffd<|im_end|>"]
)
def test_output_without_a_number_is_malformed(garbage):
    assert arith().reward(garbage, "12") == RewardResult(score=0.0, malformed=True)


@pytest.mark.parametrize(
    "completion, extracted",
    [
        ("The answer is:\n- 5", "5"),  # a bullet, not a sign
        ("####\n- 5 coins", "5"),
        ("8 - 3 = 5, so 9 - 4", "4"),  # a binary minus, not a sign
        ("#### -5", "-5"),
        ("#### 1,2345", "1"),  # a comma group is three digits: never the run cut to 1234
        ("#### 12,34", "12"),
        ("#### 1,000.50", "1000.50"),
    ],
)
def test_extract_answer_reads_signs_and_separators_as_written(completion, extracted):
    assert extract_answer(completion) == extracted


def test_extract_answer_bounds_digit_runs():
    huge = "9" * 5000
    extracted = extract_answer(f"#### {huge}")
    assert extracted is not None and len(extracted) < 100


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300), st.sampled_from(["12", "-3", "1000", "2.5"]))
def test_reward_never_raises(text, answer):
    result = arith().reward(text, answer)
    assert result.score in (0.0, 1.0)
    assert not (result.malformed and result.score)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                ["####", "$", ",", ".", "/", "-", "\\frac{", "}", "=", " ", "\n", "1e400"]
            ),
            st.integers(-10**30, 10**30).map(str),
        ),
        max_size=40,
    ).map("".join)
)
def test_reward_never_raises_on_number_soup(text):
    result = arith().reward(text, "42")
    assert result.score in (0.0, 1.0)


def test_reward_works_outside_the_main_thread():
    """math-verify's timeouts use signal.alarm, which fails in threads; ours must not."""
    results = []
    worker = threading.Thread(target=lambda: results.append(arith().reward("#### 12", "12")))
    worker.start()
    worker.join()
    assert results == [RewardResult(score=1.0, malformed=False)]


# ----------------------------------------------------------------------------- gsm8k


def gsm8k_from_fixture(seed: int = 0, path: Path = FIXTURE):
    return build_task(
        {"name": "gsm8k", "path": str(path), "held_out_fraction": 0.5}, seed=seed
    )


def test_gold_answer_is_the_text_after_the_marker():
    assert gold_answer("so 3 * 4 = <<3*4=12>>12\n#### 12") == "12"
    assert gold_answer("#### 1,000") == "1000"
    with pytest.raises(ValueError):
        gold_answer("no final answer")


def test_gsm8k_from_a_local_jsonl_file():
    task = gsm8k_from_fixture()
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    gold = {r["question"]: gold_answer(r["answer"]) for r in records}
    held_out = task.eval_problems(100)
    trained = {q for step in range(10) for q in questions(task.train_batch(step, 3))}
    assert held_out and trained
    assert not set(questions(held_out)) & trained
    assert set(questions(held_out)) | trained == set(gold)
    for problem in held_out + task.train_batch(0, 3):
        assert problem.answer == gold[problem.question]
        assert task.reward(f"The answer is\n#### {problem.answer}", problem.answer).score == 1.0


def test_gsm8k_epochs_cover_the_training_set_deterministically():
    task = gsm8k_from_fixture(seed=1)
    size = len(task.train)
    epoch = [p for step in range(size) for p in task.train_batch(step, 1)]
    assert sorted(questions(epoch)) == sorted(questions(task.train))
    assert gsm8k_from_fixture(seed=1).train_batch(7, 2) == task.train_batch(7, 2)
    assert [task.train_batch(s, 1) for s in range(3 * size)] != [
        gsm8k_from_fixture(seed=2).train_batch(s, 1) for s in range(3 * size)
    ]


def test_gsm8k_from_a_directory_with_train_and_test_files(tmp_path):
    lines = FIXTURE.read_text().splitlines()
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "train.jsonl").write_text("\n".join(lines[:6]) + "\n")
    (tmp_path / "main" / "test.jsonl").write_text("\n".join(lines[6:]) + "\n")
    task = build_task({"name": "gsm8k", "path": str(tmp_path)}, seed=0)
    assert len(task.train) == 6
    held_out = [json.loads(line)["question"] for line in lines[6:]]
    assert sorted(questions(task.eval_problems(10))) == sorted(held_out)  # the test file, in eval order


def test_gsm8k_from_parquet(tmp_path):
    import pandas as pd

    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    pd.DataFrame(records).to_parquet(tmp_path / "gsm8k.parquet")
    task = gsm8k_from_fixture(path=tmp_path / "gsm8k.parquet")
    assert len(task.train) + len(task.eval_problems(100)) == len(records)


def test_gsm8k_too_small_to_split_is_a_config_error():
    with pytest.raises(ConfigError, match="held-out"):
        build_task({"name": "gsm8k", "path": str(FIXTURE), "held_out_fraction": 0.01}, seed=0)


def test_gsm8k_missing_local_path_fails_before_loading():
    with pytest.raises(ConfigError, match="task.path"):
        validate_task_cfg({"name": "gsm8k", "path": "/no/such/gsm8k.jsonl"})


def _bad_copy(tmp_path, name: str, line_number: int, replacement: str) -> Path:
    """The fixture with its `line_number`-th line (1-based) replaced."""
    lines = FIXTURE.read_text().splitlines()
    lines[line_number - 1] = replacement
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _data_error(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        gsm8k_from_fixture(path=path)
    message = str(error.value)
    assert "\n" not in message and f"task.path file {path}" in message
    assert "question and answer" in message and "####" in message  # what a record must hold
    return message


@pytest.mark.parametrize("line_number, replacement, problem", [
    (3, '{"question": "cut short", "answer": "#### 1', "line 3 is not valid JSON"),
    (5, "not json at all", "line 5 is not valid JSON (Expecting value at column 1)"),
    (2, '{"question": "Q?", "solution": "#### 4"}', "line 2 has no field answer (its fields: question, solution)"),
    (4, '["Q?", "#### 4"]', "line 4 is a list, not an object"),
    (6, '{"question": "Q?", "answer": 4}', "line 6: field answer is a number, not a string"),
    (1, '{"question": "Q?", "answer": "4"}', "line 1: GSM8K solution has no '####' final answer"),
])
def test_gsm8k_bad_jsonl_line_is_a_config_error_naming_file_and_line(tmp_path, line_number, replacement, problem):
    message = _data_error(_bad_copy(tmp_path, "gsm8k.jsonl", line_number, replacement))
    assert problem in message


def test_gsm8k_json_file_must_be_a_list_of_objects(tmp_path):
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    listed = tmp_path / "gsm8k.json"
    listed.write_text(json.dumps(records, indent=1))
    assert len(gsm8k_from_fixture(path=listed).train) > 0  # the good case: one list of objects
    listed.write_text(json.dumps([*records[:3], "just a string"]))
    assert "record 3 is a string, not an object" in _data_error(listed)
    listed.write_text(json.dumps(records, indent=1)[:-40])  # cut short
    assert "is not valid JSON" in _data_error(listed)


def test_gsm8k_parquet_without_the_fields_is_a_config_error(tmp_path):
    import pandas as pd

    path = tmp_path / "gsm8k.parquet"
    pd.DataFrame({"question": ["Q?"], "solution": ["#### 4"]}).to_parquet(path)
    assert "cannot be read as parquet" in _data_error(path)


def test_cli_reports_a_bad_gsm8k_file_in_one_line(tmp_path):
    bad = _bad_copy(tmp_path, "gsm8k.jsonl", 3, "{oops")
    proc = subprocess.run(
        [sys.executable, "experiments/train.py", "task=gsm8k", f"task.path={bad}", "model=tiny", "device=cpu",
         "logger=none", f"output_root={tmp_path / 'outputs'}"],
        cwd=REPO, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(error_lines) == 1 and f"task.path file {bad}, line 3 is not valid JSON" in error_lines[0]
    assert "Traceback" not in proc.stderr


def _offline(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    # whatever this machine can reach or has cached, the hub load fails as it does offline
    import datasets

    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)


def test_gsm8k_from_an_unreachable_hub_is_a_config_error_naming_task_path(monkeypatch):
    _offline(monkeypatch)
    with pytest.raises(ConfigError) as error:
        build_task({"name": "gsm8k", "path": None}, seed=0)
    message = str(error.value)
    assert "task.path" in message and "openai/gsm8k" in message
    assert "question" in message and "answer" in message and "####" in message
    assert isinstance(error.value.__cause__, ConnectionError)


def test_gsm8k_hub_errors_unrelated_to_reaching_it_are_not_turned_into_config_errors(monkeypatch):
    import datasets

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the loader")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(RuntimeError, match="a bug in the loader"):
        build_task({"name": "gsm8k", "path": None}, seed=0)


def test_cli_reports_an_unreachable_gsm8k_hub_as_a_config_error(tmp_path):
    """No monkeypatching across a subprocess: offline mode and an empty cache make the hub
    unreachable for `datasets` at once (no network retries), wherever the test runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    proc = subprocess.run(
        [sys.executable, "experiments/train.py", "task=gsm8k", "model=tiny", "device=cpu", "logger=none",
         f"output_root={tmp_path / 'outputs'}"],
        cwd=REPO, capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    # the start's offline check (a3po.run.fetch) names what is missing and how to get it
    assert "config error:" in proc.stderr and "task.path" in proc.stderr
    assert "openai/gsm8k" in proc.stderr and "python -m a3po.run.fetch" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- config


def test_unknown_task_names_the_key_and_choices():
    with pytest.raises(ConfigError) as error:
        build_task({"name": "math500"}, seed=0)
    message = str(error.value)
    assert "task.name" in message and "math500" in message
    assert all(name in message for name in TASKS)


@pytest.mark.parametrize("level", [0, 4, "1", None])
def test_unknown_arith_level_is_rejected(level):
    with pytest.raises(ConfigError, match="task.level"):
        validate_task_cfg({"name": "arith", "level": level})


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5, "0.2"])
def test_held_out_fraction_must_be_a_proper_fraction(fraction):
    with pytest.raises(ConfigError, match="task.held_out_fraction"):
        validate_task_cfg({"name": "arith", "level": 1, "held_out_fraction": fraction})


def test_every_task_config_in_conf_validates():
    configs = sorted((REPO / "conf" / "task").glob("*.yaml"))
    assert {p.stem for p in configs} == set(TASKS)
    for path in configs:
        validate_task_cfg(OmegaConf.load(path))
    build_task(OmegaConf.load(REPO / "conf" / "task" / "arith.yaml"), seed=0).train_batch(0, 2)


# ----------------------------------------------------------------------------- prompts


class _TemplateFreeTokenizer:
    chat_template = None


def test_prompt_without_a_chat_template_still_asks_for_the_marker():
    prompt = render_prompt(_TemplateFreeTokenizer(), "Calculate 2 + 2.")
    assert "Calculate 2 + 2." in prompt and "####" in prompt


def test_prompt_uses_the_chat_template():
    from a3po.models import smollm2_cache_dir

    cache = smollm2_cache_dir()
    if not cache.exists():
        pytest.skip("needs the converted SmolLM2 cache (created by tests/test_models.py)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cache))
    prompt = render_prompt(tokenizer, "Calculate 2 + 2.")
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert f"Calculate 2 + 2.\n{ANSWER_INSTRUCTION}" in prompt


# ----------------------------------------------------------------------------- calibration


def test_calibration_samples_exactly_what_the_rollout_engine_samples():
    """`python -m a3po.rollout.calibrate` goes through `HFEngine.generate` with the trainer's prompt
    encoding: the same seed gives the same completions, and the caller's RNG stream stays put."""
    import torch

    from a3po.models import CONVERSION_MARKER, load_policy, smollm2_cache_dir
    from a3po.rollout.hf import HFEngine
    from a3po.tasks import encode_prompt
    from a3po.rollout.calibrate import measure_mean_reward

    if not (smollm2_cache_dir() / CONVERSION_MARKER).exists():
        pytest.skip("needs the converted SmolLM2 cache (created by tests/test_models.py)")
    torch.set_num_threads(1)
    model_cfg = OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml")
    model, tokenizer = load_policy(model_cfg, seed=0)
    task = arith(1)
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    result = measure_mean_reward(model, tokenizer, task, n_prompts=3, n_samples=2, max_new_tokens=6,
                                 batch_size=4, seed=11)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert result["n"] == 6 and len(result["examples"]) == 4
    assert 0.0 <= result["mean_reward"] <= 1.0 and 0.0 <= result["malformed_rate"] <= 1.0

    problems = task.train_batch(0, 3)
    prompt_ids = [encode_prompt(tokenizer, p.question) for p in problems]
    assert prompt_ids[0] == tokenizer(render_prompt(tokenizer, problems[0].question),
                                      add_special_tokens=False).input_ids
    groups = HFEngine(model, tokenizer, max_new_tokens=6, batch_size=4).generate(prompt_ids, 2, seed=11)
    expected = [(p.question, p.answer, tokenizer.decode(s.response_ids, skip_special_tokens=True))
                for p, group in zip(problems, groups) for s in group]
    assert [example[:3] for example in result["examples"]] == expected[:4]
