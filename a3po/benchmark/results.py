"""The report as markdown (the tables docs/benchmarks.md holds), and where it is written."""

from __future__ import annotations

import json
from pathlib import Path

from a3po.benchmark.derive import median

DOCS_HEADER = """# Benchmarks

Figures produced by `experiments/benchmark.py` (logic in the `a3po/benchmark/` package). Each
section below was appended by a run with `--append-docs`, with the machine it ran on (CPU
model, cores, torch version, device) and the exact command, so every figure can be reproduced or
re-measured. Times are medians over interleaved repetitions; spreads are the interquartile range
(IQR) and min/max.
"""


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.1f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def _table(header: str, rows: list[str]) -> list[str]:
    """A markdown table from its header cells and its rows' cells, each row `a | b | c`."""
    return ["", f"| {header} |", "|" + "---|" * (header.count("|") + 1), *(f"| {row} |" for row in rows)]


def _header(report: dict, heading_level: int) -> list[str]:
    """Title, machine, command and batch."""
    b, m, options, model = report["batch"], report["machine"], report["options"], report["model"]
    title = (f"{'#' * heading_level} {model['name']} ({model['dtype']}), {b['n_prompts']}x{b['n_samples']} samples, "
             f"prompt {b['prompt_len']}, response <= {b['response_len_max']}, {m['device']}, {report['date_utc']} UTC"
             + (f": {report['label']}" if report.get("label") else ""))
    load = m.get("load_average_start")
    machine = (f"Machine: {m['cpu']}, {m['cpus_available']} of {m['cpu_count']} cores available, "
               f"{m['torch_threads']} torch threads, torch {m['torch']}, transformers {m['transformers']}, "
               f"device {m['device']}" + (f", {m['gpu']}" if m.get("gpu") else "")
               + (f"; load average {load[0]:.1f} at start, {m['load_average_end'][0]:.1f} at end" if load else ""))
    batch = (f"Batch: {b['tokens']} tokens ({b['response_tokens']} response), staleness {b['staleness']}, "
             f"{b['n_minibatches']} minibatches, token budget {b['token_budget']}: {b['micro_batches']} "
             f"micro-batches, padding waste {b['padding_waste']:.1%} ({b['padded_tokens']} padded for "
             f"{b['real_tokens']} real tokens). {options['reps']} interleaved repetitions after "
             f"{max(options['warmup'], 1)} warm-up; {report['elapsed_s']:.0f} s in all.")
    return [title, "", machine + ".", "", "```", report["command"] or "(called from Python)", "```", "", batch]


def _result_row(name: str, entry: dict) -> str:
    s, c = entry["seconds"], entry["cpu_seconds"]
    return (f"{name} | {_ms(s['median'])} | {_ms(s['iqr'])} | {_ms(s['min'])} | {_ms(s['max'])} | "
            f"{_ms(c['median'])} ({_ms(c['iqr'])}) | {s['n']}")


def _results_tables(report: dict) -> list[str]:
    """Every variant's wall and CPU time; each step's phases."""
    results = report["results"]
    steps = [f"{name} | {_ms(e['seconds']['median'])} | {_ms(e['prox_logp']['median'])} | {_ms(e['train']['median'])}"
             for name, e in results.items() if e["kind"] == "step"]
    return [*_table("variant | median | IQR | min | max | CPU time median (IQR) | n",
                    [_result_row(name, entry) for name, entry in results.items()]),
            *(_table("step | median | prox_logp in step | train in step", steps) if steps else []), ""]


def _ratio_lines(report: dict) -> list[str]:
    d, lines = report["derived"], []
    if "prox_ratio_recompute_over_loglinear" in d:
        lines.append(f"- prox time, recompute / loglinear: {_ms(median(report, 'prox/recompute'))} / "
                     f"{_ms(median(report, 'prox/loglinear-inverse'))} = "
                     f"**{d['prox_ratio_recompute_over_loglinear']:.3g}x** (CPU time: "
                     f"{d['prox_ratio_recompute_over_loglinear_cpu']:.3g}x)")
    if "step_ratio_recompute_over_loglinear" in d:
        lines.append(f"- step time, recompute / loglinear: **{d['step_ratio_recompute_over_loglinear']:.3f}** "
                     f"(loglinear saves {d['step_time_saved_fraction']:.1%}); ceiling T_step/(T_step - T_prox) = "
                     f"{d['step_ratio_ceiling']:.3f}; measured / ceiling = {d['step_ratio_over_ceiling']:.3f}. "
                     f"Paired per round: {d['step_ratio_paired_median']:.3f}; min / min: "
                     f"{d['step_ratio_min_over_min']:.3f}. "
                     f"CPU time: **{d['step_ratio_recompute_over_loglinear_cpu']:.3f}**"
                     + (f", ceiling {d['step_ratio_ceiling_cpu']:.3f}, measured / ceiling "
                        f"{d['step_ratio_over_ceiling_cpu']:.3f}" if "step_ratio_ceiling_cpu" in d else ""))
    if "adamw_fused_speedup" in d:
        lines.append(f"- AdamW step, default / fused: {d['adamw_fused_speedup']['seconds']:.2f}x (wall), "
                     f"{d['adamw_fused_speedup']['cpu_seconds']:.2f}x (CPU time)")
    if "entropy_extra_s" in d:
        lines.append("- entropy on top of the log-probs (fwd + bwd over the vocabulary at the response positions): "
                     + _ms(d["entropy_extra_s"]))
    return lines


def _rate_lines(report: dict) -> list[str]:
    d, lines = report["derived"], []
    probe = d.get("peak_flops_measured")
    if probe:
        nominal = f"nominal {d['peak_flops'] / 1e12:.0f} TFLOP/s" if d.get("peak_flops") else "nominal: not known here"
        lines.append(f"- measured matmul peak ({probe['dtype']}, {' x '.join(map(str, probe['shape']))}): "
                     f"{probe['flops_per_s'] / 1e9:.1f} GFLOP/s median, {probe['flops_per_s_best'] / 1e9:.1f} best; "
                     + nominal)
    for name, row in d.get("throughput", {}).items():
        mfu = f", MFU {row['mfu_measured_peak']:.1%} of the measured peak" if "mfu_measured_peak" in row else ""
        mfu += f" ({row['mfu_measured_peak_cpu']:.1%} per CPU second)" if "mfu_measured_peak_cpu" in row else ""
        mfu += f", {row['mfu']:.1%} of nominal" if "mfu" in row else ""
        lines.append(f"- {name}: {row['tokens_per_s']:.0f} tokens/s, {row['flops_per_s'] / 1e9:.1f} GFLOP/s{mfu}")
    if "rollout_tokens_per_s" in d:
        lines.append(f"- rollout: {d['rollout_tokens_per_s']:.0f} generated tokens/s")
    if "memory_bandwidth_GBps" in d:
        lines.append(f"- memory bandwidth (copy of {report['options']['bandwidth_mib']} MiB, read + write): "
                     f"{d['memory_bandwidth_GBps']:.1f} GB/s median, {d['memory_bandwidth_best_GBps']:.1f} best")
    return lines


def _floor_row(key: str, row: dict) -> str:
    return (f"{key.split('@')[0]} | {row['tokens']} | {row['bytes_minimal']:,} / {row['bytes_eager']:,}, "
            f"{row['aten_ops']} | {_ms(row['floor_s'])} | {_ms(row['measured_s'])} | {row['over_floor']:.1f} | "
            f"{_ms(row['measured_no_check_s'])} | {row['over_floor_no_check']:.1f} | {_ms(row['finite_flag_s'])}")


def _floor_table(report: dict) -> list[str]:
    floors = report["derived"].get("bandwidth_floor")
    if not floors:
        return []
    return _table("approximation | tokens | bytes (min / eager, ops) | floor | measured | x floor | without check | "
                  "x floor | finite flag", [_floor_row(key, row) for key, row in floors.items()])


def render_markdown(report: dict, *, heading_level: int = 2) -> str:
    return "\n".join([*_header(report, heading_level), *_results_tables(report), *_ratio_lines(report),
                      *_rate_lines(report), *_floor_table(report), ""])


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """benchmark.json (every figure, the raw repetitions) and benchmark.md under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "benchmark.json", out_dir / "benchmark.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report, heading_level=1))
    return json_path, md_path


def append_to_docs(report: dict, docs_path: Path) -> None:
    """Append the report as a section of `docs_path` (created with DOCS_HEADER if missing)."""
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    existing = docs_path.read_text() if docs_path.exists() else DOCS_HEADER
    docs_path.write_text(existing.rstrip("\n") + "\n\n" + render_markdown(report))
