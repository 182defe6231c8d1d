"""The contract every rollout engine (hf, vllm) fulfils.

The trainer never looks inside an engine: it hands over prompt token ids and gets back, per
sample, the response tokens, the log-prob the *sampling* distribution gave each of them
(`behave_logp`) and the policy version that produced each token (`versions`). Versions are
per token, not per sequence, because an interruptible engine may change weights in the
middle of a sequence; A-3PO's approximation is per token for exactly that reason.
"""

from __future__ import annotations

import threading
from typing import Protocol, Sequence

import torch

from a3po.batch import Sample


class GenerationCancelled(RuntimeError):
    """Raised by an engine's `generate` after `cancel()`: a runtime shutting down must not
    wait for a whole batch of generation it is going to throw away."""


class RolloutEngine(Protocol):
    """What `a3po.rollout.build_engine(cfg.rollout, ...)` returns."""

    version: int

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n_samples: int, *, seed: int
    ) -> list[list[Sample]]:
        """Sample `n_samples` responses per prompt; result[i][j] is sample j of prompt i."""
        ...

    def update_weights(self, policy: torch.nn.Module, version: int) -> None:
        """Make the engine sample from `policy`'s current weights, stamped `version`."""
        ...

    def close(self) -> None:
        ...


class StagedWeightUpdates:
    """`update_weights` that never makes the trainer wait for a generation in flight.

    With no generation running the new weights load at once. Otherwise one clone of the
    state dict is staged and the generating thread loads it where a new version may take
    effect (`_apply_pending`: before the next batch, or between decode steps for an
    interruptible engine), so every token is sampled, and stamped, by exactly one version.
    An engine calls `_init_staging()` in its constructor, defines `_load(state, version)`,
    holds `_generate_lock` while it generates and calls `_apply_pending()` at those points.
    """

    def _init_staging(self, dtype: torch.dtype | None = None) -> None:
        """`dtype`: floating tensors are staged in it (the engine's own weight dtype, into which its
        loader casts them anyway); None stages exact clones."""
        self._staging_dtype = dtype
        self._generate_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None

    def update_weights(self, policy: torch.nn.Module, version: int) -> None:
        if self._generate_lock.acquire(blocking=False):
            try:
                with self._pending_lock:
                    self._pending = None
                self._load(policy.state_dict(), version)
            finally:
                self._generate_lock.release()
            return
        staged = {name: self._stage(tensor.detach()) for name, tensor in policy.state_dict().items()}
        with self._pending_lock:
            self._pending = (staged, version)

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._staging_dtype is not None and tensor.is_floating_point():
            return tensor.to(self._staging_dtype, copy=True)
        return tensor.clone()

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._load(*pending)
