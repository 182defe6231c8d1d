"""The one place a `device=` config value becomes a torch device, and `precision=` a compute dtype.

The precision rule (docs/design.md, "Precision"): `bf16` is autocast to bfloat16 with float32
master weights, optimizer state and log-softmax; `fp32` is exact float32. `auto` picks bf16
where it is the faster of the two: a GPU with bf16 support; a CPU with AMX; a CPU with
AVX512-BF16 that is not Intel's. On an Intel CPU with AVX512-BF16 but no AMX, MKL's AVX-512
float32 GEMM outruns oneDNN's bf16 one, and on a CPU with neither oneDNN emulates bf16; `auto`
picks fp32 there (measured in docs/benchmarks.md, "Precision"). Where `bf16` is asked for on
such a CPU anyway (a study registered in bf16), its GEMMs (linear layers, attention's products)
multiply their bf16 operands in float32, the same arithmetic at float32's speed
(`Bf16GemmsInFloat32`).
The trainer's forwards, the recompute forward, the HF engine's sampling, vLLM's dtype and the
benchmark all follow the resolved value, so behaviour and current log-probs are computed alike.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from a3po.errors import ConfigError

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
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


def bf16_gemm_in_float32(device: torch.device) -> bool:
    """Whether `precision=bf16`'s GEMMs multiply in float32 on `device`: a CPU where bf16
    is not the faster (`auto`'s rule), so oneDNN's bf16 GEMM (emulated, or AVX512-BF16 without
    AMX) would run slower than MKL's float32 one for the same arithmetic (docs/benchmarks.md)."""
    device = torch.device(device)
    return device.type == "cpu" and not bf16_is_faster(device)


class Bf16GemmsInFloat32(TorchFunctionMode):
    """bf16 autocast's GEMMs as float32 GEMMs of bf16 operands: `F.linear` (the linear layers)
    and `torch.matmul` (eager attention's two products), each operand rounded to bf16 (autocast's
    cast), multiplied in float32 (a product of two bf16 numbers is exact in float32, and a bf16
    GEMM accumulates in float32 too), the output rounded to bf16. The arithmetic of a bf16 GEMM
    up to the order of the float32 sums, at float32's speed; the backward runs through the same
    float32 GEMMs, its gradients rounded to bf16 at the casts. Where autocast is off (a region
    that turns it off) or an operand is not floating point, the call passes through as it is.
    Where no gradient is taken (the rollout's decode, the recompute forward) a parameter's rounded
    copy is made once per scope and again when the parameter changes in place; under grad, at
    each use."""

    def __init__(self) -> None:
        super().__init__()
        self._rounded: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and not kwargs and _batched_pair(*args):
            return self._matmul(*args)
        if func is torch.nn.functional.linear and _bf16_autocast(args[0] if args else kwargs.get("input")):
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _operand(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        # an activation (or None), or any operand under grad, is rounded where it is used: two
        # backwards (micro-batches) must not share a piece of graph, whose saved tensors a compiled
        # layer's backward frees after the first
        if not isinstance(tensor, torch.nn.Parameter) or torch.is_grad_enabled():
            return None if tensor is None else tensor.to(torch.bfloat16).float()
        held = self._rounded.get(id(tensor))
        if held is None or held[0] is not tensor or held[1] != tensor._version:
            held = (tensor, tensor._version, tensor.to(torch.bfloat16).float())
            self._rounded[id(tensor)] = held
        return held[2]

    def _linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast(input.device.type, enabled=False):
            output = _Float32Linear.apply(self._operand(input), self._operand(weight), self._operand(bias))
        return output.to(torch.bfloat16)

    def _matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast(a.device.type, enabled=False):
            output = _Float32Matmul.apply(self._operand(a), self._operand(b))
        return output.to(torch.bfloat16)


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm)


def _bf16_autocast(tensor) -> bool:
    """Whether autocast would cast a GEMM on `tensor` to bf16 here."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            and torch.is_autocast_enabled(tensor.device.type)
            and torch.get_autocast_dtype(tensor.device.type) == torch.bfloat16)


def _batched_pair(*args) -> bool:
    """Two operands of one batch shape (attention's [batch, heads, rows, cols] products) under
    bf16 autocast; a broadcast, a vector, or anything else passes through."""
    return (len(args) == 2 and all(_bf16_autocast(t) for t in args) and args[0].dim() == args[1].dim() >= 2
            and args[0].shape[:-2] == args[1].shape[:-2])


class _Float32Linear(torch.autograd.Function):
    """`F.linear` of float32 operands whose backward GEMMs are float32 too. autograd's own would
    be cast back to bf16 by the autocast scope a backward is called in (the trainer's minibatch
    scope); `custom_bwd` runs this backward under the forward's autocast state, which is off."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.with_bias = bias is not None
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor):
        input, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_input = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = rows.T @ input.reshape(-1, input.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


class _Float32Matmul(torch.autograd.Function):
    """`torch.matmul` of float32 operands of one batch shape, its backward GEMMs float32 too (as
    `_Float32Linear`'s)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return torch.matmul(a, b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = torch.matmul(grad, b.transpose(-2, -1)) if ctx.needs_input_grad[0] else None
        grad_b = torch.matmul(a.transpose(-2, -1), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def checkpoint_as_forward(function, *args, **kwargs):
    """torch's non-reentrant activation checkpoint, whose recomputation multiplies as the forward
    did. Eager, a backward runs outside every torch function mode (`Tensor.backward` is itself
    dispatched through the mode, which steps aside while it runs), so the recomputation gets a
    `Bf16GemmsInFloat32` of its own where the forward had one (the `context_fn`). Under
    torch.compile, which takes only dispatch modes as a `context_fn`, the mode is traced into the
    layer's graph and the recompute replays that graph; a layer dynamo leaves eager takes the
    first branch."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_recompute_context,
                                             **kwargs)


def _recompute_context():
    return contextlib.nullcontext(), (Bf16GemmsInFloat32() if _in_float32_mode() else contextlib.nullcontext())


def _in_float32_mode() -> bool:
    """Whether a `Bf16GemmsInFloat32` is active on this thread."""
    return any(isinstance(mode, Bf16GemmsInFloat32) for mode in _get_current_function_mode_stack())


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The autocast context for `autocast_dtype`'s answer on `device` (a no-op for None); bf16 on
    a CPU where bf16 is not the faster also multiplies its GEMMs in float32
    (`Bf16GemmsInFloat32`)."""
    if dtype is None:
        return contextlib.nullcontext()
    device = torch.device(device)
    if dtype != torch.bfloat16 or not bf16_gemm_in_float32(device):
        return torch.autocast(device.type, dtype=dtype)
    return _autocast_with_gemms_in_float32(device.type)


@contextlib.contextmanager
def _autocast_with_gemms_in_float32(device_type: str):
    """A scope nested in another (the trainer's forward inside its minibatch scope) keeps the
    outer one's mode, and its rounded weights: one mode, never one inside another."""
    nested = _in_float32_mode()
    mode = contextlib.nullcontext() if nested else Bf16GemmsInFloat32()
    with torch.autocast(device_type, dtype=torch.bfloat16), mode:
        yield
