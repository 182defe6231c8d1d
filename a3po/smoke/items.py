"""The smoke items, in the order they run, and the command each runs. Training items are
2-step runs of experiments/train.py into the item's own output root; an item that needs more
GPUs than are visible is skipped with the reason, one whose software or data is absent
(vLLM, the SmolLM2 weights, GSM8K) is skipped by its precondition."""

from __future__ import annotations

import sys
from pathlib import Path

from a3po.smoke import checks
from a3po.smoke.runner import Item

TRAIN = "experiments/train.py"
BENCHMARK = "experiments/benchmark.py"
STEPS = 2
# A short run: 4 prompts x 4 samples in 2 minibatches (8 samples, so up to 8 ranks each get
# one), an eval and a checkpoint after the last step.
SHORT_RUN = ("logger=none", f"train.total_steps={STEPS}", "train.n_prompts=4", "train.n_samples=4",
             "train.n_minibatches=2", f"train.eval_every={STEPS}", "train.eval_size=4",
             f"train.checkpoint_every={STEPS}", "rollout.max_new_tokens=16")
# The paper's shape (conf/experiment/paper_gsm8k.yaml: GSM8K, vLLM, runtime=async, 4 samples in
# 4 minibatches) on SmolLM2-135M, with few prompts and short responses.
PAPER_SHAPED = ("experiment=paper_gsm8k", "model=smollm2_135m", "logger=none", f"train.total_steps={STEPS}",
                "train.n_prompts=8", f"train.eval_every={STEPS}", "train.eval_size=8",
                f"train.checkpoint_every={STEPS}", "rollout.max_new_tokens=64")
BENCHMARK_SHAPE = ("device=cuda", "model=smollm2_135m", "train.n_prompts=4", "train.n_samples=4", "--prompt-len", "48",
                   "--response-len", "32", "--reps", "2", "--no-optimizer-kernels", "--no-progress")
VLLM_RUN = ("model=smollm2_135m", "rollout=vllm", "device=cuda")
MAX_FSDP_GPUS = 8
TIMEOUT_S = {"tiny": 300, "smollm2": 600, "behave-logp": 600, "vllm": 900, "fsdp2": 600, "paper": 1200,
             "benchmark": 900}
ITEM_NAMES = ("tiny-fp32", "tiny-bf16", "smollm2-fp32", "smollm2-bf16", "behave-logp", "vllm-inprocess",
              "vllm-child", "vllm-child-torchrun", "vllm-child-torchrun-gpu", "fsdp2-nccl", "fsdp2-nccl-1rank",
              "paper-shaped", "benchmark-cuda")


def torchrun(python: str, processes: int) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]


def need(python: str, what: str, *overrides: str) -> list[str]:
    return [python, "-m", "a3po.smoke.probes", "need", what, *overrides]


def too_few_gpus(required: int, visible: int, what: str) -> str | None:
    if visible >= required:
        return None
    return f"{what} needs at least {required} GPUs; {visible} visible"


def fsdp_processes(gpus: int) -> int:
    """One rank a GPU, 2 to 8 of them."""
    return min(max(gpus, 2), MAX_FSDP_GPUS)


class _Builder:
    def __init__(self, work: Path, gpus: int, python: str) -> None:
        self.work, self.gpus, self.python = work, gpus, python

    def run(self, name: str, overrides: tuple[str, ...] | list[str], *, timeout: str, processes: int = 1,
            min_gpus: int = 1, needs: tuple[str, ...] = (), precision: str | None = None,
            vllm_child: bool = False, shape: tuple[str, ...] = SHORT_RUN, what: str = "") -> Item:
        """A 2-step training run of `overrides`, checked by checks.training_run."""
        out = self.work / name
        launcher = [self.python, TRAIN] if processes == 1 else [*torchrun(self.python, processes), TRAIN]
        return Item(name, [*launcher, *overrides, *shape, f"output_root={out}"],
                    checks.training_run(STEPS, precision, vllm_child), TIMEOUT_S[timeout], out,
                    needs=[need(self.python, n) for n in needs],
                    skip=too_few_gpus(min_gpus, self.gpus, what or name))


def build_items(work: Path, gpus: int, *, python: str = sys.executable, gsm8k_path: str | None = None) -> list[Item]:
    """Every item, in order, for a machine with `gpus` visible GPUs; outputs under `work`."""
    b = _Builder(work, gpus, python)
    data = [f"task.path={gsm8k_path}"] if gsm8k_path else []
    items = [
        b.run("tiny-fp32", ("model=tiny", "device=cuda", "precision=fp32"), timeout="tiny", precision="fp32"),
        b.run("tiny-bf16", ("model=tiny", "device=cuda", "precision=bf16"), timeout="tiny", precision="bf16"),
        b.run("smollm2-fp32", ("model=smollm2_135m", "device=cuda", "precision=fp32"), timeout="smollm2",
              needs=("smollm2",), precision="fp32"),
        b.run("smollm2-bf16", ("model=smollm2_135m", "device=cuda", "precision=bf16"), timeout="smollm2",
              needs=("smollm2",), precision="bf16"),
        Item("behave-logp", [python, "-m", "a3po.smoke.probes", "behave-logp",
                             str(work / "behave-logp" / "behave_logp.json"), "model=smollm2_135m"],
             checks.behave_logp, TIMEOUT_S["behave-logp"], work / "behave-logp", needs=[need(python, "smollm2")]),
        b.run("vllm-inprocess", VLLM_RUN, timeout="vllm", needs=("vllm", "smollm2")),
        b.run("vllm-child", (*VLLM_RUN, "rollout.device=cuda:1"), timeout="vllm", min_gpus=2,
              needs=("vllm", "smollm2"), vllm_child=True, what="vLLM on a GPU of its own (cuda:1)"),
        b.run("vllm-child-torchrun", VLLM_RUN, timeout="vllm", processes=2, min_gpus=2, needs=("vllm", "smollm2"),
              vllm_child=True, what="vLLM beside 2 torchrun ranks"),
        b.run("vllm-child-torchrun-gpu", (*VLLM_RUN, "rollout.device=cuda:2"), timeout="vllm", processes=2,
              min_gpus=3, needs=("vllm", "smollm2"), vllm_child=True,
              what="vLLM on its own GPU (cuda:2) beside 2 torchrun ranks"),
        b.run("fsdp2-nccl", ("model=tiny", "device=cuda"), timeout="fsdp2", processes=fsdp_processes(gpus),
              min_gpus=2, what="FSDP2 over nccl (one rank a GPU)"),
        Item("fsdp2-nccl-1rank", [python, "-m", "a3po.smoke.probes", "fsdp-one-rank",
                                  str(work / "fsdp2-nccl-1rank" / "fsdp.json")],
             checks.fsdp_one_rank, TIMEOUT_S["fsdp2"], work / "fsdp2-nccl-1rank"),
        _paper_item(b, data),
        Item("benchmark-cuda", [python, BENCHMARK, *BENCHMARK_SHAPE, "--out", str(work / "benchmark-cuda")],
             checks.benchmark_report, TIMEOUT_S["benchmark"], work / "benchmark-cuda",
             needs=[need(python, "smollm2")]),
    ]
    assert tuple(item.name for item in items) == ITEM_NAMES
    return items


def _paper_item(b: _Builder, data: list[str]) -> Item:
    item = b.run("paper-shaped", PAPER_SHAPED, timeout="paper", needs=("vllm", "smollm2"), shape=tuple(data))
    item.needs.append(need(b.python, "gsm8k", *data))  # last: it loads the data set, the slowest
    return item


def select(items: list[Item], only: list[str] | None) -> list[Item]:
    """The items `only` names (all when None), in the order they run; an unknown name is a ValueError."""
    if only is None:
        return items
    unknown = sorted(set(only) - set(ITEM_NAMES))
    if unknown:
        raise ValueError(f"unknown item(s) {', '.join(unknown)}; allowed: {', '.join(ITEM_NAMES)}")
    return [item for item in items if item.name in only]
