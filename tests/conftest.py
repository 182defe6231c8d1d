"""Shared fixtures: compose the real Hydra config with test-sized overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import a3po.config  # noqa: F401  (registers the run-name resolver)
from a3po.metrics import is_machine_figure

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# Small enough for a 2-core CPU: a step of the tiny model takes well under a second.
TINY_OVERRIDES = [
    "model=tiny",
    # fp32 whatever the CPU: tests compare log-probs to float32 precision and runs bit for bit;
    # `auto` would be bf16 on some CPUs. tests/test_device.py and tests/test_precision.py cover the rule.
    "precision=fp32",
    "logger=none",
    "train.total_steps=3",
    "train.n_prompts=2",
    "train.n_samples=2",
    "train.n_minibatches=2",
    "train.token_budget=256",
    "train.eval_every=2",
    "train.eval_size=2",
    "train.checkpoint_every=2",
    "rollout.max_new_tokens=8",
]


def compose_config(overrides: list[str], output_root: Path | None = None, with_hydra: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        extra = [f"output_root={output_root}"] if output_root is not None else []
        return compose(config_name="config", overrides=[*overrides, *extra], return_hydra_config=with_hydra)


@pytest.fixture
def tiny_cfg(tmp_path):
    """A function: overrides -> composed tiny config writing under tmp_path."""

    def make(*overrides: str):
        return compose_config([*TINY_OVERRIDES, *overrides], output_root=tmp_path / "outputs")

    return make


def even_token_share(self, problems, groups) -> int:
    """A reward a random tiny model earns (the arith task's is always 0 for it): the share of a
    response's tokens with an even id. Every GRPO group gets mixed rewards, so gradients are not 0.
    Installed as RolloutProducer.score (the `earnable_reward` fixture, or a subprocess worker)."""
    for group in groups:
        for sample in group:
            sample.reward = float((sample.response_ids % 2 == 0).float().mean())
    return 0


@pytest.fixture
def earnable_reward(monkeypatch):
    """Runs in this test score samples with `even_token_share`."""
    import a3po.rollout.producer

    monkeypatch.setattr(a3po.rollout.producer.RolloutProducer, "score", even_token_share)


def comparable(records: list[dict], *prefixes: str) -> list[dict]:
    """Log records without what measures the machine (time, memory: a3po.metrics.is_machine_figure)
    or starts with `prefixes`: what two runs computing the same numbers must log alike."""
    return [{k: v for k, v in r.items() if not is_machine_figure(k) and not k.startswith(prefixes)} for r in records]
