"""How it is measured: timed calls, interleaved repetitions, their summary, the memory traffic
of eager ops, and the machine the figures come from."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from a3po.run.timer import synchronize


@dataclass
class Variant:
    name: str
    kind: str  # rollout | prox | step | kernel
    run: Callable[[], dict[str, float]]
    before: Callable[[], None] | None = None  # untimed (state restore)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timing:
    """Wall seconds, and this process's CPU seconds: on a CPU shared with other jobs the
    wall clock also counts the time the scheduler gave our core to someone else, the CPU
    clock does not (with one torch thread it is the uncontended wall time, cache and
    memory-bandwidth contention aside). On a GPU the wall clock is the measure."""

    seconds: float
    cpu_seconds: float
    out: Any = None

    def as_dict(self, **extra: float) -> dict[str, float]:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, **extra}


def timed(fn: Callable[[], Any], device: torch.device) -> Timing:
    """fn() timed with the device drained before and after (kernels are asynchronous)."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    synchronize(device)
    return Timing(time.perf_counter() - wall, time.process_time() - cpu, out)


def repeated(fn: Callable[[], Any], device: torch.device) -> Callable[[], dict[str, float]]:
    """A variant for a sub-millisecond call: calibrated on its first (warm-up) run to repeat
    `inner` times per measurement; reports seconds per call."""
    inner = {"n": 1}

    def run() -> dict[str, float]:
        timing = timed(lambda: [fn() for _ in range(inner["n"])], device)
        return {"seconds": timing.seconds / inner["n"], "cpu_seconds": timing.cpu_seconds / inner["n"],
                "inner": float(inner["n"])}

    def calibrate(min_seconds: float) -> None:
        one = timed(fn, device).seconds
        inner["n"] = int(min(100_000, max(1, math.ceil(min_seconds / max(one, 1e-7)))))

    run.calibrate = calibrate  # type: ignore[attr-defined]
    return run


def summarize(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "q25": q1, "q75": q3, "iqr": q3 - q1,
            "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def interleaved(variants: list[Variant], *, reps: int, warmup: int, device: torch.device,
                min_kernel_seconds: float, progress: bool) -> dict[str, list[dict[str, float]]]:
    """Run every variant `warmup` times (discarded), then `reps` rounds of all of them, each
    round starting one variant later so no variant always follows the same neighbour."""
    from tqdm.auto import tqdm

    warmup = max(warmup, 1)
    results: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    with tqdm(total=(warmup + reps) * len(variants), desc="benchmark", unit="run", disable=not progress,
              dynamic_ncols=True) as bar:
        for round_index in range(warmup + reps):
            is_warmup = round_index < warmup
            shift = 0 if is_warmup else (round_index - warmup) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                bar.set_postfix_str(("warm-up " if is_warmup else "") + variant.name)
                if variant.before is not None:
                    variant.before()
                if round_index == 0 and hasattr(variant.run, "calibrate"):
                    variant.run.calibrate(min_kernel_seconds)  # type: ignore[attr-defined]
                sample = variant.run()
                if not is_warmup:
                    results[variant.name].append(sample)
                bar.update(1)
    return results


def summarize_results(variants: list[Variant], raw: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """Per variant: its kind, a summary of every measured key, the raw samples, its info."""
    results = {}
    for variant in variants:
        samples_of = raw[variant.name]
        keys = sorted({k for s in samples_of for k in s})
        results[variant.name] = {
            "kind": variant.kind,
            **{k: summarize([s[k] for s in samples_of]) for k in keys},
            "raw": samples_of,
            **({"info": variant.info} if variant.info else {}),
        }
    return results


class TrafficCounter:
    """Bytes read and written by every aten op run under it (inputs + outputs, as eager
    execution moves them): the memory traffic of an unfused implementation."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = [v for v in (*_flat(args), *_flat(kwargs or {})) if torch.is_tensor(v)]
                outputs = [v for v in _flat(out) if torch.is_tensor(v)]
                input_storages = {v.untyped_storage().data_ptr() for v in inputs}
                if outputs and all(v.untyped_storage().data_ptr() in input_storages for v in outputs):
                    return out  # a view (detach, reshape): no data moves
                counter.ops += 1
                counter.bytes += sum(v.numel() * v.element_size() for v in (*inputs, *outputs))
                counter.largest = max(counter.largest, *(v.numel() for v in outputs), 0)
                return out

        self.ops = 0
        self.bytes = 0
        self.largest = 0  # elements of the largest tensor an op wrote
        self.mode = _Mode()

    def __enter__(self) -> "TrafficCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def _flat(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat(item)
    else:
        yield value


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average_start": load_average(),
    }
