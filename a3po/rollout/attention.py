"""The decode loop's attention: eager attention's arithmetic, without repeating the keys.

transformers' eager attention first repeats each key-value head once for every query head that
reads it (`repeat_kv`: SmolLM2's 3 key-value heads become 9), which copies the whole KV cache at
every layer of every decode step. Under `Bf16GemmsInFloat32` that copy is then copied again into
float32. Here the query heads that share a key-value head are stacked as the rows of one product
over that head's keys and values, which are read where the cache holds them.

Each product multiplies the same numbers in the same precision as eager's, with autocast's casts
or `Bf16GemmsInFloat32`'s rounding at the same points. Only the order of the float32 sums inside a
GEMM of more rows may differ, and with it the last bit of a product. The decode loop uses this in
place of eager (`grouped_eager`). The trainer keeps transformers' eager attention, which also
serves its backward. Measured in docs/benchmarks.md, "Decode's attention without repeated keys".
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

__all__ = ["GROUPED_EAGER", "grouped_eager_attention", "grouped_eager"]

GROUPED_EAGER = "a3po_grouped_eager"


def grouped_eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `eager_attention_forward`, with query heads grouped by key-value head.

    query [batch, heads, q_len, head_dim]; key and value [batch, kv_heads, kv_len, head_dim].
    Query head h reads key-value head h // (heads / kv_heads), as `repeat_kv` pairs them. Returns
    the output [batch, q_len, heads, head_dim] and the probabilities [batch, heads, q_len, kv_len]."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rows = heads // kv_heads * q_len  # the query rows that read one key-value head
    scores = torch.matmul(query.reshape(batch, kv_heads, rows, head_dim), key.transpose(2, 3))
    scores = scores.view(batch, heads, q_len, kv_len) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs.reshape(batch, kv_heads, rows, kv_len), value)
    return output.view(batch, heads, q_len, head_dim).transpose(1, 2).contiguous(), probs


AttentionInterface.register(GROUPED_EAGER, grouped_eager_attention)
# and eager's masks: under a name without a mask function transformers builds no mask at all
AttentionMaskInterface.register(GROUPED_EAGER, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextlib.contextmanager
def grouped_eager(model: torch.nn.Module):
    """Run `model`'s eager attention as `grouped_eager_attention` inside this scope. Its config
    is restored on the way out, including on an error. Any other implementation is left alone."""
    config = model.config
    if config._attn_implementation != "eager":
        yield
        return
    config._attn_implementation = GROUPED_EAGER
    try:
        yield
    finally:
        config._attn_implementation = "eager"
