"""The one-call check for a single borrowed GPU (docs/gpus.md, "The one-call check for a borrowed
GPU"). All logic lives in a3po.smoke.gpu_check.

    python experiments/gpu_check.py [--dry-run] [--out DIR] [--only ITEM,...] [--budget-s S] [--keep-runs]
    python experiments/gpu_check.py --print-wheels

Writes DIR/summary.json (default outputs/gpu_check/) and each item's log under DIR/logs/.
Exit status: 0 when no item failed (skips allowed), 1 when one did, 2 for a bad argument or,
without --dry-run, no CUDA device.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from a3po.smoke.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
