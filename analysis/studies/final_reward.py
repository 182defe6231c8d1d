"""The final-reward study's rules, as docs/studies/final_reward.md registers them.

    python -m analysis.studies.final_reward docs/logs/final_reward.tar.xz --out docs/reports/final_reward.md \
        --figures-dir docs/reports/final_reward --deviations docs/studies/final_reward.md

One claim, one test: the paper's A-3PO (loglinear `inverse`) against recompute at d = 8, paired
by seed, on the final policy's held-out reward (`last_evals_reward`, the mean of the last two
evals): a TOST at +-`MARGIN` (`analysis.studies.judge_family`), alone in its family, so at alpha
0.05. Beside it, outside the family and read as descriptive: the two-sided paired difference,
the plateau check on recompute's last two evals, what more seeds would decide, and the figures
(`analysis.figures.arms`). The registered stopping rule (`analysis.stopping`): only the ended
runs of the seeds ended in both arms are read, and the report lists the registered runs it left
out.
"""

from __future__ import annotations

import argparse

import pandas as pd

from analysis.figures.arms import arm_figures
from analysis.hypotheses import declared
from analysis.load import load_configs, load_runs
from analysis.markdown import fmt, markdown_table
from analysis.outcomes import with_outcomes
from analysis.provenance import figures_markdown, generated_line, provenance
from analysis.scalars import plateau_check, run_scalars
from analysis.stopping import (diverged_line, ended, left_out_line, registered_seeds, reward_of_the_diverged, rows_of,
                               seeds_ended_in_every_arm)
from analysis.studies import (decided, deviations_flag, judge_family, paired_values, provenance_table, study_parser,
                              what_would_decide, write_study_report)

STALENESS = 8
PLATEAU_GAIN = 0.05    # the plateau check's bound on recompute's gain between its last two evals
ARMS = {"recompute": ("recompute", ""), "inverse": ("loglinear", "inverse")}  # arm -> (algo, schedule)
REWARD, DIFFERENCE = declared("final_reward", "R"), declared("final_reward", "R'")  # analysis.hypotheses
MARGIN = REWARD.margin  # absolute reward, S6's margin (docs/studies/final_reward.md)


def study_runs(df: pd.DataFrame, seeds: list[int] | None = None) -> pd.DataFrame:
    """One row per run at `STALENESS` of an arm in `ARMS` on a registered seed (`seeds`, the
    experiment's by default): `run_scalars`, outcomes, `arm`, `ended` (all its steps, or diverged:
    such runs keep their reward) and its evals (the held-out rewards in step order)."""
    seeds = registered_seeds("final_reward") if seeds is None else seeds
    scalars = with_outcomes(run_scalars(df), df)
    scalars["arm"] = [next((arm for arm, (algo, schedule) in ARMS.items()
                            if row["algo"] == algo and (not schedule or row["schedule"] == schedule)), "")
                      for _, row in scalars.iterrows()]
    scalars["ended"] = ended(scalars)
    evals = df[df["metric"] == "eval/reward"].sort_values("step").groupby(["experiment", "run"])["value"].agg(list)
    scalars = scalars.join(evals.rename("evals"), on=["experiment", "run"])
    keep = (scalars["staleness"] == STALENESS) & (scalars["arm"] != "") & scalars["seed"].isin(seeds)
    return reward_of_the_diverged(scalars[keep].reset_index(drop=True), REWARD.column)


def _by_seed(runs: pd.DataFrame, arm: str) -> dict[int, float]:
    rows = runs[runs["arm"] == arm]
    return {int(s): float(v) for s, v in zip(rows["seed"], rows[REWARD.column])}


def judged(runs: pd.DataFrame) -> pd.DataFrame:
    """R, alone in its family (collapsed and diverged runs keep their reward), and R' beside it,
    judged apart so it takes no alpha from R."""
    treated, baseline = _by_seed(runs, "inverse"), _by_seed(runs, "recompute")
    return pd.concat([judge_family([("inverse vs recompute", test, paired_values(test, treated, baseline))])
                      for test in (REWARD, DIFFERENCE)], ignore_index=True)


def plateau(runs: pd.DataFrame) -> dict:
    """Recompute's runs that ran all their steps (the evals after steps 70 and 80; a diverged run has neither)."""
    whole = (runs["arm"] == "recompute") & runs["complete"].astype(bool) & ~runs["diverged"].astype(bool)
    interval, holds = plateau_check(runs[whole]["evals"], PLATEAU_GAIN)
    return {"interval": interval, "holds": holds}


def _verdict_table(tests: pd.DataFrame) -> str:
    """R's verdict in bold; R', registered as descriptive (no claim, no alpha), shows its interval's
    direction unbolded."""
    rows = [[r["label"], r["quantity"], r["n"], f"{fmt(r['effect'], 3)} [{fmt(r['low'], 3)}, {fmt(r['high'], 3)}]",
             fmt(r["p"], 2), f"**{r['verdict']}**" if r["label"] == REWARD.label else f"descriptive ({r['verdict']})"]
            for _, r in tests.iterrows()]
    return markdown_table(["test", "quantity", "seeds", "inverse - recompute [95% CI]", "p", "**verdict**"], rows,
                          numeric_from=2)


def _arm_table(runs: pd.DataFrame) -> str:
    rows = [[arm, len(rows), int(rows["flagged"].sum()), f"{fmt(rows[REWARD.column].mean(), 3)} ± "
             f"{fmt(rows[REWARD.column].std(), 2)}"] for arm in ARMS for rows in [runs[runs["arm"] == arm]]]
    return markdown_table(["arm", "runs", "collapsed or diverged", "last_evals_reward (mean ± sd)"], rows,
                          numeric_from=1)


def _plateau_line(check: dict) -> str:
    gain = check["interval"]
    if not gain.known:
        return (f"Cannot be computed: {gain.n} recompute run(s) with both evals, and an interval needs 2 "
                f"(bound {PLATEAU_GAIN:g}).")
    return (f"{fmt(gain.mean, 3)} [{fmt(gain.low, 3)}, {fmt(gain.high, 3)}] over {gain.n} seeds: "
            + ("**holds**" if check["holds"] else "**does not hold**: R is the reward after 80 steps, recompute "
               "still rising") + f" (bound {PLATEAU_GAIN:g}).")


def _more_seeds_line(verdict: str, decide: pd.DataFrame) -> str:
    if decided(verdict):
        return "R is decided."
    if decide.empty:
        return "R is undecided, with fewer than 2 seeds ended in both arms: no spread to plan from."
    return (f"At the observed spread (sd {fmt(decide.iloc[0]['sd'], 3)}) and difference, a TOST at ±{MARGIN:g} "
            f"needs {decide.iloc[0]['seeds_loosest']} seeds for 80% power.")


def _command(args: argparse.Namespace) -> str:
    return (f"python -m analysis.studies.final_reward {' '.join(map(str, args.logs))} --out {args.out} "
            f"--figures-dir {args.figures_dir}" + deviations_flag(args))


def report(args: argparse.Namespace) -> list[str]:
    """The report's lines (markdown) from the parsed command line."""
    df, configs = load_runs(args.logs), load_configs(args.logs)
    seeds = registered_seeds("final_reward")
    runs, left_out = seeds_ended_in_every_arm(study_runs(df, seeds), seeds, list(ARMS))
    tests, check = judged(runs), plateau(runs)
    decide = what_would_decide(tests.iloc[:1])
    diverged = [line, ""] if (line := diverged_line(runs, REWARD.column)) else []
    return [f"# Is A-3PO's final reward within ±{MARGIN:g} of recompute's? (d = {STALENESS})", "",
            generated_line(_command(args)) + " Pre-registered in docs/studies/final_reward.md; its deviations end "
            "this page.", "",
            "## Provenance", "", provenance(args.logs, runs, configs, df.attrs.get("skipped", ())), "",
            provenance_table(runs, [("d", "staleness")]), "",
            left_out_line(len(runs), left_out, len(seeds) * len(ARMS)), "",
            "## Arms", "", _arm_table(runs), "", *diverged,
            "## The claim", "",
            f"R is the registered test (TOST at ±{MARGIN:g}, alone in its family: α 0.05); R' is descriptive. "
            "\"Inconclusive\" never counts as equivalence.", "", _verdict_table(tests), "",
            "## Plateau check (recompute: last eval - the one before)", "",
            _plateau_line(check), "",
            "## What more seeds would decide", "",
            _more_seeds_line(tests.iloc[0]["verdict"], decide), "",
            "## Figures", "", figures_markdown(arm_figures(rows_of(df, runs), STALENESS, args.figures_dir, "final_reward", "Final reward"),
                                                args.out.parent)]


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "logs", "the study's sweep (run directories or a docs/logs archive)")
    return write_study_report(parser, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
