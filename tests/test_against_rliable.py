"""analysis/robust.py against rliable itself: the interquartile mean, the probability of
improvement and the stratified-bootstrap interval, computed by both on the same scores
(analysis/checks/against_rliable.py), in the environment of pyproject's `rliable` extra
(`make setup-rliable`; rliable needs pandas < 3, the suite runs on pandas 3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis" / "checks"))
from extra_requirements import extra_requirements  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VENV_RLIABLE", ROOT / ".venv-rliable"))
PYTHON = VENV / "bin" / "python"


def test_the_rliable_extra_declares_rliable_and_the_pandas_it_imports_under():
    assert extra_requirements("rliable") == ["rliable==1.2.0", "pandas>=2.0,<3"]
    with pytest.raises(SystemExit, match="no optional-dependency group 'nope'; it has: rliable, test"):
        extra_requirements("nope")


@pytest.mark.rliable
@pytest.mark.skipif(not PYTHON.exists(), reason=f"{PYTHON} is absent: `make setup-rliable` installs it")
def test_robust_statistics_equal_rliables_on_the_same_scores():
    installed = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m; print(m.version('rliable'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert installed == "1.2.0"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(PYTHON), str(ROOT / "analysis" / "checks" / "against_rliable.py")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [re.match(r"(\d+) runs x (\d+) cells", line).groups() for line in lines] == [("3", "1"), ("8", "3"), ("10", "4")]
    assert all(line.endswith(" ok") for line in lines), done.stdout
