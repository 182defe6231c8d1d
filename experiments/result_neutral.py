"""Is a change result-neutral? Tiny-model runs of every method, an objective, a correction, the async
and the fidelity telemetry, from a checkout, then the two sets of metrics compared bit for
bit (every key but the timings and the machine's), and their config.yaml as a resume compares it:

    python experiments/result_neutral.py run  --repo PATH_A --out /tmp/neutral/a
    python experiments/result_neutral.py run  --repo PATH_B --out /tmp/neutral/b
    python experiments/result_neutral.py compare /tmp/neutral/a /tmp/neutral/b

`--repo` is a checkout (`git worktree add /tmp/before <commit>` gives the one before a change); its
experiments/train.py runs with that checkout on PYTHONPATH, one thread, a run at a time. `compare`
exits 1 naming the first metric that differs, 0 when every run's every step is equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# One tiny run per algorithm and per axis beside it: what a refactor of the config, the trainer or
# the rollout must leave unchanged. Four steps of 2 prompts x 4 samples, 2 minibatches, an eval.
# (runtime=async is left out: which version a batch trains at depends on the machine's timing.)
COMMON = ("model=tiny", "task=arith", "logger=none", "device=cpu", "precision=fp32", "train.total_steps=4",
          "train.n_prompts=2", "train.n_samples=4", "train.eval_every=2", "train.eval_size=4",
          "train.checkpoint_every=2", "rollout.max_new_tokens=8", "staleness=2", "train.warmup=false")
RUNS = {
    "coupled": ("algo=coupled",),
    "recompute": ("algo=recompute",),
    "loglinear": ("algo=loglinear", "schedule=inverse"),
    "linear": ("algo=linear", "schedule=step_start"),
    "hybrid": ("algo=hybrid",),
    "loglinear-cispo": ("algo=loglinear", "objective=cispo"),
    "recompute-icepop": ("algo=recompute", "correction=icepop"),
    "loglinear-telemetry": ("algo=loglinear", "train.log_prox_errors=true", "train.grad_fidelity_every=2"),
    "loglinear-bf16": ("algo=loglinear", "precision=bf16"),
}
# Keys that measure the machine, not the run: wall and CPU time, memory, threads.
VOLATILE = ("time/", "wall_time", "memory/", "machine/", "rollout/tokens_per_s")


def run_all(repo: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for i, (name, overrides) in enumerate(RUNS.items(), 1):
        run_dir = out / name
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "done").is_file():
            print(f"[{i}/{len(RUNS)}] {name}: done before", flush=True)
            continue
        started = time.perf_counter()
        command = [sys.executable, str(repo / "experiments" / "train.py"), *COMMON, *overrides,
                   f"hydra.run.dir={run_dir}", f"output_root={out}", "experiment_name=neutral"]
        result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
        (run_dir / "done").write_text("")
        print(f"[{i}/{len(RUNS)}] {name}: {time.perf_counter() - started:.0f} s", flush=True)


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _differences(a: Path, b: Path) -> list:
    """What a resume of run `a` under run `b`'s config.yaml would refuse (a3po.run.rundir): a
    result-neutral key added since (`rollout.logprob_check`) or `output_root` is no difference."""
    import yaml

    from a3po.run.rundir import config_differences

    return config_differences(*(yaml.safe_load((d / "config.yaml").read_text()) for d in (a, b)))


def compare(a: Path, b: Path) -> int:
    for name in RUNS:
        left, right = steps(a / name), steps(b / name)
        if len(left) != len(right):
            print(f"{name}: {len(left)} steps against {len(right)}")
            return 1
        compared = 0
        for x, y in zip(left, right):
            keys = {k for k in x.keys() | y.keys() if not k.startswith(VOLATILE)}
            for key in sorted(keys):
                if not same(x.get(key), y.get(key)):
                    print(f"{name}: step {x.get('step')} {key}: {x.get(key)!r} against {y.get(key)!r}")
                    return 1
                compared += 1
        differences = _differences(a / name, b / name)
        if differences:
            print(f"{name}: config.yaml differs where a resume compares it: {differences}")
            return 1
        print(f"{name}: {len(left)} steps, {compared} values equal, config.yaml the same run's")
    print("result-neutral: every run's every metric equal bit for bit, every config.yaml the same run's")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the tiny runs of a checkout")
    run.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    run.add_argument("--out", type=Path, required=True)
    cmp = sub.add_parser("compare", help="two sets of runs, bit for bit")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run_all(args.repo.resolve(), args.out.resolve())
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
