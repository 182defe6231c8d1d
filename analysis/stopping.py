"""The studies' stopping rule: which runs a report may read when a sweep did not finish.

S6 and S7 register it alike (docs/studies/s6.md, docs/studies/final_reward.md): a report reads
the runs that ended (all their steps, or diverged: such runs keep their reward) of the
registered seeds, only the seeds ended in every arm, and lists each registered run it left
out. A diverged run's reward is the mean of the last two evals it logged, and 0 when it
stopped before its first (`reward_of_the_diverged`: reported, not dropped, as the pages
register). Each arm and seed is one run: logs that hold one twice fail. The registered seeds
are the experiment's own sweep (`conf/experiment/<name>.yaml`, `hydra.sweeper.params.seed`),
so the rule reads the grid the runs were launched from.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

EXPERIMENTS = Path(__file__).resolve().parents[1] / "conf" / "experiment"


def registered_seeds(experiment: str, experiments: Path = EXPERIMENTS) -> list[int]:
    """The seeds `experiment`'s sweep registers, in its order."""
    path = experiments / f"{experiment}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such experiment (one of: "
                                f"{', '.join(sorted(p.stem for p in experiments.glob('*.yaml')))})")
    return [int(seed) for seed in str(OmegaConf.load(path).hydra.sweeper.params.seed).split(",")]


def ended(runs: pd.DataFrame) -> pd.Series:
    """Per run: it logged all its steps (`complete`) or diverged (`diverged`, from `with_outcomes`)."""
    return runs["complete"].astype(bool) | runs["diverged"].astype(bool)


def reward_of_the_diverged(runs: pd.DataFrame, column: str = "last_evals_reward") -> pd.DataFrame:
    """`runs` with `column` 0 for each diverged run that logged no eval before it stopped (its
    reward would be NaN and its pair silently dropped); every other value as it is."""
    out = runs.copy()
    out.loc[out["diverged"].astype(bool) & out[column].isna(), column] = 0.0
    return out


def diverged_line(runs: pd.DataFrame, column: str = "last_evals_reward") -> str:
    """The report's line on the diverged runs it read and the reward each kept; '' when none."""
    rows = runs[runs["diverged"].astype(bool)]
    if rows.empty:
        return ""
    return "Diverged, kept with their reward: " + "; ".join(
        f"{r['arm']} seed {r['seed']} ({column} {r[column]:.3f})" for _, r in rows.iterrows()) + "."


def seeds_ended_in_every_arm(runs: pd.DataFrame, seeds: Sequence[int], arms: Sequence[str]) -> tuple[pd.DataFrame, list[str]]:
    """`runs` (one row per run, with `arm`, `seed`, `complete`, `diverged`) cut to the ended runs
    of the seeds ended in every arm, and a line for each registered (arm, seed) left out: "ended,
    its pair did not", "part-done" or "not started", in seed then arm order. Two runs of one arm
    and seed (a sweep passed twice) raise ValueError naming them."""
    twice = runs[runs.duplicated(["arm", "seed"], keep=False)]
    if len(twice):
        raise ValueError("more than one run of an arm and seed (is a sweep passed twice?): "
                         + ", ".join(sorted(f"{r['arm']} seed {r['seed']}: {r['run']}" for _, r in twice.iterrows())))
    done = runs[ended(runs)]
    done_pairs, started = set(zip(done["arm"], done["seed"])), set(zip(runs["arm"], runs["seed"]))
    kept = [seed for seed in seeds if all((arm, seed) in done_pairs for arm in arms)]
    left_out = [f"{arm} seed {seed}: " + ("ended, its pair did not" if (arm, seed) in done_pairs
                                       else "part-done" if (arm, seed) in started else "not started")
                for seed in seeds if seed not in kept for arm in arms]
    return done[done["seed"].isin(kept)].reset_index(drop=True), left_out


def left_out_line(n_kept: int, left_out: Sequence[str], n_registered: int) -> str:
    """The report's line on what the stopping rule read: `n_kept` runs of `n_registered`."""
    if not left_out:
        return f"Every registered run ended ({n_kept} of {n_registered})."
    return (f"Read from {n_kept} runs, those of the seeds ended in every arm (the stopping rule); left out, "
            f"{len(left_out)} of {n_registered} registered runs: " + "; ".join(left_out) + ".")


def rows_of(df: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The tidy rows (`load_runs`) of `runs` alone, so the figures draw what the tests read."""
    keys = pd.MultiIndex.from_frame(runs[["experiment", "run"]])
    return df[pd.MultiIndex.from_frame(df[["experiment", "run"]]).isin(keys)]
