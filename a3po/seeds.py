"""Every seed a run uses is derived here, from the run's `seed`, a named stream and an index,
never from RNG state: a resumed run repeats them, and no two purposes share one.

- `stream_seed(seed, stream, index)`: an integer seed (a batch's sampling, an eval, a step's
  minibatch shuffle, one vLLM request, a rank's global RNGs).
- `task_rng(stream, *key)`: a numpy generator for a task's draws (which prompts a step trains
  on; the held-out order), keyed by its stream and whatever the draw depends on.
- `seeded(seed)`: a block that draws from torch's global generators seeded with `seed`,
  leaving the caller's streams exactly where they were (model construction and HF sampling
  must be a function of their seed alone and must not move the trainer's RNG streams, which
  a3po.run.checkpoint saves and restores).
"""

from __future__ import annotations

import contextlib
import enum
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["Stream", "stream_seed", "task_rng", "seed_everything", "seeded", "rank_seed", "rng_state", "set_rng_state"]


class Stream(enum.IntEnum):
    """The purposes seeds are drawn for; each value is used by one purpose only."""

    TASK_TRAIN = 0    # task_rng: the prompts of a step (or a GSM8K epoch's order)
    ROLLOUT = 1       # stream_seed: sampling the batch for step s
    EVAL = 2          # stream_seed: sampling the eval after step s
    MINIBATCH = 3     # stream_seed: step s's minibatch shuffle
    VLLM_REQUEST = 4  # stream_seed: request i of one vLLM generate call (seeded by its ROLLOUT/EVAL seed)
    RANK = 5          # stream_seed: the global RNGs of rank r > 0
    TASK_EVAL = 6     # task_rng: the held-out order, the same for every run seed


# Seeds stay below 2**62: vLLM and numpy take them as signed 64-bit integers.
_MODULUS = 2**62


def stream_seed(seed: int, stream: Stream, index: int) -> int:
    """The seed of draw `index` of `stream` in a run seeded `seed`."""
    return (int(seed) * 1_000_003 + int(stream) * 7_919 + int(index)) % _MODULUS


def task_rng(stream: Stream, *key: int) -> np.random.Generator:
    """A numpy generator that depends on (stream, key) alone. The entropy list keeps the
    task streams' historical values (0 for training draws, 1 for the eval order), so the
    prompts a step draws are those of every earlier version of the suite."""
    legacy = {Stream.TASK_TRAIN: 0, Stream.TASK_EVAL: 1}[stream]
    return np.random.default_rng([legacy, *(int(k) for k in key)])


def rank_seed(seed: int, rank: int) -> int:
    """Rank 0 keeps `seed` (a 1-process run is rank 0); other ranks get their own stream."""
    return int(seed) if rank == 0 else stream_seed(seed, Stream.RANK, rank) % 2**32


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generators with `seed` for the block; restore the previous states on
    exit. `torch.manual_seed` seeds the CPU generator and every CUDA device's, so the CUDA
    states are saved and restored too, but only where CUDA is already initialised: saving
    them would otherwise initialise it."""
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def rng_state() -> dict[str, Any]:
    """Every global generator's state (python, numpy, torch CPU and CUDA): what a checkpoint
    saves and a block that must not move the streams restores."""
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
