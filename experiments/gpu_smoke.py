"""The GPU smoke test: run first on a new cluster (`make gpu-smoke`). All logic lives in the
a3po.smoke package.

    python experiments/gpu_smoke.py [--out FILE] [--only ITEM,...] [--gsm8k-path PATH] [--keep-runs]

Writes outputs/gpu_smoke/smoke.json (pass/fail/skipped per item, its figure and wall seconds)
and smoke.md beside it. Exit status: 0 when no item failed (skips allowed; also without CUDA,
where there is nothing to test), 1 when one did, 2 for a bad argument.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from a3po.smoke.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
