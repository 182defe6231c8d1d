"""Will this run fit? Its peak resident memory, estimated from the composed config and the
model's architecture before anything heavy loads (docs/design.md, "Memory check"); the check
that holds it against the machine at start is a3po.run.memory_check (`memory_check`,
conf/config.yaml).

Without it a config too large for the machine (`train.n_prompts=100000`) runs until the
kernel's OOM killer ends it: exit 137, no message, a half-written run directory. With it the
run stops in seconds with exit 2 and a `config error:` that names the estimate, what the
machine has, the largest parts and the keys that drive them.

The estimate is a sum of named parts (a3po.run.memory_model.Part), each a formula over the
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

import math
from typing import Any, Sequence

from a3po.run_config import RunConfig
from a3po.run.memory_model import (BASELINE_BYTES, BF16_CPU_BYTES_PER_POSITION, DECODE_VOCAB_BYTES, GIB, HEAP_SLACK,
                                   MMAP_THRESHOLD_MAX, PREFILL_ATTENTION_BYTES, SAMPLE_BYTES, SMALL_ALLOCATION,
                                   Architecture, Estimate, Part, format_bytes)
from a3po.run.memory_train import TRAIN_KEYS, TrainShape, layer_tensor, micro_batch_shape, train_parts

__all__ = ["estimate_memory", "rollout_parts", "train_parts", "micro_batch_shape", "heap_slack", "TRAIN_KEYS"]


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def _rows(n: int, batch_size: int | None) -> int:
    """Sequences decoded together: every request at once, or `rollout.batch_size` of them."""
    return min(n, batch_size) if batch_size else n


def rollout_parts(arch: Architecture, *, rows: int, prompt: int, new_tokens: int, compute: int, device: str,
                  keys: tuple[str, ...], label: str = "rollout", samples: int = 1, eager: bool = True,
                  gemms_in_float32: bool = False) -> list[Part]:
    """The HF engine's decode loop (a3po.rollout.decode) on `rows` sequences at once: its KV
    cache, preallocated for the longest prompt plus every new token, what attention copies of it
    at a decode step, one decode step's vocabulary-sized tensors, and the prefill's attention
    over the prompt, once per distinct prompt (a group's `samples` share one)."""
    positions = prompt + new_tokens
    kv = arch.num_hidden_layers * 2 * rows * arch.num_key_value_heads * positions * arch.head_dim * compute
    step = rows * arch.vocab_size * DECODE_VOCAB_BYTES
    prompts = math.ceil(rows / samples)
    prefill = prompts * arch.num_attention_heads * prompt * prompt * PREFILL_ATTENTION_BYTES
    return [
        _attention_copy(arch, rows=rows, positions=positions, compute=compute, device=device, keys=keys, label=label,
                        eager=eager, gemms_in_float32=gemms_in_float32),
        Part(f"{label} KV cache", kv, keys, "rollout", device,
             f"{arch.num_hidden_layers} layers x 2 x {rows} rows x {arch.num_key_value_heads} kv heads x "
             f"({prompt} prompt + {new_tokens} new) positions x {arch.head_dim} x {compute} B",
             tensor=kv // (2 * arch.num_hidden_layers)),
        Part(f"{label} decode step (logits, sampling)", step, keys[:3], "rollout", device,
             f"{rows} rows x {arch.vocab_size} vocab x {DECODE_VOCAB_BYTES} B", tensor=rows * arch.vocab_size * 4),
        Part(f"{label} prefill attention", prefill, keys[:3] + ("task",), "rollout", device,
             f"{prompts} prompts x {arch.num_attention_heads} heads x {prompt}^2 x {PREFILL_ATTENTION_BYTES} B",
             tensor=prompts * arch.num_attention_heads * prompt * prompt * 4),
    ]


def _attention_copy(arch: Architecture, *, rows: int, positions: int, compute: int, device: str,
                    keys: tuple[str, ...], label: str, eager: bool, gemms_in_float32: bool) -> Part:
    """What attention copies of one layer's cache at a decode step. sdpa (given the loop's mask)
    repeats each key/value head for its query heads (transformers' `repeat_kv`): keys and values
    at the query heads' width. The loop's eager attention reads the cache where it lies
    (a3po.rollout.attention); where bf16's GEMMs multiply in float32 it takes a float32 copy of
    the keys, then of the values."""
    if eager:
        copied = rows * arch.num_key_value_heads * positions * arch.head_dim * 4 if gemms_in_float32 else 0
        return Part(f"{label} key/value heads in float32", copied, keys, "rollout", device,
                    f"{rows} rows x {arch.num_key_value_heads} kv heads x {positions} positions x {arch.head_dim} x "
                    f"4 B (one layer's keys or values, at each decode step)", tensor=copied)
    repeated = 2 * rows * arch.num_attention_heads * positions * arch.head_dim * compute
    repeated = repeated if arch.num_attention_heads != arch.num_key_value_heads else 0
    return Part(f"{label} repeated key/value heads", repeated, keys, "rollout", device,
                f"2 x {rows} rows x {arch.num_attention_heads} heads x {positions} positions x {arch.head_dim} x "
                f"{compute} B (one layer's, at each decode step)", tensor=repeated // 2)


def _hf_rollout_weights(arch: Architecture, weight_bytes: int, *, cast_bf16: bool, private: bool,
                        separate: bool, device: str, gemms_in_float32: bool = False) -> list[Part]:
    """The HF engine's weights beside the trainer's (a3po.rollout.weights.ComputeWeights,
    a3po.run.parts.build_parts): a policy of its own where it runs elsewhere (`rollout.device`,
    torchrun); under bf16 a bf16 copy of every linear layer, and where bf16's linear layers
    multiply in float32 (a3po.gemms.Bf16GemmsInFloat32) their rounded float32 copies while it
    samples; under runtime=async a private copy of every other weight too."""
    parts = []
    if separate:
        parts.append(Part("rollout policy copy", arch.n_params * weight_bytes, ("rollout.device", "model"), "always",
                          device, f"{arch.n_params:,} params x {weight_bytes} B (rollout elsewhere)"))
    untied_linear = arch.linear_params - (arch.lm_head_params if arch.tie_word_embeddings else 0)
    if cast_bf16:
        parts.append(Part("rollout bf16 linear weights", arch.linear_params * 2, ("precision", "model.dtype", "model"),
                          "always", device, f"{arch.linear_params:,} linear params (lm_head included) x 2 B"))
        if gemms_in_float32:
            parts.append(Part("rollout linear weights rounded, in float32", arch.linear_params * 4,
                              ("precision", "model.dtype", "model"), "rollout", device,
                              f"{arch.linear_params:,} linear params x 4 B (bf16 GEMMs run in float32 here)"))
    if private:
        rest = arch.n_params - untied_linear if cast_bf16 else arch.n_params
        parts.append(Part("rollout private weights (async)", rest * weight_bytes, ("runtime.name", "model"), "always",
                          device, f"{rest:,} params x {weight_bytes} B"))
        staged = (arch.n_params + (arch.lm_head_params if arch.tie_word_embeddings else 0)) * weight_bytes
        parts.append(Part("rollout staged weight update (async)", staged, ("runtime.name", "model"), "rollout", device,
                          "one clone of the state dict (a tied weight twice)", tensor=layer_tensor(arch, weight_bytes)))
    return parts


def _vllm_parts(cfg: Any, arch: Architecture, weight_bytes: int, *, separate: bool, device: str,
                device_total: int | None, precision: str, trainer_device: str = "cpu") -> list[Part]:
    """vLLM holds its own weights and a KV cache of a configured size: `rollout.cpu_kv_cache_gib`
    on a CPU; on a GPU `rollout.gpu_memory_utilization` of the device's memory, weights included.
    Its host copy of the policy (a3po.run.parts) where the rollout is elsewhere. Under
    runtime=async an update that arrives during a generation is staged in vLLM's dtype
    (a3po.rollout.base): beside the trainer's weights in process, in host memory in a child."""
    rollout = cfg.rollout
    parts = []
    if separate:
        parts.append(Part("rollout policy copy (host)", arch.n_params * weight_bytes, ("rollout.device", "model"),
                          "always", "cpu", f"{arch.n_params:,} params x {weight_bytes} B"))
    dtype = rollout.dtype or ("bfloat16" if precision == "bf16" else cfg.model.dtype)
    vllm_weight_bytes = weight_bytes if dtype == "auto" else _dtype_bytes(dtype)
    if cfg.runtime.name == "async":
        staged = (arch.n_params + (arch.lm_head_params if arch.tie_word_embeddings else 0)) * vllm_weight_bytes
        parts.append(Part("vLLM staged weight update (async)", staged, ("runtime.name", "rollout.dtype", "model"),
                          "rollout", "cpu" if separate else trainer_device,
                          f"one copy of the state dict in vLLM's {vllm_weight_bytes}-byte dtype (a tied weight twice)",
                          tensor=layer_tensor(arch, vllm_weight_bytes)))
    if device.startswith("cuda"):
        share = float(rollout.gpu_memory_utilization)
        total = int(share * (device_total or 0))
        parts.append(Part("vLLM weights and KV cache", total, ("rollout.gpu_memory_utilization",), "always", device,
                          f"{share} x the device's {format_bytes(device_total or 0)}"))
        return parts
    gib = float(rollout.cpu_kv_cache_gib)
    parts.append(Part("vLLM weights", arch.n_params * vllm_weight_bytes, ("rollout.name", "rollout.dtype", "model"),
                      "always", device, f"{arch.n_params:,} params x {vllm_weight_bytes} B"))
    parts.append(Part("vLLM KV cache", int(gib * GIB), ("rollout.cpu_kv_cache_gib",), "always", device, f"{gib} GiB"))
    return parts


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


def estimate_memory(cfg: Any, arch: Architecture, *, prompt_tokens: int, trainer_device: str = "cpu",
                    rollout_device: str | None = None, world: int = 1, device_total: int | None = None,
                    eager_attention: bool = True, mmap_threshold: int = MMAP_THRESHOLD_MAX,
                    gemms_in_float32: tuple[bool, bool] = (False, False)) -> Estimate:
    """The peak of one run of `cfg` (composed, `precision` resolved) as named parts.

    `prompt_tokens`: the task's longest prompt; `trainer_device`/`rollout_device`: where the
    trainer and the rollout run ("cpu", "cuda:0"); `world`: torchrun's processes (each trains
    on a shard; FSDP shards weights, gradients and AdamW state; the figures are rank 0's, plus
    the other ranks' processes where they share the host); `device_total`: the rollout GPU's
    memory, for vLLM's share of it; `mmap_threshold`: glibc's, as the run will set it
    (a3po.allocator), which decides what the heap keeps between phases;
    `gemms_in_float32`: whether bf16's GEMMs (linear layers, attention) multiply in float32, holding float32
    operands, on the trainer's and on the rollout's device (`a3po.device.bf16_gemm_in_float32`)."""
    train_gemms_in_float32, rollout_gemms_in_float32 = gemms_in_float32
    cfg = RunConfig.of(cfg)  # typed (as is when it already is)
    rollout_device = rollout_device or trainer_device
    model_dtype = cfg.model.dtype
    weight_bytes = _dtype_bytes(model_dtype)
    cast_bf16 = cfg.precision == "bf16" and model_dtype == "float32"
    compute = 2 if cfg.precision == "bf16" or weight_bytes == 2 else 4
    concurrent = cfg.runtime.name == "async"
    parts = _trainer_state(arch, weight_bytes, world, trainer_device)
    if cfg.rollout.name == "vllm":
        parts += _vllm_parts(cfg, arch, weight_bytes, separate=world > 1 or rollout_device != trainer_device,
                             device=rollout_device, device_total=device_total, precision=cfg.precision,
                             trainer_device=trainer_device)
    else:
        parts += _hf_rollout_weights(arch, weight_bytes, cast_bf16=cast_bf16, private=concurrent,
                                     separate=world > 1 or rollout_device != trainer_device, device=rollout_device,
                                     gemms_in_float32=cast_bf16 and rollout_gemms_in_float32)
        parts += _hf_rollout(cfg, arch, prompt_tokens, compute, rollout_device, eager=eager_attention,
                             gemms_in_float32=cast_bf16 and rollout_gemms_in_float32)
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


def _hf_rollout(cfg: Any, arch: Architecture, prompt_tokens: int, compute: int, device: str, *, eager: bool,
                gemms_in_float32: bool) -> list[Part]:
    """The training rollout's decode loop, or the eval's where it holds more rows (the eval
    samples `train.eval_size` prompts once each); bf16 on a CPU, its kernels per position."""
    train, rollout = cfg.train, cfg.rollout
    batch_size = rollout.batch_size
    kernels = dict(compute=compute, device=device, eager=eager, gemms_in_float32=gemms_in_float32)
    chosen = rollout_parts(arch, rows=_rows(train.n_prompts * train.n_samples, batch_size), prompt=prompt_tokens,
                           new_tokens=rollout.max_new_tokens, samples=train.n_samples, **kernels,
                           keys=("train.n_prompts", "train.n_samples", "rollout.batch_size", "rollout.max_new_tokens"))
    if train.eval_every:
        eval_samples = train.eval_samples
        evaluation = rollout_parts(arch, rows=_rows(train.eval_size * eval_samples, batch_size), prompt=prompt_tokens,
                                   new_tokens=rollout.max_new_tokens, label="eval rollout", samples=eval_samples,
                                   **kernels, keys=("train.eval_size", "train.eval_samples", "rollout.batch_size",
                                                    "rollout.max_new_tokens"))
        if sum(p.nbytes for p in evaluation) > sum(p.nbytes for p in chosen):
            chosen = evaluation
    if compute == 2 and device == "cpu":
        positions = prompt_tokens + rollout.max_new_tokens
        chosen.append(Part("bf16 decode kernels (CPU)", positions * BF16_CPU_BYTES_PER_POSITION,
                           ("precision", "rollout.max_new_tokens"), "always", "cpu",
                           f"{positions} positions x {format_bytes(BF16_CPU_BYTES_PER_POSITION)}"))
    return chosen


def _held_batches(cfg: Any, prompt_tokens: int, concurrent: bool) -> Part:
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
