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


def same_cuda_device(a: torch.device | str | None, b: torch.device | str | None) -> bool:
    """Whether `a` and `b` are one CUDA device (`cuda` is `cuda:0`, as a3po.run.parts has it).

    Two threads timing phases on one device time each other's kernels: `synchronize` waits
    for the whole device, and CUDA events on the default stream, which both threads share,
    complete after whatever the other thread queued before them. a3po.runtimes.asynchronous
    flags such timings (`runtime/shared_device`)."""
    if a is None or b is None:
        return False
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type == "cuda" and (a.index or 0) == (b.index or 0)


# Phases that only measure (train.log_prox_errors: the reference forward, the fidelity
# telemetry): timed apart and left out of `time/step` and `time/step_cpu` (a3po.run.loop).
DIAGNOSTIC_PHASES = ("prox_reference", "fidelity")


class PhaseTimer:
    """Accumulates wall-clock seconds per phase name; `pop()` returns and resets them."""

    def __init__(self, device: torch.device | str | None = None, always: tuple[str, ...] = ()) -> None:
        """`always`: phases reported (as 0.0) even in a step where they did not run, so every
        line of metrics.jsonl has the same timing keys (e.g. no rollout in a lagged step)."""
        self.device = device
        self.always = always
        self._seconds: dict[str, float] = defaultdict(float)
        self._cpu: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str, within: str | None = None) -> Iterator[None]:
        """Time a phase (wall clock, and this process's CPU seconds for `spent`). `within`: the
        enclosing phase, whose time this one's is taken out of (a diagnostic inside `train`)."""
        synchronize(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            synchronize(self.device)
            seconds = time.perf_counter() - start
            self._seconds[name] += seconds
            self._cpu[name] += time.process_time() - cpu_start
            if within is not None:
                self._seconds[within] -= seconds

    def spent(self, names: tuple[str, ...]) -> tuple[float, float]:
        """(wall, CPU) seconds the named phases took since the last `pop`."""
        return sum(self._seconds.get(n, 0.0) for n in names), sum(self._cpu.get(n, 0.0) for n in names)

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] += seconds

    def pop(self) -> dict[str, float]:
        out = {f"time/{name}": 0.0 for name in self.always}
        out.update({f"time/{name}": seconds for name, seconds in self._seconds.items()})
        self._seconds.clear()
        self._cpu.clear()
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
