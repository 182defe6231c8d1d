"""bf16 autocast's GEMMs as float32 GEMMs of bf16 operands, for a CPU where bf16 is not the faster.

On such a CPU (`a3po.device.bf16_is_faster` is false: oneDNN emulates bf16, or runs AVX512-BF16
without AMX on Intel) a study registered in bf16 still computes bf16's arithmetic, at float32's
speed: `a3po.device.autocast` adds `Bf16GemmsInFloat32` to its bf16 scope there. The linear
layers (`F.linear`) and eager attention's two products (`torch.matmul` of one batch shape) round
their operands to bf16, multiply them with MKL's float32 GEMM and round the output to bf16,
forward and backward (docs/design.md, "Precision"; measured in docs/benchmarks.md).
`checkpoint_as_forward` gives activation checkpointing's recomputation the same mode.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


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
    layer's graph and the recompute replays that graph; a layer dynamo leaves eager (a graph
    break) is checkpointed as an eager one, with the `context_fn`."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_recompute_context,
                                             **kwargs)


def _recompute_context():
    return contextlib.nullcontext(), (Bf16GemmsInFloat32() if in_float32_mode() else contextlib.nullcontext())


def in_float32_mode() -> bool:
    """Whether a `Bf16GemmsInFloat32` is active on this thread."""
    return any(isinstance(mode, Bf16GemmsInFloat32) for mode in _get_current_function_mode_stack())


@contextlib.contextmanager
def autocast_with_gemms_in_float32(device_type: str):
    """bf16 autocast with `Bf16GemmsInFloat32` (`a3po.device.autocast` decides where). A scope
    nested in another (the trainer's forward inside its minibatch scope) keeps the outer one's
    mode, and its rounded weights: one mode, never one inside another."""
    nested = in_float32_mode()
    mode = contextlib.nullcontext() if nested else Bf16GemmsInFloat32()
    with torch.autocast(device_type, dtype=torch.bfloat16), mode:
        yield
