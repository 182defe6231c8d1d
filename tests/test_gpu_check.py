"""The one-call check for a borrowed GPU (experiments/gpu_check.py, a3po/smoke/gpu_check*.py):
its dry run end to end on the CPU (what CI runs), a failing item failing the check and naming
itself, the time budget, and the wheels it names being the ones docs/gpus.md carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from a3po.smoke.gpu_check import main, run_within, wheel_commands
from a3po.smoke.gpu_check_items import FAIL_ENV, ITEM_NAMES, WHEELS, gpu_test_files, pytest_counts
from a3po.smoke.runner import Item, SmokeFailure

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "gpu_check.py"
TRAINER_ITEMS = ("trainer-rank0-of-2", "qwen1.5b-step", "resume", "async-runtime", "pytest-gpu")


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    out = tmp_path / "gpu_check"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
    return done, summary


@pytest.mark.slow
def test_the_dry_run_runs_every_item_in_order_and_passes(tmp_path):
    started = time.monotonic()
    done, summary = _check(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert time.monotonic() - started < 480
    assert summary["mode"] == "dry-run" and summary["status"] == "pass"
    assert [item["name"] for item in summary["items"]] == list(ITEM_NAMES)
    by_name = {item["name"]: item for item in summary["items"]}
    for name in TRAINER_ITEMS:
        item = by_name[name]
        assert item["status"] == "pass", item
        assert item["figures"] and Path(item["log"]).is_file() and item["seconds"] <= item["limit_s"]
    assert all(item["status"] == "skip" and "dry run" in item["reason"]
               for item in summary["items"] if item["name"].startswith("smoke-"))
    ranks = by_name["trainer-rank0-of-2"]["figures"]
    assert ranks["backend"] == "gloo" and ranks["group_world"] == 1 and ranks["collectives"]["all_reduce"] > 0
    assert by_name["resume"]["figures"]["steps"] == [0, 1, 2]
    assert by_name["pytest-gpu"]["figures"]["skipped"] >= 2  # collected, skipped on the CPU
    assert summary["machine"]["torch"] == torch.__version__ and summary["budget"]["total_s"] == 480


def test_a_failing_item_fails_the_check_and_the_summary_names_it(tmp_path):
    done, summary = _check(tmp_path, "--only", "pytest-gpu", env={FAIL_ENV: "pytest-gpu"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert summary["status"] == "fail" and summary["counts"]["fail"] == 1
    failed = [item for item in summary["items"] if item["status"] == "fail"]
    assert [item["name"] for item in failed] == ["pytest-gpu"]
    assert f"{FAIL_ENV} names pytest-gpu" in failed[0]["error"]
    assert [item["name"] for item in summary["items"]] == list(ITEM_NAMES)  # the others: not selected
    assert all(item["reason"] == "not selected (--only)" for item in summary["items"] if item["name"] != "pytest-gpu")
    assert "[gpu-check] fail pytest-gpu" in done.stdout


def test_an_item_left_without_time_fails_saying_so(tmp_path):
    """The first item's limit is cut to the 10.5 s left; it takes 1 s, so under MIN_START_S (10 s) are left."""
    items = [Item("first", [sys.executable, "-c", "import time; time.sleep(1)"], lambda work, output: {"ran": True},
                  30, tmp_path / "a"),
             Item("late", [sys.executable, "-c", "pass"], lambda work, output: {}, 30, tmp_path / "b")]
    results = run_within(items, tmp_path / "logs", time.monotonic() + 10.5, None, echo=lambda line: None)
    assert results[0]["status"] == "passed" and results[0]["figure"] == {"ran": True}
    assert results[0]["limit_s"] <= 10.5 and results[0]["budget_s"] == 30
    assert results[1]["status"] == "failed" and "not started" in results[1]["error"]
    assert "--only late" in results[1]["error"]


def test_the_wheels_the_check_names_are_the_ones_docs_carry():
    docs = (REPO / "docs" / "gpus.md").read_text()
    section = docs.split("## The one-call check for a borrowed GPU", 1)[1].split("\n## ", 1)[0]
    for command in wheel_commands().splitlines():
        assert command in section
    assert all(wheel in section for wheel in WHEELS)
    printed = subprocess.run([sys.executable, str(SCRIPT), "--print-wheels"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0 and printed.stdout.strip() == wheel_commands()


def test_a_bad_argument_and_a_machine_without_cuda_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as bad:
        main(["--dry-run", "--only", "no-such-item", "--out", str(tmp_path)])
    assert bad.value.code == 2 and "unknown item(s) no-such-item" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path)]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
        assert not (tmp_path / "summary.json").exists()


def test_pytest_gpu_is_judged_by_its_closing_counts():
    assert gpu_test_files()  # tests/test_device.py, tests/test_allocator.py at least
    assert "tests/test_device.py" in gpu_test_files()
    output = "SKIPPED [1] tests/test_device.py:262: needs a CUDA device\n2 skipped, 37 deselected in 3.1s\n"
    assert pytest_counts(dry_run=True)(Path("."), output) == {"skipped": 2, "deselected": 37}
    with pytest.raises(SmokeFailure, match="every gpu-marked test must run and pass"):
        pytest_counts(dry_run=False)(Path("."), output)
    assert pytest_counts(dry_run=False)(Path("."), "2 passed, 37 deselected in 9.0s") == {"passed": 2, "deselected": 37}
    with pytest.raises(SmokeFailure, match="no gpu-marked test was collected"):
        pytest_counts(dry_run=True)(Path("."), "37 deselected in 1.0s")


def test_on_a_gpu_every_item_runs_its_cuda_code_within_its_budget(tmp_path):
    """The GPU list, built without running it: no --dry-run anywhere, each budget its timeout, the
    smoke's SmolLM2 items skipped first where the weights are absent, fsdp2-nccl at one GPU."""
    from a3po.smoke.gpu_check_items import BUDGETS_S, TOTAL_BUDGET_S, build_items

    items = build_items(tmp_path, dry_run=False, gpus=1)
    assert [item.name for item in items] == list(ITEM_NAMES)
    assert all("--dry-run" not in item.command for item in items)
    assert all(item.timeout_s == BUDGETS_S[item.name] for item in items)
    assert "device=cuda" in items[ITEM_NAMES.index("async-runtime")].command
    by_name = {item.name: item for item in items}
    assert by_name["smoke-smollm2-fp32"].needs[0][-1] == "need-smollm2-weights"
    assert "2 GPUs" in by_name["smoke-fsdp2-nccl"].skip
    runs_on_one_gpu = [name for name in ITEM_NAMES if name not in ("smoke-fsdp2-nccl",)
                       and not name.startswith(("smoke-smollm2", "smoke-behave", "smoke-benchmark"))]
    assert 30 + sum(BUDGETS_S[name] for name in runs_on_one_gpu) <= TOTAL_BUDGET_S  # the machine probe's 30 s


def test_a_tokenizer_carried_alone_runs_the_tiny_items_and_skips_smollm2s(tmp_path, monkeypatch):
    import a3po.models.smollm2 as smollm2
    from a3po.smoke.gpu_check_probes import need_smollm2_weights, need_tokenizer

    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: None)
    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    assert "tokenizer (SmolLM2's) is absent" in need_tokenizer()
    carried = tmp_path / smollm2.SMOLLM2_CACHE_NAME
    carried.mkdir()
    (carried / smollm2.CONVERSION_MARKER).write_text("{}")
    assert need_tokenizer() is None
    assert "weights are absent" in need_smollm2_weights()
    (carried / "model.safetensors").write_bytes(b"")
    assert need_smollm2_weights() is None
