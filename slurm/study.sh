#!/usr/bin/env bash
# Run (or resume) a pre-registered study's sweep on the local SLURM, from a frozen worktree, the
# way every study since S6 has run: one command a session, on a fresh machine or the same one.
#
#   slurm/study.sh EXPERIMENT COMMIT [HYDRA OVERRIDES...]     # e.g. slurm/study.sh s8_pilot 65b48ac
#   slurm/study.sh --pack EXPERIMENT                          # pack the ended runs into docs/logs/running/
#   slurm/study.sh --stop                                     # every running run checkpoints and exits
#
# It starts the local cluster if it is down (slurm/local_cluster.sh), makes a detached worktree of
# COMMIT at $A3PO_WORKTREES/EXPERIMENT-COMMIT (default /work/wt) if there is none, restores the
# ended runs packed in docs/logs/running/EXPERIMENT.tar.xz (never over a run directory that
# exists), and submits the experiment's sweep as an array of 1-thread jobs, two at a time, with
# output under $A3PO_STUDY_OUTPUTS (default ./outputs, outside the worktree) and the worktree on
# PYTHONPATH: edits to this checkout never reach a running job. Rerunning it resumes each run
# from its last checkpoint; ended runs exit at once. The submitting process blocks until the
# array ends (run it in the background: its log is $A3PO_STUDY_OUTPUTS/EXPERIMENT/submit.log).
# --stop holds the arrays, sends USR2 to the running tasks' job steps (not the batch shell, which
# dies of it): each run finishes its step and writes its checkpoint. It waits for them (up to
# 10 minutes, the studies' signal_delay_s), then cancels the arrays; the next submission resumes.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${A3PO_PYTHON:-$repo/.venv/bin/python}
outputs=$(realpath -m "${A3PO_STUDY_OUTPUTS:-$repo/outputs}")
worktrees=${A3PO_WORKTREES:-/work/wt}
running=${A3PO_RUNNING_LOGS:-$repo/docs/logs/running}   # where ended runs are carried between machines
export SLURM_CONF=${SLURM_CONF:-${A3PO_SLURM_DIR:-/tmp/a3po-slurm}/etc/slurm.conf}

usage() { sed -n '2,8p' "$0" >&2; exit 2; }

case "${1:-}" in
    --stop)
        # hold what waits, signal what runs, wait for each run's checkpoint, then cancel the arrays
        arrays=$(squeue -h -o "%F" | sort -u)
        for array in $arrays; do scontrol hold "$array" >/dev/null 2>&1 || true; done
        tasks=$(squeue -h -t R -o "%i")
        for task in $tasks; do scancel --signal=USR2 "$task" || true; done
        for _ in $(seq 120); do
            busy=""
            for task in $tasks; do
                state=$(squeue -h -j "$task" -o "%t" 2>/dev/null || true)
                case "$state" in R|CG) busy="$busy $task" ;; esac
            done
            [ -z "$busy" ] && break
            sleep 5
        done
        for array in $arrays; do scancel "$array" 2>/dev/null || true; done
        echo "study.sh: stopped; each run resumes from its checkpoint at the next submission" >&2
        exit 0 ;;
    --pack)
        [ $# -eq 2 ] || usage
        mkdir -p "$running"
        "$python" -m analysis.logs pack "$outputs/$2" "$running/$2.tar.xz" --ended
        exit 0 ;;
    ""|-*) usage ;;
esac
[ $# -ge 2 ] || usage
experiment=$1 commit=$2
shift 2

if ! bash "$repo/slurm/local_cluster.sh" status >/dev/null 2>&1; then
    bash "$repo/slurm/local_cluster.sh" start >/dev/null
fi
tree=$worktrees/$experiment-$commit
if [ ! -d "$tree" ]; then
    mkdir -p "$worktrees"
    git -C "$repo" worktree add --detach "$tree" "$commit" >/dev/null
fi
[ "$(git -C "$tree" rev-parse HEAD)" = "$(git -C "$repo" rev-parse "$commit^{commit}")" ] || {
    echo "study.sh: $tree is not at $commit" >&2; exit 2; }
carried=$running/$experiment.tar.xz
if [ -f "$carried" ]; then
    "$python" -m analysis.logs unpack "$carried" "$outputs"
fi
mkdir -p "$outputs/$experiment"
cd "$tree"
echo "study.sh: $experiment from $tree ($commit), outputs in $outputs/$experiment" >&2
OMP_NUM_THREADS=1 PYTHONPATH=$tree PYTHONUNBUFFERED=1 exec "$python" experiments/train.py -m \
    "experiment=$experiment" hydra/launcher=slurm_local \
    hydra.launcher.timeout_min=180 hydra.launcher.signal_delay_s=600 hydra.launcher.max_num_timeout=30 \
    "output_root=$outputs" "$@"
