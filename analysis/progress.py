"""A sweep's progress from its run logs, without reading a result.

    python -m analysis.progress outputs/final_reward --expect 32 --jobs 2

One line per run: the steps it has logged of its total (`train.total_steps`), its state
(finished, diverged or part-done), the wall hours it has taken (`wall_time`, which a resumed run
carries on from its checkpoint), the median `time/step` of its last ten steps and the most
resident memory any of its processes reached (`memory/host_peak`, GiB; blank for logs from before
the key). Then the sweep:
runs ended, part-done and not started (of `--expect`, the size of the sweep's grid), and the wall
time the runs not ended still need at `--jobs` runs at once, at the pace these logs show (a run's
mean hours when any has ended, else each part-done run's own pace; a floor, since runs of
unequal length do not pack perfectly).

It reads a run's config.yaml, its ended marker and four keys of metrics.jsonl (`step`,
`wall_time`, `time/step`, `memory/host_peak`); never a reward, so a pre-registered study can be watched while it
runs without being read. A path may be a log archive (`analysis.logs`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from a3po.run.metrics_log import read_metrics
from analysis.load import UnusableRun, find_run_dirs, read_config
from analysis.logs import ENDED_MARKERS

RECENT_STEPS = 10
PROGRESS_KEYS = ("step", "wall_time", "time/step", "memory/host_peak")
STATES = ("finished", "diverged", "part-done")
FINISHED_MARKER, DIVERGED_MARKER = ENDED_MARKERS


def read_progress_keys(path: Path) -> list[dict[str, float]]:
    """`PROGRESS_KEYS` of each record of a metrics.jsonl (`read_metrics`: a line that does not
    parse is skipped with a warning); [] when there is none yet."""
    return [{key: record[key] for key in PROGRESS_KEYS if key in record}
            for record in read_metrics(path) if "step" in record]


def run_progress(run_dir: Path) -> dict[str, Any]:
    """One run's progress: name, steps logged, total steps, state, wall hours, recent s/step,
    peak GiB (None where the log has no `memory/host_peak`)."""
    total = (read_config(run_dir).get("train") or {}).get("total_steps")
    if not isinstance(total, int) or total < 1:
        raise UnusableRun(f"config.yaml has no train.total_steps (a positive integer), got {total!r}")
    rows = read_progress_keys(run_dir / "metrics.jsonl")
    state = ("diverged" if (run_dir / DIVERGED_MARKER).is_file()
             else "finished" if (run_dir / FINISHED_MARKER).is_file() else "part-done")
    recent = [row["time/step"] for row in rows[-RECENT_STEPS:] if row.get("time/step") is not None]
    peaks = [row["memory/host_peak"] for row in rows if row.get("memory/host_peak") is not None]
    return {"run": run_dir.name, "steps": len({row["step"] for row in rows}), "total": total, "state": state,
            "hours": (rows[-1].get("wall_time") or 0.0) / 3600 if rows else 0.0,
            "step_s": statistics.median(recent) if recent else None, "peak_gib": max(peaks) if peaks else None}


def run_hours(runs: Sequence[dict[str, Any]]) -> float | None:
    """A run's wall hours at the pace these logs show: the mean over the finished runs (diverged
    ones stopped early), else the mean of each part-done run's hours per step times its total;
    None when no run has logged a step."""
    finished = [run["hours"] for run in runs if run["state"] == "finished"]
    paces = finished or [run["hours"] / run["steps"] * run["total"]
                         for run in runs if run["state"] == "part-done" and run["steps"]]
    return statistics.fmean(paces) if paces else None


def hours_left(runs: Sequence[dict[str, Any]], expect: int | None, jobs: int) -> dict[str, Any]:
    """The sweep's counts, and the run-hours and wall hours (at `jobs` at once) that the runs not
    ended still need: `run_hours` for each not started, its share not yet done for each part-done."""
    counts = {state: sum(run["state"] == state for run in runs) for state in STATES}
    not_started = max((expect or 0) - len(runs), 0)
    per_run = run_hours(runs)
    left = None if per_run is None else per_run * (
        not_started + sum(1 - min(run["steps"] / run["total"], 1) for run in runs if run["state"] == "part-done"))
    return {**counts, "not started": not_started, "run_hours": per_run,
            "run_hours_left": left, "wall_hours_left": None if left is None else left / jobs}


def progress_table(runs: Sequence[dict[str, Any]]) -> str:
    """The per-run lines, as a markdown table."""
    lines = ["| run | steps | state | wall hours | s/step (last 10) | peak GiB |", "|---|--:|---|--:|--:|--:|"]
    for run in runs:
        step_s = "" if run["step_s"] is None else f"{run['step_s']:.0f}"
        peak = "" if run.get("peak_gib") is None else f"{run['peak_gib']:.1f}"
        lines.append(f"| {run['run']} | {run['steps']}/{run['total']} | {run['state']} | {run['hours']:.2f} | {step_s} "
                     f"| {peak} |")
    return "\n".join(lines)


def summary_line(summary: dict[str, Any], jobs: int) -> str:
    """The sweep in one line: counts, then the wall time left (or why there is no estimate)."""
    counts = (f"{summary['finished']} finished, {summary['diverged']} diverged, "
              f"{summary['part-done']} part-done, {summary['not started']} not started")
    if summary["wall_hours_left"] is None:
        return f"{counts}; no step logged yet, so no estimate."
    return (f"{counts}; at {summary['run_hours']:.2f} wall hours a run, the runs not ended need "
            f"{summary['run_hours_left']:.1f} run-hours: at least {summary['wall_hours_left']:.1f} "
            f"hours of wall time at {jobs} at once.")


def collect(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every run's progress below `paths`, sorted by run name; a run whose config cannot be read
    is an error naming it."""
    runs = []
    for run_dir in find_run_dirs(paths):
        try:
            runs.append(run_progress(run_dir))
        except UnusableRun as error:
            raise UnusableRun(f"{run_dir}: {error}") from None
    return sorted(runs, key=lambda run: run["run"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.progress", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="sweep folders (or log archives) holding run directories")
    parser.add_argument("--expect", type=int, default=None,
                        help="runs in the sweep's grid, to count those not started (default: the runs found)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, for the wall time left (default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    missing = [path for path in args.paths if not Path(path).exists()]
    if missing:
        parser.error(f"no such path: {', '.join(missing)}")
    try:
        runs = collect(args.paths)
    except UnusableRun as error:
        print(f"analysis.progress: {error}", file=sys.stderr)
        return 2
    if not runs:
        print(f"analysis.progress: no run directory (a folder with config.yaml) below {', '.join(args.paths)}",
              file=sys.stderr)
        return 2
    if args.expect is not None and args.expect < len(runs):
        parser.error(f"--expect {args.expect} is fewer than the {len(runs)} runs found")
    print(progress_table(runs))
    print()
    print(summary_line(hours_left(runs, args.expect, args.jobs), args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
