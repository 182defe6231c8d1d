"""The one-call GPU check's items, in the order they run, each with its budget (its timeout, in
seconds), the command its subprocess runs and how its result is checked (a3po.smoke.runner's
Item). On the GPU each runs its code on cuda:0; in the dry run (`dry_run=True`) the same list
runs its CPU stand-ins, and the smoke's items are listed as skipped.

1. trainer-rank0-of-2: the multi-rank trainer code over a world-1 nccl group (gloo dry), the
   trainer told it is rank 0 of 2 (a3po.smoke.gpu_check_step).
2. qwen1.5b-step: one step at Qwen2.5-1.5B's exact sizes with gpu1's settings beside vLLM's
   stand-in block, default allocator: peak allocated/reserved GiB, allocator retries.
3. resume: a run stopped after 2 of 3 steps and run again (a3po.smoke.gpu_check_probes).
4. async-runtime: runtime=async, rollout and trainer on the one device, 3 steps.
5. pytest-gpu: `pytest -m gpu` over the test files that hold gpu-marked tests.
6. smoke-*: the GPU smoke test's items that need no vLLM (a3po.smoke.items).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from a3po.smoke import checks
from a3po.smoke.items import ITEM_NAMES as SMOKE_ITEM_NAMES
from a3po.smoke.items import build_items as build_smoke_items
from a3po.smoke.probes import _version
from a3po.smoke.runner import REPO, Item, SmokeFailure

PROBES = "a3po.smoke.gpu_check_probes"
ASYNC_STEPS = 3
# The smoke's items that need no vLLM (the SmolLM2 ones skip where its weights are absent,
# fsdp2-nccl where one GPU is visible), with their budgets here.
SMOKE_BUDGETS_S = {"tiny-fp32": 40, "tiny-bf16": 40, "smollm2-fp32": 45, "smollm2-bf16": 45, "behave-logp": 45,
                   "fsdp2-nccl": 60, "fsdp2-nccl-1rank": 35, "benchmark-cuda": 60}
BUDGETS_S = {"trainer-rank0-of-2": 45, "qwen1.5b-step": 120, "resume": 60, "async-runtime": 45, "pytest-gpu": 60,
             **{f"smoke-{name}": seconds for name, seconds in SMOKE_BUDGETS_S.items()}}
ITEM_NAMES = tuple(BUDGETS_S)
MACHINE_BUDGET_S = 30
TOTAL_BUDGET_S = 480  # 8 minutes, the machine probe and every item included
DRY_RUN_SLACK = 2  # the dry run's limits: the budgets times this (2 CPU cores)
# The wheels the check needs besides torch (>= 2.11) and transformers (the project's range),
# pure Python, installed with --no-deps on a machine without network (docs/gpus.md).
WHEELS = ("hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3", "math-verify==0.9.0",
          "latex2sympy2_extended==1.11.0", "pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1",
          "pygments==2.21.0", "packaging==26.4")
IMAGE = {"torch": "2.11", "transformers": "5.16.1"}  # what the machine must have already: at least these
FAIL_ENV = "A3PO_GPU_CHECK_FAIL"  # names of items whose check fails on purpose (the tests of the check)

assert set(SMOKE_BUDGETS_S) == {n for n in SMOKE_ITEM_NAMES if not n.startswith("vllm") and n != "paper-shaped"}


def requirements() -> dict[str, Any]:
    """Each named wheel's and the image's distributions' installed versions (None: absent)."""
    names = [wheel.split("==")[0] for wheel in WHEELS]
    return {"wheels": {name: _version(name) for name in names},
            "image": {name: {"installed": _version(name), "at_least": least} for name, least in IMAGE.items()}}


def gpu_test_files(tests: Path = REPO / "tests") -> list[str]:
    """The test files holding a gpu-marked test, relative to the repository."""
    return sorted(str(p.relative_to(REPO)) for p in tests.glob("test_*.py") if "@pytest.mark.gpu" in p.read_text())


# ------------------------------------------------------------------ checks
def probe_check(validate: Callable[[dict[str, Any]], None] | None = None) -> checks.Check:
    """The figures a probe wrote to its item's work dir (OUT.json), after `validate` (raises SmokeFailure)."""

    def check(work: Path, output: str) -> dict[str, Any]:
        figures = json.loads((work / "out.json").read_text())
        if validate is not None:
            validate(figures)
        return figures

    return check


def standin_counted(figures: dict[str, Any]) -> None:
    """On the GPU the peak includes vLLM's stand-in block: otherwise it was not allocated beside the step."""
    peak, block = figures.get("peak_allocated_gib"), figures.get("vllm_standin_gib") or 0.0
    if peak is not None and peak < block:
        raise SmokeFailure(f"peak allocated {peak:.2f} GiB is below vLLM's stand-in block ({block:.2f} GiB)")


def async_run(root: Path, output: str) -> dict[str, Any]:
    """training_run's figure for the async run, with the last step's largest token staleness."""
    from a3po.run.metrics_log import read_metrics

    figure = checks.training_run(ASYNC_STEPS)(root, output)
    last = read_metrics(checks.the_run_dir(root) / "metrics.jsonl")[-1]
    return {**figure, "staleness_max": last.get("staleness/max")}


def pytest_counts(dry_run: bool) -> checks.Check:
    """pytest's closing counts: on a GPU a gpu-marked test passed and none skipped; dry, they were collected."""

    def check(work: Path, output: str) -> dict[str, Any]:
        closing = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected)", line)]
        found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)\b", closing[-1] if closing else "")
        counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in found}
        if dry_run and counts.get("passed", 0) + counts.get("skipped", 0) == 0:
            raise SmokeFailure(f"no gpu-marked test was collected: {counts}")
        if not dry_run and (not counts.get("passed") or counts.get("skipped")):
            raise SmokeFailure(f"on a GPU every gpu-marked test must run and pass: {counts}")
        return counts

    return check


# ------------------------------------------------------------------ the items
def _probe(name: str, work: Path, dry_run: bool, check: checks.Check, needs: list[list[str]] = ()) -> Item:
    command = [sys.executable, "-m", PROBES, name, str(work / name / "out.json"), *(["--dry-run"] if dry_run else [])]
    return Item(name, command, check, BUDGETS_S[name], work / name, needs=list(needs))


def _smoke(work: Path, gpus: int, dry_run: bool) -> list[Item]:
    if dry_run:
        return [Item(f"smoke-{name}", [], probe_check(), BUDGETS_S[f"smoke-{name}"], work / f"smoke-{name}",
                     skip="dry run: the smoke's items run on CUDA only (experiments/gpu_smoke.py)")
                for name in SMOKE_BUDGETS_S]
    items = [item for item in build_smoke_items(work / "smoke", gpus) if item.name in SMOKE_BUDGETS_S]
    weights = [sys.executable, "-m", PROBES, "need-smollm2-weights"]
    for item in items:
        item.timeout_s, item.name = SMOKE_BUDGETS_S[item.name], f"smoke-{item.name}"
        if any(need[-1] == "smollm2" for need in item.needs):  # the smoke's own need passes on a tokenizer alone
            item.needs.insert(0, weights)
    return items


def _failing(item: Item) -> Item:
    """`item` with a check that fails after the real one (FAIL_ENV: the check's own tests)."""
    real = item.check

    def check(work: Path, output: str) -> dict[str, Any]:
        real(work, output)
        raise SmokeFailure(f"failed on purpose: {FAIL_ENV} names {item.name}")

    item.check = check
    return item


def build_items(work: Path, *, dry_run: bool, gpus: int = 1, fail: tuple[str, ...] = ()) -> list[Item]:
    """Every item, in order, with its budget as its timeout (times DRY_RUN_SLACK in the dry run)."""
    from a3po.smoke.gpu_check_probes import tiny_run

    tokenizer = [[sys.executable, "-m", PROBES, "need-tokenizer"]]
    async_command = tiny_run(dry_run, work / "async-runtime", "runtime=async", "staleness=1",
                             f"train.total_steps={ASYNC_STEPS}", "train.checkpoint_every=0")
    items = [
        _probe("trainer-rank0-of-2", work, dry_run, probe_check()),
        _probe("qwen1.5b-step", work, dry_run, probe_check(standin_counted)),
        _probe("resume", work, dry_run, probe_check(), needs=tokenizer),
        Item("async-runtime", async_command, async_run, BUDGETS_S["async-runtime"], work / "async-runtime",
             needs=tokenizer),
        Item("pytest-gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                            *gpu_test_files()], pytest_counts(dry_run), BUDGETS_S["pytest-gpu"], work / "pytest-gpu"),
        *_smoke(work, gpus, dry_run),
    ]
    assert tuple(item.name for item in items) == ITEM_NAMES
    for item in items:
        item.timeout_s *= DRY_RUN_SLACK if dry_run else 1
    return [_failing(item) if item.name in fail else item for item in items]
