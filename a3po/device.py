"""The one place a `device=` config value becomes a torch device, and `precision=` a compute dtype.

The precision rule (docs/design.md, "Precision"): `bf16` is autocast to bfloat16 with float32
master weights, optimizer state and log-softmax; `fp32` is exact float32. `auto` picks bf16
where it is the faster of the two: a GPU with bf16 support; a CPU with AMX; a CPU with
AVX512-BF16 that is not Intel's. On an Intel CPU with AVX512-BF16 but no AMX, MKL's AVX-512
float32 GEMM outruns oneDNN's bf16 one, and on a CPU with neither oneDNN emulates bf16; `auto`
picks fp32 there (measured in docs/benchmarks.md, "Precision"). Where `bf16` is asked for on
such a CPU anyway (a study registered in bf16), its GEMMs (linear layers, attention's products)
multiply their bf16 operands in float32, the same arithmetic at float32's speed
(`Bf16GemmsInFloat32`, a3po/gemms.py).
The trainer's forwards, the recompute forward, the HF engine's sampling, vLLM's dtype and the
benchmark all follow the resolved value, so behaviour and current log-probs are computed alike.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from a3po.errors import ConfigError
from a3po.gemms import autocast_with_gemms_in_float32

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
# `bf16_gemms`: how bf16's GEMMs multiply on a CPU (None: the faster for it; conf/config.yaml)
BF16_GEMMS = (None, "bf16", "float32")
# The run's `bf16_gemms`, held in the environment so that every process of the run (a rollout
# child included) multiplies the same way; set by `pin_bf16_gemms` at the run's start.
BF16_GEMMS_ENV = "A3PO_BF16_GEMMS"
# What a run's config records: `auto` is resolved at start, so the record says what ran.
RESOLVED_PRECISIONS = ("fp32", "bf16", "fp16")
# Runs written before `precision` existed computed in float32 on a CPU (every committed run).
LEGACY_PRECISION = "fp32"


def resolve_device(name: str, key: str = "device") -> torch.device:
    """`auto` -> cuda when visible, else cpu; `cuda`/`cuda:<k>` must name a visible GPU.
    Anything else is a ConfigError naming `key` (the config key the value came from)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return torch.device("cuda" if visible else "cpu")
    if name not in DEVICES and not str(name).startswith("cuda:"):
        raise ConfigError(f"{key}={name!r} is not allowed; allowed: {list(DEVICES)} or cuda:<index>")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= visible:
        allowed = f"cuda, cuda:0..cuda:{visible - 1}, auto or cpu" if visible else "auto or cpu (no CUDA device is visible)"
        raise ConfigError(f"{key}={name!r} is not allowed on this machine; allowed: {allowed}")
    return device


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, as torch itself detects them (the instructions oneDNN's bf16 GEMM uses)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id as Linux reports it (`GenuineIntel`, `AuthenticAMD`), '' where unknown."""
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def native_bf16(device: torch.device) -> bool:
    """Whether `device` runs bf16 matmuls in hardware (not emulated)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return cpu_has_native_bf16()


def bf16_is_faster(device: torch.device) -> bool:
    """`auto`'s rule, whether `device` runs bf16 matmuls faster than float32: every bf16 GPU; a
    CPU with AMX; a CPU with AVX512-BF16 alone unless it is Intel's, where MKL's AVX-512 float32
    GEMM is the faster (docs/benchmarks.md, "Precision")."""
    device = torch.device(device)
    if device.type == "cuda":
        return native_bf16(device)
    if torch.cpu._is_amx_tile_supported():
        return True
    return bool(torch.cpu._is_avx512_bf16_supported()) and cpu_vendor() != "GenuineIntel"


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def resolve_precision(name: str, device: torch.device, weights_dtype: str = "float32", key: str = "precision") -> str:
    """`auto` -> `bf16` where `device` runs it faster than float32, else `fp32`; `fp32`/`bf16` as given.

    Weights stored in a lower precision (model.dtype=bfloat16) compute in it: `auto` resolves
    to it and another value is a ConfigError. A GPU without bf16 refuses `bf16`; a CPU without
    native bf16 runs it emulated, correct but slower, with a warning (useful to reproduce the
    paper's bf16 behaviour/current mismatch, never to save time); an Intel CPU with AVX512-BF16
    but no AMX runs it natively, still slower than float32, with a warning. On both, the GEMMs
    (linear layers, attention's products) multiply in float32 (`Bf16GemmsInFloat32`)."""
    if name not in PRECISIONS:
        raise ConfigError(f"{key}={name!r} is not allowed; allowed: {list(PRECISIONS)}")
    device = torch.device(device)
    if weights_dtype != "float32":
        stored = SHORT_DTYPES.get(weights_dtype, weights_dtype)
        if name not in ("auto", stored):
            raise ConfigError(f"{key}={name!r} is not allowed with model.dtype={weights_dtype} (the weights themselves "
                              f"are {weights_dtype}); allowed: auto or {stored}, or set model.dtype=float32")
        return stored
    if name == "auto":
        return "bf16" if bf16_is_faster(device) else "fp32"
    if name == "bf16" and not native_bf16(device):
        if device.type == "cuda":
            raise ConfigError(f"{key}='bf16' is not allowed on this machine: {torch.cuda.get_device_name(device)} "
                              "has no bf16 support; allowed: fp32 or auto")
        log.warning("%s=bf16 on a CPU without AVX512-BF16 or AMX: oneDNN emulates bf16; its GEMMs (linear "
                    "layers, attention) multiply their bf16 operands in float32 here (the same arithmetic, at "
                    "fp32's speed), the rest is slower than fp32 (docs/benchmarks.md, \"Precision\"); %s=auto "
                    "picks fp32 on this machine", key, key)
    elif name == "bf16" and not bf16_is_faster(device):
        log.warning("%s=bf16 on an Intel CPU with AVX512-BF16 but no AMX: oneDNN's bf16 GEMM is slower than MKL's "
                    "fp32 GEMM here, so its GEMMs (linear layers, attention) multiply their bf16 operands in "
                    "float32 (the same arithmetic; docs/benchmarks.md, \"Precision\"); %s=auto picks fp32 on this "
                    "machine", key, key)
    return name


def autocast_dtype(device: torch.device, model: torch.nn.Module, precision: str) -> torch.dtype | None:
    """bfloat16 for a float32 model under `precision=bf16` (resolved), else None: float32
    master weights and bf16 matmuls, the standard mixed precision. A model whose weights are
    already bf16 (model.dtype=bfloat16) needs no autocast."""
    first = next(model.parameters(), None)
    if precision == "bf16" and first is not None and first.dtype == torch.float32:
        return torch.bfloat16
    return None


def pin_bf16_gemms(mode: str | None, device: torch.device) -> None:
    """Make `mode` (the run's `bf16_gemms`) this process's and its children's GEMM path for bf16 on
    a CPU; warn where it pins oneDNN's bf16 GEMM on a CPU that emulates it (slower, same sums)."""
    if mode not in BF16_GEMMS:
        raise ConfigError(f"bf16_gemms={mode!r} is not allowed; allowed: {list(BF16_GEMMS)}")
    os.environ[BF16_GEMMS_ENV] = mode or ""
    if mode == "bf16" and torch.device(device).type == "cpu" and not bf16_is_faster(device):
        log.warning("bf16_gemms=bf16 on a CPU where bf16 is not the faster: oneDNN's bf16 GEMM runs %s here, "
                    "a step some 2.5-3x slower than bf16_gemms=null would take (the same operands and rounding)",
                    "natively without AMX" if native_bf16(device) else "emulated")


def bf16_gemm_in_float32(device: torch.device) -> bool:
    """Whether `precision=bf16`'s GEMMs multiply in float32 on `device` (a CPU): as the run's
    `bf16_gemms` pins it (`pin_bf16_gemms`), or, unpinned, where bf16 is not the faster
    (`auto`'s rule), so oneDNN's bf16 GEMM (emulated, or AVX512-BF16 without AMX) would run
    slower than MKL's float32 one for the same arithmetic (docs/benchmarks.md)."""
    device = torch.device(device)
    if device.type != "cpu":
        return False
    pinned = os.environ.get(BF16_GEMMS_ENV) or None
    if pinned is not None:
        return pinned == "float32"
    return not bf16_is_faster(device)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The autocast context for `autocast_dtype`'s answer on `device` (a no-op for None); bf16 on
    a CPU where bf16 is not the faster also multiplies its GEMMs in float32
    (`Bf16GemmsInFloat32`)."""
    if dtype is None:
        return contextlib.nullcontext()
    device = torch.device(device)
    if dtype != torch.bfloat16 or not bf16_gemm_in_float32(device):
        return torch.autocast(device.type, dtype=dtype)
    return autocast_with_gemms_in_float32(device.type)


def vllm_placement(rollout_device, trainer_device, world: int) -> tuple[str, str]:
    """Where vLLM runs, ("process" | "child", why). In this process vLLM's GPU worker takes
    `cuda:0` whatever it is asked (vLLM 0.32: the uniprocess executor and the GPU worker pin
    device 0) and makes it the process's current device; so it runs here only where that is the
    rollout device and no trainer on another GPU of this process is disturbed. Anywhere else it
    runs in a child whose `CUDA_VISIBLE_DEVICES` holds the rollout GPU alone
    (a3po.rollout.vllm_child.child_environment); under torchrun always in a child (vllm_child says why)."""
    rollout, trainer = torch.device(rollout_device), torch.device(trainer_device)
    if world > 1:
        return "child", f"the trainer is one of {world} torchrun processes"
    if rollout.type == "cuda" and (rollout.index or 0) != 0:
        return "child", f"vLLM in this process would take cuda:0, not {rollout}"
    if rollout.type == "cuda" and trainer.type == "cuda" and (trainer.index or 0) != 0:
        return "child", f"vLLM in this process would make cuda:0 the current device of the trainer on {trainer}"
    return "process", f"vLLM runs on {rollout} in this process"
