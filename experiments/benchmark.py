"""Time the proximal policy (recompute vs A-3PO's approximations), the training step per algo
and the rollout, interleaved in one process. All logic lives in the a3po.benchmark package.

    python experiments/benchmark.py model=smollm2_135m train.n_prompts=4 train.n_samples=4 \
        --prompt-len 48 --response-len 32 --reps 5

Positional arguments are Hydra overrides of conf/config.yaml; flags are the benchmark's own
(`--help`). Writes benchmark.json and benchmark.md to --out (default under the git-ignored
outputs/benchmark/); `--append-docs` also appends a section to docs/benchmarks.md. To compare
against an older trainer, run the same command in a git worktree of that commit.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from a3po.benchmark import main  # noqa: E402

if __name__ == "__main__":
    main(program="python experiments/benchmark.py")
