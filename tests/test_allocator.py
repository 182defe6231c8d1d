"""a3po.allocator: freed host memory is reused without the kernel faulting its pages in again."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

SCRIPT = """
import resource, sys, torch
from a3po.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory() and retain_freed_memory()  # once, and idempotent

def step():  # as a training step allocates, touches and frees its weight casts and gradients
    blocks = [torch.ones(1536, 576) for _ in range(40)]  # 40 x 3.5 MB
    del blocks

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults():
    pages = 40 * 1536 * 576 * 4 // 4096  # one step's blocks
    assert _faults("default") > pages // 2  # glibc trims the freed heap top: its pages fault in again
    assert _faults("retain") < pages // 3  # kept: reused as they are (measured 2-8k faults against 35-70k)


def test_expandable_segments_are_set_for_the_hf_engine_on_cuda_only():
    from a3po.allocator import CUDA_ALLOC_CONF, expandable_cuda_segments
    from a3po.rollout.engines import ENGINES

    environ: dict[str, str] = {}
    assert expandable_cuda_segments(torch.device("cuda", 0), ENGINES["hf"].expandable_segments, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}
    for device, engine in ((torch.device("cpu"), "hf"), (torch.device("cuda"), "vllm")):
        untouched: dict[str, str] = {}
        assert not expandable_cuda_segments(device, ENGINES[engine].expandable_segments, untouched)
        assert untouched == {}


@pytest.mark.parametrize("key", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_setting_wins(key):
    from a3po.allocator import expandable_cuda_segments

    environ = {key: "expandable_segments:False"}
    assert not expandable_cuda_segments(torch.device("cuda"), True, environ)
    assert environ == {key: "expandable_segments:False"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_reserves_what_a_growing_decode_needs_not_the_sum():
    """In a fresh process, as `a3po.run.main.run` calls it before CUDA starts: blocks of a new,
    larger size every step (the decode's pattern) reuse one growing segment instead of each
    taking a new one (the default allocator takes a segment for each: 20 blocks of 100-119 MiB,
    ~2.2 GiB; passed on an H100, docs/gpu_runs.md)."""
    script = ("import os, torch; from a3po.allocator import expandable_cuda_segments\n"
              "for key in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'): os.environ.pop(key, None)\n"
              "assert expandable_cuda_segments(torch.device('cuda'), True)\n"
              "for i in range(20):\n"
              "    x = torch.empty((100 + i) << 20, dtype=torch.uint8, device='cuda'); del x\n"
              "print(torch.cuda.max_memory_reserved() >> 20)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) < 2 * 120  # MiB: about the largest block


RELEASE = """
import torch
from a3po.allocator import release_freed_memory, retain_freed_memory
from a3po.memory.machine import host_resident
assert retain_freed_memory()
blocks = [torch.ones(1536, 576) for _ in range(80)]  # 80 x 3.5 MB: heap blocks under the raised threshold
held = host_resident()
del blocks
kept = host_resident()
assert release_freed_memory()
again = torch.ones(1536, 576).sum().item()  # the heap still serves
print(held, kept, host_resident(), again)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_released_pages_leave_the_process_and_the_heap_still_serves():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    held, kept, released, again = out.stdout.split()[-4:]
    size = 80 * 1536 * 576 * 4
    assert int(kept) > int(held) - size // 4  # retained: freeing the blocks gave back almost nothing
    assert int(released) < int(kept) - size // 2  # released: most of their pages left the process
    assert float(again) == 1536 * 576


def test_releasing_the_heap_at_every_step_changes_no_result(tiny_cfg, monkeypatch):
    """A one-process CPU run whose resident memory passes the memory check's estimate starts the
    next step by releasing the heap's freed pages (a3po.run.loop); here every step does (a ceiling
    of one byte), and the run logs what a run without a ceiling (memory_check=off) logs."""
    import a3po.run.main as main
    from a3po.run.metrics_log import read_metrics
    from conftest import comparable

    released_cfg, plain_cfg = tiny_cfg("experiment_name=released"), tiny_cfg("experiment_name=plain", "memory_check=off")
    monkeypatch.setattr(main, "host_ceiling", lambda estimate, device, world: 1)
    main.run(released_cfg)
    monkeypatch.undo()
    main.run(plain_cfg)
    released, plain = (read_metrics(main.run_dir_of(c) / "metrics.jsonl") for c in (released_cfg, plain_cfg))
    assert [r["memory/heap_released"] for r in released] == [1.0] * len(released) == [1.0] * 3
    assert all("memory/heap_released" not in r for r in plain)
    assert comparable(released, "identity") == comparable(plain, "identity")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_a_step_releases_only_above_its_ceiling():
    from a3po.run.loop import _release_above

    assert _release_above(None) is False  # no estimate: never
    assert _release_above(2**60) is False  # resident memory below the ceiling: the pages stay
    assert _release_above(1) is True
