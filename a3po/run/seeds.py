"""`seeded(seed)`: a block that draws from torch's global generators seeded with `seed`,
leaving the caller's streams exactly where they were.

Rollout and model construction must be a function of their seed alone, and must not move the
trainer's RNG streams (which `a3po.run.checkpoint` saves and restores on resume). `torch.manual_seed`
seeds the CPU generator and every CUDA device's, so the CUDA states are saved and restored too,
but only where CUDA is already initialised: saving them would otherwise initialise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generators with `seed` for the block; restore the previous states on exit."""
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
