"""Cross-check analysis.robust against rliable itself (Agarwal et al. 2021), in the environment
of pyproject's `rliable` extra (README, "Statistics"); tests/test_against_rliable.py runs it:

    make setup-rliable
    PYTHONPATH=. .venv-rliable/bin/python analysis/checks/against_rliable.py

rliable 1.2.0 imports `arch`, whose 7.2 release fails to import under pandas 3 (the suite's
pandas), hence an environment of its own with pandas < 3. Prints each statistic from both libraries
on random scores shaped as the claims report uses them (runs x cells), and exits 1 on a
difference beyond float rounding (point values) or beyond bootstrap noise (interval ends).
"""

from __future__ import annotations

import sys

import numpy as np
from rliable import library as rly
from rliable import metrics as rlm

from analysis.robust import mean_probability_of_improvement, pooled_iqm, stratified_bootstrap


def main() -> int:
    rng = np.random.default_rng(0)
    failures = 0
    for n_runs, n_cells in ((3, 1), (8, 3), (10, 4)):
        x = rng.normal(1.0, 0.5, size=(n_runs, n_cells))
        y = rng.normal(0.8, 0.5, size=(n_runs, n_cells))
        ours_iqm = float(pooled_iqm(*[x[:, j] for j in range(n_cells)]))
        theirs_iqm = float(rlm.aggregate_iqm(x))
        ours_poi = float(mean_probability_of_improvement(*[v for j in range(n_cells) for v in (x[:, j], y[:, j])]))
        theirs_poi = float(rlm.probability_of_improvement(x, y))
        point_ok = abs(ours_iqm - theirs_iqm) < 1e-12 and abs(ours_poi - theirs_poi) < 1e-12
        ours_ci = stratified_bootstrap([x[:, j] for j in range(n_cells)], pooled_iqm, reps=20_000)
        scores, cis = rly.get_interval_estimates({"x": x}, lambda s: np.array([rlm.aggregate_iqm(s)]), reps=20_000)
        low, high = float(cis["x"][0, 0]), float(cis["x"][1, 0])
        width = max(high - low, 1e-9)
        ci_ok = abs(ours_ci.low - low) < 0.05 * width and abs(ours_ci.high - high) < 0.05 * width
        failures += not (point_ok and ci_ok)
        print(f"{n_runs} runs x {n_cells} cells: IQM {ours_iqm:.6f} / {theirs_iqm:.6f}; P(X>Y) {ours_poi:.6f} / "
              f"{theirs_poi:.6f}; IQM 95% interval [{ours_ci.low:.4f}, {ours_ci.high:.4f}] / [{low:.4f}, {high:.4f}] "
              f"(ours / rliable) {'ok' if point_ok and ci_ok else 'DIFFERENT'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
