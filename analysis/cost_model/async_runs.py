"""The async pipeline's simulation against `runtime=async` runs of this suite.

Each async run is paired with the lagged run of the same shape, algorithm, seed and staleness:
the HF engine loads new weights between batches, so where the trainer keeps the rollout at its
bound (`staleness/mean` equal to it from step 1 on) both runtimes train on the same batches and
the two runs do the same work, token for token. The async run's measured seconds per step (the
mean interval between steps' `wall_time` once the pipeline has filled) are set beside two
predictions of `simulate_async` at the run's bound:

- **from the lagged twin** (rollout and trainer each alone on a core, as on devices of their
  own): the model's question, what overlapping the two sides would give;
- **from the async run's own phases** (`time/rollout` per batch, the trainer's step less its
  wait for data and its weight sync), which on a CPU carry the two sides' contention for one
  memory bus and its caches: a check of the simulation's admission rule and overlap alone.

The gap between the lagged phases and the async run's own is what two cores of one CPU cannot
do as two devices would; the report gives it per side.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median
from typing import Any

from analysis.cost_model.pipeline import simulate_async, steady_interval
from analysis.load import UnusableRun, find_run_dirs, read_config
from analysis.runs import lookup

__all__ = ["SKIP", "read_run", "pair_runs", "async_rows"]

SKIP = 4  # steps left out of every figure: the trainer's warm-up and the pipeline filling


def _shape(config: dict) -> tuple:
    return tuple(lookup(config, key) for key in ("train.n_prompts", "train.n_samples", "rollout.max_new_tokens",
                                                  "train.n_minibatches", "model.name", "precision"))


def read_run(run_dir: Path, skip: int = SKIP) -> dict[str, Any]:
    """One run's identity and steady-state figures (seconds, wall): the step interval and the
    per-step medians of its rollout, its trainer side and its weight sync, from step `skip` on."""
    if skip < 1:
        raise ValueError(f"skip must be >= 1 (the interval starts after step skip - 1), got {skip}")
    try:
        config = read_config(run_dir)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in (json.loads(line) for line in lines if line.strip()) if "time/step" in r]
    except (UnusableRun, OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{run_dir}: unreadable run ({error})") from error
    if len(rows) < skip + 2:
        raise ValueError(f"{run_dir}: {len(rows)} steps logged; the steady state needs at least {skip + 2}")
    runtime = lookup(config, "runtime.name")
    steady = rows[skip:]
    waits = [r.get("time/wait_data", 0.0) if runtime == "async" else r["time/rollout"] for r in steady]
    return {"run_dir": str(run_dir), "runtime": runtime, "algo": lookup(config, "algo.name"),
            "bound": int(lookup(config, "runtime.max_staleness", lookup(config, "staleness"))),
            "shape": _shape(config), "seed": lookup(config, "seed"),
            "interval_s": (steady[-1]["wall_time"] - rows[skip - 1]["wall_time"]) / len(steady),
            "rollouts_s": [r["time/rollout"] for r in steady],
            "trainer_s": median(r["time/step"] - w - r["time/weight_sync"] for r, w in zip(steady, waits)),
            "sync_s": median(r["time/weight_sync"] for r in steady)}


def _twin_key(run: dict) -> tuple:
    return run["shape"], run["algo"], run["seed"], run["bound"]


def pair_runs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(async run, its lagged twin) for every async run that has one; an async run without a
    twin is an error naming it, since the report would silently lose a row."""
    lagged = {_twin_key(r): r for r in runs if r["runtime"] == "lagged"}
    pairs = []
    for run in (r for r in runs if r["runtime"] == "async"):
        twin = lagged.get(_twin_key(run))
        if twin is None:
            raise ValueError(f"{run['run_dir']}: no lagged run of the same shape, algorithm, seed and staleness "
                             "to pair it with")
        pairs.append((run, twin))
    return pairs


def _predicted(rollouts: list[float], trainer_s: float, sync_s: float, bound: int) -> float:
    return steady_interval(simulate_async(rollouts, trainer_s, sync_s, bound, steps=400), tail=200)


def async_rows(paths: list[str | Path], skip: int = SKIP) -> list[dict[str, Any]]:
    """Per async run: measured interval, both predictions and their errors, and each side's
    slowdown in the async run against its lagged twin (median rollout, trainer side)."""
    runs = [read_run(d, skip) for d in find_run_dirs(paths)]
    rows = []
    for run, twin in sorted(pair_runs(runs), key=lambda p: (p[0]["shape"], p[0]["bound"], p[0]["algo"])):
        from_lagged = _predicted(twin["rollouts_s"], twin["trainer_s"], twin["sync_s"], run["bound"])
        from_own = _predicted(run["rollouts_s"], run["trainer_s"], run["sync_s"], run["bound"])
        rows.append({"shape": run["shape"], "algo": run["algo"], "bound": run["bound"],
                     "measured_s": run["interval_s"], "lagged_step_s": twin["interval_s"],
                     "from_lagged_s": from_lagged, "from_lagged_error": from_lagged / run["interval_s"] - 1,
                     "from_own_s": from_own, "from_own_error": from_own / run["interval_s"] - 1,
                     "rollout_slowdown": median(run["rollouts_s"]) / median(twin["rollouts_s"]),
                     "trainer_slowdown": run["trainer_s"] / twin["trainer_s"],
                     "rollout_s": median(twin["rollouts_s"]), "trainer_s": twin["trainer_s"]})
    return rows
