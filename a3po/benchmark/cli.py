"""The command line and one run: Hydra overrides of the training config as positional
arguments, `BenchmarkOptions` as flags; the report goes under --out, and into
docs/benchmarks.md only when asked (--append-docs)."""

from __future__ import annotations

import argparse
import datetime as dt
import math
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
from a3po.benchmark.workload import (CONF_DIR, REPO, BenchmarkOptions, batch_info, build_workload, compose, model_info,
                                    parse_algo)
from a3po.errors import EXIT_CONFIG_ERROR, ConfigError
from a3po.maths.proximal import approximations
from a3po.maths.schedules import SCHEDULES
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


def _require(ok: bool, flag: str, value: Any, allowed: str) -> None:
    if not ok:
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        raise ConfigError(f"--{flag.replace('_', '-')}={shown!r} is not allowed; {allowed}")


def options_from(args: argparse.Namespace) -> BenchmarkOptions:
    """The options, each held to its range before anything composes or loads. Raises ConfigError
    naming the flag."""
    for flag in ("prompt_len", "response_len", "reps", "bandwidth_mib"):
        _require(getattr(args, flag) >= 1, flag, getattr(args, flag), "it must be an integer >= 1")
    _require(args.threads is None or args.threads >= 1, "threads", args.threads, "it must be an integer >= 1")
    _require(args.warmup >= 0, "warmup", args.warmup, "it must be an integer >= 0")
    _require(0.0 <= args.length_spread < 1.0, "length_spread", args.length_spread, "it must be in [0, 1)")
    _require(math.isfinite(args.min_kernel_seconds) and args.min_kernel_seconds >= 0, "min_kernel_seconds",
             args.min_kernel_seconds, "it must be a number >= 0 (seconds)")
    _require(all(n >= 1 for n in args.kernel_tokens), "kernel_tokens", args.kernel_tokens,
             "each must be an integer >= 1 (comma-separated)")
    algos, schedules = (sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) for group in ("algo", "schedule"))
    _require(bool(args.algos), "algos", args.algos, f"at least one of {algos} (or algo:schedule)")
    for spec in args.algos:
        algo, schedule = parse_algo(spec)
        _require(algo in algos and schedule in schedules, "algos", args.algos,
                 f"each must be an algo of {algos}, or algo:schedule with a schedule of {schedules}")
    for flag, allowed in (("approx_methods", approximations()), ("approx_schedules", tuple(SCHEDULES))):
        _require(all(name in allowed for name in getattr(args, flag)), flag, getattr(args, flag),
                 f"each must be one of {list(allowed)} (comma-separated)")
    return BenchmarkOptions(**{option.name: getattr(args, option.name) for option in fields(BenchmarkOptions)})


def check_fits(cfg: RunConfig, options: BenchmarkOptions) -> None:
    """The longest synthetic sequence must fit one micro-batch, as a run's must (a3po.learner.batching)."""
    longest = options.prompt_len + options.response_len
    if longest > cfg.train.token_budget:
        raise ConfigError(f"train.token_budget={cfg.train.token_budget} is not allowed with --prompt-len "
                          f"{options.prompt_len} and --response-len {options.response_len}: a sequence of {longest} "
                          "tokens must fit one micro-batch; raise train.token_budget or shorten them")


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
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after flags alike
    try:  # bad input fails here, before the model loads (exit 2, one line)
        options = options_from(args)
        cfg = compose(args.overrides)  # the benchmark's door: validated and typed from here on
        check_fits(cfg, options)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run_benchmark(cfg, options, command=" ".join([program, *map(shlex.quote, argv)]))
    json_path, md_path = write_report(report, args.out or default_out_dir(cfg, report))
    if args.append_docs:
        append_to_docs(report, args.docs)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}" + (f"; appended to {args.docs}" if args.append_docs else ""))
    return report
