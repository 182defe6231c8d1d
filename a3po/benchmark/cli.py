"""The command line: Hydra overrides of the training config as positional arguments, the
benchmark's own options as flags; writes the report under --out, and appends it to
docs/benchmarks.md only when asked (--append-docs)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from a3po.benchmark.report import append_to_docs, render_markdown, write_report
from a3po.benchmark.run import run_benchmark
from a3po.benchmark.workload import REPO, BenchmarkOptions, compose

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


def _csv(value: str) -> tuple[str, ...]:
    return tuple(item for item in value.split(",") if item)


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(item) for item in value.split(",") if item)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time recompute vs A-3PO approximations, the training step per algo and the rollout.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = BenchmarkOptions()
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., train.*=..., staleness=..., device=...)")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--response-len", type=int, default=defaults.response_len, help="longest response")
    parser.add_argument("--length-spread", type=float, default=defaults.length_spread,
                        help="responses are uniform in [(1 - spread) * response_len, response_len]")
    parser.add_argument("--reps", type=int, default=defaults.reps)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--algos", type=_csv, default=defaults.algos,
                        help="comma-separated; algo or algo:schedule (e.g. loglinear:exponential)")
    parser.add_argument("--approx-methods", type=_csv, default=defaults.approx_methods)
    parser.add_argument("--approx-schedules", type=_csv, default=defaults.approx_schedules)
    parser.add_argument("--kernel-tokens", type=_ints, default=defaults.kernel_tokens,
                        help="flat sizes for the bandwidth-floor comparison")
    parser.add_argument("--bandwidth-mib", type=int, default=defaults.bandwidth_mib)
    parser.add_argument("--min-kernel-seconds", type=float, default=defaults.min_kernel_seconds)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads; on a CPU shared with other jobs 1 is often fastest, "
                             "as OpenMP threads that wait on each other at every barrier lose their core")
    parser.add_argument("--no-rollout", action="store_true")
    parser.add_argument("--no-optimizer-kernels", action="store_true",
                        help="skip timing AdamW default vs fused (saves two sets of Adam moments of memory)")
    parser.add_argument("--label", default="", help="appended to the report's heading, e.g. 'before: ...'")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default outputs/benchmark/<shape>)")
    parser.add_argument("--append-docs", action="store_true",
                        help="also append the report as a section of --docs (a tracked file; off by default)")
    parser.add_argument("--docs", type=Path, default=DOCS_PATH, help="markdown file --append-docs appends to")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def options_from(args: argparse.Namespace) -> BenchmarkOptions:
    options = BenchmarkOptions(
        prompt_len=args.prompt_len, response_len=args.response_len, length_spread=args.length_spread,
        reps=args.reps, warmup=args.warmup, algos=args.algos, approx_methods=args.approx_methods,
        approx_schedules=args.approx_schedules, kernel_tokens=args.kernel_tokens, rollout=not args.no_rollout,
        min_kernel_seconds=args.min_kernel_seconds, bandwidth_mib=args.bandwidth_mib, label=args.label,
        progress=not args.no_progress, optimizer_kernels=not args.no_optimizer_kernels)
    if options.reps < 1:
        raise SystemExit(f"--reps={options.reps} is not allowed; it must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads={args.threads} is not allowed; it must be >= 1")
    return options


def default_out_dir(cfg, report: dict[str, Any]) -> Path:
    b = report["batch"]
    return Path(cfg.output_root) / "benchmark" / (
        f"{cfg.model.name}-{b['n_prompts']}x{b['n_samples']}-p{b['prompt_len']}-r{b['response_len_max']}")


def main(argv: Sequence[str] | None = None, *, program: str = "python -m a3po.benchmark") -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    options = options_from(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = compose(args.overrides)
    report = run_benchmark(cfg, options, command=" ".join([program, *map(shlex.quote, argv)]))
    json_path, md_path = write_report(report, args.out or default_out_dir(cfg, report))
    if args.append_docs:
        append_to_docs(report, args.docs)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}" + (f"; appended to {args.docs}" if args.append_docs else ""))
    return report
