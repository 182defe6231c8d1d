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

    environ: dict[str, str] = {}
    assert expandable_cuda_segments(torch.device("cuda", 0), "hf", environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}
    for device, engine in ((torch.device("cpu"), "hf"), (torch.device("cuda"), "vllm")):
        untouched: dict[str, str] = {}
        assert not expandable_cuda_segments(device, engine, untouched)
        assert untouched == {}


@pytest.mark.parametrize("key", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_setting_wins(key):
    from a3po.allocator import expandable_cuda_segments

    environ = {key: "expandable_segments:False"}
    assert not expandable_cuda_segments(torch.device("cuda"), "hf", environ)
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
              "assert expandable_cuda_segments(torch.device('cuda'), 'hf')\n"
              "for i in range(20):\n"
              "    x = torch.empty((100 + i) << 20, dtype=torch.uint8, device='cuda'); del x\n"
              "print(torch.cuda.max_memory_reserved() >> 20)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) < 2 * 120  # MiB: about the largest block
