"""The command line: `python experiments/gpu_smoke.py [--out FILE] [--only ITEM,...]`
(`make gpu-smoke`). Without CUDA it says so, writes the report with that status and exits 0;
with it, it runs the items for the GPUs visible and exits 1 when one failed (skips allowed)."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from a3po.smoke.items import ITEM_NAMES, build_items, select
from a3po.smoke.probes import machine_info
from a3po.smoke.runner import (NO_CUDA_MESSAGE, REPO, build_report, exit_code, no_cuda_report, render_markdown,
                               run_command, run_items, write_report)

DEFAULT_OUT = REPO / "outputs" / "gpu_smoke" / "smoke.json"
MACHINE_PROBE_TIMEOUT_S = 300


def build_parser(program: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program, description="Run the GPU smoke items, each in a subprocess with a timeout, and write "
                                  "pass/fail/skipped per item with its figure and wall seconds.",
        epilog=f"items, in order: {', '.join(ITEM_NAMES)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the JSON report; the markdown table goes beside it (.md), each item's log under "
                             "logs/ there (default outputs/gpu_smoke/smoke.json)")
    parser.add_argument("--only", type=lambda v: [name for name in v.split(",") if name], default=None,
                        help="comma-separated items to run (default: all)")
    parser.add_argument("--gsm8k-path", default=None,
                        help="a local GSM8K copy for paper-shaped (task.path; default: the hub)")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep the items' output directories (default: a temporary root, removed at the end)")
    return parser


def probe_machine(work: Path, log_dir: Path) -> dict[str, Any]:
    """machine_info in a subprocess: this process never initialises CUDA, whatever the items do."""
    out = work / "machine.json"
    log_dir.mkdir(parents=True, exist_ok=True)
    outcome = run_command([sys.executable, "-m", "a3po.smoke.probes", "machine", str(out)],
                          log_dir / "machine.log", MACHINE_PROBE_TIMEOUT_S)
    if outcome.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    return {"error": f"the machine probe exited {outcome.returncode} (log: {log_dir / 'machine.log'})"}


def main(argv: Sequence[str] | None = None, *, program: str = "python experiments/gpu_smoke.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(program)
    args = parser.parse_args(argv)
    try:
        select([], args.only)  # names checked before anything runs
    except ValueError as error:
        parser.error(f"--only: {error}")
    extra = {"command": shlex.join([*program.split(), *argv]), "only": args.only}
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        json_path, md_path = write_report(no_cuda_report(machine_info(), **extra), args.out)
        print(f"wrote {json_path} and {md_path}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="a3po-gpu-smoke-"))
    log_dir = args.out.parent / "logs"
    try:
        machine = probe_machine(work, log_dir)
        items = select(build_items(work / "runs", torch.cuda.device_count(), gsm8k_path=args.gsm8k_path), args.only)
        results = run_items(items, log_dir)
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    report = build_report(results, machine, **extra, runs=str(work / "runs") if args.keep_runs else None)
    json_path, md_path = write_report(report, args.out)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}")
    return exit_code(report)
