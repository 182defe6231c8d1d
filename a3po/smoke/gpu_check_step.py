"""The one-call GPU check's trainer items (a3po.smoke.gpu_check), run in their subprocesses by
a3po.smoke.gpu_check_probes:

- `trainer_rank0_of_2`: the multi-rank trainer code over a world-1 process group (nccl on the
  GPU, gloo in the dry run) with the trainer told it is rank 0 of 2: FSDP2 wraps the model, the
  batch is broadcast, every rank-count reduction of a step runs as a collective, and the full
  state dicts a checkpoint holds are gathered. (FSDP2 itself skips its all-gathers and
  reduce-scatters in a group of one: those need two GPUs, the smoke's `fsdp2-nccl`.)
- `qwen_step`: one training step at Qwen2.5-1.5B's exact sizes (random weights) with the gpu1
  layout's settings (conf/layout/gpu1.yaml under experiment=paper_gsm8k), beside one block of
  `rollout.gpu_memory_utilization` x the GPU's memory standing in for vLLM's share, under
  PyTorch's default allocator: peak allocated and reserved memory and the allocator's retries,
  and the step's seconds (the first step of the process: cold kernels and AdamW's state included).

Both train on a synthetic batch (random token ids, rewards and behaviour log-probs): no
tokenizer, no task, no rollout engine. The dry run (`dry_run=True`) runs the same code on the
CPU with a scaled-down model.
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any, Callable

import torch

__all__ = ["trainer_rank0_of_2", "qwen_step", "QWEN_1_5B", "SCALED_DOWN"]

QWEN_1_5B = "Qwen/Qwen2.5-1.5B-Instruct"
# The dry run's stand-in for the 1.5B model: the same architecture (qwen2, tied), a CPU's size.
SCALED_DOWN = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
# The step's batch: 12 prompts x 4 samples of the paper's longest sequence (the memory check's
# GSM8K prompt bound + rollout.max_new_tokens), 6 rows a micro-batch at train.token_budget=10240,
# so the step reaches the per-micro-batch peak of the paper's step in 8 micro-batches.
QWEN_STEP_PROMPTS = 12
QWEN_STEP_OVERRIDES = ("experiment=paper_gsm8k", "layout=gpu1", "logger=none", f"train.n_prompts={QWEN_STEP_PROMPTS}")
DRY_STEP_OVERRIDES = ("device=cpu", "precision=fp32", "train.n_prompts=2", "train.token_budget=256",
                      "rollout.max_new_tokens=24")
DRY_PROMPT_TOKENS = 24
# The multi-rank item: the scaled-down model, 4 prompts x 4 samples in 2 minibatches, 2 steps.
RANKS_OVERRIDES = ("model=tiny", "logger=none", "train.n_prompts=4", "train.n_samples=4", "train.n_minibatches=2",
                   "train.token_budget=256")
RANKS_PROMPT_TOKENS, RANKS_RESPONSE_TOKENS, RANKS_STEPS = 16, 16, 2
COLLECTIVES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_tensor", "reduce_scatter_single")
ALLOC_CONF_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
GIB = 2**30


def the_device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to this process (torch.cuda.is_available() is False); "
                           "the dry run (--dry-run) runs the CPU stand-ins")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def compose_resolved(overrides: list[str], device: torch.device):
    """The training config as a run resolves it: Hydra's composition, `precision` resolved for `device`."""
    from a3po.device import resolve_precision
    from a3po.smoke.probes import compose

    cfg = compose(overrides)
    return cfg.with_values(precision=resolve_precision(cfg.precision, device, cfg.model.dtype))


def build_qwen2(sizes: dict[str, Any], device: torch.device, dtype: str, attention: str) -> torch.nn.Module:
    """A Qwen2 causal LM of `sizes`, random weights, built on `device` (no host copy of 1.5 B weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in sizes.items() if k != "model_type"}, attn_implementation=attention)
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, dtype))


def synthetic_batch(n_prompts: int, n_samples: int, prompt_len: int, response_len: int, vocab: int):
    """Random ids, rewards in [0, 1) (so the advantages are not 0) and behaviour log-probs near a
    random model's (-log vocab), every token of policy version 0."""
    from a3po.learner.trainer import RolloutBatch, Sample  # the trainer's input types (a3po.batch)

    rng = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(n_prompts * n_samples):
        behave = -math.log(vocab) + 0.01 * torch.randn(response_len, generator=rng)
        samples.append(Sample(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=rng),
                              response_ids=torch.randint(0, vocab, (response_len,), generator=rng),
                              behave_logp=behave, versions=torch.zeros(response_len, dtype=torch.long),
                              finished=False, reward=float(torch.rand((), generator=rng))))
    return RolloutBatch(step=0, samples=samples, n_prompts=n_prompts, n_samples=n_samples)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(trainer, batch, version: int, device: torch.device) -> tuple[dict[str, float], float]:
    _synchronize(device)
    start = time.perf_counter()
    metrics = trainer.step(batch, version, torch.Generator().manual_seed(version))
    _synchronize(device)
    return metrics, time.perf_counter() - start


def finite_metrics(metrics: dict[str, float], keys: tuple[str, ...] = ("actor/loss", "actor/grad_norm")) -> dict:
    out = {key.split("/")[-1]: metrics.get(key) for key in keys}
    bad = {key: value for key, value in out.items() if not (isinstance(value, float) and math.isfinite(value))}
    if bad:
        raise RuntimeError(f"the step's metrics are not finite: {bad}")
    return out


def cuda_memory(device: torch.device) -> dict[str, Any]:
    """torch's peaks since the process started and the caching allocator's retries and OOMs."""
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "alloc_retries": None, "ooms": None}
    stats = torch.cuda.memory_stats(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "alloc_retries": int(stats.get("num_alloc_retries", 0)), "ooms": int(stats.get("num_ooms", 0))}


# ------------------------------------------------------------------ rank 0 of 2 over a world-1 group
def _count_collectives(dist) -> dict[str, int]:
    """Wrap torch.distributed's collectives (those this torch has) to count their calls."""
    counts: dict[str, int] = {}

    def counted(name: str, function: Callable) -> Callable:
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))
    return counts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join_world_of_one(dist, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group(backend, rank=0, world_size=1)


def trainer_rank0_of_2(dry_run: bool) -> dict[str, Any]:
    """Two steps of the trainer told it is rank 0 of 2 (a3po.distributed.DistInfo) in a world-1
    group. At one rank the suite's helpers skip a collective (a3po.distributed._active); here they
    call it, as at world 2: a collective over one rank returns its input, so the step computes
    what it would, and every collective it makes reaches the backend with the tensors it made."""
    import torch.distributed as dist

    import a3po.distributed as a3po_dist
    from a3po.learner.build import trainer_from
    from a3po.timer import PhaseTimer

    device = the_device(dry_run)
    backend = "gloo" if dry_run else "nccl"
    _join_world_of_one(dist, backend)
    counts = _count_collectives(dist)
    a3po_dist._active = lambda: dist.is_available() and dist.is_initialized()
    try:
        dry = ("precision=fp32",) if dry_run else ()  # float32 on the CPU: 2 cores in CI
        cfg = compose_resolved([*RANKS_OVERRIDES, f"device={device.type}", *dry], device)
        info = a3po_dist.DistInfo(rank=0, world=2, local_rank=0, is_main=True)
        policy = build_qwen2(SCALED_DOWN, device, "float32", "sdpa")
        trainer = trainer_from(cfg, policy, pad_id=0, device=device, timer=PhaseTimer(device), dist=info)
        made = synthetic_batch(cfg.train.n_prompts, cfg.train.n_samples, RANKS_PROMPT_TOKENS, RANKS_RESPONSE_TOKENS,
                               SCALED_DOWN["vocab_size"])
        batch = a3po_dist.broadcast_object(made, info)  # rank 0's batch, as the loop sends it
        steps = [timed_step(trainer, batch, version, device) for version in range(RANKS_STEPS)]
        stop = a3po_dist.any_rank(False, info)
        weights = a3po_dist.full_state_dict(policy)
        optimizer = a3po_dist.full_optimizer_state_dict(policy, trainer.optimizer)
        figures = {"backend": dist.get_backend(), "group_world": dist.get_world_size(), "told": "rank 0 of 2",
                   "device": str(device), "precision": cfg.precision, "collectives": dict(counts),
                   "steps": len(steps), "step_s": steps[-1][1], **finite_metrics(steps[-1][0]),
                   "stop_flag": stop, "gathered_weights": len(weights),
                   "gathered_optimizer_params": len(optimizer["state"])}
    finally:
        dist.destroy_process_group()
    if not counts.get("all_reduce") or not counts.get("broadcast_object_list"):
        raise RuntimeError(f"the trainer's collectives did not reach the {backend} group: calls {counts}")
    return figures


# ------------------------------------------------------------------ one step at Qwen2.5-1.5B's sizes
def _standin_block(cfg, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """vLLM's share of the GPU as gpu1 gives it (`rollout.gpu_memory_utilization` x total), one tensor."""
    if device.type != "cuda":
        return None, 0.0
    total = torch.cuda.get_device_properties(device).total_memory
    nbytes = int(float(cfg.rollout.gpu_memory_utilization) * total)
    return torch.empty(nbytes, dtype=torch.uint8, device=device), nbytes / GIB


def qwen_step(dry_run: bool) -> dict[str, Any]:
    """One step at Qwen2.5-1.5B's sizes and gpu1's settings beside vLLM's stand-in block."""
    from a3po.learner.build import trainer_from
    from a3po.run.memory_check import GSM8K_QUESTION_TOKENS_BOUND, TEMPLATE_TOKENS_BOUND
    from a3po.memory.parts import PUBLISHED_CONFIGS
    from a3po.timer import PhaseTimer

    user_allocator = {key: os.environ.pop(key) for key in ALLOC_CONF_KEYS if key in os.environ}  # the default, always
    device = the_device(dry_run)
    overrides = [*QWEN_STEP_OVERRIDES, *(DRY_STEP_OVERRIDES if dry_run else ())]
    cfg = compose_resolved(overrides, device)
    sizes = SCALED_DOWN if dry_run else PUBLISHED_CONFIGS[QWEN_1_5B]
    block, block_gib = _standin_block(cfg, device)
    policy = build_qwen2(sizes, device, cfg.model.dtype, cfg.model.attn_implementation)
    prompt = DRY_PROMPT_TOKENS if dry_run else TEMPLATE_TOKENS_BOUND + GSM8K_QUESTION_TOKENS_BOUND
    response = int(cfg.rollout.max_new_tokens)
    batch = synthetic_batch(cfg.train.n_prompts, cfg.train.n_samples, prompt, response, sizes["vocab_size"])
    trainer = trainer_from(cfg, policy, pad_id=0, device=device, timer=PhaseTimer(device))
    metrics, seconds = timed_step(trainer, batch, 0, device)
    figures = {"device": str(device), "model": "Qwen2.5-1.5B sizes, random weights" if not dry_run else "scaled down",
               "parameters": sum(p.numel() for p in policy.parameters()), "precision": cfg.precision,
               "weights_dtype": cfg.model.dtype, "attention": cfg.model.attn_implementation,
               "activation_checkpointing": cfg.train.activation_checkpointing, "token_budget": cfg.train.token_budget,
               "samples": len(batch.samples), "sequence_tokens": prompt + response, "step_s": seconds,
               "vllm_standin_gib": block_gib, "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
               "allocator": "default" + (f" (the caller's {sorted(user_allocator)} removed)" if user_allocator else ""),
               **cuda_memory(device), **finite_metrics(metrics)}
    del block
    return figures
