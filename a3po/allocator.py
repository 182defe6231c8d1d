"""Host memory that a process frees stays in the process, to be reused without page faults.

glibc's malloc serves a large block (over its mmap threshold, 32 MB at most by default) with its
own mmap and hands it back to the kernel when freed, and trims the heap's free top likewise. A
training step frees and re-allocates the same few hundred MB every minibatch: the gradients
(`zero_grad(set_to_none=True)`), autocast's bf16 copies of the weights, the logits. Each time
the kernel zero-fills those pages again on first touch (its cost: docs/benchmarks.md, "Rollout at
the hardware's pace"). Raising both thresholds keeps freed blocks in the heap; the price is
resident memory that does not shrink back (fragmentation, measured there too).

A no-op where the C library is not glibc (macOS, musl) or when called again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["retain_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap and return to it
TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap's free top (the largest int mallopt takes)
_done: bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True where they were set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the allocator thresholds: freed host memory goes back to the OS "
                    "(slower training steps, same results)")
    return _done
