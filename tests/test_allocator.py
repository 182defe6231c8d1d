"""a3po.allocator: freed host memory is reused without the kernel faulting its pages in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
