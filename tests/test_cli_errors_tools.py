"""Bad input to the suite's tools fails at start, before any model loads: exit 2 (the config-error
exit) and one line on stderr, `error: ...`, naming the flag or key, never a traceback or a
silent success. The tools: the task calibration (a3po.rollout.calibrate), the benchmark
(a3po.benchmark, experiments/benchmark.py) and the memory plan (a3po.run.memory_plan). Each
test replaces what would load or measure with a failure, so nothing heavy runs."""

from __future__ import annotations

import pytest

from a3po.errors import EXIT_CONFIG_ERROR


def _refuses(main, argv, capsys) -> str:
    """main(argv) exits 2 with one `error: ...` line on stderr; that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _must_not_run(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran on invalid input")
    return fail


# --- python -m a3po.rollout.calibrate ---------------------------------------------------------

@pytest.mark.parametrize("argv, names", [
    (["--prompts", "0"], "--prompts"),
    (["--samples", "0"], "--samples"),
    (["--threads", "0"], "--threads"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "0"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--task", "nope"], "--task"),
    (["--task", "gsm8k", "--path", "/nonexistent.jsonl"], "--path"),
    (["--task", "words", "--operations", "nope"], "--operations"),
    (["--level", "9"], "--level"),
])
def test_calibrate_refuses_bad_flags_before_the_model_loads(argv, names, capsys, monkeypatch):
    import a3po.rollout.calibrate as calibrate

    monkeypatch.setattr(calibrate, "load_policy", _must_not_run("load_policy"))
    err = _refuses(calibrate.main, argv, capsys)
    assert names in err, err


def test_calibrate_sampling_rules_are_the_training_configs():
    """--temperature, --top-p and --max-new-tokens are held to rollout.*'s rules (a3po.schema)."""
    import argparse

    from a3po.errors import ConfigError
    from a3po.rollout.calibrate import check_args

    good = dict(task="arith", level=1, operations=None, path=None, prompts=1, samples=1, threads=1, seed=0,
                temperature=0.5, top_p=1.0, max_new_tokens=1)
    assert check_args(argparse.Namespace(**good))["level"] == 1
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        check_args(argparse.Namespace(**{**good, "temperature": -1.0}))


# --- python -m a3po.benchmark / experiments/benchmark.py --------------------------------------

BENCH = ["model=tiny", "device=cpu", "train.n_prompts=2", "train.n_samples=2", "train.token_budget=128"]


@pytest.mark.parametrize("argv, names", [
    (["staleness=-1"], "staleness"),
    (["train.lr=-1"], "train.lr"),
    (["precision=fp8"], "precision"),
    (["algo=nope"], "algo"),
    (["model.source=nope"], "model.source"),
    (["train.nope=1"], "train.nope"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--response-len", "0"], "--response-len"),
    (["--reps", "0"], "--reps"),
    (["--threads", "0"], "--threads"),
    (["--warmup", "-1"], "--warmup"),
    (["--length-spread", "1"], "--length-spread"),
    (["--kernel-tokens", "0"], "--kernel-tokens"),
    (["--bandwidth-mib", "0"], "--bandwidth-mib"),
    (["--min-kernel-seconds", "-1"], "--min-kernel-seconds"),
    (["--algos", "nope"], "--algos"),
    (["--algos", "loglinear:nope"], "--algos"),
    (["--approx-methods", "coupled"], "--approx-methods"),
    (["--approx-schedules", "nope"], "--approx-schedules"),
    (["--prompt-len", "100", "--response-len", "50"], "train.token_budget"),
])
def test_benchmark_refuses_bad_input_before_the_model_loads(argv, names, capsys, monkeypatch):
    import a3po.benchmark.cli as cli

    monkeypatch.setattr(cli, "run_benchmark", _must_not_run("the benchmark"))
    monkeypatch.setattr(cli, "write_report", _must_not_run("write_report"))
    overrides, flags = [a for a in argv if "=" in a], [a for a in argv if "=" not in a]  # positionals first
    err = _refuses(cli.main, [*BENCH, *overrides, "--no-progress", *flags], capsys)
    assert names in err, err


def test_benchmark_compose_validates_without_a_task():
    """The benchmark's config has no task group: everything else is validated as a run's is."""
    from a3po.benchmark.workload import compose
    from a3po.errors import ConfigError

    assert compose(["model=tiny"]).task.name == "arith"  # TaskConfig's defaults, as before
    # it generates --response-len tokens, not rollout.max_new_tokens: that rule is the run's only
    assert compose(["model=tiny", "train.token_budget=16"]).train.token_budget == 16
    with pytest.raises(ConfigError, match="staleness"):
        compose(["model=tiny", "staleness=-1"])


# --- python -m a3po.run.memory_plan -----------------------------------------------------------

@pytest.mark.parametrize("argv, names", [
    (["--gpu-memory-gib", "80", "--world", "0"], "--world"),
    (["algo=nope"], "algo"),
    (["--gpu-memory-gb", "80"], "--gpu-memory-gb"),
    (["staleness=-1"], "staleness"),
    (["train.n_prompts=0"], "train.n_prompts"),
    (["--gpu-memory-gib", "-5"], "--gpu-memory-gib"),
    (["--gpu-memory-gib", "80", "--host-memory-gib", "-1"], "--host-memory-gib"),
    (["--gpu-memory-gib", "80", "--host-memory-gib", "0"], "--host-memory-gib"),
    (["model.source=nope"], "model.source"),
    (["--gpu-memory-gib", "80", "--world", "100"], "train.n_minibatches"),
])
def test_memory_plan_refuses_bad_input_before_any_estimate(argv, names, capsys, monkeypatch):
    import a3po.run.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "architecture_of", _must_not_run("architecture_of"))
    err = _refuses(memory_plan.main, ["model=tiny", *argv], capsys)
    assert names in err, err
