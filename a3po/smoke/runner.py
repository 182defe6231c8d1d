"""How one smoke item runs, and the report.

An item is a command (after the preconditions it `needs`) run as a subprocess in its own
session, with a timeout over the whole item: at the timeout its process group (torchrun's
ranks, vLLM's engine processes) is stopped, and the next item runs. A subprocess that exits
with `SKIP_EXIT` skips the item, with the reason it printed after `SKIP_PREFIX`. An item that
exits 0 has passed only once its `check` has read its result (a run's metrics, a report) and
returned the figure measured; a check raises `SmokeFailure` with what was wrong.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
SKIP_EXIT = 77  # automake's "skipped"
SKIP_PREFIX = "SMOKE-SKIP: "
PASSED, FAILED, SKIPPED, NO_CUDA = "passed", "failed", "skipped", "no-cuda"
NO_CUDA_MESSAGE = "no CUDA device: nothing to smoke-test"
# A launcher's variables (torchrun, submitit) must not leak into an item's own launch.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR")
KILL_GRACE_S = 10.0
OUTPUT_TAIL_CHARS = 1_000_000  # what a check sees of its command's output (vLLM logs at length)
ERROR_TAIL_LINES = 12

Check = Callable[[Path, str], dict]


class SmokeFailure(Exception):
    """An item ran, but its result is not what it must be."""


class _Skipped(Exception):
    pass


@dataclass
class Item:
    name: str
    command: list[str]
    check: Check  # (work_dir, the command's output) -> figure
    timeout_s: float
    work_dir: Path
    needs: list[list[str]] = field(default_factory=list)  # preconditions, each may skip the item
    skip: str | None = None  # decided before running (e.g. too few GPUs)


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the timeout
    seconds: float
    output: str


def item_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _stop_group(proc: subprocess.Popen) -> None:
    """TERM to the command's process group, KILL to whatever is left of it after the grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_command(command: list[str], log_path: Path, timeout_s: float) -> Outcome:
    """Run `command` in the repository root, its output appended to `log_path`; a process it
    leaves behind (an orphaned engine process) is ended with it."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        offset, start = log.tell(), time.monotonic()
        proc = subprocess.Popen(command, cwd=REPO, env=item_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(timeout_s, 0.01))
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # also on Ctrl-C: the command's own session does not get the terminal's signal
            _stop_group(proc)
        seconds = time.monotonic() - start
    with open(log_path, encoding="utf-8", errors="replace") as log:
        log.seek(max(offset, log_path.stat().st_size - OUTPUT_TAIL_CHARS))
        output = log.read()
    return Outcome(returncode, seconds, output)


def _tail(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return "\n".join(lines[-ERROR_TAIL_LINES:])[-3000:]


def _judge(outcome: Outcome, what: str, timeout_s: float) -> None:
    """Raise _Skipped or SmokeFailure unless the command exited 0."""
    if outcome.returncode is None:
        raise SmokeFailure(f"{what} timed out (the item's limit is {timeout_s:.0f} s) and was stopped")
    if outcome.returncode == SKIP_EXIT:
        reasons = [line[len(SKIP_PREFIX):] for line in outcome.output.splitlines() if line.startswith(SKIP_PREFIX)]
        raise _Skipped(reasons[-1] if reasons else f"{what} exited {SKIP_EXIT} without a reason")
    if outcome.returncode != 0:
        raise SmokeFailure(f"{what} exited {outcome.returncode}:\n{_tail(outcome.output)}")


def run_item(item: Item, log_dir: Path, needs_done: dict[tuple[str, ...], Outcome] | None = None) -> dict[str, Any]:
    """One item's result: status, figure, wall seconds, and the reason or error. `needs_done`
    holds the preconditions already run (several items need vLLM: it is imported once)."""
    result: dict[str, Any] = {"name": item.name, "status": SKIPPED, "figure": {}, "seconds": 0.0,
                              "commands": [shlex.join(c) for c in [*item.needs, item.command]]}
    if item.skip:
        return {**result, "reason": item.skip}
    needs_done = {} if needs_done is None else needs_done
    log_path = log_dir / f"{item.name}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    item.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        for need in item.needs:
            key = tuple(need)
            outcome = needs_done.get(key)
            if outcome is None:
                outcome = run_command(need, log_path, item.timeout_s - (time.monotonic() - start))
            else:
                with open(log_path, "a", encoding="utf-8") as log:
                    log.write(f"$ {shlex.join(need)}  (run for an earlier item: exit {outcome.returncode})\n")
            if outcome.returncode is not None:  # a precondition cut short by this item's limit is asked again
                needs_done[key] = outcome
            _judge(outcome, f"precondition `{shlex.join(need)}`", item.timeout_s)
        outcome = run_command(item.command, log_path, item.timeout_s - (time.monotonic() - start))
        _judge(outcome, "the command", item.timeout_s)
        result.update(status=PASSED, figure=item.check(item.work_dir, outcome.output))
    except _Skipped as skipped:
        result.update(reason=str(skipped))
    except SmokeFailure as failure:
        result.update(status=FAILED, error=str(failure))
    except Exception as error:  # e.g. a check that could not read the result: the result is wrong
        result.update(status=FAILED, error=f"the item raised {type(error).__name__}: {error}")
    return {**result, "seconds": time.monotonic() - start, "log": str(log_path)}


def run_items(items: list[Item], log_dir: Path, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    needs_done: dict[tuple[str, ...], Outcome] = {}
    results = []
    for item in items:
        if not item.skip:
            echo(f"[gpu-smoke] {item.name}: {shlex.join(item.command)}")
        result = run_item(item, log_dir, needs_done)
        echo(f"[gpu-smoke] {item.name}: {result['status']} ({result['seconds']:.0f} s) {_note(result)}")
        results.append(result)
    return results


def counts(results: list[dict[str, Any]]) -> dict[str, int]:
    return {status: sum(r["status"] == status for r in results) for status in (PASSED, FAILED, SKIPPED)}


def build_report(results: list[dict[str, Any]], machine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    tally = counts(results)
    return {"status": FAILED if tally[FAILED] else PASSED, "counts": tally, "machine": machine, "items": results,
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), **extra}


def no_cuda_report(machine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"status": NO_CUDA, "message": NO_CUDA_MESSAGE, "counts": counts([]), "machine": machine, "items": [],
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), **extra}


def exit_code(report: dict[str, Any]) -> int:
    return 1 if report["status"] == FAILED else 0


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _note(result: dict[str, Any]) -> str:
    if result["status"] == PASSED:
        return ", ".join(f"{key} {_value(value)}" for key, value in result["figure"].items())
    text = result.get("reason") or result.get("error") or ""
    lines = text.splitlines()
    return lines[0] if result["status"] == SKIPPED or len(lines) < 2 else " / ".join([lines[0], *lines[-2:]])


def machine_line(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus") or []
    names = sorted({f"{g['name']} ({g['memory_gib']:.1f} GiB)" for g in gpus})
    parts = [f"host {machine.get('hostname')}", f"{len(gpus)} GPU(s)" + (f": {', '.join(names)}" if names else ""),
             f"CUDA {machine.get('cuda')}", f"driver {machine.get('driver')}", f"torch {machine.get('torch')}",
             f"transformers {machine.get('transformers')}", f"vllm {machine.get('vllm')}",
             f"Python {machine.get('python')}"]
    return "; ".join(parts) + (f" (machine probe: {machine['error']})" if machine.get("error") else "")


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU smoke test, {report['date_utc']} UTC", "", f"Machine: {machine_line(report['machine'])}.", ""]
    if report["status"] == NO_CUDA:
        return "\n".join([*lines, report["message"], ""])
    tally = report["counts"]
    lines += [f"**{report['status']}**: {tally[PASSED]} passed, {tally[FAILED]} failed, {tally[SKIPPED]} skipped.", "",
              "| item | status | figure / reason | seconds |", "|---|---|---|---|"]
    for result in report["items"]:
        note = _note(result).replace("|", "\\|")
        lines.append(f"| `{result['name']}` | {result['status']} | {note} | {result['seconds']:.0f} |")
    return "\n".join([*lines, ""])


def write_report(report: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    """The JSON at `json_path`, the markdown table beside it (same name, .md)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(render_markdown(report))
    return json_path, md_path
