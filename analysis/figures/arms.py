"""Figures of a study whose arms (recompute and loglinear schedules) pair by seed, S6's first
(docs/studies/s6.md): seed means with min-max bands, one colour per arm, `<study>_*_d<d>.png`:

- `<study>_reward_d<d>`: the held-out reward against the policy version evaluated, and the rollout
  reward against the version that sampled the batch (step - staleness), so the arms' rewards
  line up by policy, not by step (at d = 8 the first nine batches all come from version 0);
- `<study>_anchor_free_d<d>`: what does not depend on the proximal anchor's definition, per
  training step: entropy, the total ratio pi_theta / pi_behave's max, KL(pi_behave || pi_theta)
  and the gradient norm;
- `<study>_clip_split_d<d>`: the clip excess split as the family's C1 and C2 split it: recompute's
  anchor on each arm's own batches (the trajectory) and the arm's own anchor minus recompute's
  on the same batches (the anchor alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.plotting import PALETTE, STEP_LABEL, Palette, band, legend, save, seed_note, seed_stats
from analysis.provenance import REPORT_FIGURES

ARMS = ("recompute", "inverse", "step_start")
STYLE = Palette({"recompute": PALETTE["recompute"], "inverse": PALETTE["loglinear"], "step_start": "#ff7f0e"},
                {"recompute": "-", "inverse": "-", "step_start": "--"})
VERSION_LABEL = "policy version"


def with_arms(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with an `arm` column: recompute, or the loglinear run's schedule name."""
    arm = np.where(df["algo"] == "recompute", "recompute",
                   np.where(df["algo"] == "loglinear", df["schedule"].astype(str), ""))
    return df.assign(arm=arm)


def by_version(df: pd.DataFrame) -> pd.DataFrame:
    """The rewards on a policy-version axis `x`: a held-out eval logged at step t read the
    policy after t's update (version t + 1); the rollout batch trained on at step t was sampled
    by version t - staleness/mean (the lagged runtime's batches share one staleness)."""
    keys = ["experiment", "run", "step"]
    lag = df[df["metric"] == "staleness/mean"].set_index(keys)["value"].rename("lag")
    evals = df[df["metric"] == "eval/reward"].assign(x=lambda f: f["step"] + 1)
    rollout = df[df["metric"] == "reward/mean"].join(lag, on=keys)
    rollout = rollout.assign(x=rollout["step"] - rollout["lag"]).drop(columns="lag")
    return pd.concat([evals, rollout], ignore_index=True)


def _draw(ax, frame: pd.DataFrame, metric: str, y_label: str, x_label: str, log_y: bool = False) -> pd.DataFrame:
    # one value per run and x first: at d = 8 the batches of steps 0-8 all come from version 0
    per_run = frame[frame["metric"] == metric].groupby(["arm", "seed", "x"], as_index=False)["value"].mean()
    data = seed_stats(per_run, ["arm", "x"])
    for arm in STYLE.order(set(data["arm"]) & set(ARMS)):
        curve = data[data["arm"] == arm]
        band(ax, curve["x"], curve["mean"], curve["min"], curve["max"], arm, STYLE, len(curve))
    if log_y:
        ax.set_yscale("log", nonpositive="mask")
    ax.grid(True, alpha=0.3)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    return data.assign(metric=metric)


def _figure(panels: Sequence[tuple[pd.DataFrame, str, str, str, bool]], title: str, out_dir: Path,
            stem: str) -> list[Path]:
    """Panels two to a row: (frame, metric, y label, x label, log y) each."""
    n_rows, n_cols = (len(panels) + 1) // 2, min(len(panels), 2)
    fig = Figure(figsize=(2.0 + 4.2 * n_cols, 0.6 + 3.4 * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    data = pd.concat([_draw(ax, *panel) for ax, panel in zip(axes, panels)], ignore_index=True)
    fig.suptitle(title + seed_note(data))
    legend(fig, STYLE.order(set(data["arm"]) & set(ARMS)), STYLE, title="arm")
    return save(fig, data, out_dir, stem, REPORT_FIGURES)


def _anchor_effect(df: pd.DataFrame) -> pd.DataFrame:
    """Per loglinear run and step: its own anchor's clip rate minus recompute's, same batches."""
    keys = ["experiment", "run", "step"]
    recompute = df[df["metric"] == "prox_error/recompute/clip_rate"].set_index(keys)["value"]
    own = df[(df["arm"] != "recompute") & (df["metric"] == "prox_error/" + df["arm"] + "/clip_rate")]
    return own.assign(value=own["value"].to_numpy() - recompute.reindex(own.set_index(keys).index).to_numpy(),
                      metric="anchor_effect")


def arm_figures(df: pd.DataFrame, staleness: int, out_dir: Path, study: str, title: str = "") -> list[Path]:
    """The three figures of `study`'s runs at `staleness` (PNG, for the report), their paths;
    `title` heads them (the study's name in capitals by default)."""
    cell = with_arms(df[df["staleness"] == staleness])
    cell = cell[cell["arm"].isin(ARMS)]
    if cell.empty:
        return []
    steps = cell.assign(x=cell["step"])
    versions = by_version(cell)
    d, stem, name = f"d = {staleness}", f"{study}_{{}}_d{staleness}", title or study.upper()
    return [
        *_figure([(versions, "eval/reward", "held-out reward", VERSION_LABEL + " evaluated", False),
                  (versions, "reward/mean", "rollout reward", VERSION_LABEL + " that sampled the batch", False)],
                 f"{name}, {d}: reward by policy version", out_dir, stem.format("reward")),
        *_figure([(steps, "actor/entropy", "entropy (nats per token)", STEP_LABEL, False),
                  (steps, "offpolicy/total_ratio_max", r"max $\pi_\theta / \pi_{behave}$ (log)", STEP_LABEL, True),
                  (steps, "offpolicy/kl_k3", r"KL($\pi_{behave} \| \pi_\theta$), k3", STEP_LABEL, False),
                  (steps, "actor/grad_norm", "gradient norm", STEP_LABEL, False)],
                 f"{name}, {d}: what does not depend on the anchor", out_dir, stem.format("anchor_free")),
        *_figure([(steps, "prox_error/recompute/clip_rate", "clip rate, recompute's anchor", STEP_LABEL, False),
                  (_anchor_effect(steps), "anchor_effect", "clip rate, own anchor - recompute's",
                   STEP_LABEL, False)],
                 f"{name}, {d}: the clip excess on each arm's own batches: trajectory (left), anchor alone (right)", out_dir,
                 stem.format("clip_split")),
    ]
