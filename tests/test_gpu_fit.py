"""The keys that make the paper's setting fit a GPU reach the model and change nothing they
should not: activation checkpointing (the same metrics, bit for bit on CPU), FSDP2's mixed
precision (distributed tier, tests/test_distributed.py style), the attention implementation."""

from __future__ import annotations

import pytest
import torch

from a3po.models.loading import enable_activation_checkpointing
from a3po.run.main import run, run_dir_of
from a3po.run.metrics_log import read_metrics
from conftest import comparable


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_changes_no_metric(tiny_cfg, earnable_reward, precision):
    common = ["algo=recompute", "staleness=1", "train.total_steps=3", "train.checkpoint_every=0",
              f"precision={precision}"]
    plain = tiny_cfg(*common, "experiment_name=plain")
    checkpointed = tiny_cfg(*common, "experiment_name=checkpointed", "train.activation_checkpointing=true")
    run(plain)
    run(checkpointed)
    expected = read_metrics(run_dir_of(plain) / "metrics.jsonl")
    got = read_metrics(run_dir_of(checkpointed) / "metrics.jsonl")
    assert len(got) == 3 and got[-1]["actor/grad_norm"] > 0
    assert comparable(got) == comparable(expected)


def test_activation_checkpointing_reaches_every_decoder_layer_and_saves_only_layer_inputs(tiny_cfg):
    from a3po.models import load_policy

    model, _ = load_policy(tiny_cfg().model, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))

    weights = {p.data_ptr() for p in model.parameters()}

    def saved_bytes() -> int:
        """What the decoder's forward keeps for backward, weights aside."""
        total = []

        def pack(tensor):
            if tensor.data_ptr() not in weights:
                total.append(tensor.numel() * tensor.element_size())
            return tensor

        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.get_decoder()(input_ids=ids).last_hidden_state.sum()
        return sum(total)

    before = saved_bytes()
    enable_activation_checkpointing(model)
    layers = model.get_decoder().layers
    assert all(layer.gradient_checkpointing for layer in layers) and model.config.use_cache is False
    assert saved_bytes() < before / 2
