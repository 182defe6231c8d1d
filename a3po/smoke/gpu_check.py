"""The one-call check for a single borrowed GPU: `python experiments/gpu_check.py [--dry-run]`.

Runs a3po.smoke.gpu_check_items' items in order, each in a subprocess with its budget as its
timeout (a3po.smoke.runner), the whole within `--budget-s` (480 s: an item that would start
with under MIN_START_S left is not started, and fails saying so). Writes DIR/summary.json (the
machine, the wheels found, the budgets, and per item its status pass/fail/skip, seconds,
figures and log) and DIR/logs/<item>.log. Exit 0 when no item failed, 1 when one did, 2 for a
bad argument or (without --dry-run) no CUDA device. `--dry-run` runs the CPU stand-ins (CI).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from a3po.smoke.gpu_check_items import (BUDGETS_S, DRY_RUN_SLACK, FAIL_ENV, ITEM_NAMES, MACHINE_BUDGET_S,
                                        TOTAL_BUDGET_S, WHEELS, build_items, requirements)
from a3po.smoke.runner import FAILED, PASSED, REPO, SKIPPED, Item, run_command, run_item

DEFAULT_OUT = REPO / "outputs" / "gpu_check"
MIN_START_S = 10.0
STATUS = {PASSED: "pass", FAILED: "fail", SKIPPED: "skip"}
NO_CUDA = ("no CUDA device is visible (torch.cuda.is_available() is False); this check runs on a GPU. "
           "--dry-run runs its CPU stand-ins")


def build_parser(program: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program, description="The one-call check for a borrowed GPU: the trainer's multi-rank code over nccl, a "
                                  "step at Qwen2.5-1.5B's sizes beside vLLM's share, a resume, the async runtime, "
                                  "pytest -m gpu and the smoke's items without vLLM, within 8 minutes.",
        epilog=f"items, in order: {', '.join(ITEM_NAMES)}")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the CPU stand-ins of every item (gloo, a scaled-down model; what CI runs)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where summary.json and logs/ go (default outputs/gpu_check)")
    parser.add_argument("--only", type=lambda v: [name for name in v.split(",") if name], default=None,
                        help="comma-separated items to run; the others are listed as skipped")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                        help=f"the whole check's time, machine probe included (default {TOTAL_BUDGET_S})")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep the items' run directories under DIR/runs (default: a temporary root, removed)")
    parser.add_argument("--print-wheels", action="store_true",
                        help="print the pip commands that carry the check's wheels to a machine without network")
    return parser


def wheel_commands() -> str:
    """On a networked machine, `pip wheel` (pip download, which also builds antlr4 4.9.3's sdist into
    its pure-Python wheel); on the GPU machine, the install from that folder alone."""
    wheels = " ".join(WHEELS)
    return (f"pip wheel --no-deps --wheel-dir gpu-check-wheels {wheels}\n"
            f"pip install --no-index --no-deps --find-links gpu-check-wheels {wheels}")


def machine(work: Path, log_dir: Path, dry_run: bool) -> dict[str, Any]:
    """The machine (a3po.smoke.probes.machine_info); on the GPU in a subprocess: this process never
    initialises CUDA."""
    from a3po.smoke.probes import machine_info

    if dry_run:
        return machine_info()
    out = work / "machine.json"
    outcome = run_command([sys.executable, "-m", "a3po.smoke.probes", "machine", str(out)], log_dir / "machine.log",
                          MACHINE_BUDGET_S)
    if outcome.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    return {"error": f"the machine probe exited {outcome.returncode} (log: {log_dir / 'machine.log'})"}


def _skipped(item: Item, reason: str) -> dict[str, Any]:
    return {"name": item.name, "status": SKIPPED, "figure": {}, "seconds": 0.0, "reason": reason}


def run_within(items: list[Item], log_dir: Path, deadline: float, only: list[str] | None,
               echo=print) -> list[dict[str, Any]]:
    """Each item in turn, its timeout cut to the time left before `deadline`."""
    needs_done: dict = {}
    results = []
    for item in items:
        budget, left = item.timeout_s, deadline - time.monotonic()
        if only is not None and item.name not in only:
            result = _skipped(item, "not selected (--only)")
        elif left < MIN_START_S and not item.skip:
            result = {**_skipped(item, ""), "status": FAILED, "reason": None,
                      "error": f"not started: {left:.0f} s of the check's budget were left "
                               f"(run it alone: --only {item.name})"}
        else:
            item.timeout_s = min(budget, left)
            result = run_item(item, log_dir, needs_done)
        result.update(budget_s=budget, limit_s=item.timeout_s if result["status"] != SKIPPED else None)
        echo(line(result))
        results.append(result)
    return results


def line(result: dict[str, Any]) -> str:
    note = result.get("error") or result.get("reason") or json.dumps(result.get("figure") or {})
    note = " / ".join(part for part in note.splitlines()[-3:] if part.strip())
    return f"[gpu-check] {STATUS[result['status']]:4} {result['name']:24} {result['seconds']:5.0f} s " \
           f"(budget {result['budget_s']:.0f}) {note[:400]}"


def summary_item(result: dict[str, Any]) -> dict[str, Any]:
    out = {"name": result["name"], "status": STATUS[result["status"]], "seconds": round(result["seconds"], 2),
           "budget_s": result["budget_s"], "limit_s": result["limit_s"], "figures": result.get("figure") or {},
           "log": result.get("log"), "commands": result.get("commands", [])}
    for key in ("reason", "error"):
        if result.get(key):
            out[key] = result[key]
    return out


def build_summary(results: list[dict[str, Any]], machine_info: dict[str, Any], *, dry_run: bool, budget_s: float,
                  seconds: float, command: str) -> dict[str, Any]:
    items = [summary_item(result) for result in results]
    counts = {status: sum(item["status"] == status for item in items) for status in STATUS.values()}
    return {"check": "gpu-check", "mode": "dry-run" if dry_run else "gpu",
            "status": "fail" if counts["fail"] else "pass", "counts": counts, "seconds": round(seconds, 1),
            "budget": {"total_s": budget_s, "machine_s": MACHINE_BUDGET_S, "items_s": dict(BUDGETS_S),
                       "dry_run_slack": DRY_RUN_SLACK if dry_run else 1},
            "machine": machine_info, "requirements": requirements(), "items": items, "command": command,
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")}


def write_summary(summary: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Sequence[str] | None = None, *, program: str = "python experiments/gpu_check.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(program)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or []) - set(ITEM_NAMES))
    if unknown:
        parser.error(f"--only: unknown item(s) {', '.join(unknown)}; allowed: {', '.join(ITEM_NAMES)}")
    if args.print_wheels:
        print(wheel_commands())
        return 0
    gpus = 0 if args.dry_run else _cuda_gpus()
    if not args.dry_run and gpus == 0:
        print(f"{program}: {NO_CUDA}", file=sys.stderr)
        return 2
    start = time.monotonic()
    log_dir = args.out / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)  # this check's own logs, from an earlier call
    log_dir.mkdir(parents=True)
    work = args.out / "runs" if args.keep_runs else Path(tempfile.mkdtemp(prefix="a3po-gpu-check-"))
    fail = tuple(name for name in os.environ.get(FAIL_ENV, "").split(",") if name)
    try:
        machine_info = machine(work, log_dir, args.dry_run)
        items = build_items(work, dry_run=args.dry_run, gpus=gpus, fail=fail)
        results = run_within(items, log_dir, start + args.budget_s, args.only)
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    summary = build_summary(results, machine_info, dry_run=args.dry_run, budget_s=args.budget_s,
                            seconds=time.monotonic() - start, command=shlex.join([*program.split(), *argv]))
    path = write_summary(summary, args.out)
    counts = summary["counts"]
    print(f"[gpu-check] {summary['status']}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} "
          f"skipped in {summary['seconds']:.0f} s (budget {args.budget_s:.0f} s); wrote {path}")
    return 1 if counts["fail"] else 0
