"""Data-parallel training over torchrun's processes: FSDP2 (`fully_shard`) and gloo/nccl.

One process per trainer device, launched by `torchrun --nproc-per-node N experiments/train.py ...`.
Without torchrun `init_distributed` returns world 1 and every helper is the identity: a plain
run is the single-process code path, bit for bit.

Layout (docs/distributed.md): rank 0 generates every batch and broadcasts it; each rank trains
on its shard of every minibatch; FSDP2 sums the gradients (the loss is already normalised by
the whole minibatch's token count); rank 0 alone logs and writes checkpoints, which hold the
full (gathered) model and optimizer state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

# `train.collective_timeout_min: null`: how long a rank waits in a collective (or for the others
# to join the group) before the job fails. Above every wait that rank 0 makes alone while the
# others sit in a collective: the vLLM child's start (a3po.rollout.vllm_child.START_TIMEOUT_S,
# 15 min), a checkpoint's write, an eval, a batch's generation. torch's own default is 10 min.
COLLECTIVE_TIMEOUT_MIN = 30.0

@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    is_main: bool = True


SINGLE = DistInfo()


def launched_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun or a multi-task job)."""
    adopt_submitit_tasks()
    return int(os.environ.get("WORLD_SIZE", "1"))


def adopt_submitit_tasks() -> None:
    """A submitit SLURM job of several tasks (hydra.launcher.tasks_per_node > 1, slurm/README.md)
    is a distributed run too: each task is a rank. submitit's own helper exports torchrun's
    variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from SLURM's; every task keeps
    seeing all the node's GPUs, so rollout.device can name one no rank trains on."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    import submitit
    from submitit.helpers import TorchDistributedEnvironment

    if submitit.JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def collective_timeout(minutes: float | None) -> timedelta:
    """`train.collective_timeout_min` as the process group's timeout (null: COLLECTIVE_TIMEOUT_MIN)."""
    return timedelta(minutes=COLLECTIVE_TIMEOUT_MIN if minutes is None else float(minutes))


def init_distributed(device: torch.device, timeout_min: float | None = None) -> DistInfo:
    """Join torchrun's process group (nccl on cuda, gloo on cpu); world 1 without torchrun.
    On cuda each rank takes cuda:LOCAL_RANK (see `rank_device`). `timeout_min`
    (`train.collective_timeout_min`): how long a collective waits for the slowest rank."""
    world = launched_world()
    if world == 1:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=collective_timeout(timeout_min))
    return DistInfo(rank=rank, world=world, local_rank=local_rank, is_main=rank == 0)


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """The trainer device of this rank: cuda:LOCAL_RANK on a GPU when distributed."""
    if device.type == "cuda" and info.world > 1:
        return torch.device("cuda", info.local_rank)
    return device


def close_distributed(info: DistInfo) -> None:
    if info.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def shard(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """This rank's part of a minibatch: every world-th index from `rank`, so parts differ in
    size by at most one and each rank sees a similar mix of lengths."""
    return list(indices[rank::world])


# ------------------------------------------------------------------ collectives
def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(tensor: torch.Tensor, op) -> torch.Tensor:
    if _active():
        dist.all_reduce(tensor, op=op)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; the tensor itself when not distributed (so max and min)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    return _all_reduce(tensor, dist.ReduceOp.MIN)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when it is true on one (a stop signal that reached one process)."""
    if info.world == 1:
        return flag
    return bool(all_reduce_max(torch.tensor([int(flag)], device=_collective_device())).item())


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (pickled; a batch of token ids is small)."""
    if info.world == 1:
        return obj
    box = [obj if info.is_main else None]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
    return box[0]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ FSDP2
def wrap_fsdp(model: torch.nn.Module, forward_method: Callable[..., Any] | None = None,
              mixed_precision: bool = False) -> Callable[..., Any] | None:
    """Shard `model` over every rank with FSDP2: each decoder layer, then the root (embedding,
    final norm, tied lm_head). Gradients are SUMMED over ranks, not averaged: each rank's loss
    is its share of the whole minibatch's token mean, so the sum is the 1-process gradient.
    `forward_method` (the trainer's, which calls the decoder and lm_head itself) is returned
    wrapped so the root's parameters are gathered around it as around `forward`.
    `mixed_precision` (`train.fsdp_mixed_precision`): weights gathered in bf16, gradients
    reduced in float32 (FSDP2's MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
              else MixedPrecisionPolicy())
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: gloo has no AVG or PREMUL_SUM, and a factor of 1 needs no scaling
            module.set_force_sum_reduction_for_comms(True)
    if forward_method is None:
        return None
    model.a3po_forward = forward_method
    register_fsdp_forward_method(model, "a3po_forward")
    return model.a3po_forward


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (clip_grad_norm_ over sharded gradients returns one); else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on rank 0, on the host ({} on other ranks). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's state gathered on rank 0, keyed by parameter name. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, Any] | None, optimizer_state: dict[str, Any] | None) -> None:
    """Load rank 0's full model and optimizer state into every rank's shards (broadcast from
    rank 0: the others pass None, never reading the file). Loading replaces the values of the
    dicts it is given with shards, hence the copies."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _options(broadcast_from_rank0=True)
    set_model_state_dict(model, dict(model_state or {}), options=options)
    set_optimizer_state_dict(model, optimizer, dict(optimizer_state or {}), options=options)
