"""How it is measured: every variant through `torch.utils.benchmark.Timer`, in interleaved
rounds; the summary of the rounds; the memory traffic of eager ops; the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils.benchmark as benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Variant:
    """One timed call. `before` runs untimed before every timed block (the Timer's setup),
    e.g. the restore that makes every step start from the same weights; `after` reads what
    the measured call left behind (a step's phases and loss). A `blocked` call is short and
    is repeated in blocks until `min_kernel_seconds`; any other is timed once a repetition."""

    name: str
    kind: str  # rollout | prox | step | kernel
    run: Callable[[], Any]
    before: Callable[[], None] | None = None
    after: Callable[[], dict[str, float]] | None = None
    blocked: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class CpuClock:
    """The Timer's own clock (`torch.utils.benchmark.timer`: the accelerator drained, then
    the wall clock) that also notes this process's CPU time at every reading. timeit reads
    its clock once before and once after each block, so consecutive readings give each block's
    CPU seconds: on a CPU shared with other jobs the wall clock also counts the time the
    scheduler gave our core to someone else, the CPU clock does not."""

    def __init__(self) -> None:
        self.readings: list[float] = []

    def __call__(self) -> float:
        wall = benchmark.timer()
        self.readings.append(time.process_time())
        return wall

    def block_seconds(self, n_blocks: int) -> list[float]:
        """CPU seconds of the last `n_blocks` blocks."""
        last = self.readings[-2 * n_blocks:]
        return [end - start for start, end in zip(last[::2], last[1::2])]


def measure(variant: Variant, min_run_time: float) -> dict[str, float]:
    """One repetition: `Timer.blocked_autorange`, whose block-size estimate first runs the
    call untimed. A blocked variant reports its median block per call; any other runs with
    min_run_time 0, i.e. one timed block of one call. num_threads is the process's (the
    Timer would otherwise pin one thread), so --threads holds."""
    clock = CpuClock()
    timer = benchmark.Timer("run()", setup="before()" if variant.before else "pass", timer=clock, label=variant.name,
                            globals={"run": variant.run, "before": variant.before}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time if variant.blocked else 0.0)
    cpu = statistics.median(clock.block_seconds(len(measurement.raw_times))) / measurement.number_per_run
    return {"seconds": measurement.median, "cpu_seconds": cpu, "inner": float(measurement.number_per_run),
            **(variant.after() if variant.after else {})}


def interleaved(variants: list[Variant], *, reps: int, warmup: int, min_run_time: float,
                progress: bool) -> dict[str, list[dict[str, float]]]:
    """`warmup` untimed calls of every variant (at least one), then `reps` rounds measuring
    each once, each round starting one variant later: load drift over minutes then hits every
    variant alike instead of whichever ran last."""
    from tqdm.auto import tqdm

    warmup = max(warmup, 1)
    samples: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    with tqdm(total=(warmup + reps) * len(variants), desc="benchmark", unit="run", disable=not progress,
              dynamic_ncols=True) as bar:
        for variant in [v for _ in range(warmup) for v in variants]:
            bar.set_postfix_str(f"warm-up {variant.name}")
            if variant.before:
                variant.before()
            variant.run()
            bar.update(1)
        for round_index in range(reps):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                bar.set_postfix_str(variant.name)
                samples[variant.name].append(measure(variant, min_run_time))
                bar.update(1)
    return samples


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive, as torch.quantile interpolates), IQR, min, max, n."""
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {"median": statistics.median(ordered), "q25": q1, "q75": q3, "iqr": q3 - q1,
            "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def summarize_results(variants: list[Variant], samples: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """Per variant: its kind, a summary of every measured key, the raw repetitions, its info."""
    results = {}
    for variant in variants:
        raw = samples[variant.name]
        keys = sorted({key for sample in raw for key in sample})
        results[variant.name] = {"kind": variant.kind, **{k: summarize([s[k] for s in raw]) for k in keys},
                                 "raw": raw, **({"info": variant.info} if variant.info else {})}
    return results


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written by every aten op run under it (inputs + outputs, as eager
    execution moves them), ops that only make a view aside: an unfused implementation's traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.bytes, self.largest = 0, 0, 0  # largest: elements of the largest tensor written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [v for v in tree_leaves((args, kwargs or {})) if torch.is_tensor(v)]
        outputs = [v for v in tree_leaves(out) if torch.is_tensor(v)]
        storages = {v.untyped_storage().data_ptr() for v in inputs}
        if outputs and all(v.untyped_storage().data_ptr() in storages for v in outputs):
            return out  # a view (detach, reshape): no data moves
        self.ops += 1
        self.bytes += sum(v.numel() * v.element_size() for v in (*inputs, *outputs))
        self.largest = max(self.largest, *(v.numel() for v in outputs), 0)
        return out


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
