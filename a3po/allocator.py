"""Host memory that a process frees stays in the process, to be reused without page faults.

glibc's malloc serves a large block (over its mmap threshold, 32 MB at most by default) with its
own mmap and hands it back to the kernel when freed, and trims the heap's free top likewise. A
training step frees and re-allocates the same few hundred MB every minibatch: the gradients
(`zero_grad(set_to_none=True)`), autocast's bf16 copies of the weights, the logits. Each time
the kernel zero-fills those pages again on first touch (its cost: docs/benchmarks.md, "Rollout at
the hardware's pace"). Raising both thresholds keeps freed blocks in the heap; the price is
resident memory that does not shrink back: a run's grows step after step as freed blocks of
one shape are split for the next (docs/design.md, "Memory check"). So a CPU run hands the
freed pages back (`release_freed_memory`) at the start of a step that finds its resident memory
above the memory check's estimate (a3po.run.loop), and keeps them otherwise.

No-ops where the C library is not glibc (macOS, musl); `retain_freed_memory` also when called again.

On a GPU the same question is PyTorch's caching allocator's: `expandable_cuda_segments` below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import MutableMapping

import torch

__all__ = ["retain_freed_memory", "release_freed_memory", "expandable_cuda_segments", "CUDA_ALLOC_CONF", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap and return to it
TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap's free top (the largest int mallopt takes)
_done: bool | None = None


@functools.cache
def _glibc_function(name: str):
    """The C library's `name` (mallopt, malloc_trim), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True where they were set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the allocator thresholds: freed host memory goes back to the OS "
                    "(slower training steps, same results)")
    return _done


def release_freed_memory() -> bool:
    """Hand the pages of the heaps' free blocks back to the kernel (glibc's `malloc_trim(0)`, which
    also releases free pages inside the heap, not only at its top): resident memory falls to what
    is live, and the next allocations fault their pages in again (zero-filled). True where glibc
    ran it; the freed blocks stay allocatable either way."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


CUDA_ALLOC_CONF = "expandable_segments:True"
ALLOC_CONF_KEYS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.10's name, and its alias


def expandable_cuda_segments(device: torch.device, engine_allows: bool,
                             environ: MutableMapping[str, str] = os.environ) -> bool:
    """Let PyTorch's CUDA allocator grow segments in place; True where this call set it.

    The HF engine's decode step allocates blocks of a new size every token (the attention over a
    growing cache), and the default allocator keeps each freed block for reuse until an
    allocation fails, so what it reserves runs far past what is allocated (measured at the
    paper's shape: docs/gpu_runs.md). The memory check's estimate bounds what is allocated, so
    this is also what makes it bound what is reserved.

    Left alone where the user set the allocator's configuration themselves, and where the rollout
    engine does not allow it (`engine_allows`: its spec's `expandable_segments`, a3po.rollout.engines):
    vLLM's CUDA-graph and IPC buffers have crashed under expandable segments in some versions
    (custom all-reduce at tensor parallelism > 1, sleep mode's memory pool). Every torchrun rank sets it
    in its own process, and what a run starts inherits it through the environment; a process
    whose allocator is already initialized gets it through torch's setter."""
    if device.type != "cuda" or not engine_allows or any(key in environ for key in ALLOC_CONF_KEYS):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(CUDA_ALLOC_CONF)
    log.info("PYTORCH_CUDA_ALLOC_CONF=%s (set by a3po; set it yourself to choose otherwise)", CUDA_ALLOC_CONF)
    return True
