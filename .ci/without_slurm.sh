#!/usr/bin/env bash
# The launcher tests and the collection of the whole suite with SLURM's commands absent from PATH
# (issue: `make test` failed on a fresh machine without SLURM because submitit probed for srun).
# PATH is a fresh directory holding links to the few tools the tests call, none of SLURM's; the
# step fails if srun, sbatch or squeue can be found through it, or if any launcher test fails or
# skips.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
for tool in git sh bash env uname nproc; do
    if command -v "$tool" >/dev/null; then ln -s "$(command -v "$tool")" "$bin/$tool"; fi
done
python=$(realpath -s .venv/bin/python)
for cmd in srun sbatch squeue; do
    if PATH=$bin command -v "$cmd" >/dev/null; then echo "without_slurm: $cmd is on PATH" >&2; exit 1; fi
done
PATH=$bin "$python" -m pytest -q -p no:cacheprovider tests/test_slurm_launcher.py -rs | tee "$bin/launcher.log"
if grep -q "skipped" "$bin/launcher.log"; then echo "without_slurm: a launcher test skipped" >&2; exit 1; fi
PATH=$bin "$python" -m pytest -q -p no:cacheprovider --collect-only >/dev/null
echo "without_slurm: launcher tests passed and the suite collects with no SLURM on PATH"
