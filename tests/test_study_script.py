"""slurm/study.sh, the one command a session runs a study's sweep with: its arguments, and the
carrying of ended runs between machines (the cluster part runs in the slurm tier's sweeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "study.sh"


def _study(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "A3PO_PYTHON": sys.executable, **(env or {})})


def test_without_arguments_it_prints_its_usage_and_exits_2():
    for args in ((), ("--pack",), ("s8_pilot",), ("--bogus",)):
        done = _study(*args)
        assert done.returncode == 2, args
        assert "slurm/study.sh EXPERIMENT COMMIT" in done.stderr


def test_pack_carries_the_ended_runs_only(tmp_path):
    outputs, running = tmp_path / "outputs", tmp_path / "running"
    for name, ended in (("recompute-d2-s300", True), ("loglinear-d2-s300", False)):
        run = outputs / "s8_pilot" / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"run_name: {name}\nexperiment_name: s8_pilot\n")
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
        if ended:
            (run / "finished.json").write_text(json.dumps({"steps": 1}))
    done = _study("--pack", "s8_pilot", env={"A3PO_STUDY_OUTPUTS": str(outputs), "A3PO_RUNNING_LOGS": str(running)})
    assert done.returncode == 0, done.stderr
    from analysis.logs import unpack

    restored = tmp_path / "restored"
    unpack(running / "s8_pilot.tar.xz", restored)
    assert sorted(p.name for p in (restored / "s8_pilot").iterdir()) == ["recompute-d2-s300"]
