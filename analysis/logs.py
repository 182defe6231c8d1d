"""A sweep's run logs as one small archive that the analysis reads directly.

    python -m analysis.logs pack outputs/claims docs/logs/claims.tar.xz
    python -m analysis.logs pack outputs/s6 docs/logs/s6_d2.tar.xz --match '*-d2-*'
    python -m analysis.logs pack outputs/s6_stress carry.tar.xz --ended   # a running sweep's ended runs
    python -m analysis.logs unpack carry.tar.xz outputs                   # ... restored, to resume there

Each run directory below the sweep contributes its config.yaml, metrics.jsonl, finished.json (or
diverged.json) and train.log (no checkpoints, no launcher folders), under `<sweep name>/<run>/`;
`--match` keeps the runs whose directory name matches a shell pattern (one tier of a sweep that
shares a folder with another), `--ended` the runs that finished or diverged. `unpack` puts an
archive's runs back under an output root as run directories: a sweep rerun there finds them
ended and skips them, so the ended runs of a long sweep travel to a fresh machine or checkout
(a run still going has no checkpoint in the archive and is not packed by `--ended`). The
archive is deterministic (sorted members, fixed times and owners), so packing the same logs
twice gives the same bytes and git stores it once. Every loader in `analysis`
accepts such an archive where it accepts a folder (`analysis.load.find_run_dirs`): `python -m
analysis.report docs/logs/claims.tar.xz --out docs/reports/claims.md` regenerates a report from
the repository alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import tarfile
import tempfile
from pathlib import Path

__all__ = ["RUN_FILES", "ENDED_MARKERS", "ARCHIVE_SUFFIXES", "is_archive", "has_ended", "pack", "unpack",
           "unpacked", "main"]

# Written last by a run that finished / diverged: a3po.run.rundir.FINISHED_MARKER and
# a3po.run.health.DIVERGED_MARKER, spelled here so that packing logs imports no torch
# (tests/test_logs_carry.py holds them equal).
ENDED_MARKERS = ("finished.json", "diverged.json")
RUN_FILES = ("config.yaml", "metrics.jsonl", *ENDED_MARKERS, "train.log")
ARCHIVE_SUFFIXES = (".tar.xz", ".tar.gz", ".tgz")


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES)


def _run_dirs(sweep: Path) -> list[Path]:
    found = [p.parent for p in sweep.rglob("config.yaml")]
    return sorted(d for d in found if not any(part.startswith(".") or part in ("checkpoints", "wandb")
                                              for part in d.relative_to(sweep).parts))


def has_ended(run_dir: Path) -> bool:
    return any((run_dir / marker).is_file() for marker in ENDED_MARKERS)


def pack(sweep: str | Path, out: str | Path, match: str = "*", ended_only: bool = False) -> int:
    """Write the archive of every run below `sweep` whose directory name matches `match` (and,
    with `ended_only`, that finished or diverged); the number of runs packed."""
    sweep, out = Path(sweep), Path(out)
    runs = [d for d in _run_dirs(sweep)
            if fnmatch.fnmatchcase(d.name, match) and (has_ended(d) or not ended_only)]
    if not runs:
        raise FileNotFoundError(f"{sweep}: no run directory (a folder with a config.yaml) below it"
                                + ("" if match == "*" else f" whose name matches {match!r}")
                                + (" that has ended (finished.json or diverged.json)" if ended_only else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", format=tarfile.PAX_FORMAT) as archive:
        for run_dir in runs:
            for name in RUN_FILES:
                path = run_dir / name
                if not path.is_file():
                    continue
                data = path.read_bytes()
                info = tarfile.TarInfo(str(Path(sweep.name) / run_dir.relative_to(sweep) / name))
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                archive.addfile(info, io.BytesIO(data))
    return len(runs)


def unpack(archive: str | Path, output_root: str | Path) -> tuple[int, int]:
    """Put the archive's runs back as `<output_root>/<sweep name>/<run>/`; (restored, kept): a
    run directory that exists already is kept as it is, never overwritten. Each run appears
    whole or not at all (written beside its place, then renamed into it)."""
    source, output_root = unpacked(archive), Path(output_root)
    restored = kept = 0
    for run_dir in _run_dirs(source):
        target = output_root / run_dir.relative_to(source)
        if target.exists():
            kept += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        for path in run_dir.iterdir():
            (staging / path.name).write_bytes(path.read_bytes())
        staging.chmod(0o755)  # mkdtemp's is 0700: a restored run reads like one the sweep wrote
        staging.rename(target)
        restored += 1
    return restored, kept


def unpacked(archive: str | Path) -> Path:
    """The folder the archive's runs are read from: extracted once into the temp directory,
    under a name from the archive's content hash (a changed archive is extracted afresh)."""
    archive = Path(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "a3po-logs" / f"{archive.name.split('.')[0]}-{digest}"
    if (target / ".complete").exists():
        return target
    try:
        with tarfile.open(archive) as handle:
            handle.extractall(target, filter="data")
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ValueError(f"{archive}: not a readable log archive ({error}); pack one with "
                         "`python -m analysis.logs pack SWEEP_DIR OUT.tar.xz`") from None
    (target / ".complete").touch()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.logs", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="archive a sweep's run logs")
    packing.add_argument("sweep", type=Path)
    packing.add_argument("out", type=Path)
    packing.add_argument("--match", default="*", help="keep the runs whose directory name matches this shell "
                         "pattern, e.g. '*-d2-*' (default: every run)")
    packing.add_argument("--ended", action="store_true", help="keep the runs that finished or diverged "
                         "(a running sweep's, to carry them elsewhere with `unpack`)")
    unpacking = commands.add_parser("unpack", help="restore an archive's runs under an output root")
    unpacking.add_argument("archive", type=Path)
    unpacking.add_argument("output_root", type=Path)
    args = parser.parse_args(argv)
    return _unpack_command(args) if args.command == "unpack" else _pack_command(args)


def _os_error(error: OSError, flag: str, path: Path, allowed: str) -> str:
    """An OSError as one line: ours (no filename) as it is; the system's naming the path it hit
    and, where that is `path`, a folder above it or a path below it, the argument `flag` and
    what it allows."""
    if error.filename is None:
        return str(error)
    hit = Path(error.filename)
    where = f"{hit}: {error.strerror or error}"
    if hit == path or hit in path.parents or path in hit.parents:
        return f"{flag} {path}: cannot be used ({where}); {allowed}"
    return where


def _pack_command(args: argparse.Namespace) -> int:
    try:
        n = pack(args.sweep, args.out, args.match, args.ended)
    except OSError as error:  # no run to pack (ours), or OUT cannot be written (a folder, a file above it)
        print("error: " + _os_error(error, "OUT", args.out, "give the archive file to write, e.g. "
                                    f"docs/logs/NAME.tar.xz (allowed: {', '.join(ARCHIVE_SUFFIXES)})"))
        return 2
    print(f"wrote {args.out}: {n} runs, {args.out.stat().st_size / 1024:.0f} KiB")
    return 0


def _unpack_command(args: argparse.Namespace) -> int:
    if not is_archive(args.archive):
        print(f"error: {args.archive}: no such log archive (allowed: {', '.join(ARCHIVE_SUFFIXES)})")
        return 2
    if args.output_root.exists() and not args.output_root.is_dir():
        print(f"error: OUTPUT_ROOT {args.output_root}: not a folder; give a folder to restore the runs under "
              "(created where missing)")
        return 2
    try:
        restored, kept = unpack(args.archive, args.output_root)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    except OSError as error:  # OUTPUT_ROOT (or a folder on the way) is a file, or cannot be written
        print("error: " + _os_error(error, "OUTPUT_ROOT", args.output_root,
                                    "give a folder to restore the runs under (created where missing)"))
        return 2
    print(f"{args.archive}: {restored} runs restored under {args.output_root}, {kept} kept as they were")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
