"""The training step's speed changes compute what they replaced: on a fixed batch the step's
metrics and updated weights are bit for bit those of the code before them."""

from __future__ import annotations

import contextlib
import sys

import torch

from a3po.learner import trainer as trainer_module
from a3po.config import parse_config


def _batch_and_trainer(tiny_cfg, *overrides):
    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.rollout.producer import RolloutProducer
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer

    cfg = tiny_cfg("rollout.max_new_tokens=12", "train.n_prompts=4", "train.n_samples=3", *overrides)
    cfg.precision = "bf16"
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, torch.device("cpu"), precision="bf16")
    producer = RolloutProducer(parse_config(cfg), build_task(cfg.task, 0), tokenizer, engine, PhaseTimer())
    batch, _ = producer(0)
    for sample in batch.samples:  # mixed rewards: every group has a gradient
        sample.reward = float(sample.response_ids.numel() % 2)
    trainer = trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer())
    return trainer, batch


def _step(tiny_cfg, *overrides):
    """The step's metrics, its updated weights, its plans and how many weight casts it made."""
    from torch.profiler import ProfilerActivity, profile

    trainer, batch = _batch_and_trainer(tiny_cfg, *overrides)
    plans = trainer.plan(batch.samples, torch.Generator().manual_seed(3))
    weight_shapes_list = [list(p.shape) for p in trainer.policy.parameters() if p.dim() == 2]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        metrics = trainer.step(batch, 2, torch.Generator().manual_seed(3))
    casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                and e.input_shapes[0] in weight_shapes_list)
    return metrics, [p.detach().clone() for p in trainer.policy.parameters()], plans, casts


def test_one_autocast_scope_per_minibatch_changes_no_bit(tiny_cfg, monkeypatch):
    """Weights cast once per minibatch (one autocast scope around its micro-batches) against a
    cast per micro-batch forward: the scope in `Trainer.step` made a no-op, so each forward's own
    scope casts afresh. autocast's own casts: on a CPU where bf16's linear layers multiply in
    float32 they round at each use under grad instead (a3po.gemms.Bf16GemmsInFloat32)."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr("a3po.device.bf16_gemm_in_float32", lambda device: False)
    overrides = ("train.token_budget=130", "train.n_minibatches=2", "algo=loglinear", "staleness=0")
    scoped, scoped_weights, plans, scoped_casts = _step(tiny_cfg, *overrides)
    assert max(len(plan) for plan in plans) >= 3  # several micro-batches share one cast

    real_autocast = trainer_module.autocast

    def per_forward(device, dtype):
        if sys._getframe(1).f_code.co_name == "step":
            return contextlib.nullcontext()
        return real_autocast(device, dtype)

    monkeypatch.setattr(trainer_module, "autocast", per_forward)
    unscoped, unscoped_weights, _, unscoped_casts = _step(tiny_cfg, *overrides)
    assert scoped == unscoped
    assert all(torch.equal(a, b) for a, b in zip(scoped_weights, unscoped_weights))
    assert scoped_casts < unscoped_casts  # the scope did save casts


def _model_with_grads(scale: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * scale
    return model


def test_clip_gradients_equals_torchs_clip_and_skips_only_the_multiply_by_one(monkeypatch):
    from a3po.learner.update import clip_gradients

    real_clip = torch.nn.utils.clip_grads_with_norm_
    calls = []
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or real_clip(*a, **k))
    for scale, max_norm, clips in ((1e-3, 1.0, False), (10.0, 1.0, True), (1.0, 1e9, False)):
        ours, theirs = _model_with_grads(scale), _model_with_grads(scale)
        calls.clear()
        norm = clip_gradients(ours, max_norm)
        assert bool(calls) is clips  # the multiply runs only where it changes the gradients
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
    ours, theirs = _model_with_grads(1.0), _model_with_grads(1.0)
    for model in (ours, theirs):
        next(model.parameters()).grad[0, 0] = float("nan")
    assert clip_gradients(ours, 1.0).isnan() and torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0).isnan()
    assert all(a.grad.isnan().all() and b.grad.isnan().all() for a, b in zip(ours.parameters(), theirs.parameters()))


def test_a_step_with_the_cpu_clip_is_bit_identical_to_torchs_clip(tiny_cfg, monkeypatch):
    for clip in ("train.grad_clip=1e-3", "train.grad_clip=1e6"):  # every minibatch clipped, and none
        overrides = ("train.n_minibatches=2", "algo=loglinear", "staleness=0", clip)
        ours, our_weights, _, _ = _step(tiny_cfg, *overrides)
        with monkeypatch.context() as patch:
            patch.setattr(trainer_module, "clip_gradients",
                          lambda policy, max_norm, sharded: torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))
            theirs, their_weights, _, _ = _step(tiny_cfg, *overrides)
        assert ours == theirs
        assert all(torch.equal(a, b) for a, b in zip(our_weights, their_weights))
