"""`analysis.logs pack --ended` and `unpack`: a running sweep's ended runs travel to a fresh
output root, and a rerun there skips them."""

from __future__ import annotations

import tarfile
from pathlib import Path

from analysis.logs import ENDED_MARKERS, main as logs_main

from conftest import compose_config, TINY_OVERRIDES


def _run(sweep: Path, name: str, marker: str | None) -> Path:
    run_dir = sweep / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run_name: {name}\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    if marker:
        (run_dir / marker).write_text('{"steps": 1}\n')
    else:  # still going: its checkpoint is what a resume needs, and it never travels
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "last.pt").write_bytes(b"weights")
    return run_dir


def test_the_ended_markers_are_the_runs_own():
    from a3po.run.health import DIVERGED_MARKER
    from a3po.run.rundir import FINISHED_MARKER

    assert ENDED_MARKERS == (FINISHED_MARKER, DIVERGED_MARKER)


def test_pack_ended_keeps_the_finished_and_diverged_runs_with_their_markers(tmp_path):
    sweep = tmp_path / "outputs" / "stress"
    _run(sweep, "a-s0", "finished.json")
    _run(sweep, "a-s1", "diverged.json")
    _run(sweep, "a-s2", None)
    out = tmp_path / "carry.tar.xz"
    assert logs_main(["pack", str(sweep), str(out), "--ended"]) == 0
    with tarfile.open(out) as archive:
        names = set(archive.getnames())
    assert names == {f"stress/a-s0/{f}" for f in ("config.yaml", "metrics.jsonl", "finished.json")} | \
        {f"stress/a-s1/{f}" for f in ("config.yaml", "metrics.jsonl", "diverged.json")}
    assert logs_main(["pack", str(sweep), str(tmp_path / "all.tar.xz")]) == 0  # without --ended: all three
    with tarfile.open(tmp_path / "all.tar.xz") as archive:
        assert {n.split("/")[1] for n in archive.getnames()} == {"a-s0", "a-s1", "a-s2"}


def test_unpack_restores_runs_and_never_overwrites_one(tmp_path, capsys):
    sweep = tmp_path / "outputs" / "stress"
    finished = _run(sweep, "a-s0", "finished.json")
    _run(sweep, "a-s1", "diverged.json")
    out = tmp_path / "carry.tar.xz"
    assert logs_main(["pack", str(sweep), str(out), "--ended"]) == 0
    fresh = tmp_path / "fresh"
    assert logs_main(["unpack", str(out), str(fresh)]) == 0
    assert "2 runs restored" in capsys.readouterr().out
    for name in ("config.yaml", "metrics.jsonl", "finished.json"):
        assert (fresh / "stress" / "a-s0" / name).read_bytes() == (finished / name).read_bytes()
    assert (fresh / "stress" / "a-s1" / "diverged.json").is_file()
    assert (fresh / "stress" / "a-s0").stat().st_mode & 0o777 == 0o755  # not the staging's 0700
    (fresh / "stress" / "a-s0" / "metrics.jsonl").write_text("changed here\n")
    assert logs_main(["unpack", str(out), str(fresh)]) == 0
    assert "0 runs restored under" in capsys.readouterr().out
    assert (fresh / "stress" / "a-s0" / "metrics.jsonl").read_text() == "changed here\n"
    assert sorted(p.name for p in (fresh / "stress").iterdir()) == ["a-s0", "a-s1"]  # no staging left


def test_bad_input_is_named(tmp_path, capsys):
    sweep = tmp_path / "outputs" / "stress"
    _run(sweep, "a-s2", None)
    assert logs_main(["pack", str(sweep), str(tmp_path / "x.tar.xz"), "--ended"]) == 2
    assert "that has ended (finished.json or diverged.json)" in capsys.readouterr().out
    assert logs_main(["unpack", str(tmp_path / "missing.tar.xz"), str(tmp_path)]) == 2
    assert "missing.tar.xz: no such log archive" in capsys.readouterr().out
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(b"not an archive")
    assert logs_main(["unpack", str(broken), str(tmp_path)]) == 2
    assert "not a readable log archive" in capsys.readouterr().out


def test_a_restored_finished_run_is_not_run_again(tmp_path):
    from a3po.run.main import run, run_dir_of

    first = compose_config([*TINY_OVERRIDES, "train.total_steps=1", "experiment_name=carry"], tmp_path / "here")
    assert run(first)  # trained: its last step's metrics
    out = tmp_path / "carry.tar.xz"
    assert logs_main(["pack", str(tmp_path / "here" / "carry"), str(out), "--ended"]) == 0
    assert logs_main(["unpack", str(out), str(tmp_path / "there")]) == 0
    again = compose_config([*TINY_OVERRIDES, "train.total_steps=1", "experiment_name=carry"], tmp_path / "there")
    before = (run_dir_of(again) / "metrics.jsonl").read_bytes()
    assert run(again) == {}  # found finished: nothing to do
    assert (run_dir_of(again) / "metrics.jsonl").read_bytes() == before
