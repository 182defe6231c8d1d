"""`python -m analysis.cost_model validate-async`: runs read, paired and predicted as the
simulation says, on crafted run directories whose answers are known in closed form."""

from __future__ import annotations

import json

import pytest
import yaml

from analysis.cost_model.__main__ import main
from analysis.cost_model.async_runs import async_rows, pair_runs, read_run


def _run(root, name, runtime, algo, *, rollout_s, trainer_s, interval_s, sync_s=0.0, steps=10, bound=1, prompts=4):
    """A run directory whose steps take `interval_s` apart, each a rollout of `rollout_s` and a
    trainer side of `trainer_s` (the async trainer also waits for its data: the rest)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"runtime": {"name": runtime, **({"max_staleness": bound} if runtime == "async" else {})},
              "staleness": bound, "seed": 0, "algo": {"name": algo}, "precision": "bf16", "model": {"name": "smollm2_135m"},
              "train": {"n_prompts": prompts, "n_samples": 4, "n_minibatches": 4}, "rollout": {"max_new_tokens": 64}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for step in range(steps):
        wait = max(0.0, interval_s - trainer_s - sync_s) if runtime == "async" else rollout_s
        rows.append({"step": step, "wall_time": interval_s * (step + 1), "time/rollout": rollout_s,
                     "time/step": wait + trainer_s + sync_s, "time/weight_sync": sync_s,
                     **({"time/wait_data": wait} if runtime == "async" else {})})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_a_rollout_bound_pipeline_is_predicted_at_its_closed_form(tmp_path):
    _run(tmp_path, "lagged-ll", "lagged", "loglinear", rollout_s=2.0, trainer_s=1.0, interval_s=3.0)
    # on separate devices the async step would be max(2, 1) = 2 s; this run's sides slowed down to 2.5 and 1.2
    _run(tmp_path, "async-ll", "async", "loglinear", rollout_s=2.5, trainer_s=1.2, interval_s=2.5)
    [row] = async_rows([tmp_path])
    assert row["from_lagged_s"] == pytest.approx(2.0)
    assert row["from_own_s"] == pytest.approx(2.5) and row["from_own_error"] == pytest.approx(0.0)
    assert row["from_lagged_error"] == pytest.approx(2.0 / 2.5 - 1)
    assert row["rollout_slowdown"] == pytest.approx(1.25) and row["trainer_slowdown"] == pytest.approx(1.2)
    assert row["lagged_step_s"] == pytest.approx(3.0)


def test_bound_zero_is_predicted_as_the_serial_sum(tmp_path):
    _run(tmp_path, "lagged", "lagged", "recompute", rollout_s=1.0, trainer_s=2.0, interval_s=3.0, sync_s=0.5, bound=0)
    _run(tmp_path, "async", "async", "recompute", rollout_s=1.0, trainer_s=2.0, interval_s=3.5, sync_s=0.5, bound=0)
    [row] = async_rows([tmp_path])
    assert row["bound"] == 0 and row["from_lagged_s"] == pytest.approx(3.5)


def test_the_steady_state_leaves_the_first_steps_out(tmp_path):
    run_dir = _run(tmp_path, "lagged", "lagged", "loglinear", rollout_s=1.0, trainer_s=1.0, interval_s=2.0)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[0]["wall_time"] = 0.1  # a slow first step would be 30 s: left out, it changes nothing
    rows[0]["time/rollout"] = 30.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(run_dir, skip=2)
    assert run["interval_s"] == pytest.approx(2.0) and run["rollouts_s"] == [1.0] * 8
    with pytest.raises(ValueError, match="10 steps logged; the steady state needs at least 12"):
        read_run(run_dir, skip=10)
    with pytest.raises(ValueError, match="skip must be >= 1"):
        read_run(run_dir, skip=0)
    (run_dir / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="unreadable run"):
        read_run(run_dir)


def test_an_async_run_without_a_lagged_twin_is_named(tmp_path):
    _run(tmp_path, "lagged", "lagged", "loglinear", rollout_s=1.0, trainer_s=1.0, interval_s=2.0, prompts=8)
    _run(tmp_path, "lagged-d0", "lagged", "loglinear", rollout_s=1.0, trainer_s=1.0, interval_s=2.0, bound=0)
    lonely = _run(tmp_path, "async", "async", "loglinear", rollout_s=1.0, trainer_s=1.0, interval_s=1.0)
    runs = [read_run(d) for d in (tmp_path / "lagged", tmp_path / "lagged-d0", lonely)]
    with pytest.raises(ValueError, match="async: no lagged run of the same shape, algorithm, seed and staleness"):
        pair_runs(runs)


def test_the_cli_prints_both_tables_and_refuses_a_folder_without_async_runs(tmp_path, capsys):
    for algo, trainer_s in (("loglinear", 1.0), ("recompute", 1.5)):
        _run(tmp_path, f"lagged-{algo}", "lagged", algo, rollout_s=0.5, trainer_s=trainer_s, interval_s=2.0)
        _run(tmp_path, f"async-{algo}", "async", algo, rollout_s=0.5, trainer_s=trainer_s, interval_s=trainer_s)
    out = tmp_path / "table.md"
    assert main(["validate-async", str(tmp_path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4x4, r<=64, m=4, bf16" in text and text.rstrip().endswith("1.500 |           1.500 |    1.500 |")  # trainer-bound
    assert out.read_text() == text
    empty = tmp_path / "only_lagged"
    _run(empty, "lagged", "lagged", "loglinear", rollout_s=0.5, trainer_s=1.0, interval_s=2.0)
    assert main(["validate-async", str(empty)]) == 2
    assert "no runtime=async run found" in capsys.readouterr().err


def test_the_async_table_regenerates_from_the_committed_runs():
    """docs/cost_model.md's async validation is what the command gives on the committed archive."""
    from analysis.cost_model.__main__ import build_parser, validate_async_lines
    from conftest import REPO

    args = build_parser().parse_args(["validate-async", str(REPO / "docs/logs/cost_model/async.tar.xz")])
    tables = "\n".join(validate_async_lines(args))
    assert tables in (REPO / "docs" / "cost_model.md").read_text()
    assert sum(line.startswith("| ") and "bf16" in line for line in tables.splitlines()) == 6 + 2
