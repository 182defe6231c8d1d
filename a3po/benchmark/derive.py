"""The figures computed from the measured ones: the headline ratios and the ceiling of the
step-time ratio, throughput and MFU, and the approximation's memory-bandwidth floor."""

from __future__ import annotations

import re
import statistics
from typing import Any

import torch

# Dense (not 2:4-sparse) bf16 tensor-core peaks, per GPU, from NVIDIA's datasheets (their
# "with sparsity" figures halved), keyed by model and form factor (`device_model`).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,
    "H200 SXM": 989e12, "H200 NVL": 835e12, "GH200": 989e12,
    "A100 SXM": 312e12, "A100 PCIe": 312e12, "L40S": 362e12, "B200": 2250e12,
}
# Words of a device name that name a form factor; memory sizes and types are ignored.
_FORMS = {"SXM": "SXM", "SXM4": "SXM", "SXM5": "SXM", "PCIE": "PCIe", "NVL": "NVL"}
_MEMORY = re.compile(r"\d+GB?|HBM\d[A-Z]?")


def device_model(name: str) -> str | None:
    """The `PEAK_BF16_FLOPS` key of a `torch.cuda.get_device_name`, matched word by word:
    "NVIDIA H100 80GB HBM3" -> "H100 SXM", "NVIDIA A100-PCIE-40GB" -> "A100 PCIe",
    "NVIDIA H200 NVL" -> "H200 NVL". A model without a form factor is its SXM part where the
    table has one; any word that is not a form factor or a memory size or type (a MIG slice,
    a model not in the table) gives None: no figure rather than a wrong one."""
    words = re.sub(r"^NVIDIA\s+", "", name.strip(), flags=re.IGNORECASE).upper().replace("-", " ").split()
    if not words:
        return None
    model, forms = words[0], set()
    for word in words[1:]:
        if word in _FORMS:
            forms.add(_FORMS[word])
        elif not _MEMORY.fullmatch(word):
            return None
    if len(forms) > 1:
        return None
    keys = [f"{model} {form}" for form in forms] or [model, f"{model} SXM"]
    return next((key for key in keys if key in PEAK_BF16_FLOPS), None)


def peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """The nominal dense bf16 peak of a known GPU; None on a CPU (no datasheet figure applies
    to a VM's share of one), for fp32, whose GPU peak is not a tensor-core figure, or for a
    device name `device_model` does not know."""
    if device.type != "cuda" or precision != "bf16":
        return None
    key = device_model(torch.cuda.get_device_name(device))
    return PEAK_BF16_FLOPS[key] if key else None


def median(report: dict, name: str, key: str = "seconds") -> float | None:
    entry = report["results"].get(name)
    return entry[key]["median"] if entry and key in entry else None


def first(report: dict, prefix: str) -> dict | None:
    """The first result whose name starts with `prefix` (kernel names end in their size)."""
    return next((entry for name, entry in report["results"].items() if name.startswith(prefix)), None)


def prox_ratios(report: dict) -> dict[str, float]:
    recompute, loglinear = report["results"].get("prox/recompute"), report["results"].get("prox/loglinear-inverse")
    if not (recompute and loglinear):
        return {}
    return {f"prox_ratio_recompute_over_loglinear{suffix}": recompute[key]["median"] / loglinear[key]["median"]
            for suffix, key in (("", "seconds"), ("_cpu", "cpu_seconds"))}


def step_ratios(report: dict) -> dict[str, float]:
    """recompute / loglinear step time (wall medians, paired per round, min / min, CPU), and
    its ceiling T_step / (T_step - T_prox): the ratio had the approximation cost nothing."""
    recompute, loglinear = report["results"].get("step/recompute"), report["results"].get("step/loglinear")
    out: dict[str, float] = {}
    if loglinear:
        out["prox_in_step_loglinear_s"] = loglinear["prox_logp"]["median"]
    if not recompute:
        return out
    step, prox = recompute["seconds"]["median"], recompute["prox_logp"]["median"]
    out.update(prox_in_step_recompute_s=prox, step_ratio_ceiling=step / (step - prox))
    if not loglinear:
        return out
    ratio = step / loglinear["seconds"]["median"]
    cpu_step, prox_cpu = recompute["cpu_seconds"]["median"], median(report, "prox/recompute", "cpu_seconds")
    out.update(step_ratio_recompute_over_loglinear=ratio, step_time_saved_fraction=1.0 - 1.0 / ratio,
               step_ratio_over_ceiling=ratio / out["step_ratio_ceiling"],
               # Paired: the two steps of one round ran minutes apart at most, so slow load drift cancels.
               step_ratio_paired_median=statistics.median(
                   r["seconds"] / l["seconds"] for r, l in zip(recompute["raw"], loglinear["raw"])),
               step_ratio_min_over_min=recompute["seconds"]["min"] / loglinear["seconds"]["min"],
               step_ratio_recompute_over_loglinear_cpu=cpu_step / loglinear["cpu_seconds"]["median"])
    if prox_cpu:
        ceiling = cpu_step / (cpu_step - prox_cpu)
        out.update(step_ratio_ceiling_cpu=ceiling,
                   step_ratio_over_ceiling_cpu=out["step_ratio_recompute_over_loglinear_cpu"] / ceiling)
    return out


def kernel_ratios(report: dict) -> dict[str, Any]:
    """AdamW default / fused, and what the entropy adds to the vocabulary log-prob pass."""
    out: dict[str, Any] = {}
    default, fused = first(report, "kernel/adamw_default@"), first(report, "kernel/adamw_fused@")
    if default and fused:
        out["adamw_fused_speedup"] = {key: default[key]["median"] / fused[key]["median"]
                                      for key in ("seconds", "cpu_seconds")}
    plain, with_entropy = first(report, "kernel/logprobs@"), first(report, "kernel/logprobs+entropy@")
    if plain and with_entropy:
        out["entropy_extra_s"] = with_entropy["seconds"]["median"] - plain["seconds"]["median"]
    return out


def forward_flops(model: dict, batch: dict) -> float:
    """Model FLOPs of one forward over the batch, as the trainer runs it: 2 x non-embedding
    parameters per token (every real token; neither the input embedding nor the output layer,
    tied or not: `a3po.benchmark.workload.parameter_counts`), causal attention's QK^T and AV
    (2 x 2 x hidden per query-key pair per layer), and the lm_head (2 x hidden x vocab) at
    response positions only, where the trainer applies it: the output layer counted once.
    Padding is not counted: it is waste, not work."""
    dense = 2 * model["non_embedding_params"] * batch["tokens"]
    attention = 4 * model["hidden"] * model["layers"] * batch["attention_pairs"]
    lm_head = 2 * model["hidden"] * model["vocab"] * batch["response_tokens"]
    return float(dense + attention + lm_head)


def measured_peak(report: dict) -> dict[str, Any] | None:
    """The matmul probe's rate (FLOP/s at its median and at its best repetition, and per CPU second)."""
    entry = first(report, "kernel/matmul_")
    if not entry:
        return None
    flops = entry["info"]["flops"]
    return {"dtype": entry["info"]["dtype"], "shape": entry["info"]["shape"],
            "flops_per_s": flops / entry["seconds"]["median"], "flops_per_s_best": flops / entry["seconds"]["min"],
            "flops_per_cpu_s": flops / entry["cpu_seconds"]["median"]}


def rate(flops: float, tokens: int, seconds: float, probe: dict | None, peak: float | None,
         cpu_seconds: float | None = None) -> dict[str, float]:
    """Tokens/s and FLOP/s of one measured figure, with MFU against the measured matmul peak
    (per CPU second too: what survives a shared machine) and, where known, the nominal peak."""
    row = {"tokens_per_s": tokens / seconds, "model_flops": flops, "flops_per_s": flops / seconds}
    if probe:
        row["mfu_measured_peak"] = flops / seconds / probe["flops_per_s"]
        if cpu_seconds:
            row["mfu_measured_peak_cpu"] = flops / cpu_seconds / probe["flops_per_cpu_s"]
    if peak:
        row["mfu"] = flops / seconds / peak
    return row


def throughput(report: dict, peak: float | None) -> dict[str, dict[str, float]]:
    """Per step (forward + backward = 3 forwards, plus one for recompute's no-grad forward),
    per step's train phase (forward + backward of every micro-batch, and AdamW), and of the
    recompute forward alone."""
    tokens, probe = report["batch"]["tokens"], measured_peak(report)
    forward, out = forward_flops(report["model"], report["batch"]), {}
    for name, entry in report["results"].items():
        if entry["kind"] == "step":
            flops = (4 if name == "step/recompute" else 3) * forward
            out[name] = rate(flops, tokens, entry["seconds"]["median"], probe, peak, entry["cpu_seconds"]["median"])
            if entry["train"]["median"]:
                out[f"{name}/train_phase"] = rate(3 * forward, tokens, entry["train"]["median"], probe, peak)
    if "prox/recompute" in report["results"]:
        out["prox/recompute"] = rate(forward, tokens, median(report, "prox/recompute"), probe, peak,
                                     median(report, "prox/recompute", "cpu_seconds"))
    return out


def bandwidth_floor(report: dict, traffic: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The copy's GB/s, and per approximation size its bytes over that bandwidth against its time."""
    copy = report["results"].get("kernel/copy")
    if not copy:
        return {}
    bandwidth = copy["info"]["bytes"] / copy["seconds"]["median"]
    floors = {}
    for key, row in traffic.items():
        method, n = key.split("@")
        measured = median(report, f"kernel/{method}-inverse@{n}")
        unchecked = median(report, f"kernel/{method}-inverse@{n}/no_check")
        floor = row["bytes_minimal"] / bandwidth
        floors[key] = {**row, "floor_s": floor, "eager_floor_s": row["bytes_eager"] / bandwidth,
                       "measured_s": measured, "measured_no_check_s": unchecked,
                       "over_floor": measured / floor if measured else None,
                       "over_floor_no_check": unchecked / floor if unchecked else None,
                       "check_finite_cost_s": measured - unchecked if measured and unchecked else None,
                       "finite_flag_s": median(report, f"kernel/finite_flag@{n}")}
    return {"memory_bandwidth_GBps": bandwidth / 1e9,
            "memory_bandwidth_best_GBps": copy["info"]["bytes"] / copy["seconds"]["min"] / 1e9,
            "bandwidth_floor": floors}


def derive(report: dict, device: torch.device, traffic: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios, the ceiling of the step-time ratio, throughput and MFU, the bandwidth floor."""
    peak = peak_flops(device, report["model"].get("precision", "bf16"))
    out = {**prox_ratios(report), **step_ratios(report), **kernel_ratios(report),
           "throughput": throughput(report, peak), "peak_flops": peak,
           "peak_flops_device": device_model(torch.cuda.get_device_name(device)) if device.type == "cuda" else None,
           "peak_flops_measured": measured_peak(report),
           **bandwidth_floor(report, traffic)}
    if "rollout" in report["results"]:
        out["rollout_tokens_per_s"] = median(report, "rollout", "tokens") / median(report, "rollout")
    return out
