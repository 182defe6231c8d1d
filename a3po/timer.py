"""Phase timers: the numbers behind the paper's Fig. 1 and the training-time comparison.

Every phase of a step is measured by the same clock in the same way for every algo, so
`time/prox_logp` of recompute and of loglinear are comparable. On a GPU the clock is read
only after a device synchronize: kernel launches are asynchronous, and without it a phase
would be charged to whichever later phase happened to wait.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch


def synchronize(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates wall-clock seconds per phase name; `pop()` returns and resets them."""

    def __init__(self, device: torch.device | str | None = None, always: tuple[str, ...] = ()) -> None:
        """`always`: phases reported (as 0.0) even in a step where they did not run, so every
        line of metrics.jsonl has the same timing keys (e.g. no rollout in a lagged step)."""
        self.device = device
        self.always = always
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self._seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] += seconds

    def pop(self) -> dict[str, float]:
        out = {f"time/{name}": 0.0 for name in self.always}
        out.update({f"time/{name}": seconds for name, seconds in self._seconds.items()})
        self._seconds.clear()
        return out


class DeviceSpans:
    """Seconds spent in short spans inside the micro-batch loop, without a host sync per span.

    On a GPU a synchronizing timer around each micro-batch's approximation would stall the
    launch queue twice per micro-batch; CUDA events are recorded instead and read after the
    step's one sync. On CPU, work is synchronous and the wall clock is exact.
    """

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        self.cpu_seconds = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((start, end))
        else:
            started = time.perf_counter()
            try:
                yield
            finally:
                self.cpu_seconds += time.perf_counter() - started

    def seconds(self) -> float:
        """Total; on a GPU call it after the step's sync (the last event is waited for anyway)."""
        if self.events:
            self.events[-1][1].synchronize()
        return self.cpu_seconds + sum(start.elapsed_time(end) for start, end in self.events) / 1000.0
