"""One benchmark run: build the workload and its variants, measure them interleaved, and
assemble the report dict (what benchmark.json holds)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig

from a3po.benchmark.derive import derive
from a3po.benchmark.harness import interleaved, load_average, machine_info, summarize_results
from a3po.benchmark.probes import all_variants, approximation_traffic
from a3po.benchmark.workload import BenchmarkOptions, Workload, build_workload, padding_stats


def batch_info(w: Workload) -> dict[str, Any]:
    samples, options, train_cfg = w.samples, w.options, w.cfg.train
    return {
        "n_prompts": w.batch.n_prompts, "n_samples": w.batch.n_samples, "prompt_len": options.prompt_len,
        "response_len_max": options.response_len, "length_spread": options.length_spread,
        "response_tokens": sum(s.response_ids.numel() for s in samples), "tokens": sum(s.length for s in samples),
        # query-key pairs a causal attention uses, summed over sequences: its FLOPs' size
        "attention_pairs": sum(s.length * (s.length + 1) // 2 for s in samples),
        "staleness": w.staleness, "version": w.version,
        "n_minibatches": int(train_cfg.n_minibatches), "token_budget": int(train_cfg.token_budget),
        **padding_stats(samples, w.plans),
    }


def run_benchmark(cfg: DictConfig, options: BenchmarkOptions, *, command: str = "") -> dict[str, Any]:
    """Build the model, the batch and every variant; measure; return the report dict."""
    w = build_workload(cfg, options)
    variants, kernel_inputs = all_variants(w)

    load_start = load_average()
    started = time.perf_counter()
    raw = interleaved(variants, reps=options.reps, warmup=options.warmup, device=w.device,
                      min_kernel_seconds=options.min_kernel_seconds, progress=options.progress)
    elapsed = time.perf_counter() - started
    machine = machine_info(w.device)
    machine["load_average_start"] = load_start
    machine["load_average_end"] = load_average()

    n_params = sum(p.numel() for p in w.policy.parameters())
    embedding = w.policy.get_input_embeddings().weight.numel()
    report = {
        "command": command,
        "label": options.label,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "model": {"name": cfg.model.name, "dtype": cfg.model.dtype, "precision": w.precision, "params": n_params,
                  "non_embedding_params": n_params - embedding, "hidden": int(w.policy.config.hidden_size),
                  "layers": int(w.policy.config.num_hidden_layers), "vocab": int(w.policy.config.vocab_size)},
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()},
        "batch": batch_info(w),
        "elapsed_s": elapsed,
        "results": summarize_results(variants, raw),
    }
    report["derived"] = derive(report, w.device, approximation_traffic(kernel_inputs, w.version))
    return report
