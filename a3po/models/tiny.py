"""A tiny random model with SmolLM2's tokenizer, for the unit tests (its rewards are always 0)."""

from __future__ import annotations

from a3po.run_config import ModelConfig

import torch

from a3po.models.loading import attn_implementation, prepare_tokenizer
from a3po.models.smollm2 import ensure_smollm2_converted
from a3po.seeds import seeded

__all__ = ["TINY_SIZE_KEYS", "build_tiny"]

TINY_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def build_tiny(model_cfg: ModelConfig, dtype: torch.dtype, seed: int):
    """A random llama sharing SmolLM2's tokenizer, so tests exercise real chat prompts."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2_converted()))
    prepare_tokenizer(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attn_implementation(model_cfg),
    )
    # A private RNG scope: the model is a function of `seed` alone and the caller's global
    # RNG stream (which the trainer checkpoints) is left untouched.
    with seeded(seed):
        model = LlamaForCausalLM(config)
    return model.to(dtype), tokenizer
