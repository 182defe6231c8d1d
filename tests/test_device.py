"""One precision rule for the trainer and the HF engine, and the device config value."""

from __future__ import annotations

import pytest
import torch

from a3po.device import autocast_dtype, resolve_device
from a3po.errors import ConfigError

from conftest import TINY_OVERRIDES, compose_config


def test_autocast_rule():
    float32 = torch.nn.Linear(2, 2)
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert autocast_dtype(torch.device("cuda"), float32) is torch.bfloat16  # a float32 model on a GPU
    assert autocast_dtype(torch.device("cuda"), bf16) is None  # already bf16
    assert autocast_dtype(torch.device("cpu"), float32) is None  # CPU keeps exact float32
    assert autocast_dtype("cuda:1", float32) is torch.bfloat16


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda' is not allowed"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="device='tpu' is not allowed"):
        resolve_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_engine_samples_as_the_trainer_computes_on_gpu():
    """Under bf16 autocast on both sides, behave_logp matches the trainer's forward at d = 0
    to bf16 precision (float32 sampling against a bf16 trainer differed by ~1e-2)."""
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer
    from a3po.train import RolloutProducer
    from a3po.trainer import Trainer

    device = torch.device("cuda")
    cfg = compose_config([*TINY_OVERRIDES, "device=cuda", "rollout.max_new_tokens=12"])
    policy, tokenizer = load_policy(cfg.model, device=device, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, device)
    timer = PhaseTimer(device)
    batch = RolloutProducer(cfg, build_task(cfg.task, 0), tokenizer, engine, timer)(0)
    trainer = Trainer(policy, algo_cfg=cfg.algo, schedule_cfg={"name": "inverse"}, train_cfg=cfg.train,
                      temperature=1.0, pad_id=tokenizer.pad_token_id, device=device, timer=timer)
    with torch.no_grad():
        logp, _ = trainer.response_logp(batch.samples)
    behave = torch.cat([s.behave_logp for s in batch.samples]).to(device)
    assert (logp - behave).abs().max().item() < 5e-2
