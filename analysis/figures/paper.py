"""The paper's figures (and the ablation figures it lacks): the registry and the CLI.

Every figure function takes the tidy frame from `analysis.load` and an output directory,
and writes `<stem>.png`, `<stem>.pdf` and `<stem>.csv` (or what its `SaveOptions` ask
for), the CSV holding exactly the numbers drawn, so a figure can be checked or redrawn
elsewhere without rerunning anything. A figure whose metrics are absent from the runs is
skipped with a logged message and returns no paths: a coupled-only sweep has no
prox-error metrics, a sweep with one correction has no corrections panel, and that is not
an error.

The figures live in `analysis.figures.steps` (per-step curves: Figs. 1, 3, 4, 5),
`analysis.figures.panels` (Fig. 2, staleness panel, approximation error) and
`analysis.figures.corrections_panel`; shared conventions in `analysis.plotting`.

Run as `python -m analysis.figures SWEEP_DIR... [--out DIR] [--wandb-project P]`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from analysis.figures.corrections_panel import corrections_panel
from analysis.figures.panels import approx_error, fig2_reward_wallclock, staleness_panel
from analysis.figures.steps import fig1_prox_time, fig3_entropy, fig4_importance_weight, fig5_clipped_tokens
from analysis.load import NoRunsError, disambiguate, load_runs, load_wandb
from analysis.markdown import print_written
from analysis.plotting import DEFAULT_SAVE, PALETTE, SaveOptions, colour, colour_map, linestyle  # noqa: F401
from analysis.summary import write_summary

log = logging.getLogger("analysis.figures")  # the same name when run as __main__

FIGURES: list[Callable[[pd.DataFrame, Path], list[Path]]] = [
    fig1_prox_time,
    fig2_reward_wallclock,
    fig3_entropy,
    fig4_importance_weight,
    fig5_clipped_tokens,
    staleness_panel,
    approx_error,
    corrections_panel,
]


def make_figures(df: pd.DataFrame, out_dir: str | Path, options: SaveOptions = DEFAULT_SAVE) -> list[Path]:
    """Every figure that the runs have data for; the paths written."""
    written: list[Path] = []
    for figure in FIGURES:
        written.extend(figure(df, Path(out_dir), options=options))
    return written


def load_sources(sweep_dirs: Sequence[Path], wandb_project: str | None = None,
                 wandb_entity: str | None = None) -> pd.DataFrame:
    """Local runs and a wandb project's runs in one frame. A run found in both (the same
    experiment and run name: the local directory and its wandb copy) is taken from the
    local directory only, so it is not counted twice."""
    local = load_runs(sweep_dirs) if sweep_dirs else None
    if not wandb_project:
        return local
    remote = load_wandb(wandb_project, entity=wandb_entity)
    if local is None:
        return remote
    keys = set(zip(local["experiment"], local["run"]))
    copies = [(e, r) in keys for e, r in zip(remote["experiment"], remote["run"])]
    if any(copies):
        log.info("%d wandb runs also found locally: the local copies are used", remote[copies]["run"].nunique())
    return disambiguate(pd.concat([local, remote[[not c for c in copies]]], ignore_index=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.figures",
        description="Load runs (sweep dirs, run dirs, a wandb project), write every figure with "
                    "its CSV, and the summary table.")
    parser.add_argument("sweep_dirs", nargs="*", type=Path, help="sweep or run directories (searched recursively)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <first SWEEP_DIR>/figures, or figures-<project>)")
    parser.add_argument("--wandb-project", default=None, help="also load the runs of this wandb project")
    parser.add_argument("--wandb-entity", default=None, help="wandb entity of --wandb-project")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.sweep_dirs and not args.wandb_project:
        parser.error("give at least one SWEEP_DIR or --wandb-project")

    try:
        df = load_sources(args.sweep_dirs, args.wandb_project, args.wandb_entity)
    except NoRunsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    out_dir = args.out or (args.sweep_dirs[0] / "figures" if args.sweep_dirs else Path(f"figures-{args.wandb_project}"))
    written = make_figures(df, out_dir)
    markdown, summary_paths = write_summary(df, out_dir)
    written.extend(summary_paths)
    print(markdown)
    return print_written(written)


if __name__ == "__main__":
    sys.exit(main())
