"""A schedule fitted to the logs (issue "How good is the approximation"): the weights of the
`rational` family, w_b = (c + b k/m) / (d^gamma + c + b k/m), that best place a loglinear
anchor on recompute's, from runs with `train.log_prox_errors=true` (experiment=approx_quality).

    python -m analysis.anchor.fit_schedule SWEEP_DIR... --out conf/schedule/fitted.yaml [--fit-seeds 0] [--report FILE]

Each step logs, per minibatch k, C = mean(delta * target) and D = mean(delta^2) over the valid
tokens (`alpha_fit/{cross,delta_sq}/k<k>`, delta = logp - behave, target = recompute's anchor -
behave). A loglinear anchor with weight alpha has mean squared log-prob error
alpha^2 D - 2 alpha C + T, smallest at alpha* = C / D, and D (alpha - alpha*)^2 above that
smallest (T, recompute's own distance from behave, cancels). The cells are (d, k/m), with d the
step's mean staleness (one value per lagged run after its first d steps) and C, D averaged over
the steps and runs in the cell; the fit minimises the summed excess over (gamma, c, b) by least
squares. The table gives, per d, alpha* and the excess of inverse (the paper's), step_start and
the fit, as a root mean square over k in nats, on the fitted seeds and, with `--fit-seeds`, on
the others (held out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.optimize import least_squares

from a3po.maths.schedules import SCHEDULES
from analysis.load import load_runs
from analysis.provenance import head_commit

__all__ = ["alpha_cells", "fit_rational", "excess_table", "RationalFit", "main"]

CROSS, DELTA_SQ = "alpha_fit/cross/k", "alpha_fit/delta_sq/k"
# (gamma, c, b) bounds: the rational spec's ranges, gamma kept away from 0
BOUNDS = ([0.05, 0.0, 0.0], [8.0, 1e3, 1e3])
STARTS = ((1.0, 0.0, 1.0), (1.0, 1.0, 0.0), (0.5, 0.5, 0.5))  # step_start, 1/(d+1), in between


@dataclass(frozen=True)
class RationalFit:
    gamma: float
    c: float
    b: float
    n_cells: int

    def params(self) -> dict[str, float]:
        return {"gamma": self.gamma, "c": self.c, "b": self.b}


def alpha_cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (d, k, m): C, D (means over steps and runs), alpha* = C / D and the step count."""
    stats = df[df["metric"].str.startswith(CROSS) | df["metric"].str.startswith(DELTA_SQ)].copy()
    if stats.empty:
        return pd.DataFrame(columns=["d", "k", "m", "C", "D", "alpha_star", "n"])
    stats["stat"] = np.where(stats["metric"].str.startswith(CROSS), "C", "D")
    stats["k"] = stats["metric"].str.rsplit("k", n=1).str[1].astype(int)
    wide = stats.pivot_table(index=["run", "step", "k"], columns="stat", values="value").reset_index()
    wide["m"] = wide.groupby(["run", "step"])["k"].transform("max") + 1
    staleness = df[df["metric"] == "staleness/mean"].set_index(["run", "step"])["value"]
    wide["d"] = staleness.reindex(pd.MultiIndex.from_frame(wide[["run", "step"]])).to_numpy().round(6)
    wide = wide[(wide["d"] >= 1) & (wide["D"] > 0)]
    cells = wide.groupby(["d", "k", "m"]).agg(C=("C", "mean"), D=("D", "mean"), n=("C", "size")).reset_index()
    cells["alpha_star"] = cells["C"] / cells["D"]
    return cells


def schedule_alpha(name: str, d: np.ndarray, position: np.ndarray, **params: float) -> np.ndarray:
    """alpha of a3po's own schedule function at each (d, k/m), d >= 1."""
    spec = SCHEDULES[name]
    d_t = torch.tensor(d, dtype=torch.float64)
    if spec.uses_position:
        return np.array([float(spec.fn(d_t[i:i + 1], float(p), **params)) for i, p in enumerate(position)])
    return spec.fn(d_t, **params).numpy()


def fit_rational(cells: pd.DataFrame) -> RationalFit:
    """(gamma, c, b) minimising sum over cells of D (alpha - alpha*)^2, from the best of STARTS."""
    if len(cells) < 3:
        raise ValueError(f"a fit of 3 parameters needs 3 (d, k/m) cells at least; the logs give {len(cells)} "
                         "(runs with train.log_prox_errors=true log alpha_fit/{cross,delta_sq}/k<k>)")
    d, p = cells["d"].to_numpy(float), (cells["k"] / cells["m"]).to_numpy(float)
    weight, target = np.sqrt(cells["D"].to_numpy(float)), cells["alpha_star"].to_numpy(float)

    def residuals(theta: np.ndarray) -> np.ndarray:
        gamma, c, b = theta
        power = d**gamma
        return weight * (power / (power + c + b * p) - target)

    best = min((least_squares(residuals, np.array(start), bounds=BOUNDS) for start in STARTS), key=lambda r: r.cost)
    # 4 significant digits, and a bound's float residue (1e-25) read as the bound itself
    gamma, c, b = (0.0 if abs(v) < 1e-6 else float(f"{v:.4g}") for v in best.x)
    return RationalFit(gamma, c, b, len(cells))


def excess_table(cells: pd.DataFrame, schedules: dict[str, tuple[str, dict[str, float]]]) -> pd.DataFrame:
    """Rows: d; columns: alpha* (mean over k) and, per label, the root mean over k of
    D (alpha - alpha*)^2 in nats (`schedules`: label -> (schedule name, params))."""
    out = cells[["d", "k", "m", "D", "alpha_star"]].copy()
    position = (out["k"] / out["m"]).to_numpy(float)
    for label, (name, params) in schedules.items():
        alpha = schedule_alpha(name, out["d"].to_numpy(float), position, **params)
        out[label] = out["D"] * (alpha - out["alpha_star"]) ** 2
    table = out.groupby("d").agg({"alpha_star": "mean", **{label: "mean" for label in schedules}})
    table[list(schedules)] = np.sqrt(table[list(schedules)])
    return table


def _markdown(table: pd.DataFrame, title: str) -> list[str]:
    labels = [c for c in table.columns if c != "alpha_star"]
    head = "| d | alpha* (mean over k) | " + " | ".join(f"`{label}` excess" for label in labels) + " |"
    rows = [f"| {d:g} | {row['alpha_star']:.3f} | " + " | ".join(f"{row[label]:.4f}" for label in labels) + " |"
            for d, row in table.iterrows()]
    return [f"{title}", "", head, "|--:|--:|" + "--:|" * len(labels), *rows, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="sweep or run directories")
    parser.add_argument("--out", type=Path, required=True, help="the schedule file to write (conf/schedule/<name>.yaml)")
    parser.add_argument("--fit-seeds", type=int, nargs="*", help="fit on these seeds, report the others as held out")
    parser.add_argument("--report", type=Path, help="also write the tables as markdown here")
    args = parser.parse_args(argv)
    df = load_runs(args.paths)
    fit_df = df[df["seed"].isin(args.fit_seeds)] if args.fit_seeds else df
    try:
        fit = fit_rational(alpha_cells(fit_df))
    except ValueError as err:
        print(f"no fit: {err}", file=sys.stderr)
        return 2
    compared = {"inverse": ("inverse", {}), "step_start": ("step_start", {}), "fitted": ("rational", fit.params())}
    formula = f"w_b = ({fit.c:g} + {fit.b:g} k/m) / (d^{fit.gamma:g} + {fit.c:g} + {fit.b:g} k/m)"
    command = f"python -m analysis.anchor.fit_schedule {' '.join(map(str, args.paths))} --out {args.out}" + (
        f" --fit-seeds {' '.join(map(str, args.fit_seeds))}" if args.fit_seeds else "")
    commit = head_commit()
    seeds = sorted(fit_df["seed"].unique())
    lines = [f"{formula}, fitted over {fit.n_cells} (d, k/m) cells of {fit_df['run'].nunique()} runs "
             f"(seeds {', '.join(map(str, seeds))}).", "",
             *_markdown(excess_table(alpha_cells(fit_df), compared), "Excess root-mean-square log-prob error over the "
                        "best loglinear anchor (nats), on the fitted runs:")]
    held_out = df[~df["seed"].isin(seeds)]
    if not held_out.empty:
        lines += _markdown(excess_table(alpha_cells(held_out), compared),
                           f"The same on the held-out runs (seeds {', '.join(map(str, sorted(held_out['seed'].unique())))}):")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# Fitted by `{command}`\n# at {commit or 'an unknown commit'} on {dt.date.today()}: {formula}\n"
        f"# over {fit.n_cells} (d, k/m) cells (analysis/anchor/fit_schedule.py); train with schedule={args.out.stem}.\n"
        f"name: rational\ngamma: {fit.gamma:g}\nc: {fit.c:g}\nb: {fit.b:g}\n")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(f"Generated by `{command} --report {args.report}` at {commit}.\n\n" + "\n".join(lines))
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
