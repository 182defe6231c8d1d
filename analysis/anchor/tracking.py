"""How closely each loglinear anchor tracks recompute's, from runs with
`train.log_prox_errors=true`: per schedule and staleness, the steady-state (steps >= d) mean
log-prob error and clip-flip rate, and S2's fidelity rules on them (docs/studies/alpha_schedules.md).
Read by the approx_quality report and the alpha-schedule study alike."""

from __future__ import annotations

import pandas as pd

from analysis.hypotheses import titled
from analysis.stats import mean_ci

KINDS = {"logp_abs": "log-prob error", "clip_flip": "clip flips"}


def schedule_table(df: pd.DataFrame) -> pd.DataFrame:
    """Rows: schedule; columns: (kind, d); values: mean over seeds of each run's steady-state mean."""
    errors = df[df["metric"].str.startswith("prox_error/") & (df["step"] >= df["staleness"])].copy()
    parts = errors["metric"].str.removeprefix("prox_error/").str.rsplit("/", n=1)
    errors["schedule"], errors["kind"] = parts.str[0], parts.str[1]
    errors = errors[errors["kind"].isin(list(KINDS))]
    per_run = errors.groupby(["run", "seed", "staleness", "schedule", "kind"])["value"].mean().reset_index()
    table = per_run.groupby(["schedule", "kind", "staleness"])["value"].mean().unstack(["kind", "staleness"])
    return table.sort_values(("logp_abs", table["logp_abs"].columns.max()))


def steady(df: pd.DataFrame, prefix: str) -> pd.DataFrame:
    return df[df["metric"].str.startswith(prefix) & (df["step"] >= df["staleness"])].copy()


def _per_seed(df: pd.DataFrame, schedule: str, kind: str) -> pd.Series:
    """(staleness, seed) -> a recompute run's steady-state mean of prox_error/<schedule>/<kind>."""
    rows = steady(df[df["algo"] == "recompute"], f"prox_error/{schedule}/{kind}")
    rows = rows[rows["metric"] == f"prox_error/{schedule}/{kind}"]
    return rows.groupby(["staleness", "seed"])["value"].mean()


def s2_verdicts(df: pd.DataFrame) -> list[str]:
    """docs/studies/alpha_schedules.md's fidelity rules. H-S2a per d and metric: the 95% t interval of the
    per-seed difference step_start - inverse; holds wholly below 0, does not hold wholly above,
    else inconclusive. H-S2c (where a `fitted` anchor is logged): the (seed, d) cells in which
    its error is below step_start's; decided only when all or none are."""
    lines = [f"{titled('H-S2a')}:", "",
             "| d | metric | seeds | step_start - inverse | 95% interval | verdict |", "|--:|---|--:|--:|---|---|"]
    for kind in ("logp_abs", "clip_flip"):
        diff = (_per_seed(df, "step_start", kind) - _per_seed(df, "inverse", kind)).dropna()
        for d, values in diff.groupby(level="staleness"):
            ci = mean_ci(values.tolist())
            verdict = ("holds" if ci.known and ci.high < 0 else "does not hold" if ci.known and ci.low > 0
                       else "inconclusive")
            lines.append(f"| {d} | {kind} | {ci.n} | {ci.mean:+.4f} | [{ci.low:+.4f}, {ci.high:+.4f}] | {verdict} |")
    fitted = _per_seed(df, "fitted", "logp_abs")
    if not fitted.empty:
        step_start = _per_seed(df, "step_start", "logp_abs").reindex(fitted.index)
        below = fitted < step_start
        verdict = "holds" if below.all() else "does not hold" if not below.any() else "undecided (mixed)"
        cells = ", ".join(f"d = {d} seed {seed}: {f:.4f} vs {s:.4f}" for (d, seed), f, s in
                          zip(fitted.index, fitted, step_start))
        lines += ["", f"{titled('H-S2c')}: {int(below.sum())} of "
                      f"{len(below)} (seed, d) cells: {verdict}. {cells}."]
    return lines + [""]


def schedule_markdown(table: pd.DataFrame) -> list[str]:
    columns = [(kind, d) for kind in KINDS for d in sorted(table[kind].columns)]
    head = "| schedule | " + " | ".join(f"{KINDS[kind]}, d = {d}" for kind, d in columns) + " |"
    rows = [f"| `{name}` | " + " | ".join(f"{100 * row[c]:.1f}%" if c[0] == "clip_flip" else f"{row[c]:.3f}"
                                           for c in columns) + " |" for name, row in table.iterrows()]
    return [head, "|---|" + "--:|" * len(columns), *rows]
