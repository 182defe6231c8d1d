"""How each smoke item checks its own result, beyond the exit status: a training run's
metrics.jsonl has every step with a finite reward and step time, its finished.json the step
count and its config.yaml the precision asked for; behave-logp's differences are within their
tolerances; the benchmark's report has its keys and finite figures. Each returns the figure
the report shows, or raises `SmokeFailure` saying what is wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from a3po.smoke.runner import Check, SmokeFailure

# Max |trainer logp - behave_logp| on cuda. fp32: the same float32 model computed by the decode
# loop (with its KV cache) and by one padded forward; measured 9.5e-7 on an H200 (docs/gpu_runs.md),
# 4-6e-5 for vLLM against the trainer. bf16: the bf16 tolerance of tests/test_decode.py.
BEHAVE_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}
# What a3po.rollout.vllm_child's process is called in vLLM's log lines (tests/test_distributed_async.py).
VLLM_CHILD_MARKER = "(a3po-vllm pid="
BENCHMARK_KEYS = ("machine", "model", "batch", "results", "derived")
# fsdp2-nccl-1rank: fp32 FSDP2 at one rank against the unwrapped model; bf16 gathers against
# autocast, as a share of the largest gradient (what an H200 measured: docs/gpu_runs.md).
FSDP_FP32_TOLERANCE, FSDP_MIXED_SHARE = 1e-6, 0.1


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def the_run_dir(root: Path) -> Path:
    """The one run directory under `root` (the item's output root)."""
    found = sorted(path.parent for path in root.rglob("metrics.jsonl"))
    if len(found) != 1:
        raise SmokeFailure(f"expected one run's metrics.jsonl under {root}, found {len(found)}: {found}")
    return found[0]


def _check_records(records: list[dict[str, Any]], steps: int) -> None:
    if [r.get("step") for r in records] != list(range(steps)):
        raise SmokeFailure(f"metrics.jsonl has steps {[r.get('step') for r in records]}, expected 0..{steps - 1}")
    for record in records:
        if not finite(record.get("reward/mean")):
            raise SmokeFailure(f"step {record['step']}: reward/mean is {record.get('reward/mean')!r}, not finite")
        if not (finite(record.get("time/step")) and record["time/step"] > 0):
            raise SmokeFailure(f"step {record['step']}: time/step is {record.get('time/step')!r}, not a positive time")
        if not finite(record.get("actor/loss")):
            raise SmokeFailure(f"step {record['step']}: actor/loss is {record.get('actor/loss')!r}, not finite")


def training_run(steps: int, precision: str | None = None, vllm_child: bool = False) -> Check:
    """A run of `steps` steps (at `precision` where given): the last step's time/step and reward."""

    def check(root: Path, output: str) -> dict[str, Any]:
        from omegaconf import OmegaConf

        from a3po.run.metrics_log import read_metrics

        run_dir = the_run_dir(root)
        records = read_metrics(run_dir / "metrics.jsonl")
        _check_records(records, steps)
        finished = run_dir / "finished.json"
        if not finished.is_file() or json.loads(finished.read_text()).get("steps") != steps:
            raise SmokeFailure(f"{finished} is missing or does not record {steps} steps")
        ran_at = OmegaConf.load(run_dir / "config.yaml").get("precision")
        if precision is not None and ran_at != precision:
            raise SmokeFailure(f"the run recorded precision={ran_at}, not the {precision} asked for")
        last = records[-1]
        figure = {"time_step_s": last["time/step"], "reward": last["reward/mean"], "precision": ran_at}
        if finite(last.get("eval/reward")):
            figure["eval_reward"] = last["eval/reward"]
        if vllm_child:  # where vLLM ran, as its log says (recorded, not judged: the log format is vLLM's)
            figure["vllm_child_seen"] = VLLM_CHILD_MARKER in output
        return figure

    return check


def behave_logp(root: Path, output: str) -> dict[str, Any]:
    """probes.behave_logp's file: every precision scored tokens, within its tolerance."""
    measured = json.loads((root / "behave_logp.json").read_text())
    figure: dict[str, Any] = {}
    for precision, tolerance in BEHAVE_TOLERANCE.items():
        entry = measured.get(precision)
        if not entry or not entry.get("tokens"):
            raise SmokeFailure(f"{precision}: no tokens were scored ({entry!r})")
        diff = entry.get("max_abs_diff")
        if not finite(diff) or diff > tolerance:
            raise SmokeFailure(f"{precision}: max |trainer logp - behave_logp| = {diff!r} over {entry['tokens']} "
                               f"tokens of {entry.get('model')}, above the tolerance {tolerance}")
        figure[f"{precision}_max_abs_diff"] = diff
    figure["tokens"] = measured[next(iter(BEHAVE_TOLERANCE))]["tokens"]
    return figure


def fsdp_one_rank(root: Path, output: str) -> dict[str, Any]:
    """probes' fsdp-one-rank file: fp32 cases equal to the unwrapped model, bf16 gathers close
    to autocast, float32 master weights."""
    measured = json.loads((root / "fsdp.json").read_text())
    figure: dict[str, Any] = {"backend": measured["backend"]}
    for case in measured["cases"]:
        mixed = "mixed" in case["case"]
        bound = FSDP_MIXED_SHARE * case["max_grad"] if mixed else FSDP_FP32_TOLERANCE
        worst = max(case["max_grad_diff"], 0.0 if mixed else case["max_weight_diff"])
        if not finite(worst) or worst > bound:
            raise SmokeFailure(f"{case['case']}: max difference {worst!r} from the unwrapped model, above {bound:.3g}")
        key = "mixed_grad_diff" if mixed else "fp32_max_diff"
        figure[key] = max(worst, figure.get(key, 0.0))
    if measured["master_dtypes"] != ["torch.float32"]:
        raise SmokeFailure(f"master weights {measured['master_dtypes']}, expected float32 only")
    return figure


def benchmark_report(root: Path, output: str) -> dict[str, Any]:
    """benchmark.json: measured on cuda, with the step ratio and the step's throughput."""
    report = json.loads((root / "benchmark.json").read_text())
    missing = [key for key in BENCHMARK_KEYS if key not in report]
    if missing:
        raise SmokeFailure(f"benchmark.json lacks {missing}")
    if not str(report["machine"].get("device", "")).startswith("cuda"):
        raise SmokeFailure(f"the benchmark ran on {report['machine'].get('device')!r}, not cuda")
    derived = report["derived"]
    ratio = derived.get("step_ratio_recompute_over_loglinear")
    if not (finite(ratio) and ratio > 0):
        raise SmokeFailure(f"step_ratio_recompute_over_loglinear is {ratio!r}")
    step = derived.get("throughput", {}).get("step/loglinear")
    if not step or not finite(step.get("tokens_per_s")):
        raise SmokeFailure(f"no finite throughput for step/loglinear: {step!r}")
    return {"step_ratio": ratio, "mfu": step.get("mfu"), "mfu_measured_peak": step.get("mfu_measured_peak"),
            "tokens_per_s": step["tokens_per_s"], "gpu": report["machine"].get("gpu"),
            "precision": report["model"].get("precision")}
