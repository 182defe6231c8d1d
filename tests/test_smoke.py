"""The GPU smoke command (a3po.smoke, experiments/gpu_smoke.py) without a GPU: its CPU path,
the runner's bookkeeping on real subprocesses (pass, fail, hang past the timeout, skip), which
items a machine's GPU count runs, the exact command lines, and the checks against real runs
and probes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from a3po.smoke import checks, cli
from a3po.smoke.items import ITEM_NAMES, STEPS, build_items, select
from a3po.smoke.probes import main as probes_main
from a3po.smoke.probes import need_gsm8k
from a3po.smoke.runner import (NO_CUDA_MESSAGE, Item, SmokeFailure, build_report, exit_code, render_markdown,
                               run_item, run_items, write_report)

from conftest import REPO, compose_config

PY = sys.executable


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------------- without CUDA
def test_without_cuda_it_says_so_writes_the_status_and_exits_0(tmp_path, monkeypatch, capsys):
    _no_cuda(monkeypatch)
    out = tmp_path / "smoke" / "smoke.json"
    assert cli.main(["--out", str(out)]) == 0
    assert NO_CUDA_MESSAGE in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["status"], report["message"], report["items"]) == ("no-cuda", NO_CUDA_MESSAGE, [])
    assert report["machine"]["cuda_available"] is False and report["machine"]["gpus"] == []
    assert report["machine"]["torch"] == torch.__version__
    assert NO_CUDA_MESSAGE in out.with_suffix(".md").read_text()


def test_the_entry_point_without_cuda(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([PY, "experiments/gpu_smoke.py", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert NO_CUDA_MESSAGE in proc.stdout
    assert json.loads(out.read_text())["status"] == "no-cuda"


def test_an_unknown_item_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    _no_cuda(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--only", "tiny-fp32,warp-drive", "--out", str(tmp_path / "s.json")])
    assert stopped.value.code == 2
    assert "unknown item(s) warp-drive; allowed: tiny-fp32, tiny-bf16" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


# ---------------------------------------------------------------------- the runner
def _python(code: str, *args: str) -> list[str]:
    return [PY, "-c", code, *args]


def _reads_figure(root: Path, output: str) -> dict:
    return json.loads((root / "figure.json").read_text())


def _rejects(root: Path, output: str) -> dict:
    raise SmokeFailure("reward/mean is None, not finite")


def _process_gone(pid: int) -> bool:
    """No such process, or one that died and awaits its parent (a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_the_runner_records_pass_fail_hang_and_skip(tmp_path):
    work, counter = tmp_path / "work", tmp_path / "need_runs.txt"
    counted_need = _python("import sys; open(sys.argv[1], 'a').write('ran\\n')", str(counter))
    # the hanging item starts a grandchild (as torchrun starts ranks): both must be stopped
    hang = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(600)']); open(sys.argv[1], 'w').write(f'{child.pid}'); time.sleep(600)")
    items = [
        Item("passes", _python("import json, sys; open(sys.argv[1], 'w').write(json.dumps({'x': 1.5}))",
                               str(work / "passes" / "figure.json")), _reads_figure, 60, work / "passes",
             needs=[counted_need]),
        Item("fails", _python("import sys; print('boom: the GPU fell off'); sys.exit(3)"), _reads_figure, 60,
             work / "fails", needs=[counted_need]),
        Item("hangs", _python(hang, str(tmp_path / "grandchild.pid")), _reads_figure, 5, work / "hangs"),
        Item("skips", _python("print('SMOKE-SKIP: no frobnicator here'); raise SystemExit(77)"), _reads_figure, 60,
             work / "skips"),
        Item("wrong-result", _python("pass"), _rejects, 60, work / "wrong-result"),
        Item("too-few-gpus", _python("raise SystemExit(1)"), _reads_figure, 60, work / "g", skip="needs 2 GPUs"),
    ]
    results = {r["name"]: r for r in run_items(items, tmp_path / "logs", echo=lambda line: None)}
    assert {name: r["status"] for name, r in results.items()} == {
        "passes": "passed", "fails": "failed", "hangs": "failed", "skips": "skipped", "wrong-result": "failed",
        "too-few-gpus": "skipped"}
    assert results["passes"]["figure"] == {"x": 1.5} and results["passes"]["seconds"] > 0
    assert "exited 3" in results["fails"]["error"] and "boom: the GPU fell off" in results["fails"]["error"]
    assert "timed out" in results["hangs"]["error"]
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 30
    while not _process_gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _process_gone(grandchild)  # the item's whole process group was stopped
    assert results["skips"]["reason"] == "no frobnicator here"
    assert results["wrong-result"]["error"] == "reward/mean is None, not finite"
    assert results["too-few-gpus"]["reason"] == "needs 2 GPUs" and results["too-few-gpus"]["seconds"] == 0
    assert counter.read_text() == "ran\n"  # a precondition two items share runs once
    assert "boom: the GPU fell off" in Path(results["fails"]["log"]).read_text()

    report = build_report(list(results.values()), {"hostname": "h", "gpus": [{"name": "G", "memory_gib": 80.0}]})
    json_path, md_path = write_report(report, tmp_path / "out" / "smoke.json")
    saved = json.loads(json_path.read_text())
    assert (saved["status"], saved["counts"]) == ("failed", {"passed": 1, "failed": 3, "skipped": 2})
    assert exit_code(saved) == 1
    table = md_path.read_text()
    assert "| `passes` | passed | x 1.5 |" in table and "| `skips` | skipped | no frobnicator here |" in table
    assert "| `hangs` | failed |" in table and "1 GPU(s): G (80.0 GiB)" in table
    assert exit_code(build_report([results["passes"], results["skips"]], {})) == 0  # skips allowed


# ---------------------------------------------------------------------- which items run
def _items_main_would_run(monkeypatch, tmp_path, gpus: int, *argv: str) -> list[Item]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(cli, "probe_machine", lambda work, log_dir: {"gpus": []})
    captured: list[Item] = []
    monkeypatch.setattr(cli, "run_items", lambda items, log_dir: captured.extend(items) or [])
    assert cli.main(["--out", str(tmp_path / "s.json"), *argv]) == 0
    return captured


MULTI_GPU = {"vllm-child": 2, "vllm-child-torchrun": 2, "vllm-child-torchrun-gpu": 3, "fsdp2-nccl": 2}


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_the_gpu_count_decides_which_items_run(monkeypatch, tmp_path, gpus):
    items = {item.name: item for item in _items_main_would_run(monkeypatch, tmp_path, gpus)}
    assert tuple(items) == ITEM_NAMES
    for name, item in items.items():
        required = MULTI_GPU.get(name, 1)
        if gpus < required:
            assert item.skip and item.skip.endswith(f"needs at least {required} GPUs; {gpus} visible"), name
        else:
            assert item.skip is None, name
    if gpus >= 2:
        assert f"--nproc-per-node={gpus}" in items["fsdp2-nccl"].command


def test_only_runs_the_items_named_in_their_order(monkeypatch, tmp_path):
    items = _items_main_would_run(monkeypatch, tmp_path, 1, "--only", "fsdp2-nccl,tiny-fp32")
    assert [item.name for item in items] == ["tiny-fp32", "fsdp2-nccl"]
    [fsdp] = select(build_items(tmp_path, 12), ["fsdp2-nccl"])
    assert "--nproc-per-node=8" in fsdp.command  # one rank a GPU, 8 at most


# ---------------------------------------------------------------------- the command lines
SHORT = ["logger=none", "train.total_steps=2", "train.n_prompts=4", "train.n_samples=4", "train.n_minibatches=2",
         "train.eval_every=2", "train.eval_size=4", "train.checkpoint_every=2", "rollout.max_new_tokens=16"]
TORCHRUN = ["PY", "-m", "torch.distributed.run", "--standalone"]
VLLM = ["model=smollm2_135m", "rollout=vllm", "device=cuda"]


def _need(what: str, *overrides: str) -> list[str]:
    return ["PY", "-m", "a3po.smoke.probes", "need", what, *overrides]


def test_the_command_each_item_runs(tmp_path):
    w = str(tmp_path)
    items = {i.name: i for i in build_items(tmp_path, 3, python="PY", gsm8k_path="/data/gsm8k.jsonl")}
    train = ["PY", "experiments/train.py"]
    assert items["tiny-fp32"].command == [*train, "model=tiny", "device=cuda", "precision=fp32", *SHORT,
                                          f"output_root={w}/tiny-fp32"]
    assert items["tiny-bf16"].command == [*train, "model=tiny", "device=cuda", "precision=bf16", *SHORT,
                                          f"output_root={w}/tiny-bf16"]
    assert items["smollm2-bf16"].command == [*train, "model=smollm2_135m", "device=cuda", "precision=bf16", *SHORT,
                                             f"output_root={w}/smollm2-bf16"]
    assert items["smollm2-fp32"].needs == [_need("smollm2")]
    assert items["behave-logp"].command == ["PY", "-m", "a3po.smoke.probes", "behave-logp",
                                            f"{w}/behave-logp/behave_logp.json", "model=smollm2_135m"]
    assert items["vllm-inprocess"].command == [*train, *VLLM, *SHORT, f"output_root={w}/vllm-inprocess"]
    assert items["vllm-inprocess"].needs == [_need("vllm"), _need("smollm2")]
    assert items["vllm-child"].command == [*train, *VLLM, "rollout.device=cuda:1", *SHORT,
                                           f"output_root={w}/vllm-child"]
    assert items["vllm-child-torchrun"].command == [*TORCHRUN, "--nproc-per-node=2", "experiments/train.py", *VLLM,
                                                    *SHORT, f"output_root={w}/vllm-child-torchrun"]
    assert items["vllm-child-torchrun-gpu"].command == [
        *TORCHRUN, "--nproc-per-node=2", "experiments/train.py", *VLLM, "rollout.device=cuda:2", *SHORT,
        f"output_root={w}/vllm-child-torchrun-gpu"]
    assert items["fsdp2-nccl"].command == [*TORCHRUN, "--nproc-per-node=3", "experiments/train.py", "model=tiny",
                                           "device=cuda", *SHORT, f"output_root={w}/fsdp2-nccl"]
    assert items["fsdp2-nccl-1rank"].command == ["PY", "-m", "a3po.smoke.probes", "fsdp-one-rank",
                                                 f"{w}/fsdp2-nccl-1rank/fsdp.json"]
    assert items["paper-shaped"].command == [
        *train, "experiment=paper_gsm8k", "model=smollm2_135m", "logger=none", "train.total_steps=2",
        "train.n_prompts=8", "train.eval_every=2", "train.eval_size=8", "train.checkpoint_every=2",
        "rollout.max_new_tokens=64", "task.path=/data/gsm8k.jsonl", f"output_root={w}/paper-shaped"]
    assert items["paper-shaped"].needs == [_need("vllm"), _need("smollm2"), _need("gsm8k", "task.path=/data/gsm8k.jsonl")]
    assert items["benchmark-cuda"].command == [
        "PY", "experiments/benchmark.py", "device=cuda", "model=smollm2_135m", "train.n_prompts=4",
        "train.n_samples=4", "--prompt-len", "48", "--response-len", "32", "--reps", "2", "--no-optimizer-kernels",
        "--no-progress", "--out", f"{w}/benchmark-cuda"]


def test_every_command_is_one_its_program_accepts(tmp_path):
    """Each training item's overrides compose into the config meant; the benchmark's flags parse."""
    from a3po.benchmark.cli import build_parser

    items = {i.name: i for i in build_items(tmp_path, 3, python="PY")}
    for name, item in items.items():
        if "experiments/train.py" not in item.command:
            continue
        cfg = compose_config(item.command[item.command.index("experiments/train.py") + 1:])
        assert (cfg.device, cfg.train.total_steps, cfg.logger.name) == ("cuda", STEPS, "none"), name
        assert cfg.output_root == str(tmp_path / name)
    paper = compose_config(items["paper-shaped"].command[2:])
    assert (paper.model.name, paper.task.name, paper.rollout.name, paper.runtime.name) == (
        "smollm2_135m", "gsm8k", "vllm", "async")
    assert (paper.train.n_samples, paper.train.n_minibatches, paper.train.n_prompts) == (4, 4, 8)
    args = build_parser().parse_args(items["benchmark-cuda"].command[2:])
    assert (args.reps, args.response_len, args.optimizer_kernels, args.out) == (2, 32, False, tmp_path / "benchmark-cuda")
    assert args.overrides == ["device=cuda", "model=smollm2_135m", "train.n_prompts=4", "train.n_samples=4"]


# ---------------------------------------------------------------------- the checks, on the CPU
def test_a_real_run_passes_its_check_and_a_wrong_one_fails(tmp_path):
    """tiny-fp32's own command with device=cpu: the check reads the run it wrote."""
    item = next(i for i in build_items(tmp_path / "runs", 1) if i.name == "tiny-fp32")
    item.command = ["device=cpu" if arg == "device=cuda" else arg for arg in item.command]
    result = run_item(item, tmp_path / "logs")
    assert result["status"] == "passed", result.get("error")
    assert result["figure"]["precision"] == "fp32" and result["figure"]["time_step_s"] > 0
    assert result["figure"]["reward"] == json.loads(
        checks.the_run_dir(item.work_dir).joinpath("metrics.jsonl").read_text().splitlines()[-1])["reward/mean"]
    with pytest.raises(SmokeFailure, match=r"has steps \[0, 1\], expected 0..2"):
        checks.training_run(3)(item.work_dir, "")
    with pytest.raises(SmokeFailure, match="recorded precision=fp32, not the bf16 asked for"):
        checks.training_run(STEPS, "bf16")(item.work_dir, "")
    metrics = checks.the_run_dir(item.work_dir) / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], json.dumps({**json.loads(lines[1]), "reward/mean": None})]) + "\n")
    with pytest.raises(SmokeFailure, match="step 1: reward/mean is None, not finite"):
        checks.training_run(STEPS)(item.work_dir, "")


def test_the_behave_logp_probe_and_its_check(tmp_path, monkeypatch):
    """The probe's own code on the CPU (tiny model), then the check's tolerances."""
    out = tmp_path / "behave_logp.json"
    assert probes_main(["behave-logp", str(out), "model=tiny", "device=cpu"]) == 0
    measured = json.loads(out.read_text())
    assert set(measured) == {"fp32", "bf16"} and measured["fp32"]["tokens"] > 0
    figure = checks.behave_logp(tmp_path, "")
    assert figure["fp32_max_abs_diff"] == measured["fp32"]["max_abs_diff"] <= checks.BEHAVE_TOLERANCE["fp32"]
    out.write_text(json.dumps({**measured, "bf16": {**measured["bf16"], "max_abs_diff": 0.5}}))
    with pytest.raises(SmokeFailure, match="bf16: max .* = 0.5 over .* above the tolerance 0.1"):
        checks.behave_logp(tmp_path, "")


def test_the_benchmark_check_wants_a_cuda_report_with_its_figures(tmp_path):
    report = {"machine": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}, "model": {"precision": "bf16"},
              "batch": {}, "results": {},
              "derived": {"step_ratio_recompute_over_loglinear": 1.3,
                          "throughput": {"step/loglinear": {"tokens_per_s": 5e4, "mfu": 0.02, "mfu_measured_peak": 0.03}}}}
    (tmp_path / "benchmark.json").write_text(json.dumps(report))
    assert checks.benchmark_report(tmp_path, "") == {"step_ratio": 1.3, "mfu": 0.02, "mfu_measured_peak": 0.03,
                                                      "tokens_per_s": 5e4, "gpu": "NVIDIA H100 80GB HBM3",
                                                      "precision": "bf16"}
    (tmp_path / "benchmark.json").write_text(json.dumps({**report, "machine": {"device": "cpu"}}))
    with pytest.raises(SmokeFailure, match="ran on 'cpu', not cuda"):
        checks.benchmark_report(tmp_path, "")
    (tmp_path / "benchmark.json").write_text(json.dumps({k: v for k, v in report.items() if k != "derived"}))
    with pytest.raises(SmokeFailure, match=r"lacks \['derived'\]"):
        checks.benchmark_report(tmp_path, "")


def test_gsm8k_is_needed_from_a_local_copy_or_the_item_skips(tmp_path):
    fixture = REPO / "tests" / "fixtures" / "gsm8k_sample.jsonl"
    assert need_gsm8k([f"task.path={fixture}", "task.held_out_fraction=0.5"]) is None
    reason = need_gsm8k([f"task.path={tmp_path / 'absent.jsonl'}"])
    assert reason.startswith("GSM8K cannot be loaded (") and "--gsm8k-path" in reason


def test_the_report_table_names_the_machine():
    report = build_report([], {"hostname": "node7", "cuda": "12.8", "driver": "570.1", "torch": "2.13.0",
                               "transformers": "5.19.0", "vllm": "0.32.0", "python": "3.12.3",
                               "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2}] * 2})
    text = render_markdown(report)
    assert ("host node7; 2 GPU(s): NVIDIA H100 80GB HBM3 (79.2 GiB); CUDA 12.8; driver 570.1; torch 2.13.0; "
            "transformers 5.19.0; vllm 0.32.0; Python 3.12.3") in text
    assert "**passed**: 0 passed, 0 failed, 0 skipped." in text


def test_the_one_rank_fsdp2_probe_and_its_check(tmp_path):
    """On a CPU the probe runs over gloo: FSDP2 at world 1 equals the unwrapped model in fp32 (with
    checkpointing too) and its bf16 gathers stay near autocast; a doctored result fails the check."""
    out = tmp_path / "fsdp2-nccl-1rank" / "fsdp.json"
    proc = subprocess.run([sys.executable, "-m", "a3po.smoke.probes", "fsdp-one-rank", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MASTER_PORT": "29547"})
    assert proc.returncode == 0, proc.stderr
    figure = checks.fsdp_one_rank(out.parent, proc.stdout)
    assert figure["backend"] == "gloo" and figure["fp32_max_diff"] <= 1e-6 and 0 < figure["mixed_grad_diff"] < 0.05
    measured = json.loads(out.read_text())
    measured["cases"][1]["max_weight_diff"] = 1e-3
    out.write_text(json.dumps(measured))
    with pytest.raises(SmokeFailure, match="activation checkpointing: max difference 0.001"):
        checks.fsdp_one_rank(out.parent, "")
