"""The command line and one run: Hydra overrides of the training config as positional
arguments, `BenchmarkOptions` as flags; the report goes under --out, and into
docs/benchmarks.md only when asked (--append-docs)."""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Sequence

import torch

from a3po.benchmark.derive import derive
from a3po.benchmark.harness import interleaved, load_average, machine_info, summarize_results
from a3po.benchmark.probes import all_variants, approximation_traffic
from a3po.benchmark.results import append_to_docs, render_markdown, write_report
from a3po.benchmark.workload import REPO, BenchmarkOptions, batch_info, build_workload, compose, model_info
from a3po.run_config import RunConfig

DOCS_PATH = REPO / "docs" / "benchmarks.md"

EPILOG = """\
Positional arguments are Hydra overrides of conf/config.yaml, e.g. model=smollm2_135m
train.n_prompts=4 train.n_samples=4 train.n_minibatches=2 train.token_budget=2048 staleness=2
device=auto. The report goes to --out (default <output_root>/benchmark/<shape>, i.e. under the
git-ignored outputs/); nothing tracked changes unless --append-docs is given.

To measure a trainer change against the code before it, run the same command in a git worktree
of the older commit (git worktree add /tmp/a3po-old <commit>; cd /tmp/a3po-old; python
experiments/benchmark.py ...) and compare the two reports. The two runs are not interleaved, so
on a shared machine alternate them or compare CPU times."""


def _comma_separated(kind: type):
    def parse(value: str) -> tuple:
        return tuple(kind(item) for item in value.split(",") if item)
    return parse


def build_parser() -> argparse.ArgumentParser:
    """A flag per `BenchmarkOptions` field (`--no-<name>` for a switch that defaults on), and
    the flags of the command itself."""
    parser = argparse.ArgumentParser(
        description="Time recompute vs A-3PO approximations, the training step per algo and the rollout.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides (model=..., train.*=..., staleness=..., device=...)")
    for option in fields(BenchmarkOptions):
        flag, help_text = "--" + option.name.replace("_", "-"), option.metadata.get("help")
        if isinstance(option.default, bool):
            parser.add_argument("--no-" + flag[2:], dest=option.name, action="store_false", help=help_text)
        elif isinstance(option.default, tuple):
            parser.add_argument(flag, type=_comma_separated(type(option.default[0])), default=option.default,
                                help=help_text or "comma-separated")
        else:
            parser.add_argument(flag, type=type(option.default), default=option.default, help=help_text)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads; on a CPU shared with other jobs 1 is often fastest, "
                             "as OpenMP threads that wait on each other at every barrier lose their core")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default outputs/benchmark/<shape>)")
    parser.add_argument("--append-docs", action="store_true",
                        help="also append the report as a section of --docs (a tracked file; off by default)")
    parser.add_argument("--docs", type=Path, default=DOCS_PATH, help="markdown file --append-docs appends to")
    return parser


def options_from(args: argparse.Namespace) -> BenchmarkOptions:
    for flag in ("reps", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag}={getattr(args, flag)} is not allowed; it must be >= 1")
    return BenchmarkOptions(**{option.name: getattr(args, option.name) for option in fields(BenchmarkOptions)})


def run_benchmark(cfg: RunConfig, options: BenchmarkOptions, *, command: str = "") -> dict[str, Any]:
    """Build the model, the batch and every variant; measure; return the report dict (what
    benchmark.json holds)."""
    w = build_workload(cfg, options)
    variants, kernel_inputs = all_variants(w)
    load_start, started = load_average(), time.perf_counter()
    samples = interleaved(variants, reps=options.reps, warmup=options.warmup,
                          min_run_time=options.min_kernel_seconds, progress=options.progress)
    elapsed = time.perf_counter() - started
    report = {"command": command, "label": options.label,
              "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "machine": {**machine_info(w.device), "load_average_start": load_start,
                          "load_average_end": load_average()},
              "model": model_info(w), "options": asdict(options), "batch": batch_info(w),
              "elapsed_s": elapsed, "results": summarize_results(variants, samples)}
    report["derived"] = derive(report, w.device, approximation_traffic(kernel_inputs, w.version))
    return report


def default_out_dir(cfg: RunConfig, report: dict[str, Any]) -> Path:
    b = report["batch"]
    return Path(cfg.output_root) / "benchmark" / (
        f"{cfg.model.name}-{b['n_prompts']}x{b['n_samples']}-p{b['prompt_len']}-r{b['response_len_max']}")


def main(argv: Sequence[str] | None = None, *, program: str = "python -m a3po.benchmark") -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    options = options_from(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = compose(args.overrides)  # the benchmark's door: typed from here on
    report = run_benchmark(cfg, options, command=" ".join([program, *map(shlex.quote, argv)]))
    json_path, md_path = write_report(report, args.out or default_out_dir(cfg, report))
    if args.append_docs:
        append_to_docs(report, args.docs)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}" + (f"; appended to {args.docs}" if args.append_docs else ""))
    return report
