"""The decode loop's grouped attention (a3po.rollout.attention): transformers' eager attention's
values, with query heads stacked by key-value head instead of repeating the keys, in float32, under
bf16 autocast and under `Bf16GemmsInFloat32`; and the scope that puts it in a model's place."""

from __future__ import annotations

import types

import pytest
import torch
from omegaconf import OmegaConf
from transformers.models.llama.modeling_llama import eager_attention_forward

from a3po.gemms import autocast_with_gemms_in_float32
from a3po.rollout.attention import GROUPED_EAGER, grouped_eager, grouped_eager_attention

from conftest import CONF_DIR


def _inputs(q_len: int, kv_len: int, heads: int = 9, kv_heads: int = 3, kv_dtype=torch.float32, seed: int = 0):
    """Attention's inputs as a decoder layer hands them over: query [2, heads, q_len, 16] (a
    transposed view, as the layer makes it), keys and values [2, kv_heads, kv_len, 16], and an
    additive causal mask over the last q_len positions."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(2, q_len, heads, 16, generator=g).transpose(1, 2)
    key = torch.randn(2, kv_heads, kv_len, 16, generator=g).to(kv_dtype)
    value = torch.randn(2, kv_heads, kv_len, 16, generator=g).to(kv_dtype)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask = torch.zeros(2, 1, q_len, kv_len).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    return module, query, key, value, mask


@pytest.mark.parametrize("q_len,heads,kv_heads", [(1, 9, 3), (5, 9, 3), (4, 4, 4), (3, 4, 1)])
def test_grouped_attention_is_eager_attention_in_float32(q_len, heads, kv_heads):
    module, query, key, value, mask = _inputs(q_len, 7, heads, kv_heads)
    expected, expected_probs = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    output, probs = grouped_eager_attention(module, query, key, value, mask, scaling=0.25)
    assert output.shape == expected.shape == (2, q_len, heads, 16) and probs.shape == expected_probs.shape
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=0, atol=1e-6)
    assert probs[:, :, -1].sum(-1).sub(1).abs().max() < 1e-6  # each row a distribution over its keys


@pytest.mark.parametrize("scope", ["bf16 autocast", "bf16 GEMMs in float32"])
def test_grouped_attention_rounds_where_eager_rounds(scope):
    """Under either bf16 scope the products see the same bf16 operands as eager's: the outputs
    agree to a bf16 rounding, far inside the gap to float32's answer."""
    module, query, key, value, mask = _inputs(1, 40, kv_dtype=torch.bfloat16)  # a bf16 cache, as decode keeps it
    context = (torch.autocast("cpu", dtype=torch.bfloat16) if scope == "bf16 autocast"
               else autocast_with_gemms_in_float32("cpu"))
    with context:
        expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
        output, _ = grouped_eager_attention(module, query, key, value, mask, scaling=0.25)
    float32, _ = eager_attention_forward(module, query, key.float(), value.float(), mask, scaling=0.25)
    assert output.dtype == expected.dtype == torch.bfloat16
    rounding = (output.float() - expected.float()).abs().max().item()
    assert rounding <= 2 ** -7 * expected.float().abs().max().item()
    assert (output.float() == expected.float()).float().mean() > 0.9
    assert (expected.float() - float32).abs().max() > 0  # the scope did round


def _tiny_policy():
    from a3po.models import load_policy

    return load_policy(OmegaConf.load(CONF_DIR / "model" / "tiny.yaml"), seed=0)


def test_the_scope_swaps_eager_and_restores_it_even_on_an_error():
    policy, _ = _tiny_policy()
    assert policy.config._attn_implementation == "eager"
    with grouped_eager(policy):
        assert policy.config._attn_implementation == GROUPED_EAGER
    assert policy.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="stop"), grouped_eager(policy):
        raise RuntimeError("stop")
    assert policy.config._attn_implementation == "eager"
    policy.config._attn_implementation = "sdpa"
    with grouped_eager(policy):
        assert policy.config._attn_implementation == "sdpa"  # left alone


def test_a_model_under_the_scope_gives_eagers_logits(monkeypatch):
    """The whole tiny model (4 query heads on 2 key-value heads) on left-padded rows with a 2-D
    padding mask, which the model turns into eager's causal mask under the registered name too:
    the same logits, computed by the grouped function."""
    from transformers import AttentionInterface

    policy, _ = _tiny_policy()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    real = ids != 0
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return grouped_eager_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, GROUPED_EAGER, counted)
    with torch.no_grad():
        expected = policy(input_ids=ids, attention_mask=real).logits
        assert calls == []
        with grouped_eager(policy):
            logits = policy(input_ids=ids, attention_mask=real).logits
    assert calls == [(2, 4, 5, 16)] * policy.config.num_hidden_layers
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)
    causal = policy(input_ids=ids[:, :3], attention_mask=real[:, :3]).logits
    torch.testing.assert_close(logits[1, :3], causal[1], rtol=0, atol=1e-5)  # no position sees a later one
