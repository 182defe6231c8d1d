"""Will this run fit? Its peak resident memory, estimated from the composed config and the
model's architecture before anything heavy loads (docs/design.md, "Memory check"); the check
that holds it against the machine at start is a3po.run.memory_check (`memory_check`,
conf/config.yaml).

Without it a config too large for the machine (`train.n_prompts=100000`) runs until the
kernel's OOM killer ends it: exit 137, no message, a half-written run directory. With it the
run stops in seconds with exit 2 and a `config error:` that names the estimate, what the
machine has, the largest parts and the keys that drive them.

The estimate is a sum of named parts (a3po.memory.parts.Part), each a formula over the
config and the architecture with the keys that drive it; its constants were measured (peak RSS
of real runs, saved-tensor sizes), not derived. Parts belong to a phase: `always` (held for the
whole run), `rollout` or `train`. The async runtime generates while it trains, so both phases
add; the lagged one takes turns, and its peak holds the larger phase plus what the allocator
kept of the other (`Estimate.peak`). Every figure is an upper bound of its kind: each prompt as
long as the task's longest, each response `rollout.max_new_tokens` long. The figures are for a
dense decoder-only model (llama, qwen2, mistral); a mixture-of-experts or another attention
layout is estimated as if it were one. Everything here is pure: numbers in, numbers out.
"""

from __future__ import annotations

from typing import Callable, Sequence

from a3po.memory.parts import (BASELINE_BYTES, HEAP_SLACK, MMAP_THRESHOLD_MAX, SAMPLE_BYTES, SMALL_ALLOCATION,
                               Architecture, Estimate, Part, format_bytes)
from a3po.memory.rollout import RolloutMemory, dtype_bytes
from a3po.memory.train import TrainShape, layer_tensor, micro_batch_shape, train_parts
from a3po.run_config import RunConfig

__all__ = ["estimate_memory", "heap_slack"]


def heap_slack(parts: Sequence[Part]) -> list[Part]:
    """What glibc's heap holds beyond a phase's small allocations on a CPU (`HEAP_SLACK`): the
    holes freed tensors leave that the next ones, of other shapes, cannot reuse. One part per
    phase, driven by that phase's largest part's keys."""
    slack = []
    for phase in ("rollout", "train"):
        small = [p for p in parts if p.phase == phase and p.device == "cpu" and p.tensor < SMALL_ALLOCATION]
        if small:
            total = sum(p.nbytes for p in small)
            largest = max(small, key=lambda p: p.nbytes)
            slack.append(Part(f"{phase} heap fragmentation", int((HEAP_SLACK - 1) * total), largest.keys, phase, "cpu",
                              f"{HEAP_SLACK - 1:.2f} x the phase's {format_bytes(total)} in allocations under "
                              f"{format_bytes(SMALL_ALLOCATION)}"))
    return slack


def estimate_memory(cfg: RunConfig, arch: Architecture, *, rollout_parts: Callable[[RolloutMemory], list[Part]],
                    prompt_tokens: int, trainer_device: str = "cpu",
                    rollout_device: str | None = None, world: int = 1, device_total: int | None = None,
                    eager_attention: bool = True, mmap_threshold: int = MMAP_THRESHOLD_MAX,
                    gemms_in_float32: tuple[bool, bool] = (False, False)) -> Estimate:
    """The peak of one run of `cfg` (`precision` resolved) as named parts; `rollout_parts`: its
    engine's (a3po.rollout.engines.EngineSpec.memory_parts).

    `prompt_tokens`: the task's longest prompt; `trainer_device`/`rollout_device`: where the
    trainer and the rollout run ("cpu", "cuda:0"); `world`: torchrun's processes (each trains
    on a shard; FSDP shards weights, gradients and AdamW state; the figures are rank 0's, plus
    the other ranks' processes where they share the host); `device_total`: the rollout GPU's
    memory, for vLLM's share of it; `mmap_threshold`: glibc's, as the run will set it
    (a3po.allocator), which decides what the heap keeps between phases;
    `gemms_in_float32`: whether bf16's GEMMs (linear layers, attention) multiply in float32, holding float32
    operands, on the trainer's and on the rollout's device (`a3po.device.bf16_gemm_in_float32`)."""
    train_gemms_in_float32, rollout_gemms_in_float32 = gemms_in_float32
    rollout_device = rollout_device or trainer_device
    model_dtype = cfg.model.dtype
    weight_bytes = dtype_bytes(model_dtype)
    cast_bf16 = cfg.precision == "bf16" and model_dtype == "float32"
    compute = 2 if cfg.precision == "bf16" or weight_bytes == 2 else 4
    concurrent = cfg.runtime.name == "async"
    parts = _trainer_state(arch, weight_bytes, world, trainer_device)
    parts += rollout_parts(RolloutMemory(
        cfg, arch, weight_bytes, separate=world > 1 or rollout_device != trainer_device, device=rollout_device,
        trainer_device=trainer_device, device_total=device_total, prompt_tokens=prompt_tokens, compute=compute,
        cast_bf16=cast_bf16, concurrent=concurrent, eager=eager_attention, gemms_in_float32=rollout_gemms_in_float32,
        world=world))
    parts.append(_held_batches(cfg, prompt_tokens, concurrent))
    sequence = prompt_tokens + cfg.rollout.max_new_tokens
    train = cfg.train
    rows, _ = micro_batch_shape(n_samples_total=train.n_prompts * train.n_samples, n_minibatches=train.n_minibatches,
                                world=world, token_budget=train.token_budget, sequence=sequence)
    shape = TrainShape(rows=rows, sequence=sequence, response=cfg.rollout.max_new_tokens, compute=compute,
                       cast_bf16=cast_bf16, eager=eager_attention, world=world, weight_bytes=weight_bytes,
                       checkpointing=train.activation_checkpointing,
                       fsdp_mixed=train.fsdp_mixed_precision, gemms_in_float32=cast_bf16 and train_gemms_in_float32)
    parts += train_parts(arch, shape, trainer_device)
    parts += heap_slack(parts)
    if world > 1 and trainer_device == "cpu":
        parts.append(_other_ranks(parts, world))
    return Estimate(tuple(p for p in parts if p.nbytes > 0), concurrent, mmap_threshold)


def _trainer_state(arch: Architecture, weight_bytes: int, world: int, device: str) -> list[Part]:
    """The process itself, and the weights, gradients and AdamW state (FSDP: this rank's shard)."""
    shard = arch.n_params / world
    per_rank = f" / {world} ranks" if world > 1 else ""
    return [
        Part("process baseline", BASELINE_BYTES, (), "always", "cpu", "python, torch, transformers, a3po, tokenizer"),
        Part("weights", int(shard * weight_bytes), ("model", "model.dtype"), "always", device,
             f"{arch.n_params:,} params x {weight_bytes} B{per_rank}"),
        Part("gradients", int(shard * weight_bytes), ("model",), "train", device,
             f"{arch.n_params:,} params x {weight_bytes} B{per_rank}", tensor=layer_tensor(arch, weight_bytes)),
        Part("AdamW state", int(2 * shard * weight_bytes), ("model",), "always", device,
             f"2 x {arch.n_params:,} params x {weight_bytes} B{per_rank}"),
    ]


def _held_batches(cfg: RunConfig, prompt_tokens: int, concurrent: bool) -> Part:
    """The batches the runtime holds: the lagged one D + 1, the async one up to its staleness
    bound plus the one in training."""
    train = cfg.train
    held = cfg.runtime.max_staleness + 2 if concurrent else cfg.staleness + 1
    per_sample = SAMPLE_BYTES + 8 * prompt_tokens + 20 * cfg.rollout.max_new_tokens
    return Part("rollout batches held", held * train.n_prompts * train.n_samples * per_sample,
                ("train.n_prompts", "train.n_samples", "staleness"), "always", "cpu",
                f"{held} batches x {train.n_prompts * train.n_samples} samples x {per_sample} B")


def _other_ranks(parts: Sequence[Part], world: int) -> Part:
    """Every other rank of a torchrun job on this host is a process of its own: its baseline,
    its shards and its micro-batch (rank 0 alone holds the rollout side)."""
    trainer_side = {"process baseline", "weights", "gradients", "AdamW state", "training activations",
                    "training activations (checkpointed)", "FSDP2 gathered weights",
                    "training response logits", "training autocast weight casts", "train heap fragmentation"}
    per_rank = sum(p.nbytes for p in parts if p.name in trainer_side)
    return Part("the other ranks' processes", (world - 1) * per_rank, ("torchrun --nproc-per-node",), "always", "cpu",
                f"{world - 1} x {format_bytes(per_rank)}")
