"""The model against this suite's measurements: fit the per-phase efficiencies on one or two
shapes' benchmarks (`python -m a3po.benchmark`, its `benchmark.json`) and predict the others.

Every figure is CPU time (the benchmark's `cpu_seconds` medians), on one thread: on a machine
shared with other jobs it is the figure that survives the sharing. The device's peaks are the
ones each benchmark measured in the same run (its matmul probe per CPU second, in the run's
precision; its copy's bytes per CPU second), so an fp32 shape is predicted against the fp32
peak. The lagged runtime's step is measured as `rollout` + `step/<algo>` (the trainer's whole
step, the recompute forward and the optimizer steps included) and predicted as the sum of the
model's phases.

Fitted on one shape, or two that differ in micro-batches (one shape cannot tell a fixed cost
per micro-batch from a lower MFU): the recompute forward's MFU and fixed cost per micro-batch
(`prox/recompute`), the training pass's (`step/loglinear` less its AdamW steps), AdamW's share
of bandwidth (`kernel/adamw_fused`), and the rollout's fixed cost per decode step (the decode's
FLOPs at the forward's MFU, its weight and KV reads at AdamW's bandwidth share, the rest per
step)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from a3po.memory.parts import Architecture
from analysis.cost_model.phases import (Efficiency, Hardware, StepShape, decode_seconds, forward_flops,
                                        optimizer_bytes, phase_seconds, prefill_flops, train_flops)
from analysis.cost_model.pipeline import serial_step

__all__ = ["load_report", "shape_of", "hardware_of", "measured", "fit", "predict", "validation_rows"]

ALGOS = ("recompute", "loglinear")


def load_report(path: str | Path) -> dict[str, Any]:
    """A benchmark.json (or the folder holding one), with a clear error for anything else."""
    path = Path(path)
    path = path / "benchmark.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable benchmark.json ({error})") from error
    missing = [k for k in ("rollout", "prox/recompute", "step/recompute", "step/loglinear", "kernel/copy")
               if k not in report.get("results", {})]
    if missing:
        raise ValueError(f"{path}: the benchmark lacks {missing}; run it with --algos recompute,loglinear "
                         "and the rollout")
    report["_path"] = str(path)
    return report


def _cpu(report: dict, name: str) -> float:
    results = report["results"]
    key = name if name in results else next(k for k in results if k.startswith(name))
    return float(results[key]["cpu_seconds"]["median"])


def shape_of(report: dict) -> StepShape:
    """The benchmark's batch as a StepShape: its mean response, its padding, and its rollout,
    which decodes every sequence to the longest (the HF engine's static batch)."""
    b = report["batch"]
    sequences = b["n_prompts"] * b["n_samples"]
    return StepShape(prompts=b["n_prompts"], samples=b["n_samples"], prompt_len=b["prompt_len"],
                     response_len=b["response_tokens"] / sequences, response_max=b["response_len_max"],
                     minibatches=b["n_minibatches"], precision=report["model"]["precision"],
                     padding=b["padding_waste"], rollout_padded=True, micro_batches=b.get("micro_batches", 0))


def hardware_of(report: dict) -> Hardware:
    """One core's peaks as this benchmark measured them, per CPU second."""
    matmul = next(v for k, v in report["results"].items() if k.startswith("kernel/matmul_"))
    copy = report["results"]["kernel/copy"]
    return Hardware(flops=matmul["info"]["flops"] / matmul["cpu_seconds"]["median"],
                    bandwidth=copy["info"]["bytes"] / copy["cpu_seconds"]["median"])


def measured(report: dict) -> dict[str, float]:
    """CPU seconds of the lagged step per algo, of the rollout, and of the recompute forward
    (`prox/recompute`: `Trainer.recompute_prox_logp` over the step's own micro-batches, timed on
    its own; the two steps' difference holds the same forward but carries both steps' noise)."""
    return {"rollout": _cpu(report, "rollout"), "prox_logp": _cpu(report, "prox/recompute"),
            **{f"step/{algo}": _cpu(report, "rollout") + _cpu(report, f"step/{algo}") for algo in ALGOS}}


def _adamw_s(reports: list[dict]) -> float:
    """One fused AdamW step's CPU seconds, the mean over the fit shapes that timed it."""
    timed = [_cpu(r, "kernel/adamw_fused") for r in reports
             if any(k.startswith("kernel/adamw_fused") for k in r["results"])]
    if not timed:
        raise ValueError("no fit shape timed the optimizer (kernel/adamw_fused): run one of them without "
                         "--no-optimizer-kernels")
    return sum(timed) / len(timed)


def _fit_phases(report: dict, adamw_s: float) -> dict[str, float]:
    """A fit shape's phases: `measured`'s, its AdamW steps (one per minibatch, the trainer's
    fused AdamW) and the training pass (the loglinear step less them)."""
    optimizer = report["batch"]["n_minibatches"] * adamw_s
    return {**measured(report), "optimizer": optimizer, "train": _cpu(report, "step/loglinear") - optimizer}


def _line(xs: list[float], ns: list[int], ys: list[float], what: str) -> tuple[float, float]:
    """(seconds per FLOP, seconds per pass) through the fit shapes' (FLOPs, passes, seconds);
    with one shape, or shapes of one pass count, the pass cost is 0 and the FLOPs carry all."""
    if len(set(ns)) < 2:
        return sum(ys) / sum(xs), 0.0
    (a, c), *_ = np.linalg.lstsq(np.array([xs, ns], dtype=float).T, np.array(ys), rcond=None)
    if a <= 0 or c < 0:
        raise ValueError(f"the fit shapes give {what} a non-physical line ({a:.3g} s/FLOP, {c:.3g} s a pass); "
                         "fit on shapes that differ in micro-batches and little else")
    return float(a), float(c)


def fit(reports: list[dict], arch: Architecture) -> Efficiency:
    """The efficiencies that best reproduce the fit shapes' phases (exactly, for one shape, or
    two of different micro-batch counts): each trainer pass's MFU and fixed cost per
    micro-batch, AdamW's share of bandwidth, the rollout's fixed cost per decode step."""
    adamw_s = _adamw_s(reports)
    shapes, hws = [shape_of(r) for r in reports], [hardware_of(r) for r in reports]
    seen = [_fit_phases(r, adamw_s) for r in reports]
    passes = [s.passes for s in shapes]
    per_flop_f, forward_pass_s = _line([forward_flops(arch, s) / h.flops for s, h in zip(shapes, hws)], passes,
                                       [x["prox_logp"] for x in seen], "the recompute forward")
    per_flop_t, train_pass_s = _line([train_flops(arch, s) / h.flops for s, h in zip(shapes, hws)], passes,
                                     [x["train"] for x in seen], "the training pass")
    bandwidth = (sum(optimizer_bytes(arch, s) / h.bandwidth for s, h in zip(shapes, hws))
                 / sum(x["optimizer"] for x in seen))
    partial = Efficiency(prefill=1 / per_flop_f, decode=bandwidth, forward=1 / per_flop_f, optimizer=bandwidth,
                         train=1 / per_flop_t, forward_pass_s=forward_pass_s, train_pass_s=train_pass_s)
    rests = [x["rollout"] - prefill_flops(arch, s) / (h.flops * partial.prefill) - decode_seconds(arch, s, h, partial)
             for s, h, x in zip(shapes, hws, seen)]
    if min(rests) < 0:
        raise ValueError("the rollout is faster than its FLOPs and bytes at the fitted efficiencies; the model "
                         "cannot place a fixed cost per decode step")
    return replace(partial, decode_step_s=sum(rests) / sum(s.response_max for s in shapes))


def predict(report: dict, arch: Architecture, eff: Efficiency) -> dict[str, float]:
    """The model's lagged step per algo for `report`'s shape on `report`'s measured core."""
    shape, hw = shape_of(report), hardware_of(report)
    return {f"step/{algo}": serial_step(phase_seconds(arch, shape, hw, hw, eff, algo)) for algo in ALGOS}


def _name(report: dict) -> str:
    b, precision = report["batch"], report["model"]["precision"]
    return (f"{b['n_prompts']}x{b['n_samples']}, r<={b['response_len_max']}, m={b['n_minibatches']}, "
            f"{precision}")


def validation_rows(eff: Efficiency, fit_reports: list[dict], reports: list[dict],
                    arch: Architecture) -> list[dict[str, Any]]:
    """Per report, the fit shapes first: predicted (at `eff`, fitted on `fit_reports`) and
    measured lagged steps (CPU s), the error of each, and the recompute/loglinear ratio."""
    rows = []
    for report in [*fit_reports, *reports]:
        seen, model = measured(report), predict(report, arch, eff)
        row = {"shape": _name(report), "fit": any(report is r for r in fit_reports)}
        for algo in ALGOS:
            key = f"step/{algo}"
            row[f"{algo}_measured_s"], row[f"{algo}_predicted_s"] = seen[key], model[key]
            row[f"{algo}_error"] = model[key] / seen[key] - 1
        row["ratio_measured"] = seen["step/recompute"] / seen["step/loglinear"]
        row["ratio_predicted"] = model["step/recompute"] / model["step/loglinear"]
        rows.append(row)
    return rows
