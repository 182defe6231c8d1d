"""The training step's speed changes compute what they replaced: on a fixed batch the step's
metrics and updated weights are bit for bit those of the code before them."""

from __future__ import annotations

import contextlib
import sys

import torch

from a3po.learner import trainer as trainer_module


def _batch_and_trainer(tiny_cfg, *overrides):
    from a3po.learner.trainer import Trainer
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.rollout.producer import RolloutProducer
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer

    cfg = tiny_cfg("rollout.max_new_tokens=12", "train.n_prompts=4", "train.n_samples=3", *overrides)
    cfg.precision = "bf16"
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, torch.device("cpu"), precision="bf16")
    producer = RolloutProducer(cfg, build_task(cfg.task, 0), tokenizer, engine, PhaseTimer())
    batch, _ = producer(0)
    for sample in batch.samples:  # mixed rewards: every group has a gradient
        sample.reward = float(sample.response_ids.numel() % 2)
    trainer = Trainer(policy, cfg, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer())
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
    scope casts afresh."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
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
