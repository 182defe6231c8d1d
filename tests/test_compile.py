"""`train.compile`: the trainer's forwards through compiled decoder layers compute what the eager
layers compute (within float rounding: fused kernels round in another order), the model keeps
its eager layers for everything else, and the settings it cannot serve fail at start."""

from __future__ import annotations

import pytest
import torch

from a3po.errors import ConfigError
from a3po.models.loading import compiled_layers, layers_swapped
from a3po.config import parse_config


def _trainer_and_batch(tiny_cfg, precision, *overrides):
    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.rollout.producer import RolloutProducer
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer

    cfg = tiny_cfg("rollout.max_new_tokens=12", "train.n_prompts=4", "train.n_samples=3", "train.n_minibatches=2",
                   "algo=recompute", "staleness=1", *overrides)
    cfg.precision = precision
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, torch.device("cpu"), precision=precision)
    batch, _ = RolloutProducer(parse_config(cfg), build_task(cfg.task, 0), tokenizer, engine, PhaseTimer())(0)
    for sample in batch.samples:  # mixed rewards: every group has a gradient
        sample.reward = float(sample.response_ids.numel() % 2)
    trainer = trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer())
    return trainer, batch, engine


def _step(tiny_cfg, precision, compile_, *overrides):
    trainer, batch, engine = _trainer_and_batch(tiny_cfg, precision, f"train.compile={str(compile_).lower()}", *overrides)
    logp, _ = trainer.response_logp(batch.samples[:3])
    metrics = trainer.step(batch, 2, torch.Generator().manual_seed(3))
    return trainer, logp.detach(), metrics, [p.detach().clone() for p in trainer.policy.parameters()], engine


@pytest.mark.slow
# bf16's float32 GEMMs are compiled with activation checkpointing only: that case runs the plain
# compiled forward too, and each compile costs about a minute of a 2-core machine's test time.
@pytest.mark.parametrize("precision,tolerance,overrides,gemm32", [
    ("fp32", 1e-5, (), False), ("bf16", 2e-2, (), False),
    ("fp32", 1e-5, ("train.activation_checkpointing=true",), False),
    ("bf16", 2e-2, ("train.activation_checkpointing=true",), True)])
def test_compiled_step_equals_eager_within_rounding(tiny_cfg, monkeypatch, precision, tolerance, overrides, gemm32):
    """`gemm32`: bf16's GEMMs (linear layers, attention) in float32 (`Bf16GemmsInFloat32`), else oneDNN's bf16
    path, whatever this machine's CPU."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr("a3po.device.bf16_is_faster", lambda device: not gemm32)
    from a3po.device import bf16_gemm_in_float32
    assert bf16_gemm_in_float32(torch.device("cpu")) is gemm32
    _, eager_logp, eager_metrics, eager_weights, _ = _step(tiny_cfg, precision, False, *overrides)
    trainer, logp, metrics, weights, engine = _step(tiny_cfg, precision, True, *overrides)
    assert trainer._compiled is not None
    torch.testing.assert_close(logp, eager_logp, atol=tolerance, rtol=0)
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm", "offpolicy/total_ratio_max"):
        assert metrics[key] == pytest.approx(eager_metrics[key], abs=10 * tolerance, rel=10 * tolerance), key
    for a, b in zip(weights, eager_weights):
        torch.testing.assert_close(a, b, atol=10 * tolerance, rtol=0)
    # the model itself keeps its eager layers: its state dict and the rollout are untouched
    decoder = trainer.policy.get_decoder()
    assert not any("_orig_mod" in name for name in trainer.policy.state_dict())
    assert all(type(layer).__name__ != "OptimizedModule" for layer in decoder.layers)
    assert all(type(layer).__name__ == "OptimizedModule" for layer in trainer._compiled)
    assert engine.generate([[1, 2, 3]], 1, seed=0)[0][0].response_ids.numel() > 0  # the decode loop runs eagerly


def test_layers_swapped_restores_the_layers_even_on_error():
    decoder = torch.nn.Module()
    decoder.layers = own = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    other = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="inside"):
        with layers_swapped(decoder, other):
            assert decoder.layers is other
            raise RuntimeError("inside")
    assert decoder.layers is own
    with layers_swapped(decoder, None):
        assert decoder.layers is own


def test_compile_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="train.compile"):
        compiled_layers(torch.nn.Linear(2, 2))


def test_compile_under_several_ranks_fails_before_the_run_starts(tiny_cfg):
    from a3po.config import validate_world

    validate_world(tiny_cfg("train.compile=true"), 1)
    with pytest.raises(ConfigError, match="train.compile=True is not allowed; false with a world size of 2"):
        validate_world(tiny_cfg("train.compile=true"), 2)


def test_the_trainer_refuses_compile_under_several_ranks_too(tiny_cfg):
    from a3po.distributed import DistInfo
    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.timer import PhaseTimer

    cfg = tiny_cfg("train.compile=true")
    policy, tokenizer = load_policy(cfg.model, seed=0)
    with pytest.raises(ConfigError, match="train.compile=true runs in a single process"):
        trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer(),
                dist=DistInfo(rank=0, world=2, local_rank=0, is_main=True))
