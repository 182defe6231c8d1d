"""Analysis CLIs given bad input: a one-line `error: ...` naming the argument or file and what
is allowed, exit status 2, never a traceback (each case found by a probe of the CLI)."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import tarfile
import warnings

import pytest

from analysis.load import RunSkippedWarning
from conftest import REPO


def _xz_archive(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:xz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _no_runs_inputs(tmp_path) -> dict[str, str]:
    """study module -> a path holding no usable run, one kind each (as the probe found them)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    whole = _xz_archive(tmp_path / "whole.tar.xz", {"sweep/run/config.yaml": b"experiment: x\n" * 200,
                                                    "sweep/run/metrics.jsonl": b'{"step": 0}\n' * 200})
    truncated = tmp_path / "truncated.tar.xz"
    truncated.write_bytes(whole.read_bytes()[:60])
    no_metrics = tmp_path / "no_metrics" / "exp" / "run1"
    no_metrics.mkdir(parents=True)
    (no_metrics / "config.yaml").write_text("experiment: precision\n")
    not_xz = tmp_path / "not_xz.tar.xz"
    not_xz.write_text("hi\n")
    return {"s6": str(tmp_path / "nonexistent" / "sweep"), "final_reward": str(empty),
            "mechanism": str(truncated), "precision": str(tmp_path / "no_metrics"),
            "corrections": str(tmp_path / "nonexistent"), "alpha_schedules": str(not_xz),
            "approx_quality": str(empty)}


@pytest.mark.parametrize("study", ["s6", "final_reward", "mechanism", "precision", "corrections", "alpha_schedules",
                                   "approx_quality"])
def test_a_study_cli_with_no_runs_exits_2_naming_the_path(study, tmp_path, capsys):
    path = _no_runs_inputs(tmp_path)[study]
    out = tmp_path / "report.md"
    main = importlib.import_module(f"analysis.studies.{study}").main
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunSkippedWarning)
        assert main([path, "--out", str(out), "--figures-dir", str(tmp_path / "figures")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no runs found in {path}: expected run directories")
    assert not out.exists()


def test_a_study_cli_with_no_runs_prints_no_traceback(tmp_path):
    missing = tmp_path / "nonexistent"
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "analysis.studies.s6", str(missing),
                           "--out", str(tmp_path / "x.md"), "--figures-dir", str(tmp_path / "xf")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip() == (
        f"error: no runs found in {missing}: expected run directories holding config.yaml and a non-empty "
        "metrics.jsonl (outputs/<experiment>/<run_name>/)")


def _archive_and_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "run-s0").mkdir(parents=True)
    (sweep / "run-s0" / "config.yaml").write_text("experiment: sweep\n")
    (sweep / "run-s0" / "metrics.jsonl").write_text('{"step": 0}\n')
    (sweep / "run-s0" / "finished.json").write_text("{}\n")
    from analysis.logs import pack

    archive = tmp_path / "sweep.tar.xz"
    assert pack(sweep, archive) == 1
    return sweep, archive


def test_logs_unpack_onto_a_file_names_output_root(tmp_path, capsys):
    from analysis.logs import main

    _, archive = _archive_and_sweep(tmp_path)
    a_file = tmp_path / "afile"
    a_file.write_text("")
    assert main(["unpack", str(archive), str(a_file)]) == 2
    assert capsys.readouterr().out.strip() == (f"error: OUTPUT_ROOT {a_file}: not a folder; give a folder to "
                                               "restore the runs under (created where missing)")
    deeper = a_file / "deeper"  # a file on the way: the system's NotADirectoryError, caught
    assert main(["unpack", str(archive), str(deeper)]) == 2
    text = capsys.readouterr().out.strip()
    assert text.startswith(f"error: OUTPUT_ROOT {deeper}: cannot be used (") and "Not a directory" in text
    assert "\n" not in text and a_file.read_text() == ""


def test_logs_pack_onto_a_folder_names_out(tmp_path, capsys):
    from analysis.logs import main

    sweep, _ = _archive_and_sweep(tmp_path)
    folder = tmp_path / "somedir"
    folder.mkdir()
    assert main(["pack", str(sweep), str(folder)]) == 2
    text = capsys.readouterr().out.strip()
    assert text.startswith(f"error: OUT {folder}: cannot be used ({folder}: Is a directory); give the archive "
                           "file to write") and "\n" not in text
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("flag", ["--trainer-devices", "--rollout-devices"])
@pytest.mark.parametrize("count", ["0", "-1", "2.5"])
def test_cost_model_device_counts_below_one_name_the_flag(flag, count, capsys):
    from analysis.cost_model.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["predict", flag, count])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {count!r} is not allowed; give a whole number of devices >= 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("efficiency, shown", [
    ("train=abc", "error: --efficiency train=abc: train's value 'abc' is not a number; give KEY=NUMBER"),
    ("forward=0.3,train", "error: --efficiency train: train's value '' is not a number; give KEY=NUMBER"),
    ("train=0", "error: --efficiency train=0: Efficiency.train must be in (0, 1], got 0.0"),
])
def test_cost_model_a_bad_efficiency_names_the_item(efficiency, shown, capsys):
    from analysis.cost_model.__main__ import main

    assert main(["predict", "--efficiency", efficiency]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(shown) and "\n" not in err


@pytest.mark.parametrize("args, shown", [
    (["--prompts", "0"], "error: --prompts must be a positive count, got 0"),
    (["--response-len", "5000"], "error: --response-len must be in (0, response_max=1024], got 5000.0"),
    (["--precision", "fp8"], "error: --precision must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"),
])
def test_cost_model_a_bad_step_shape_names_the_flag(args, shown, capsys):
    from analysis.cost_model.__main__ import main

    assert main(["predict", *args]) == 2
    assert capsys.readouterr().err.strip() == shown
