"""The drift exponent: how the current policy's distance from the behaviour policy grows
with the versions between them (issue "How good is the approximation").

With `train.log_prox_errors=true` every step logs `drift/logp_abs/k<k>`, the mean over valid
tokens of |log pi_theta - log pi_behave| in minibatch k. The current policy there is
d + k/m versions from the behaviour one (d the step's mean staleness, m minibatches, each
update 1/m of a version). Fitting `drift = c * (d + k/m)^beta` by least squares on the logs
gives beta: near 1, drift is linear in versions (the model under which schedule=step_start is
exact and inverse clips more than recompute); near 0.5, diffusive. Points at distance 0
(d = 0, k = 0) carry no information on beta and are left out.

    python -m analysis.anchor.drift SWEEP_DIR...
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.load import load_runs

__all__ = ["DriftFit", "fit_drift", "drift_points", "main"]

PREFIX = "drift/logp_abs/k"


@dataclass(frozen=True)
class DriftFit:
    c: float
    beta: float
    n_points: int


def fit_drift(distance: np.ndarray, drift: np.ndarray) -> DriftFit:
    """Least squares of log drift on log distance over the points with both positive."""
    distance, drift = np.asarray(distance, float), np.asarray(drift, float)
    keep = (distance > 0) & (drift > 0) & np.isfinite(drift)
    if keep.sum() < 2 or np.unique(distance[keep]).size < 2:
        raise ValueError(f"a drift fit needs points at two distances at least; got {int(keep.sum())} point(s) at "
                         f"{np.unique(distance[keep]).size} distance(s)")
    beta, log_c = np.polyfit(np.log(distance[keep]), np.log(drift[keep]), 1)
    return DriftFit(float(np.exp(log_c)), float(beta), int(keep.sum()))


def drift_points(df: pd.DataFrame) -> pd.DataFrame:
    """(experiment, run, step, distance = staleness/mean + k/m, drift) for every logged minibatch
    of every step; runs are told apart by (experiment, run), so two sweeps' `recompute-d8-s0`
    never mix."""
    key = ["experiment", "run"] if "experiment" in df.columns else ["run"]
    columns = [*key, "step", "distance", "drift"]
    drift = df[df["metric"].str.startswith(PREFIX)].copy()
    if drift.empty:
        return pd.DataFrame(columns=columns)
    drift["k"] = drift["metric"].str.removeprefix(PREFIX).astype(int)
    m = drift.groupby([*key, "step"])["k"].transform("max") + 1
    staleness = df[df["metric"] == "staleness/mean"].set_index([*key, "step"])["value"]
    d = staleness.reindex(pd.MultiIndex.from_frame(drift[[*key, "step"]])).to_numpy()
    drift["distance"] = d + drift["k"].to_numpy() / m.to_numpy()
    return drift.rename(columns={"value": "drift"})[columns].reset_index(drop=True)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="sweep or run directories")
    args = parser.parse_args(argv)
    points = drift_points(load_runs(args.paths))
    try:
        fit = fit_drift(points["distance"].to_numpy(), points["drift"].to_numpy())
    except ValueError as err:
        print(f"no drift fit: {err} (runs with train.log_prox_errors=true log drift/logp_abs/k<k>)", file=sys.stderr)
        return 2
    print(f"drift = {fit.c:.4g} * (d + k/m)^{fit.beta:.3f} over {fit.n_points} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
