"""Phase timers (a3po.timer): what they synchronize, what they add up, and the async runtime's
flag for timings two threads share on one GPU. No GPU here: torch.cuda's synchronize and
Event are replaced by recording fakes, and the clock by a fake one."""

from __future__ import annotations

import logging

import pytest
import torch

import a3po.timer
from a3po.batch import RolloutBatch, Sample
from a3po.timer import DeviceSpans, PhaseTimer, same_cuda_device


class FakeClock:
    """`time.perf_counter` that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(a3po.timer.time, "perf_counter", fake)
    return fake


@pytest.fixture
def synced(monkeypatch):
    """The devices `torch.cuda.synchronize` was called with, in order."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_phase_synchronizes_its_cuda_device_before_and_after(clock, synced):
    timer = PhaseTimer(torch.device("cuda:1"), always=("rollout",))
    with timer.phase("train"):
        synced.append("work")
        clock.now += 2.0
        with timer.phase("fidelity", within="train"):
            clock.now += 0.5
    assert synced == [torch.device("cuda:1"), "work", torch.device("cuda:1"), torch.device("cuda:1"),
                      torch.device("cuda:1")]
    assert timer.pop() == {"time/rollout": 0.0, "time/train": 2.0, "time/fidelity": 0.5}
    assert timer.pop() == {"time/rollout": 0.0}


def test_phase_on_cpu_or_without_a_device_never_synchronizes(clock, synced):
    for device in (torch.device("cpu"), None):
        timer = PhaseTimer(device)
        with timer.phase("prox_logp"):
            clock.now += 1.0
        assert timer.pop() == {"time/prox_logp": 1.0}
    assert synced == []


class FakeEvent:
    """A CUDA event: `record()` logs it; `elapsed_time` is the milliseconds the test assigned
    to the span."""

    log: list = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.waited, self.ms = False, 0.0

    def record(self) -> None:
        FakeEvent.log.append(self)

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.ms


def test_device_spans_time_cuda_spans_with_events_read_after_the_step(monkeypatch, clock):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    spans = DeviceSpans(torch.device("cuda:0"))
    for ms in (3.0, 5.0):
        with spans.span():
            clock.now += 1.0  # host time is not what a cuda span counts
        spans.events[-1][1].ms = ms
    assert FakeEvent.log == [event for pair in spans.events for event in pair]  # start, end per span
    assert spans.seconds() == pytest.approx(0.008)
    assert spans.events[-1][1].waited and not spans.events[0][1].waited  # one wait: the last end


def test_device_spans_on_cpu_use_the_wall_clock(monkeypatch, clock):
    monkeypatch.setattr(torch.cuda, "Event", lambda **_: pytest.fail("no CUDA event on CPU"))
    spans = DeviceSpans(torch.device("cpu"))
    for seconds in (0.25, 0.5):
        with spans.span():
            clock.now += seconds
    assert spans.seconds() == 0.75


@pytest.mark.parametrize("a, b, same", [
    ("cuda", "cuda:0", True), ("cuda:1", torch.device("cuda", 1), True), ("cuda:0", "cuda:1", False),
    ("cpu", "cpu", False), ("cuda:0", "cpu", False), (None, "cuda:0", False),
])
def test_same_cuda_device(a, b, same):
    assert same_cuda_device(a, b) is same and same_cuda_device(b, a) is same


class Produce:
    """A producer for `a3po.run.parts.build_runtime`: a batch of one group, and its own timer."""

    def __init__(self, device: str) -> None:
        self.timer = PhaseTimer(torch.device(device))

    def __call__(self, step: int):
        sample = Sample(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3, 4]),
                        behave_logp=torch.zeros(2), versions=torch.zeros(2, dtype=torch.long), reward=0.0)
        return RolloutBatch(step=step, samples=[sample], n_prompts=1, n_samples=1), {}


@pytest.mark.parametrize("runtime, rollout_device, trainer_device, flagged", [
    ("async", "cuda:0", "cuda:0", True),
    ("async", "cuda", "cuda:0", True),  # `cuda` is `cuda:0`
    ("async", "cuda:1", "cuda:0", False),  # rollout on a GPU of its own
    ("async", "cpu", "cpu", False),
    ("lagged", "cuda:0", "cuda:0", False),  # one thread: phases never overlap
])
def test_async_runtime_flags_timings_shared_on_one_cuda_device(tiny_cfg, caplog, synced, runtime, rollout_device,
                                                               trainer_device, flagged):
    from a3po.run.parts import build_runtime

    cfg = tiny_cfg(f"runtime={runtime}", "train.n_prompts=1", "train.total_steps=2", "staleness=1")
    with caplog.at_level(logging.WARNING, logger="a3po.runtimes.asynchronous"):
        built = build_runtime(cfg, Produce(rollout_device), engine=None,
                              step_timer=PhaseTimer(torch.device(trainer_device)))
    try:
        metrics = [built.batch_for(step, version=step)[1] for step in range(2)]
    finally:
        getattr(built, "close", lambda: None)()
    warnings = [r for r in caplog.records if "runtime/shared_device" in r.getMessage()]
    assert len(warnings) == (1 if flagged else 0)
    assert all(("runtime/shared_device" in m) is flagged for m in metrics)
    if flagged:
        assert all(m["runtime/shared_device"] == 1.0 for m in metrics)
    assert synced == []  # the flag is decided from the devices' names; no CUDA call
