"""S8's rules, as docs/studies/s8.md registers them.

    python -m analysis.studies.s8 plan docs/logs/s8_pilot.tar.xz

`plan` reads the pilot (S6 tier C's runs to 100 steps, 3 arms x 3 seeds) and applies the three
registered rules: the length L (every arm's mean held-out slope below `FLAT` per 10 steps from
L* on, L = min(L* + 10, 100)), the cost of a run through L, and the arms and seeds (the second
loglinear arm only if the budget leaves it 80% power for (a) at Holm's strictest step). It prints
the block appended to the registration's "Plan from the pilot" and the main sweep's grid.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import load_runs
from analysis.markdown import fmt, markdown_table
from analysis.power import paired_power, tost_power

STALENESS = 2
ARMS = {"recompute": ("recompute", ""), "inverse": ("loglinear", "inverse"),
        "step_start": ("loglinear", "step_start")}   # arm -> (algo, schedule)
SECOND_ARM = "step_start"
CANDIDATES = (60, 70, 80, 90, 100)   # the length rule's candidate steps
FLAT = 0.01                          # reward per 10 steps: the length rule's and the plateau check's bound
WINDOW = 4                           # evals in a slope: after s - 30, s - 20, s - 10, s
EVERY = 10                           # steps between evals
MARGIN_STEPS = 10                    # L = min(L* + 10, 100)
MAX_STEPS = 100
BUDGET_HOURS = 60.0
RESTART_MARGIN = 1.1
SIGMA_FLOOR = 0.035                  # tier C's paired standard deviation at step 50
LOSS = -0.034                        # tier C's inverse - recompute, the loss (a) must see
MAX_SEEDS = 40
FIRST_SEED = 310
TIME_KEYS = ("time/step_cpu", "time/eval", "time/checkpoint")


def arm_of(algo: str, schedule: str) -> str:
    """The registered arm a run belongs to ('' for none)."""
    return next((arm for arm, (a, s) in ARMS.items() if algo == a and (not s or schedule == s)), "")


def evals_by_step(df: pd.DataFrame) -> pd.Series:
    """Per run, its held-out rewards keyed by the steps done when each ran (an eval logged at step
    index i ran after step i + 1)."""
    rows = df[df["metric"] == "eval/reward"]
    return rows.groupby("run").apply(lambda r: dict(zip((r["step"] + 1).astype(int), r["value"].astype(float))),
                                     include_groups=False)


def slope(evals: Mapping[int, float], end: int) -> float | None:
    """The least-squares slope of held-out reward against step over the evals after end - 30,
    end - 20, end - 10 and end, in reward per 10 steps; None where one of them is missing."""
    steps = [end - EVERY * k for k in range(WINDOW - 1, -1, -1)]
    if any(s not in evals for s in steps):
        return None
    return float(np.polyfit(np.array(steps, dtype=float), [evals[s] for s in steps], 1)[0] * EVERY)


def mean_slopes(runs: pd.DataFrame, candidates: Sequence[int] = CANDIDATES) -> pd.DataFrame:
    """Each arm's mean slope over its runs at each candidate step (NaN where no run reached it);
    `runs` has columns arm and evals."""
    table = {}
    for arm, rows in runs.groupby("arm", sort=False):
        values = {s: [v for e in rows["evals"] if (v := slope(e, s)) is not None] for s in candidates}
        table[arm] = {s: float(np.mean(v)) if v else math.nan for s, v in values.items()}
    return pd.DataFrame(table).T.reindex(columns=list(candidates))


def length_rule(slopes: pd.DataFrame) -> tuple[int | None, int]:
    """(L*, L): L* the smallest candidate at which every arm's mean slope is below `FLAT` there and
    at every larger candidate (None if none), L = min(L* + 10, 100), or 100 without an L*."""
    flat = (slopes < FLAT).all(axis=0)  # NaN compares False: an arm without the evals is not flat
    for s in slopes.columns:
        if flat.loc[s:].all():
            return int(s), min(int(s) + MARGIN_STEPS, MAX_STEPS)
    return None, MAX_STEPS


def run_hours(df: pd.DataFrame, through: int) -> pd.Series:
    """Per run, the CPU-hours of its steps 1..`through` and their evals and checkpoints."""
    rows = df[df["metric"].isin(TIME_KEYS) & (df["step"] < through)]
    return rows.groupby("run")["value"].sum() / 3600


def paired_sd(runs: pd.DataFrame, column: str, arm: str, baseline: str = "recompute") -> float:
    """The standard deviation over seeds of `arm` - `baseline` in `column` (NaN under 2 seeds)."""
    pivot = runs.pivot_table(index="seed", columns="arm", values=column)
    if arm not in pivot or baseline not in pivot:
        return math.nan
    differences = (pivot[arm] - pivot[baseline]).dropna()
    return float(differences.std(ddof=1)) if len(differences) >= 2 else math.nan


def last_evals(evals: Mapping[int, float], end: int) -> float:
    """The registered `last_evals_reward` at length `end`: the mean of the evals after end - 10 and end."""
    values = [evals.get(end - EVERY), evals.get(end)]
    return float(np.mean(values)) if None not in values else math.nan


@dataclass(frozen=True)
class Plan:
    slopes: pd.DataFrame
    l_star: int | None
    length: int
    pilot_hours: float
    run_hours: float
    budget: float
    n3: int
    n2: int
    sigma: float
    pilot_sd: float
    power_second_arm: float
    arms: tuple[str, ...]
    seeds: tuple[int, ...]


def plan(df: pd.DataFrame) -> Plan:
    """The registered rules applied to the pilot's logs, once every pilot run has ended."""
    runs = pilot_runs(df)
    part_done = sorted(set(df[~df["complete"].astype(bool)]["run"]) & set(runs["run"]))
    if part_done or len(runs) != len(ARMS) * 3:
        raise SystemExit(f"the pilot has not ended: {len(runs)} of {len(ARMS) * 3} runs found"
                         + (f", part-done: {', '.join(part_done)}" if part_done else ""))
    slopes = mean_slopes(runs)
    l_star, length = length_rule(slopes)
    hours_to_l = run_hours(df, length)
    pilot_hours = float(run_hours(df, 10**9).sum())
    cost = float(hours_to_l.mean())
    budget = BUDGET_HOURS - pilot_hours
    n3 = max(0, math.floor(budget / (3 * RESTART_MARGIN * cost)))
    n2 = max(0, math.floor(budget / (2 * RESTART_MARGIN * cost)))
    runs = runs.assign(last=[last_evals(e, length) for e in runs["evals"]])
    pilot_sd = max((sd for arm in ("inverse", SECOND_ARM) if not math.isnan(sd := paired_sd(runs, "last", arm))),
                   default=math.nan)
    sigma = max(SIGMA_FLOOR, pilot_sd) if not math.isnan(pilot_sd) else SIGMA_FLOOR
    power3 = paired_power(LOSS, sigma, n3, alpha=0.05 / 6)
    arms, n = (("recompute", "inverse", SECOND_ARM), n3) if power3 >= 0.80 else (("recompute", "inverse"),
                                                                                min(n2, MAX_SEEDS))
    return Plan(slopes, l_star, length, pilot_hours, cost, budget, n3, n2, sigma, pilot_sd, power3, arms,
                tuple(range(FIRST_SEED, FIRST_SEED + n)))


def pilot_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per pilot run at d = 2 of a registered arm: run, arm, seed, evals."""
    identity = df.drop_duplicates("run").set_index("run")
    runs = pd.DataFrame({"run": identity.index, "seed": identity["seed"].astype(int).values,
                         "staleness": identity["staleness"].values,
                         "arm": [arm_of(a, s) for a, s in zip(identity["algo"], identity["schedule"])]})
    runs = runs.join(evals_by_step(df).rename("evals"), on="run")
    runs["evals"] = [e if isinstance(e, dict) else {} for e in runs["evals"]]
    return runs[(runs["staleness"] == STALENESS) & (runs["arm"] != "")].reset_index(drop=True)


def power_lines(p: Plan) -> list[str]:
    """What the plan's seeds can and cannot show, at its sigma, under Holm's strictest step."""
    k = 3 * (len(p.arms) - 1)
    n = len(p.seeds)
    margin = 0.02 * 0.91
    return [f"- (a) detects {LOSS:+.3f} with {fmt(paired_power(LOSS, p.sigma, n, 0.05 / k), 2)} power at alpha "
            f"0.05 / {k} ({fmt(paired_power(LOSS, p.sigma, n), 2)} at 0.05)",
            f"- (b), ±2% (±{margin:.3f} near a reward of 0.91), at a true difference of 0: "
            f"{fmt(tost_power(0.0, p.sigma, n, margin, 0.05 / k), 2)} power at alpha 0.05 / {k} "
            f"({fmt(tost_power(0.0, p.sigma, n, margin), 2)} at 0.05)"]


def plan_markdown(p: Plan) -> str:
    slope_rows = [[arm, *[fmt(v, 4) for v in p.slopes.loc[arm]]] for arm in p.slopes.index]
    lines = ["Mean slope of the held-out reward per 10 steps over the four evals ending at each step "
             "(the pilot's seeds):", "",
             markdown_table(["arm", *[str(s) for s in p.slopes.columns]], slope_rows, numeric_from=1), "",
             f"- L* = {p.l_star if p.l_star is not None else 'none (no candidate flat in every arm)'}; "
             f"**L = {p.length}**",
             f"- the pilot: {fmt(p.pilot_hours, 3)} CPU-hours; c_L = {fmt(p.run_hours, 3)} CPU-hours a run "
             f"through step {p.length}; B = {fmt(p.budget, 3)}",
             f"- n3 = {p.n3}, n2 = {p.n2}; sigma = {fmt(p.sigma, 3)} (the pilot's paired sd at L: "
             f"{fmt(p.pilot_sd, 3)}; floor {SIGMA_FLOOR})",
             f"- `{SECOND_ARM}` as second arm: power {fmt(p.power_second_arm, 2)} for (a) at alpha 0.05 / 6 with n3 "
             f"seeds: {'included' if SECOND_ARM in p.arms else 'left out (below 0.80)'}",
             f"- **arms: {', '.join(p.arms)}; seeds {p.seeds[0]}-{p.seeds[-1]} ({len(p.seeds)})**"
             if p.seeds else "- **no seed fits the budget**",
             *power_lines(p)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser("plan", help="the pilot's rules: length, arms, seeds")
    planner.add_argument("logs", nargs="+", type=Path, help="the pilot's sweep (run directories or an archive)")
    args = parser.parse_args(argv)
    print(plan_markdown(plan(load_runs(args.logs))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
