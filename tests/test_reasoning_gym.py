"""task=reasoning_gym (a3po/tasks/reasoning_gym.py): any reasoning-gym dataset as a task, its
keys checked at start, a held-out split of problems training never sees, the reward the
dataset's own score_answer; gsm_symbolic as the offline GSM8K of the paper's setting; the
calibration command; a run that reaches a figure."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from a3po.errors import EXIT_CONFIG_ERROR, ConfigError
from a3po.run_config import TaskConfig
from a3po.tasks import RewardResult, build_task, validate_task_cfg
from a3po.tasks.reasoning_gym import DEFAULT_SIZE, POOL_SEED, OracleAnswer, ReasoningGymTask, config_keys
from a3po.tasks.splits import DEFAULT_HELD_OUT_FRACTION
from conftest import CONF_DIR, REPO, TINY_OVERRIDES, compose_config


def gym(dataset: str, seed: int = 0, **keys) -> ReasoningGymTask:
    return build_task({"name": "reasoning_gym", "dataset": dataset, **keys}, seed=seed)


# ---------------------------------------------------------------------------- keys, checked at start

def test_the_yaml_and_the_typed_defaults_are_the_tasks_own():
    shipped = yaml.safe_load((CONF_DIR / "task" / "reasoning_gym.yaml").read_text())
    defaults = TaskConfig()
    assert shipped == {"name": "reasoning_gym", "dataset": defaults.dataset, "config": defaults.config,
                       "size": DEFAULT_SIZE, "held_out_fraction": DEFAULT_HELD_OUT_FRACTION}
    assert defaults.size == DEFAULT_SIZE and defaults.config is None
    validate_task_cfg(shipped)


def test_dataset_config_composes_as_a_mapping_or_one_key_at_a_time():
    whole = compose_config(["task=reasoning_gym", "task.dataset=chain_sum", "task.config={min_terms: 2, max_terms: 3}"])
    one = compose_config(["task=reasoning_gym", "task.dataset=chain_sum", "+task.config.min_terms=2",
                          "+task.config.max_terms=3"])
    assert dict(whole.task.config) == dict(one.task.config) == {"min_terms": 2, "max_terms": 3}
    validate_task_cfg(whole.task)
    assert set(config_keys("chain_sum")) >= {"min_terms", "max_terms", "min_digits", "max_digits"}


@pytest.mark.parametrize("keys, message", [
    ({"dataset": "leg_countin"},
     r"task.dataset='leg_countin' is not a reasoning-gym dataset; allowed: \[.*'leg_counting'"),
    ({"dataset": "composite"}, r"task.dataset='composite' .* pick one dataset"),
    ({"config": {"min_animalz": 2}}, r"task.config.min_animalz is not a key of leg_counting's config; its keys: "
                                     r"\['max_animals', 'max_instances', 'min_animals', 'min_instances'\]"),
    ({"config": {"seed": 3}}, r"task.config.seed is not allowed; the task sets it"),
    ({"config": {"size": 3}}, r"task.config.size is not allowed; the task sets it: task.size"),
    ({"config": {"min_animals": 0}}, r"not allowed by leg_counting's own check .*min_animals must be positive"),
    ({"config": [2, 3]}, r"task.config=\[2, 3\] is not allowed; it must be a mapping"),
    ({"size": 1}, r"task.size=1 is not allowed"),
    ({"size": 3, "held_out_fraction": 0.1}, r"holds out 0 of 3 problems"),
])
def test_a_bad_dataset_key_or_size_fails_naming_what_is_allowed(keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_task_cfg({"name": "reasoning_gym", "dataset": "leg_counting", **keys})


def test_a_bad_dataset_key_stops_a_run_before_the_model_loads(tiny_cfg, monkeypatch):
    import a3po.models

    monkeypatch.setattr(a3po.models, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    from a3po.run.main import run

    with pytest.raises(ConfigError, match=r"task.config.max_termz is not a key of chain_sum's config"):
        run(tiny_cfg("task=reasoning_gym", "task.dataset=chain_sum", "+task.config.max_termz=3"))


def test_the_cli_exits_2_on_an_unknown_dataset_naming_the_allowed_ones(tmp_path):
    proc = subprocess.run([sys.executable, "experiments/train.py", "task=reasoning_gym", "task.dataset=nope",
                           "model=tiny", "logger=none", f"output_root={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    assert "config error: task.dataset='nope' is not a reasoning-gym dataset; allowed:" in proc.stderr
    assert "'leg_counting'" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- the held-out split

@pytest.mark.parametrize("dataset, keys", [("leg_counting", {}), ("gsm_symbolic", {}),
                                           ("basic_arithmetic", {"config": {"min_terms": 2, "max_terms": 2,
                                                                            "min_digits": 1, "max_digits": 1}})])
def test_training_never_sees_a_held_out_question(dataset, keys):
    """Disjoint generator seeds (the dataset's items before and after the held-out count), then
    disjoint question texts: one-digit sums repeat, and every repeat of a held-out one is dropped."""
    task = gym(dataset, size=400, **keys)
    held_out = {p.question for p in task.held_out}
    assert len(held_out) == len(task.held_out) and not held_out & {p.question for p in task.train}
    held_indices = {p.answer.entry["metadata"]["source_index"] for p in task.held_out}
    train_indices = {p.answer.entry["metadata"]["source_index"] for p in task.train}
    assert max(held_indices) < min(train_indices) and max(train_indices) < 400
    if dataset == "basic_arithmetic":  # the generator repeats itself: the text check is what keeps them apart
        from reasoning_gym import create_dataset

        source = create_dataset(dataset, **keys["config"], seed=POOL_SEED, size=400)
        repeats = [i for i in range(80, 400) if source[i]["question"] in held_out]
        assert repeats and len(task.held_out) < 80 and len(task.train) == 320 - len(repeats)


def test_the_held_out_order_is_the_same_for_every_run_seed_and_size():
    first, second = gym("leg_counting", seed=0, size=300), gym("leg_counting", seed=7, size=300)
    assert [p.question for p in first.eval_problems(32)] == [p.question for p in second.eval_problems(32)]
    assert [p.question for p in first.train_batch(0, 8)] != [p.question for p in second.train_batch(0, 8)]
    larger = gym("leg_counting", seed=3, size=600)  # a larger pool extends the held-out split, in the same order
    assert len(larger.held_out) > len(first.held_out)
    assert larger.eval_problems(len(first.held_out)) == list(first.held_out)
    assert first.eval_problems(10_000) == list(first.held_out) and 50 < len(first.held_out) <= 60


def test_problems_are_the_datasets_items_at_the_fixed_generator_seed():
    from reasoning_gym import create_dataset

    task = gym("chain_sum", size=100)
    source = create_dataset("chain_sum", seed=POOL_SEED, size=100)
    assert task.held_out[0].question == source[0]["question"] and task.held_out[0].answer == source[0]["answer"]
    assert task.train_batch(3, 4) == gym("chain_sum", seed=0, size=100).train_batch(3, 4)  # of (seed, step) alone


# ---------------------------------------------------------------------------- the reward: score_answer

def test_the_reward_is_the_datasets_score_of_the_marked_answer():
    task = gym("leg_counting", size=50)
    problem = task.held_out[0]
    assert task.reward(f"I count them.\n#### {problem.answer}", problem.answer) == RewardResult(1.0, False)
    assert task.reward(f"#### {int(problem.answer) + 1}", problem.answer) == RewardResult(0.0, False)
    assert task.reward("I do not know.", problem.answer) == RewardResult(0.0, True)  # no number: malformed


def test_a_non_numeric_answer_is_the_text_after_the_marker_graded_by_its_own_scorer():
    """countdown's scorer evaluates the expression against the problem's own numbers and target
    (its metadata): another correct expression scores 1, the oracle text is not what decides."""
    task = gym("countdown", size=10)
    problem = next(p for p in task.held_out if " + " in p.answer)
    reordered = " + ".join(reversed(problem.answer.split(" + ")))  # the same sum in another order
    assert reordered != problem.answer and task.reward(f"#### {reordered}", problem.answer) == RewardResult(1.0, False)
    assert task.reward(f"Try this.\n#### {problem.answer}", problem.answer) == RewardResult(1.0, False)
    wrong = task.reward(f"#### {problem.answer.entry['metadata']['numbers'][0]}", problem.answer)
    assert wrong.score < 1.0 and not wrong.malformed
    assert task.reward(problem.answer, problem.answer) == RewardResult(0.0, True)  # no marker: malformed
    assert task.reward("####   ", problem.answer) == RewardResult(0.0, True)


def test_gsm_symbolic_keeps_its_own_partial_credit_and_the_suites_number_rule():
    task = gym("gsm_symbolic", size=50)
    problem = task.held_out[0]
    assert task.reward(f"So the answer is {problem.answer}.", problem.answer) == RewardResult(1.0, False)  # last number
    assert task.reward(f"#### {problem.answer}", problem.answer) == RewardResult(1.0, False)
    wrong = f"#### {float(problem.answer) + 1}"
    assert task.reward(wrong, problem.answer) == RewardResult(0.01, False)  # gsm_symbolic's own partial credit


def test_the_answer_carries_its_entry_through_copies():
    import copy
    import pickle

    answer = gym("leg_counting", size=50).held_out[0].answer
    for copied in (copy.deepcopy(answer), pickle.loads(pickle.dumps(answer))):
        assert isinstance(copied, OracleAnswer) and copied == answer and copied.entry == answer.entry


# ---------------------------------------------------------------------------- runs

def test_gsm_symbolic_is_the_paper_settings_offline_gsm8k(monkeypatch, tmp_path):
    """experiment=paper_gsm8k task=reasoning_gym task.dataset=gsm_symbolic composes and validates
    with the hub off, and starts on a CPU with the tiny model (reward about 0 there)."""
    import datasets

    from a3po.config import parse_config
    from a3po.run.main import run

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was asked for data"))
    paper = ["experiment=paper_gsm8k", "task=reasoning_gym", "task.dataset=gsm_symbolic"]
    parse_config(compose_config(paper))
    cfg = compose_config([*paper, *TINY_OVERRIDES, "device=cpu", "rollout=hf", "train.total_steps=1",
                          "train.eval_every=1", "task.size=200"], output_root=tmp_path / "outputs")
    last = run(cfg)
    assert last["reward/mean"] >= 0.0 and 0.0 <= last["reward/malformed"] <= 1.0 and "eval/reward" in last


def test_a_leg_counting_run_logs_rewards_and_reaches_a_figure(tiny_cfg, tmp_path):
    """`python experiments/train.py task=reasoning_gym task.dataset=leg_counting model=tiny
    train.total_steps=2`, in process; then `python -m analysis.figures` on its outputs."""
    from analysis.figures.paper import main as figures
    from a3po.run.main import run, run_dir_of
    from a3po.run.metrics_log import read_metrics

    cfg = tiny_cfg("task=reasoning_gym", "task.dataset=leg_counting", "train.total_steps=2", "task.size=200")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert len(records) == 2 and all("reward/malformed" in r and "response/truncated" in r for r in records)
    assert "eval/reward" in records[-1]
    out = tmp_path / "figures"
    assert figures([str(run_dir_of(cfg).parent), "--out", str(out)]) == 0
    label = cfg.run_name.split("-d")[0]
    assert label in (out / "fig2_reward_wallclock.csv").read_text() and label in (out / "fig3_entropy.csv").read_text()


def test_the_calibration_command_takes_a_reasoning_gym_dataset(monkeypatch, capsys):
    import a3po.rollout.calibrate as calibrate
    from a3po.models import load_policy
    from omegaconf import OmegaConf

    tiny = OmegaConf.load(CONF_DIR / "model" / "tiny.yaml")
    monkeypatch.setattr(calibrate, "load_policy", lambda _cfg: load_policy(tiny, seed=0))
    monkeypatch.setattr(calibrate.torch, "set_num_threads", lambda n: None)  # leave this process's threads be
    calibrate.main(["--task", "reasoning_gym", "--dataset", "chain_sum", "--dataset-config", "min_terms=2",
                    "--dataset-config", "max_terms=2", "--size", "50", "--prompts", "2", "--samples", "2",
                    "--max-new-tokens", "4"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("task=reasoning_gym dataset=chain_sum config={'min_terms': 2, 'max_terms': 2} split=train n=4 ")
    assert "mean_reward=" in line and "malformed=" in line


def test_the_calibration_scores_the_held_out_problems_a_run_evaluates_when_asked():
    """`--split held_out` samples `eval_problems(n)` (what `train.eval_size` evaluates), not the
    step-0 training batch: for a small problem space the two splits differ (docs/testbed.md)."""
    from a3po.models import load_policy
    from a3po.rollout.calibrate import measure_mean_reward
    from a3po.tasks import build_task

    task = build_task({"name": "reasoning_gym", "dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 2},
                       "size": 50}, seed=0)
    model, tokenizer = load_policy(yaml.safe_load((CONF_DIR / "model" / "tiny.yaml").read_text()), seed=0)
    seen = {}
    for split in ("train", "held_out"):
        result = measure_mean_reward(model, tokenizer, task, n_prompts=3, n_samples=1, max_new_tokens=2, split=split)
        seen[split] = [question for question, *_ in result["examples"]]
        assert result["n"] == 3
    assert seen["held_out"] == [p.question for p in task.eval_problems(3)]
    assert seen["train"] == [p.question for p in task.train_batch(0, 3)]
    with pytest.raises(ValueError, match=r"split='test' is not allowed"):
        measure_mean_reward(model, tokenizer, task, n_prompts=1, n_samples=1, split="test")


@pytest.mark.parametrize("argv, flag", [(["--dataset", "nope"], "--dataset"),
                                        (["--dataset-config", "min_animalz=2"], "--dataset-config"),
                                        (["--dataset-config", "min_animals"], "--dataset-config"),
                                        (["--size", "1"], "--size")])
def test_calibration_refuses_a_bad_dataset_flag_before_the_model_loads(argv, flag, monkeypatch, capsys):
    import a3po.rollout.calibrate as calibrate

    monkeypatch.setattr(calibrate, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        calibrate.main(["--task", "reasoning_gym", *argv])
    assert exit_info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}") and "\n" not in err, err


def test_typed_config_keeps_the_dataset_keys():
    typed = TaskConfig.of({"name": "reasoning_gym", "dataset": "chain_sum", "config": {"min_terms": 2}, "size": 64})
    assert dataclasses.asdict(typed)["config"] == {"min_terms": 2}
    assert gym("chain_sum", **{k: v for k, v in dataclasses.asdict(typed).items()
                               if k in ("config", "size")}).config == {"min_terms": 2}
