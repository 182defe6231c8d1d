"""S8's rules, as docs/studies/s8.md registers them.

    python -m analysis.studies.s8 plan docs/logs/s8_pilot.tar.xz
    python -m analysis.studies.s8 report docs/logs/s8.tar.xz --pilot docs/logs/s8_pilot.tar.xz \
        --out docs/reports/s8.md --figures-dir docs/reports/s8 --deviations docs/studies/s8.md

`plan` applies the pilot's three rules (analysis.curves): the length L, the cost of a run through
L, and the arms and seeds (the second loglinear arm only if the budget leaves (a) 80% power at
Holm's strictest step). `report` judges the registered family on the main sweep's ended runs
(the stopping rule, analysis.stopping): per loglinear arm, (a) a paired t on `last_evals_reward`,
(b) a TOST at +-2% of recompute's mean, (c) a paired t on `early_reward` (the evals after steps
10-50), under Holm over all of them, with each arm's plateau check deciding whether (a) and (b)
are answered.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from analysis.curves import (FLAT, early_reward, evals_by_step, last_evals, length_rule, mean_slopes, paired_sd,
                             plateau)
from analysis.figures.arms import arm_figures
from analysis.hypotheses import STUDIES, Hypothesis, declared
from analysis.load import load_configs, load_runs
from analysis.markdown import fmt, markdown_table
from analysis.outcomes import with_outcomes
from analysis.power import paired_power, tost_power
from analysis.provenance import figures_markdown, generated_line, provenance
from analysis.scalars import run_scalars
from analysis.stats import mean_ci
from analysis.stopping import (EXPERIMENTS, left_out_line, registered_seeds, reward_of_the_diverged, rows_of,
                               seeds_ended_in_every_arm)
from analysis.studies import (deviations_flag, family_table, judge_family, paired_values, provenance_table, undecided_table,
                              write_study_report)

STALENESS = 2
ARMS = {"recompute": ("recompute", ""), "inverse": ("loglinear", "inverse"),
        "step_start": ("loglinear", "step_start")}   # arm -> (algo, schedule)
SECOND_ARM = "step_start"
CANDIDATES = (60, 70, 80, 90, 100)   # the length rule's candidate steps
BUDGET_HOURS = 60.0
RESTART_MARGIN = 1.1
SIGMA_FLOOR = 0.035                  # tier C's paired standard deviation at step 50
LOSS = -0.034                        # tier C's inverse - recompute, the loss (a) must see
MAX_SEEDS = 40
FIRST_SEED = 310
PILOT_RUNS = 9
TIME_KEYS = ("time/step_cpu", "time/eval", "time/checkpoint")
TESTS = STUDIES["s8"]                # (a), (b), (c): declared in analysis.hypotheses
RELATIVE_MARGIN = declared("s8", "b").margin  # (b): the paper's "within 2%" of recompute's mean


def arm_of(algo: str, schedule: str) -> str:
    """The registered arm a run belongs to ('' for none)."""
    return next((arm for arm, (a, s) in ARMS.items() if algo == a and (not s or schedule == s)), "")


def run_hours(df: pd.DataFrame, through: int) -> pd.Series:
    """Per run, the CPU-hours of its steps 1..`through` and their evals and checkpoints."""
    rows = df[df["metric"].isin(TIME_KEYS) & (df["step"] < through)]
    return rows.groupby("run")["value"].sum() / 3600


def study_runs(df: pd.DataFrame, length: int) -> pd.DataFrame:
    """One row per run at d = 2 of a registered arm: `run_scalars` and outcomes, `arm`, its evals
    by step, `last` (the registered `last_evals_reward` at `length`), `early` (evals after 10-50)
    and `total_ratio_max` (the steady mean of the anchor-free pi_theta / pi_behave max)."""
    runs = with_outcomes(run_scalars(df), df)
    runs["arm"] = [arm_of(a, s) for a, s in zip(runs["algo"], runs["schedule"])]
    runs = runs[(runs["staleness"] == STALENESS) & (runs["arm"] != "")].reset_index(drop=True)
    evals = evals_by_step(df)
    runs["evals"] = [evals.get(run, {}) if isinstance(evals.get(run), dict) else {} for run in runs["run"]]
    runs["last"] = [last_evals(e, length) for e in runs["evals"]]
    runs["early"] = [early_reward(e) for e in runs["evals"]]
    ratio = df[(df["metric"] == "offpolicy/total_ratio_max") & (df["step"] >= STALENESS)]
    runs["total_ratio_max"] = runs["run"].map(ratio.groupby("run")["value"].mean())
    return runs


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
    runs = study_runs(df, 100)
    part_done = sorted(runs[~runs["complete"].astype(bool) & ~runs["diverged"]]["run"])
    if part_done or len(runs) != PILOT_RUNS:
        raise SystemExit(f"the pilot has not ended: {len(runs)} of {PILOT_RUNS} runs found"
                         + (f", part-done: {', '.join(part_done)}" if part_done else ""))
    slopes = mean_slopes(runs, CANDIDATES)
    l_star, length = length_rule(slopes)
    pilot_hours, cost = float(run_hours(df, 10**9).sum()), float(run_hours(df, length).mean())
    budget = BUDGET_HOURS - pilot_hours
    n3 = max(0, math.floor(budget / (3 * RESTART_MARGIN * cost)))
    n2 = max(0, math.floor(budget / (2 * RESTART_MARGIN * cost)))
    runs["last"] = [last_evals(e, length) for e in runs["evals"]]
    sds = [sd for arm in ("inverse", SECOND_ARM) if not math.isnan(sd := paired_sd(runs, "last", arm))]
    pilot_sd = max(sds) if sds else math.nan
    sigma = max(SIGMA_FLOOR, pilot_sd) if sds else SIGMA_FLOOR
    power3 = paired_power(LOSS, sigma, n3, alpha=0.05 / 6)
    arms, n = (("recompute", "inverse", SECOND_ARM), n3) if power3 >= 0.80 else \
        (("recompute", "inverse"), min(n2, MAX_SEEDS))
    return Plan(slopes, l_star, length, pilot_hours, cost, budget, n3, n2, sigma, pilot_sd, power3, arms,
                tuple(range(FIRST_SEED, FIRST_SEED + n)))


def tests_of(runs: pd.DataFrame, arm: str) -> list[tuple[str, Hypothesis, list[float]]]:
    """(a), (b) and (c) for `arm` - recompute, primed for the arm's second place in the family."""
    prime = "'" if arm == SECOND_ARM else ""
    by_seed = lambda a, column: {int(r["seed"]): float(r[column]) for _, r in runs[runs["arm"] == a].iterrows()}  # noqa: E731
    base_mean = float(np.nanmean(runs[runs["arm"] == "recompute"]["last"])) if (runs["arm"] == "recompute").any() else 0.0
    margin = RELATIVE_MARGIN * base_mean if base_mean > 0 else RELATIVE_MARGIN
    family = [replace(t, label=t.label + prime, text=f"{t.text} ({margin:.4f})", margin=margin)
              if t.kind == "equivalence" else replace(t, label=t.label + prime) for t in TESTS]
    comparison = f"{arm} - recompute"
    return [(comparison, t, paired_values(t, by_seed(arm, t.column), by_seed("recompute", t.column))) for t in family]


@dataclass(frozen=True)
class Judged:
    family: pd.DataFrame
    plateaus: dict[str, tuple]   # arm -> (Interval, holds)
    answers: dict[str, str]      # loglinear arm -> the registered answer


def judge(runs: pd.DataFrame, arms: tuple[str, ...], length: int) -> Judged:
    """The family under Holm, each arm's plateau check, (a) and (b) marked not answered where an
    arm of theirs is still rising, and the registered answer per loglinear arm."""
    family = judge_family([t for arm in arms if arm != "recompute" for t in tests_of(runs, arm)])
    plateaus = {arm: plateau(list(runs[runs["arm"] == arm]["evals"]), length) for arm in arms}
    for i, row in family.iterrows():
        arm = row["comparison"].split(" - ")[0]
        rising = [a for a in (arm, "recompute") if not plateaus[a][1]]
        if row["label"][0] in "ab" and rising:
            family.at[i, "verdict"] = f"not answered: {' and '.join(rising)} still rising at step {length}"
    answers = {arm: answer(family[family["comparison"] == f"{arm} - recompute"]) for arm in arms if arm != "recompute"}
    return Judged(family, plateaus, answers)


def answer(rows: pd.DataFrame) -> str:
    """The registration's answer from one arm's adjusted verdicts of (a), (b) and (c)."""
    verdict = {row["label"][0]: row["verdict"] for _, row in rows.iterrows()}
    a, b, c = verdict.get("a", ""), verdict.get("b", ""), verdict.get("c", "")
    if a == "lower":
        return "A-3PO costs final reward"
    if c == "lower" and b.startswith("equivalent"):
        return "A-3PO only learns slower"
    if b.startswith("equivalent") and c != "lower":
        return "no loss shown"
    return "undecided"


def plan_markdown(p: Plan) -> str:
    """The block appended to the registration's "Plan from the pilot"."""
    rows = [[arm, *[fmt(v, 4) for v in p.slopes.loc[arm]]] for arm in p.slopes.index]
    k, n = 3 * (len(p.arms) - 1), len(p.seeds)
    margin = RELATIVE_MARGIN * 0.91
    return "\n".join([
        "Mean slope of the held-out reward per 10 steps over the four evals ending at each step (the pilot's seeds):", "",
        markdown_table(["arm", *map(str, p.slopes.columns)], rows, numeric_from=1), "",
        f"- L* = {p.l_star if p.l_star is not None else 'none (no candidate flat in every arm)'}; **L = {p.length}**",
        f"- the pilot: {fmt(p.pilot_hours, 3)} CPU-hours; c_L = {fmt(p.run_hours, 3)} CPU-hours a run through step "
        f"{p.length}; B = {fmt(p.budget, 3)}; n3 = {p.n3}, n2 = {p.n2}",
        f"- sigma = {fmt(p.sigma, 3)} (the pilot's paired sd at L: {fmt(p.pilot_sd, 3)}; floor {SIGMA_FLOOR})",
        f"- `{SECOND_ARM}`: power {fmt(p.power_second_arm, 2)} for (a) at alpha 0.05 / 6 with n3 seeds: "
        + ("included" if SECOND_ARM in p.arms else "left out (below 0.80)"),
        f"- **arms: {', '.join(p.arms)}; seeds {p.seeds[0]}-{p.seeds[-1]} ({n})**" if n else "- **no seed fits the budget**",
        f"- (a) detects {LOSS:+.3f} with {fmt(paired_power(LOSS, p.sigma, n, 0.05 / k), 2)} power at alpha 0.05 / {k} "
        f"({fmt(paired_power(LOSS, p.sigma, n), 2)} at 0.05)",
        f"- (b) at ±{margin:.3f} and a true difference of 0: {fmt(tost_power(0.0, p.sigma, n, margin, 0.05 / k), 2)} "
        f"power at alpha 0.05 / {k} ({fmt(tost_power(0.0, p.sigma, n, margin), 2)} at 0.05)"])


def _curve_rows(runs: pd.DataFrame, source: str) -> list[list[str]]:
    steps = sorted({s for e in runs["evals"] for s in e})
    rows = []
    for arm, group in runs.groupby("arm", sort=False):
        cells = [mean_ci([e[s] for e in group["evals"] if s in e]) for s in steps]
        rows.append([source, arm, len(group), *[f"{fmt(c.mean, 3)} ± {fmt(c.half_width, 2)}" for c in cells]])
    return rows


def _curves(runs: pd.DataFrame, pilot: pd.DataFrame | None) -> str:
    steps = sorted({s for e in runs["evals"] for s in e})
    rows = _curve_rows(runs, "S8") + (_curve_rows(pilot, "pilot") if pilot is not None else [])
    return markdown_table(["runs", "arm", "n", *[f"after {s}" for s in steps]], rows, numeric_from=2)


def _secondary(runs: pd.DataFrame, df: pd.DataFrame) -> str:
    step0 = df[(df["metric"] == "response/truncated") & (df["step"] <= STALENESS)].groupby("run")["value"].mean()
    rows = [[arm, len(g), fmt(g["clip_ratio"].mean() * 100, 3), fmt(g["entropy"].mean(), 3),
             fmt(g["total_ratio_max"].mean(), 3), int(g["collapsed"].sum() + g["diverged"].sum()),
             fmt(g["run"].map(step0).mean() * 100, 3)] for arm, g in runs.groupby("arm", sort=False)]
    return markdown_table(["arm", "runs", "clip ratio (%)", "entropy", "max pi_theta / pi_behave",
                           "collapsed or diverged", "truncated, version-0 batches (%)"], rows, numeric_from=1)


def _plateau_table(judged: Judged, length: int) -> str:
    rows = [[arm, interval.n, f"{fmt(interval.mean, 4)} [{fmt(interval.low, 4)}, {fmt(interval.high, 4)}]",
             "**holds**" if holds else "**does not hold**"] for arm, (interval, holds) in judged.plateaus.items()]
    return markdown_table(["arm", "runs", f"slope per 10 steps, evals after {length - 30}-{length} [95% CI]",
                           f"plateau (upper end < {FLAT})"], rows, numeric_from=1)


def report(args: argparse.Namespace) -> list[str]:
    df, configs = load_runs(args.logs), load_configs(args.logs)
    seeds, arms = registered_seeds("s8"), registered_arms("s8")
    length = int(OmegaConf.load(EXPERIMENTS / "s8.yaml").train.total_steps)
    runs, left_out = seeds_ended_in_every_arm(study_runs(df, length), seeds, arms)
    runs = reward_of_the_diverged(runs, "last")
    judged = judge(runs, arms, length)
    pilot = study_runs(load_runs([args.pilot]), length) if args.pilot else None
    command = (f"python -m analysis.studies.s8 report {' '.join(map(str, args.logs))}"
               + (f" --pilot {args.pilot}" if args.pilot else "") + f" --out {args.out} --figures-dir {args.figures_dir}"
               + deviations_flag(args))
    answers = [f"- **{arm}**: {text}" for arm, text in judged.answers.items()]
    return [f"# S8: does A-3PO cost final reward at d = {STALENESS}, or only learn slower?", "",
            generated_line(command) + " Pre-registered in docs/studies/s8.md; its deviations end this page.", "",
            "## The answer", "", *answers, "",
            "## Provenance", "", provenance(args.logs, runs, configs, df.attrs.get("skipped", ())), "",
            provenance_table(runs, [("d", "staleness")]), "", left_out_line(len(runs), left_out, len(seeds) * len(arms)),
            "", "## The family (Holm over every test below)", "",
            "\"Inconclusive\" and \"no difference shown\" never count as equivalence or as no loss.", "",
            family_table(judged.family), "", "## Plateau check, per arm", "", _plateau_table(judged, length), "",
            "## What more seeds would decide", "", undecided_table(judged.family), "",
            "## Held-out reward by step (mean ± 95% half-width)", "", _curves(runs, pilot), "",
            "## Secondary, descriptive (steady means, steps >= 2)", "", _secondary(runs, df), "",
            "## Figures", "", figures_markdown(arm_figures(rows_of(df, runs), STALENESS, args.figures_dir, "s8", "S8"),
                                                args.out.parent)]


def registered_arms(experiment: str) -> tuple[str, ...]:
    """The arms an experiment's sweep registers (its `+variant` list), recompute first."""
    variants = str(OmegaConf.load(EXPERIMENTS / f"{experiment}.yaml").hydra.sweeper.params["+variant"]).split(",")
    names = {"recompute": "recompute", "loglinear-inverse": "inverse", "loglinear-step_start": "step_start"}
    return tuple(names[v.strip()] for v in variants)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m analysis.studies.s8", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["plan", "report"])
    parser.add_argument("logs", nargs="+", type=Path, help="the pilot's sweep (plan) or the main sweep (report)")
    if argv[:1] == ["plan"]:
        args = parser.parse_args(argv)
        print(plan_markdown(plan(load_runs(args.logs))))
        return 0
    parser.add_argument("--pilot", type=Path, default=None, help="the pilot's archive, its curves beside S8's")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
