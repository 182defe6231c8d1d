"""The demo (`make demo`): coupled, recompute and A-3PO loglinear at staleness 2 and 4 on the
embedded SmolLM2-135M-Instruct, then the paper's figures from its logs.

    python experiments/demo.py [HYDRA OVERRIDES...]        # e.g. output_root=/tmp/demo_out

The shape follows the precision the runs resolve to on this machine (`auto`'s, or a
`precision=` override's): bf16 (a CPU with AVX512-BF16 or AMX, a GPU) runs
conf/experiment/demo.yaml, fp32 (most laptops and cloud CPUs) the cheaper
conf/experiment/demo_fp32.yaml. The six runs go to two worker processes at once
(Hydra's joblib launcher), each with half the cores as torch threads (one each on 2 cores): on
2 cores two one-thread runs do more work an hour than one two-thread run. Extra arguments are
Hydra overrides for every run. Rerunning resumes: finished runs return at once. Exit status:
the sweep's, else the figures'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without install

# Runs at once, per shape: on 2 cores two one-thread runs did more work than one two-thread run in
# both precisions (measured: docs/benchmarks.md, "The demo sweep").
JOBS = {"demo": 2, "demo_fp32": 2}


def shape(overrides: list[str] = ()) -> str:
    """The demo's experiment file for the precision the runs resolve to here: `auto`'s, or the
    one a `precision=` override asks for."""
    from a3po.device import resolve_device, resolve_precision

    asked = next((o.split("=", 1)[1] for o in overrides if o.startswith("precision=")), "auto")
    return "demo" if resolve_precision(asked, resolve_device("auto")) == "bf16" else "demo_fp32"


def threads_per_job(cores: int, jobs: int) -> int:
    return max(1, cores // jobs)


def main(overrides: list[str]) -> int:
    experiment, cores = shape(overrides), len(os.sched_getaffinity(0))
    jobs = min(JOBS[experiment], cores)
    threads = threads_per_job(cores, jobs)
    output_root = next((o.split("=", 1)[1] for o in overrides if o.startswith("output_root=")), "outputs")
    print(f"demo: experiment={experiment} ({'bf16' if experiment == 'demo' else 'fp32'} here), "
          f"{jobs} runs at once x {threads} thread(s)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    sweep = [sys.executable, str(REPO / "experiments" / "train.py"), "-m", f"experiment={experiment}",
             "hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}", *overrides]
    status = subprocess.call(sweep, env=env, cwd=REPO)
    if status != 0:
        print(f"demo: the sweep exited with {status}; no figures drawn", file=sys.stderr)
        return status
    sweep_dir = Path(output_root) / experiment  # the experiment file's experiment_name
    return subprocess.call([sys.executable, "-m", "analysis.figures", str(sweep_dir), "--out",
                            str(sweep_dir / "figures")], cwd=REPO)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
