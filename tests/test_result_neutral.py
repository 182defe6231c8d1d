"""experiments/result_neutral.py, the check a refactor runs before it lands: equal runs pass
whatever their timings, a changed metric or a config a resume would refuse fails, named."""

from __future__ import annotations

import importlib.util
import json

import yaml

from conftest import REPO

spec = importlib.util.spec_from_file_location("result_neutral", REPO / "experiments" / "result_neutral.py")
neutral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(neutral)


def _runs(root, loss=0.5, wall=1.0, lr=1e-5):
    for name in neutral.RUNS:
        run_dir = root / name
        run_dir.mkdir(parents=True)
        steps = [{"step": s, "actor/loss": loss, "time/step": wall * s, "wall_time": wall} for s in range(2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"output_root": str(root), "train": {"lr": lr}}))
    return root


def test_equal_runs_pass_whatever_their_timings_and_output_root(tmp_path, capsys):
    assert neutral.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", wall=7.0)) == 0
    assert capsys.readouterr().out.strip().endswith("every config.yaml the same run's")


def test_a_changed_metric_or_config_fails_naming_it(tmp_path, capsys):
    assert neutral.compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", loss=0.5000001)) == 1
    assert "step 0 actor/loss: 0.5 against 0.5000001" in capsys.readouterr().out
    assert neutral.compare(_runs(tmp_path / "c"), _runs(tmp_path / "d", lr=2e-5)) == 1
    assert "train.lr" in capsys.readouterr().out
