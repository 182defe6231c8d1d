"""The rollout side of the memory estimate (a3po.memory.estimate): each engine's parts, which its
spec names (a3po.rollout.engines.EngineSpec.memory_parts), from what they are computed from
(`RolloutMemory`). Pure: numbers in, parts out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from a3po.device import vllm_placement
from a3po.memory.parts import (BF16_CPU_BYTES_PER_POSITION, DECODE_VOCAB_BYTES, GIB, PREFILL_ATTENTION_BYTES, SHARED_MEMORY,
                               Architecture, Part, format_bytes)
from a3po.memory.train import layer_tensor
from a3po.run_config import RunConfig

__all__ = ["RolloutMemory", "hf_rollout_memory", "vllm_rollout_memory", "rollout_parts", "dtype_bytes"]


def dtype_bytes(dtype: str) -> int:
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


@dataclass(frozen=True)
class RolloutMemory:
    """What an engine's memory parts (a3po.rollout.engines.EngineSpec.memory_parts) are computed
    from: the run's config and the model's architecture; the weights' bytes a parameter; whether
    the rollout holds a policy of its own (`separate`: elsewhere, or under torchrun); where it
    and the trainer run; the rollout GPU's size (engines `sized_by_device`); the task's longest
    prompt; the bytes an activation (`compute`); whether bf16 casts float32 weights; the async
    runtime; eager attention; whether bf16's GEMMs multiply in float32 on the rollout's device;
    torchrun's processes."""

    config: RunConfig
    arch: Architecture
    weight_bytes: int
    separate: bool
    device: str
    trainer_device: str
    device_total: int | None
    prompt_tokens: int
    compute: int
    cast_bf16: bool
    concurrent: bool
    eager: bool
    gemms_in_float32: bool
    world: int = 1


def hf_rollout_memory(m: RolloutMemory) -> list[Part]:
    """The HF engine: its weights beside the trainer's, and its decode loop's."""
    gemms = m.cast_bf16 and m.gemms_in_float32
    return (_hf_rollout_weights(m.arch, m.weight_bytes, cast_bf16=m.cast_bf16, private=m.concurrent,
                                separate=m.separate, device=m.device, gemms_in_float32=gemms)
            + _hf_rollout(m.config, m.arch, m.prompt_tokens, m.compute, m.device, eager=m.eager, gemms_in_float32=gemms))


def vllm_rollout_memory(m: RolloutMemory) -> list[Part]:
    """vLLM holds its own weights and a KV cache of a configured size: `rollout.cpu_kv_cache_gib`
    on a CPU; on a GPU `rollout.gpu_memory_utilization` of the device's memory, weights included.
    Its host copy of the policy (a3po.run.parts) where the rollout is elsewhere or in a child
    process; a child maps that copy's storage from shared memory (a3po.rollout.vllm_child), so
    it takes its size in /dev/shm as well. Under runtime=async an update that arrives during a
    generation is staged in vLLM's dtype (a3po.rollout.base): beside the trainer's weights in
    process, in host memory in a child."""
    cfg, arch, weight_bytes, separate, device = m.config, m.arch, m.weight_bytes, m.separate, m.device
    rollout, device_total, precision, trainer_device = cfg.rollout, m.device_total, cfg.precision, m.trainer_device
    child = vllm_placement(device, trainer_device, m.world)[0] == "child"
    parts = []
    if separate or child:
        parts.append(Part("rollout policy copy (host)", arch.n_params * weight_bytes, ("rollout.device", "model"),
                          "always", "cpu", f"{arch.n_params:,} params x {weight_bytes} B"))
    if child:
        parts.append(Part("vLLM child's weights in shared memory", arch.n_params * weight_bytes,
                          ("rollout.device", "torchrun --nproc-per-node", "model"), "always", SHARED_MEMORY,
                          f"the host copy's storage, {arch.n_params:,} params x {weight_bytes} B, mapped by the child"))
    dtype = rollout.dtype or ("bfloat16" if precision == "bf16" else cfg.model.dtype)
    vllm_weight_bytes = weight_bytes if dtype == "auto" else dtype_bytes(dtype)
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


def _hf_rollout(cfg: RunConfig, arch: Architecture, prompt_tokens: int, compute: int, device: str, *, eager: bool,
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
