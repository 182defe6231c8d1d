"""`python -m analysis.progress`: a running sweep's steps, states and time left, from its logs,
never printing a reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from a3po.run.metrics_log import SkippedMetricsWarning
from analysis.progress import hours_left, main as progress_main, run_progress

from conftest import compose_config, TINY_OVERRIDES

REWARD = 0.123456  # a value no line of the output may carry


def _run(sweep: Path, name: str, steps: int, total: int, hours_a_step: float, marker: str | None = None,
         peaks: list[float] | None = None) -> Path:
    run_dir = sweep / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run_name: {name}\ntrain:\n  total_steps: {total}\n")
    memory = [{} if peaks is None else {"memory/host_peak": peaks[step]} for step in range(steps)]
    lines = [json.dumps({"step": step, "wall_time": 3600 * hours_a_step * (step + 1), "time/step": 60.0 + step,
                         "reward/mean": REWARD, "eval/reward": REWARD, **memory[step]}) for step in range(steps)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if marker:
        (run_dir / marker).write_text(json.dumps({"steps": steps}))
    return run_dir


def test_a_run_line_reads_steps_state_hours_and_recent_pace(tmp_path):
    part = _run(tmp_path, "a-s1", steps=12, total=20, hours_a_step=0.05)
    with open(part / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 12, "wall_ti')  # the line a running job is writing
    with pytest.warns(SkippedMetricsWarning, match=r"a-s1/metrics.jsonl:13: skipped an unparsable line"):
        line = run_progress(part)
    assert line == {"run": "a-s1", "steps": 12, "total": 20, "state": "part-done",
                    "hours": pytest.approx(0.6), "step_s": 66.5, "peak_gib": None}  # median of steps 2-11
    assert run_progress(_run(tmp_path, "a-s2", 20, 20, 0.1, "finished.json"))["state"] == "finished"
    diverged = run_progress(_run(tmp_path, "a-s3", 7, 20, 0.1, "diverged.json"))
    assert (diverged["state"], diverged["steps"]) == ("diverged", 7)
    fresh = run_progress(_run(tmp_path, "a-s4", 0, 20, 0.1))
    assert (fresh["steps"], fresh["hours"], fresh["step_s"]) == (0, 0.0, None)


def test_time_left_uses_the_finished_runs_pace_and_counts_those_not_started():
    runs = [{"state": "finished", "hours": 2.0, "steps": 10, "total": 10},
            {"state": "finished", "hours": 4.0, "steps": 10, "total": 10},
            {"state": "diverged", "hours": 0.5, "steps": 2, "total": 10},  # stopped early: not a pace
            {"state": "part-done", "hours": 1.0, "steps": 5, "total": 10}]
    summary = hours_left(runs, expect=6, jobs=2)
    assert summary["run_hours"] == 3.0
    assert summary["run_hours_left"] == pytest.approx(3.0 * (0.5 + 2))  # half of one, two not started
    assert summary["wall_hours_left"] == pytest.approx(3.75)
    assert (summary["finished"], summary["diverged"], summary["part-done"], summary["not started"]) == (2, 1, 1, 2)


def test_time_left_before_any_run_ended_uses_each_part_done_runs_own_pace():
    runs = [{"state": "part-done", "hours": 1.0, "steps": 5, "total": 10},   # 2 h a run
            {"state": "part-done", "hours": 1.0, "steps": 2, "total": 10},   # 5 h a run
            {"state": "part-done", "hours": 0.0, "steps": 0, "total": 10}]
    summary = hours_left(runs, expect=None, jobs=1)
    assert summary["run_hours"] == 3.5
    assert summary["run_hours_left"] == pytest.approx(3.5 * (0.5 + 0.8 + 1))
    nothing = hours_left([{"state": "part-done", "hours": 0.0, "steps": 0, "total": 10}], expect=4, jobs=1)
    assert nothing["wall_hours_left"] is None and nothing["not started"] == 3


def test_the_command_prints_the_table_and_the_sweep_line_and_no_reward(tmp_path, capsys):
    sweep = tmp_path / "outputs" / "study"
    _run(sweep, "recompute-s0", 10, 10, 0.2, "finished.json")
    _run(sweep, "loglinear-s0", 4, 10, 0.2, peaks=[8.21, 9.46, 6.0, 9.02])  # resumed after step 1: a new process
    assert progress_main([str(sweep), "--expect", "4", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "| loglinear-s0 | 4/10 | part-done | 0.80 | 62 | 9.5 |" in out  # the most any process reached
    assert "| recompute-s0 | 10/10 | finished | 2.00 | 64 |  |" in out  # a log from before the key
    assert ("1 finished, 0 diverged, 1 part-done, 2 not started; at 2.00 wall hours a run, the runs not "
            "ended need 5.2 run-hours: at least 2.6 hours of wall time at 2 at once.") in out
    assert str(REWARD)[:5] not in out and "reward" not in out


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        progress_main([str(tmp_path / "missing")])
    assert "no such path" in capsys.readouterr().err
    assert progress_main([str(tmp_path)]) == 2
    assert "no run directory" in capsys.readouterr().err
    sweep = tmp_path / "sweep"
    _run(sweep, "a-s0", 2, 10, 0.1)
    with pytest.raises(SystemExit):
        progress_main([str(sweep), "--jobs", "0"])
    assert "--jobs must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        progress_main([str(sweep), "--expect", "0"])
    assert "--expect 0 is fewer than the 1 runs found" in capsys.readouterr().err
    (sweep / "a-s0" / "config.yaml").write_text("run_name: a-s0\n")
    assert progress_main([str(sweep)]) == 2
    assert "a-s0: config.yaml has no train.total_steps" in capsys.readouterr().err


def test_a_real_run_logs_what_progress_reads(tmp_path):
    from a3po.run.main import run, run_dir_of

    config = compose_config([*TINY_OVERRIDES, "train.total_steps=2", "experiment_name=watched"], tmp_path)
    assert run(config)
    line = run_progress(run_dir_of(config))
    assert (line["steps"], line["total"], line["state"]) == (2, 2, "finished")
    assert line["hours"] > 0 and line["step_s"] > 0 and 0.05 < line["peak_gib"] < 64
