"""The figures computed from the measured ones: the headline ratios and the ceiling of the
step-time ratio, throughput and MFU, and the approximation's memory-bandwidth floor."""

from __future__ import annotations

import statistics
from typing import Any

import torch

# Dense bf16 tensor-core peaks (vendor datasheets), matched against torch.cuda.get_device_name
# in this order, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """The nominal dense bf16 peak of a known GPU; None on a CPU (no datasheet figure applies
    to a VM's share of one) or for fp32, whose GPU peak is not a tensor-core figure."""
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def median(report: dict, name: str, key: str = "seconds") -> float | None:
    entry = report["results"].get(name)
    return entry[key]["median"] if entry and key in entry else None


def prox_ratios(report: dict) -> dict[str, float]:
    prox_recompute, prox_loglinear = median(report, "prox/recompute"), median(report, "prox/loglinear-inverse")
    if not (prox_recompute and prox_loglinear):
        return {}
    return {"prox_ratio_recompute_over_loglinear": prox_recompute / prox_loglinear,
            "prox_ratio_recompute_over_loglinear_cpu": (median(report, "prox/recompute", "cpu_seconds")
                                                        / median(report, "prox/loglinear-inverse", "cpu_seconds"))}


def step_ratios(report: dict) -> dict[str, float]:
    """recompute / loglinear step time (wall, paired per round, min / min, CPU), and its
    ceiling T_step / (T_step - T_prox) had the approximation cost nothing."""
    results, out = report["results"], {}
    step_recompute, step_loglinear = median(report, "step/recompute"), median(report, "step/loglinear")
    prox_recompute = median(report, "prox/recompute")
    if step_recompute and step_loglinear:
        out["step_ratio_recompute_over_loglinear"] = step_recompute / step_loglinear
        out["step_time_saved_fraction"] = 1.0 - step_loglinear / step_recompute
        # Paired: the two steps of one round ran a minute apart at most, so slow load drift
        # cancels in their ratio.
        paired = [r["seconds"] / l["seconds"] for r, l in zip(results["step/recompute"]["raw"],
                                                               results["step/loglinear"]["raw"])]
        out["step_ratio_paired_median"] = statistics.median(paired)
        out["step_ratio_min_over_min"] = (results["step/recompute"]["seconds"]["min"]
                                          / results["step/loglinear"]["seconds"]["min"])
        cpu_recompute = median(report, "step/recompute", "cpu_seconds")
        out["step_ratio_recompute_over_loglinear_cpu"] = cpu_recompute / median(report, "step/loglinear", "cpu_seconds")
        if prox_recompute:
            prox_cpu = median(report, "prox/recompute", "cpu_seconds")
            out["step_ratio_ceiling_cpu"] = cpu_recompute / (cpu_recompute - prox_cpu)
            out["step_ratio_over_ceiling_cpu"] = (out["step_ratio_recompute_over_loglinear_cpu"]
                                                  / out["step_ratio_ceiling_cpu"])
    if step_recompute:
        prox_in_step = median(report, "step/recompute", "prox_logp")
        out["prox_in_step_recompute_s"] = prox_in_step
        out["step_ratio_ceiling"] = step_recompute / (step_recompute - prox_in_step)
        if "step_ratio_recompute_over_loglinear" in out:
            out["step_ratio_over_ceiling"] = out["step_ratio_recompute_over_loglinear"] / out["step_ratio_ceiling"]
    if step_loglinear:
        out["prox_in_step_loglinear_s"] = median(report, "step/loglinear", "prox_logp")
    return out


def kernel_ratios(report: dict) -> dict[str, Any]:
    """AdamW default / fused, and what the entropy adds to the vocabulary log-prob pass."""
    results, out = report["results"], {}
    adamw = {name.split("@")[0].removeprefix("kernel/adamw_"): entry for name, entry in results.items()
             if name.startswith("kernel/adamw_")}
    if "default" in adamw and "fused" in adamw:
        out["adamw_fused_speedup"] = {key: adamw["default"][key]["median"] / adamw["fused"][key]["median"]
                                      for key in ("seconds", "cpu_seconds")}
    plain = next((e["seconds"]["median"] for n, e in results.items() if n.startswith("kernel/logprobs@")), None)
    with_entropy = next((e["seconds"]["median"] for n, e in results.items()
                         if n.startswith("kernel/logprobs+entropy@")), None)
    if plain and with_entropy:
        out["entropy_extra_s"] = with_entropy - plain
    return out


def forward_flops(model: dict, batch: dict) -> float:
    """Model FLOPs of one forward over the batch, as the trainer runs it: 2 x non-embedding
    parameters per token (every real token), causal attention's QK^T and AV (2 x 2 x hidden
    per query-key pair per layer), and the lm_head (2 x hidden x vocab) at response positions
    only, where the trainer applies it. Padding is not counted: it is waste, not work."""
    dense = 2 * model["non_embedding_params"] * batch["tokens"]
    attention = 4 * model["hidden"] * model["layers"] * batch["attention_pairs"]
    lm_head = 2 * model["hidden"] * model["vocab"] * batch["response_tokens"]
    return float(dense + attention + lm_head)


def measured_peak(report: dict) -> dict[str, Any] | None:
    """The matmul probe's rate (FLOP/s at its median and at its best repetition)."""
    entry = next((e for n, e in report["results"].items() if n.startswith("kernel/matmul_")), None)
    if not entry:
        return None
    flops = entry["info"]["flops"]
    return {"dtype": entry["info"]["dtype"], "shape": entry["info"]["shape"],
            "flops_per_s": flops / entry["seconds"]["median"], "flops_per_s_best": flops / entry["seconds"]["min"],
            "flops_per_cpu_s": flops / entry["cpu_seconds"]["median"]}


def throughput(report: dict, peak: float | None) -> dict[str, dict[str, float]]:
    """Tokens/s and achieved FLOP/s per step (forward + backward = 3 forwards, plus one for
    recompute's no-grad forward) and of the recompute forward alone, with MFU against the
    measured matmul peak and, where known, the device's nominal peak."""
    tokens, out = report["batch"]["tokens"], {}
    forward = forward_flops(report["model"], report["batch"])
    probe = measured_peak(report)

    def row(flops: float, seconds: float, cpu_seconds: float | None = None) -> dict[str, float]:
        result = {"tokens_per_s": tokens / seconds, "model_flops": flops, "flops_per_s": flops / seconds}
        if probe:
            result["mfu_measured_peak"] = flops / seconds / probe["flops_per_s"]
            if cpu_seconds:  # per CPU second, against the probe's: what survives a shared machine
                result["mfu_measured_peak_cpu"] = flops / cpu_seconds / probe["flops_per_cpu_s"]
        if peak:
            result["mfu"] = flops / seconds / peak
        return result

    for name, entry in report["results"].items():
        if entry["kind"] == "step":
            recomputes = name.split("@")[0] == "step/recompute"
            out[name] = row(3 * forward + (forward if recomputes else 0.0), entry["seconds"]["median"],
                            entry["cpu_seconds"]["median"])
            train_s = entry.get("train", {}).get("median") if isinstance(entry.get("train"), dict) else None
            if train_s:  # the train phase alone: forward + backward of every micro-batch, and AdamW
                out[f"{name}/train_phase"] = row(3 * forward, train_s)
    prox_recompute = median(report, "prox/recompute")
    if prox_recompute:
        out["prox/recompute"] = row(forward, prox_recompute, median(report, "prox/recompute", "cpu_seconds"))
    return out


def bandwidth_floor(report: dict, traffic: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The copy's GB/s, and per approximation size its bytes over that bandwidth against its time."""
    copy = report["results"].get("kernel/copy")
    if not copy:
        return {}
    bandwidth = copy["info"]["bytes"] / copy["seconds"]["median"]
    out: dict[str, Any] = {"memory_bandwidth_GBps": bandwidth / 1e9,
                           "memory_bandwidth_best_GBps": copy["info"]["bytes"] / copy["seconds"]["min"] / 1e9}
    floors = {}
    for key, row in traffic.items():
        method, n = key.split("@")
        measured = median(report, f"kernel/{method}-inverse@{n}")
        unchecked = median(report, f"kernel/{method}-inverse@{n}/no_check")
        floor = row["bytes_minimal"] / bandwidth
        floors[key] = {
            **row, "floor_s": floor, "eager_floor_s": row["bytes_eager"] / bandwidth,
            "measured_s": measured, "measured_no_check_s": unchecked,
            "over_floor": measured / floor if measured else None,
            "over_floor_no_check": unchecked / floor if unchecked else None,
            "check_finite_cost_s": (measured - unchecked) if measured and unchecked else None,
            "finite_flag_s": median(report, f"kernel/finite_flag@{n}"),
        }
    out["bandwidth_floor"] = floors
    return out


def derive(report: dict, device: torch.device, traffic: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios, the ceiling of the step-time ratio, throughput and MFU, and the bandwidth floor."""
    peak = peak_flops(device, report["model"].get("precision", "bf16"))
    out: dict[str, Any] = {**prox_ratios(report), **step_ratios(report), **kernel_ratios(report),
                           "throughput": throughput(report, peak), "peak_flops": peak,
                           "peak_flops_measured": measured_peak(report),
                           **bandwidth_floor(report, traffic)}
    if "rollout" in report["results"]:
        out["rollout_tokens_per_s"] = report["results"]["rollout"]["tokens_per_s"]["median"]
    return out
