"""The devices the cost model knows: peak dense FLOP/s in bf16 and fp32 and memory bandwidth,
each with where the figure comes from. NVIDIA's datasheets print tensor-core FLOP/s with 2:4
sparsity; the dense figure is half. fp32 is the non-tensor-core peak. These are nominal
boost-clock peaks: sustained clocks under a power cap run lower, which the achieved
efficiencies absorb. A CPU has no datasheet figure that applies to a VM's share of it: the
validation reads a CPU core's peaks from each benchmark's own probes (analysis.cost_model.validate)."""

from __future__ import annotations

from typing import NamedTuple

from a3po.benchmark.derive import PEAK_BF16_FLOPS

__all__ = ["Device", "DEVICES", "device", "devices_markdown"]


class Device(NamedTuple):
    bf16_flops: float  # from the benchmark's table (a3po.benchmark.derive.PEAK_BF16_FLOPS) where it has the GPU
    fp32_flops: float
    bandwidth: float  # bytes/s
    source: str

    def flops(self, precision: str) -> float:
        return self.bf16_flops if precision in ("bf16", "fp16") else self.fp32_flops


_HOPPER = "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): 1,979 TFLOPS bf16 with sparsity, 67 fp32"
DEVICES = {
    "H100 SXM": Device(PEAK_BF16_FLOPS["H100 SXM"], 67e12, 3.35e12, _HOPPER + ", 3.35 TB/s HBM3"),
    "H800 SXM": Device(PEAK_BF16_FLOPS["H100 SXM"], 67e12, 3.35e12,
                       "the H100 SXM's GH100 silicon and clocks with NVLink cut to 400 GB/s and fp64 cut "
                       "(no public NVIDIA datasheet; as the H100)"),
    "H200 SXM": Device(PEAK_BF16_FLOPS["H200 SXM"], 67e12, 4.8e12,
                       "NVIDIA H200 page (nvidia.com/en-us/data-center/h200): the H100's compute, 141 GB HBM3e "
                       "at 4.8 TB/s"),
    "A100 SXM": Device(PEAK_BF16_FLOPS["A100 SXM"], 19.5e12, 2.039e12,
                       "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 624 TFLOPS "
                       "bf16 with sparsity, 19.5 fp32, 2,039 GB/s"),
    "H20": Device(148e12, 44e12, 4.0e12, "no public NVIDIA datasheet; figures as reported by resellers (148 TFLOPS "
                                         "bf16 dense, 44 fp32, 4.0 TB/s)"),
    "L40S": Device(PEAK_BF16_FLOPS["L40S"], 91.6e12, 0.864e12,
                   "NVIDIA L40S datasheet: 733 TFLOPS bf16 with sparsity, 91.6 fp32, 864 GB/s GDDR6"),
}


def device(name: str) -> Device:
    """The table's row, or a ValueError listing the names it knows."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}")
    return DEVICES[name]


def devices_markdown() -> str:
    """The table docs/cost_model.md shows (tests/test_cost_model.py holds the page to it)."""
    rows = [f"| {name} | {d.bf16_flops / 1e12:g} | {d.fp32_flops / 1e12:g} | {d.bandwidth / 1e12:g} | {d.source} |"
            for name, d in DEVICES.items()]
    return "\n".join(["| device | bf16 dense TFLOP/s | fp32 TFLOP/s | bandwidth TB/s | source |",
                      "|---|--:|--:|--:|---|", *rows])
