"""The anchor's effect on clipping alone (S3's H-S3d, docs/studies/mechanism.md): on each recompute
run's own batches and current policy, the share of tokens each loglinear anchor would clip
beside the share recompute's own anchor clips (`prox_error/<anchor>/clip_rate`, logged by
train.log_prox_errors), so the difference is the anchor's, not that of training on another
trajectory. Read by `python -m analysis.studies.mechanism`, whose report it is a section of."""

from __future__ import annotations

import re

import pandas as pd

from analysis.anchor.model import CLIP, RECOMPUTE, anchor_distance, prediction
from analysis.anchor.tracking import schedule_markdown, schedule_table
from analysis.claims.rule import FAILS, HOLDS
from analysis.hypotheses import titled
from analysis.markdown import fmt_interval, markdown_table
from analysis.runs import lookup, schedule_arm
from analysis.stats import mean_ci

__all__ = ["ARMS", "with_minibatches", "counterfactual_rates", "counterfactual_cells", "counterfactual_verdict", "counterfactual_section",
           "recompute_batches_lines"]

ARMS = ("inverse", "step_start")  # the loglinear schedules S3 compares with recompute
RATE = re.compile(r"^prox_error/(?P<anchor>[^/]+)/clip_rate(?:/(?P<stratum>H[123]))?$")
STRATA = ("", "H1", "H2", "H3")  # every valid token, then the entropy terciles (H1 lowest)


def with_minibatches(scalars: pd.DataFrame, configs: dict) -> pd.DataFrame:
    """The scalars of the S3 arms with their `arm` and minibatch count `m` (train.n_minibatches)."""
    arms = [schedule_arm(row) for _, row in scalars.iterrows()]
    out = scalars.assign(arm=[arm if arm in (RECOMPUTE, *ARMS) else None for arm in arms])
    out["m"] = [int(lookup(configs.get((e, r), {}), "train.n_minibatches", -1)) for e, r in
                zip(out["experiment"], out["run"])]
    return out[out["arm"].notna() & (out["m"] > 0)].reset_index(drop=True)


def counterfactual_rates(df: pd.DataFrame, configs: dict, d: int = 8) -> pd.DataFrame:
    """Per recompute run at `d` that logged the anchors' clip rates (train.log_prox_errors): its
    minibatch count `m`, seed, and for recompute's own anchor and each of ARMS the share of
    tokens that anchor would clip on the run's batches with the run's current policy, mean over
    steps >= d, over every valid token (stratum "") and per entropy tercile (H1-H3)."""
    rows = df[(df["algo"] == RECOMPUTE) & (df["staleness"] == d) & (df["step"] >= d)]
    parts = rows["metric"].str.extract(RATE)
    rows = rows.assign(anchor=parts["anchor"], stratum=parts["stratum"].fillna(""))
    rows = rows[rows["anchor"].isin([RECOMPUTE, *ARMS])]
    columns = ["experiment", "run", "seed", "m", "stratum", RECOMPUTE, *ARMS]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    per_run = rows.pivot_table(index=["experiment", "run", "seed", "stratum"], columns="anchor", values="value",
                               aggfunc="mean").reset_index()
    per_run["m"] = [int(lookup(configs.get((e, r), {}), "train.n_minibatches", -1))
                    for e, r in zip(per_run["experiment"], per_run["run"])]
    return per_run.reindex(columns=columns)


def counterfactual_cells(rates: pd.DataFrame) -> pd.DataFrame:
    """Per (m, arm, stratum): the per-seed difference arm - recompute of the clip rate on the
    same batches (a run is its own pair), its mean with a 95% t interval, and the direction:
    `more` (the interval wholly above 0), `less` (wholly below) or `undecided`."""
    records = []
    for m, at_m in rates.groupby("m", sort=True):
        for arm, stratum in ((arm, stratum) for arm in ARMS for stratum in STRATA):
            paired = at_m[at_m["stratum"] == stratum][[arm, RECOMPUTE]].dropna()
            if paired.empty:
                continue
            ci = mean_ci((paired[arm] - paired[RECOMPUTE]).tolist())
            direction = ("more" if ci.known and ci.low > 0 else "less" if ci.known and ci.high < 0 else "undecided")
            records.append({"m": int(m), "arm": arm, "stratum": stratum, "arm_rate": paired[arm].mean(),
                            "recompute_rate": paired[RECOMPUTE].mean(), "difference": ci, "direction": direction})
    return pd.DataFrame(records)


def counterfactual_verdict(cells: pd.DataFrame, counts: tuple[int, ...] = (2, 8)) -> str:
    """H-S3d (docs/studies/mechanism.md, Deviations): the inverse anchor clips more than recompute's on
    recompute's own batches at every m in `counts`: holds when it does at each, does not hold
    when it clips less at any, inconclusive otherwise (or not judged without those cells)."""
    whole = cells[(cells["arm"] == "inverse") & (cells["stratum"] == "")] if not cells.empty else cells
    directions = {int(m): row for m, row in zip(whole["m"], whole["direction"])} if not whole.empty else {}
    if not set(counts) <= set(directions):
        return f"not judged (no clip rates logged at m = {', '.join(str(m) for m in counts if m not in directions)})"
    found = [directions[m] for m in counts]
    return HOLDS if all(x == "more" for x in found) else FAILS if "less" in found else "inconclusive"


def counterfactual_section(df: pd.DataFrame, configs: dict, at_d: pd.DataFrame, d: int, beta: float) -> list[str]:
    """The report's section (markdown lines): the table per (m, anchor, tokens) with the model's
    call and the trained difference (`at_d`'s clip cells) beside, and H-S3d's verdict."""
    cells = counterfactual_cells(counterfactual_rates(df, configs, d))
    if cells.empty:
        return ["No recompute run at this d logged the anchors' clip rates (`prox_error/<anchor>/clip_rate`, "
                "train.log_prox_errors from the commit that added them): nothing to separate.", ""]
    trained = {(int(r["m"]), r["arm"]): r["effect"] for _, r in at_d.iterrows() if r["claim"] == CLIP} \
        if not at_d.empty else {}
    rows = []
    for _, c in cells.iterrows():
        model = prediction(anchor_distance(c["arm"], d, c["m"], beta), anchor_distance(RECOMPUTE, d, c["m"], beta))
        rows.append([str(c["m"]), f"`{c['arm']}`", c["stratum"] or "all", f"{100 * c['arm_rate']:.2f}%",
                     f"{100 * c['recompute_rate']:.2f}%", fmt_interval(c["difference"]), c["direction"],
                     model if not c["stratum"] else "",
                     trained.get((c["m"], c["arm"]), "") if not c["stratum"] else ""])
    table = markdown_table(["m", "anchor", "tokens", "anchor clips", "recompute's anchor clips",
                            "anchor - recompute [95% CI]", "direction", f"model's call (beta = {beta:.2f})",
                            "trained difference (g', arm's own runs)"], rows, numeric_from=99)
    return [f"On each recompute run's own batches and current policy, the share of tokens each anchor would clip "
            f"(`prox_error/<anchor>/clip_rate`), mean over steps >= {d}; the difference is paired within the run, "
            "then over seeds (95% t interval). This is the anchor's effect alone: the trained difference beside it "
            "(from the arm's own runs, whose policies differ) adds the effect of training on another trajectory. "
            "The terciles (H1 lowest entropy, H3 highest) show where the clipping is.", "", table, "",
            f"**{titled('H-S3d')}: {counterfactual_verdict(cells)}.**", ""]


def recompute_batches_lines(df: pd.DataFrame, configs: dict, d: int) -> list[str]:
    """Descriptive (markdown lines), on the recompute runs at `d`: how closely each loglinear
    anchor tracks recompute's (S2's log-prob error and clip flips, `analysis.anchor.tracking`)
    and what each of ARMS' anchors alone would clip on the same batches (S3's counterfactual)."""
    runs = df[(df["algo"] == RECOMPUTE) & (df["staleness"] == d)]
    cells = counterfactual_cells(counterfactual_rates(df, configs, d))
    if runs.empty or cells.empty:
        return [f"No recompute run at d = {d} logged the anchors' telemetry (train.log_prox_errors)."]
    tracked = runs["metric"].str.endswith("/logp_abs").any() and runs["metric"].str.endswith("/clip_flip").any()
    tracking = schedule_markdown(schedule_table(runs)) if tracked else ["(not logged)"]
    rows = [[str(c["m"]), f"`{c['arm']}`", c["stratum"] or "all", f"{100 * c['arm_rate']:.2f}%",
             f"{100 * c['recompute_rate']:.2f}%", fmt_interval(c["difference"]), c["direction"]]
            for _, c in cells.iterrows()]
    return [f"Each anchor against recompute's, on the recompute runs' own batches and current policy, mean over "
            f"steps >= {d} and then over seeds: the mean absolute log-prob error and the share of clip decisions "
            "it flips (S2's fidelity telemetry), by schedule:", "", *tracking, "",
            "The share of tokens each anchor alone would clip, against recompute's own anchor on the same tokens "
            "(S3's counterfactual; paired within each run, 95% t interval over seeds; H1-H3 the entropy terciles, "
            "H1 lowest):", "",
            markdown_table(["m", "anchor", "tokens", "anchor clips", "recompute's anchor clips",
                            "anchor - recompute [95% CI]", "direction"], rows, numeric_from=99)]
