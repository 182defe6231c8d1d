"""Loading a Hugging Face causal LM and its tokenizer the way every a3po model is loaded:
the dtype, the attention implementation, the padding side, the chat template check; and the
trainer's optional layer-level variants (activation checkpointing, compiled layers)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from a3po.gemms import checkpoint_as_forward
from a3po.errors import ConfigError

__all__ = ["DTYPES", "ATTN_IMPLEMENTATION", "ATTN_IMPLEMENTATIONS", "attn_implementation", "dtype_kwargs",
           "load_pretrained", "prepare_tokenizer", "check_chat_template", "enable_activation_checkpointing",
           "compiled_layers", "layers_swapped"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `model.attn_implementation`, the default and what a run directory without the key used. eager:
# the engine's left-padded log-probs match the trainer's right-padded forward more closely than
# with sdpa, its masked softmax is one code path whatever the padding, and on the CPUs measured
# it is also the faster one in bf16 (docs/benchmarks.md, "Attention implementation"). sdpa is
# there for GPUs, where the fused kernels are the fast path.
ATTN_IMPLEMENTATION = "eager"
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def attn_implementation(model_cfg) -> str:
    """The attention a model config (a3po.run_config.ModelConfig) asks for (null: the default, as
    every earlier run had)."""
    return model_cfg.attn_implementation or ATTN_IMPLEMENTATION


def dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers renamed `torch_dtype` to `dtype` in 4.56; accept both generations."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}

def load_pretrained(path: str, dtype: torch.dtype, attention: str = ATTN_IMPLEMENTATION):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, **dtype_kwargs(dtype))
    return model, tokenizer

def prepare_tokenizer(tokenizer) -> None:
    # Left padding keeps every prompt's last token at the same position, so batched
    # generation appends new tokens directly after real text rather than after padding.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"

def check_chat_template(tokenizer, source: Path) -> None:
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" not in template:
        raise RuntimeError(
            f"the SmolLM2 tokenizer from {source} has no ChatML chat template; the converted "
            f"cache is damaged: delete {source} and it will be rebuilt from the GGUF"
        )


def enable_activation_checkpointing(model) -> None:
    """Each decoder layer keeps only its input and runs again in backward (`train.activation_checkpointing`):
    transformers' per-layer checkpointing with torch's non-reentrant checkpoint, which composes with
    FSDP2 and autocast. Call it before the layers are sharded. Training forwards only: the layers
    checkpoint in train mode, and rollout and recompute run without gradients. Each layer calls
    `checkpoint_as_forward`, so its recompute multiplies as its forward did, eager or compiled."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = checkpoint_as_forward
    model.config.use_cache = False


def compiled_layers(model, world: int = 1) -> torch.nn.ModuleList:
    """`train.compile`: the decoder's layers under torch.compile with dynamic shapes, as a list
    apart from the model. One graph serves every batch and sequence length, and every layer
    (they run the same code on their own weights), so a run compiles once per kind of pass (with
    and without gradients). The model keeps its eager layers: the trainer swaps these in for its
    own forwards only (`layers_swapped`), and the rollout's decode loop, which calls the same
    decoder with a KV cache, never traces. Single process: with FSDP2 (`world` > 1) it is not
    validated, and refused."""
    if world > 1:
        raise ConfigError("train.compile=true runs in a single process only (not validated with FSDP2 yet); "
                          "set train.compile=false under torchrun")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise ConfigError(f"train.compile: {type(model).__name__} has no decoder with a `layers` list to compile; "
                         "set train.compile=false")
    return torch.nn.ModuleList(torch.compile(layer, dynamic=True) for layer in decoder.layers)


@contextmanager
def layers_swapped(decoder: torch.nn.Module, layers: torch.nn.ModuleList | None):
    """Run the decoder with `layers` (same parameters, compiled) in place of its own; None: as is."""
    if layers is None:
        yield
        return
    own = decoder.layers
    decoder.layers = layers
    try:
        yield
    finally:
        decoder.layers = own
