"""The claims report: a sweep's verdict on each of the A-3PO paper's claims, as markdown.

    python -m analysis.report SWEEP_DIR [MORE_DIRS...] --out docs/results.md [--figures-dir docs/results]

writes one markdown file: where the numbers come from (runs, steps, seeds, the settings
that matter, compute spent, contention, the run directories skipped and why), how verdicts
are decided (`analysis.claims`), one claims table per context (staleness level, plus runtime/correction/objective where they
differ from the paper's setup) with a second table beside it (power, IQM, probability of
improvement: `analysis.claims_power`) and the same robust statistics across d, the figures (small PNGs only, linked relatively, so the
file renders on GitHub and the repository stays small) and the full summary table. A claim
the sweep cannot judge says so and why; nothing is left out silently.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from a3po.identity import LEGACY_VALUES
from analysis.claims import __doc__ as CLAIMS_DOC
from analysis.claims import evaluate_claims
from analysis.claims_markdown import claims_markdown
from analysis.claims_power import __doc__ as BESIDE_DOC
from analysis.figures import make_figures
from analysis.identity import lookup
from analysis.load import NoRunsError, RunSkippedWarning, load_configs, load_runs
from analysis.markdown import fmt, print_written
from analysis.plotting import SaveOptions
from analysis.scalars import run_scalars
from analysis.summary import summary_markdown, summary_table

log = logging.getLogger("analysis.report")

REPORT_FIGURES = SaveOptions(formats=("png",), dpi=80)

# The settings a reader needs to know to compare this sweep with the paper.
PROVENANCE_KEYS = [
    ("model", "model.name"), ("model path", "model.path"), ("task", "task.name"), ("task level", "task.level"),
    ("prompts per step", "train.n_prompts"), ("samples per prompt", "train.n_samples"), ("lr", "train.lr"),
    ("max new tokens", "rollout.max_new_tokens"), ("rollout engine", "rollout.name"),
    ("minibatches per step", "train.n_minibatches"),
    ("token budget", "train.token_budget"), ("total steps", "train.total_steps"), ("device", "device"),
    ("precision", "precision"),
]


def _values(configs: Mapping[Any, Mapping[str, Any]], dotted: str) -> str:
    """The distinct values of a setting across runs, with how many runs have each."""
    # a key older runs lack counts as the value they used (a3po.identity.LEGACY_VALUES: fp32)
    default = LEGACY_VALUES.get(dotted, "(unset)")
    counts = Counter(str(lookup(config, dotted, default)) for config in configs.values())
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{value} ({n} runs)" for value, n in sorted(counts.items()))


def _compute_lines(scalars: pd.DataFrame) -> list[str]:
    total_train, total_wall = scalars["train_time_s"].sum(), scalars["wall_time_s"].sum()
    with_cpu = scalars[~scalars["cpu_missing"]]
    cpu = f"{fmt(with_cpu['cpu_time_s'].sum() / 3600, 3)} h over {len(with_cpu)} runs" if len(with_cpu) else "not logged"
    flagged = scalars[scalars["contended"]]
    names = ", ".join(sorted(flagged["run"])[:10]) + (" ..." if len(flagged) > 10 else "")
    lines = [f"- compute: training time (sum of time/step) {fmt(total_train / 3600, 3)} h; CPU time {cpu}; "
             f"wall time at the last step, summed over runs, {fmt(total_wall / 3600, 3)} h",
             f"- contention (wall/CPU > 1.25, under 0.8 of a core): {len(flagged)} of {len(scalars)} runs"
             + (f" ({names})" if len(flagged) else "")]
    if "shared_device" in scalars and scalars["shared_device"].any():
        shared = sorted(scalars[scalars["shared_device"]]["run"])
        lines.append(f"- rollout and training shared one CUDA device (runtime/shared_device): {len(shared)} runs "
                     f"({', '.join(shared[:10])}{' ...' if len(shared) > 10 else ''}); their time/rollout, "
                     "time/prox_logp and time/train overlap and do not compare with runs on separate devices")
    if scalars["cpu_missing"].any():
        lines.append(f"- CPU time missing (logs without time/step_cpu): {int(scalars['cpu_missing'].sum())} runs")
    return lines


# At most this many skipped run directories are named in the provenance; the rest are counted.
SKIPPED_SHOWN = 10


def _shown_path(path: str, sources: Sequence[Path]) -> str:
    """A run directory as the reader gave its source (`outputs/x/run`), not as resolved."""
    for source in sources:
        try:
            return (source / Path(path).relative_to(source.resolve())).as_posix()
        except ValueError:
            continue
    return path


def skipped_line(skipped: Sequence[tuple[str, str]], sources: Sequence[Path]) -> str:
    """How many run directories were left out and why (`load_runs`' `df.attrs["skipped"]`)."""
    if not skipped:
        return "- skipped run directories: none"
    named = "; ".join(f"`{_shown_path(path, sources)}`: {reason}" for path, reason in skipped[:SKIPPED_SHOWN])
    more = f"; and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
    return f"- skipped run directories: {len(skipped)}, not in any number below ({named}{more})"


def provenance(sources: Sequence[Path], scalars: pd.DataFrame, configs: Mapping[Any, Mapping[str, Any]],
               skipped: Sequence[tuple[str, str]] = ()) -> str:
    """Where the numbers come from: sources, runs, steps, seeds, settings, compute, and the
    run directories that were skipped (`(path, reason)` pairs)."""
    incomplete = int((~scalars["complete"].astype(bool)).sum())
    used = {key: config for key, config in configs.items() if key in set(zip(scalars["experiment"], scalars["run"]))}
    lines = [
        f"- sources: {', '.join(f'`{s}`' for s in sources)}",
        f"- runs: {len(scalars)} ({incomplete} incomplete, counted up to their last step); experiments: "
        f"{', '.join(sorted(set(scalars['experiment'])))}",
        skipped_line(skipped, sources),
        f"- labels: {', '.join(sorted(set(scalars['label'])))}",
        f"- staleness levels: {', '.join(str(d) for d in sorted(set(scalars['staleness'])))}; seeds: "
        f"{', '.join(str(s) for s in sorted(set(scalars['seed'])))}",
        f"- steps logged per run: {scalars['n_steps'].min()} to {scalars['n_steps'].max()}",
    ]
    runtimes = Counter(scalars["runtime"])
    lines.append("- runtime: " + ", ".join(f"{name} ({n} runs)" for name, n in sorted(runtimes.items())))
    lines += [f"- {name}: {_values(used, key)}" for name, key in PROVENANCE_KEYS]
    return "\n".join(lines + _compute_lines(scalars))


def figures_markdown(paths: Sequence[Path], relative_to: Path) -> str:
    lines = []
    for path in paths:
        if path.suffix == ".png":
            link = Path(os.path.relpath(path, relative_to)).as_posix()
            lines += [f"![{path.stem}]({link})", ""]
    return "\n".join(lines) if lines else "No figure could be drawn from these runs."


def _rule_text() -> str:
    """The verdict rule and what is shown beside it, from the docstrings of
    `analysis.claims` and `analysis.claims_power` (one definition, two readers)."""
    rule = "Effect and its interval." + CLAIMS_DOC.split("Effect and its interval.", 1)[1].rstrip()
    beside = "Beside the verdict." + BESIDE_DOC.split("Beside the verdict.", 1)[1].rstrip()
    return rule + "\n\n" + beside


def build_report(sources: Sequence[Path], df: pd.DataFrame, configs: Mapping[Any, Mapping[str, Any]],
                 figure_paths: Sequence[Path], out: Path, command: str) -> str:
    scalars = run_scalars(df)
    claims = evaluate_claims(df, scalars)
    verdicts = Counter(v.split(" (")[0] for v in claims["verdict"]) if len(claims) else Counter()
    tally = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) or "none judged"
    return "\n".join([
        "# A-3PO's claims, checked against this sweep", "",
        f"Generated by `{command}`; regenerate rather than edit. Verdicts: {tally}.", "",
        "## Provenance", "", provenance(sources, scalars, configs, df.attrs.get("skipped", ())), "",
        "## How a verdict is decided", "",
        "Each claim compares loglinear (A-3PO) with recompute at the same staleness d (and correction, "
        "objective, runtime), both with the default schedule; coupled is shown for reference. Values: mean ± "
        "95% CI half-width over seeds (Student t; `(n=1)`: one seed, no interval).", "",
        _rule_text(), "",
        "## Claims", "", claims_markdown(claims), "",
        "## Figures", "", figures_markdown(figure_paths, out.parent), "",
        summary_markdown(summary_table(df)).replace("## This sweep", "## Summary table", 1),
    ])


def deviations_section(study: Path) -> str:
    """The "## Deviations" section of a pre-registration (docs/study.md), to end a report with:
    every departure from the plan is listed in the report it affects."""
    text = study.read_text(encoding="utf-8")
    if "\n## Deviations" not in text:
        raise ValueError(f"{study}: no '## Deviations' section; --deviations takes a pre-registration page")
    body = text.split("\n## Deviations", 1)[1].partition("\n")[2].split("\n## ", 1)[0].strip()
    return f"## Deviations from the pre-registration (`{study}`)\n\n{body}"


def write_report(sources: Sequence[str | Path], out: str | Path, figures_dir: str | Path | None = None,
                 command: str | None = None, deviations: str | Path | None = None) -> tuple[str, list[Path]]:
    """Load the runs below `sources`, write the figures (PNG) and the report (ending with the
    `deviations` page's Deviations section, where given); returns the markdown and every path
    written."""
    sources = [Path(s) for s in sources]
    out = Path(out)
    figures_dir = Path(figures_dir) if figures_dir else out.parent / out.stem
    df = load_runs(sources)
    with warnings.catch_warnings():  # load_runs has warned about every run directory it skipped
        warnings.simplefilter("ignore", RunSkippedWarning)
        configs = load_configs(sources)
    figure_paths = make_figures(df, figures_dir, options=REPORT_FIGURES)
    command = command or "python -m analysis.report " + " ".join(str(s) for s in sources) + f" --out {out}"
    markdown = build_report(sources, df, configs, figure_paths, out, command)
    if deviations:
        markdown += "\n\n" + deviations_section(Path(deviations))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown + "\n", encoding="utf-8")
    return markdown, [*figure_paths, out]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path, help="sweep or run directories (searched recursively)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default: <first SWEEP_DIR>/results.md)")
    parser.add_argument("--figures-dir", type=Path, default=None,
                        help="where the PNGs go (default: beside --out, named after it: docs/results.md -> docs/results)")
    parser.add_argument("--deviations", type=Path, default=None,
                        help="a pre-registration page (docs/study.md) whose Deviations section ends the report")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = args.out or args.sweep_dirs[0] / "results.md"
    shown = " ".join(str(s) for s in args.sweep_dirs) + f" --out {out}"
    if args.figures_dir:
        shown += f" --figures-dir {args.figures_dir}"
    if args.deviations:
        shown += f" --deviations {args.deviations}"
        try:
            deviations_section(args.deviations)  # a missing page or section fails before any loading
        except (ValueError, OSError) as error:
            print(f"error: --deviations: {error}", file=sys.stderr)
            return 2
    try:
        _, written = write_report(args.sweep_dirs, out, args.figures_dir, command=f"python -m analysis.report {shown}",
                                  deviations=args.deviations)
    except NoRunsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return print_written(written)


if __name__ == "__main__":
    sys.exit(main())
