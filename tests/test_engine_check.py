"""The start check of the rollout engine against the trainer (a3po.run.engine_check), and vLLM's
model runner key (`rollout.model_runner`, issue "The first 8-GPU SLURM run succeeds", item 4)."""

from __future__ import annotations

import pytest
import torch

from a3po.config import parse_config
from a3po.errors import ConfigError
from a3po.rollout.hf import HFEngine
from a3po.run.engine_check import TOLERANCE, logprob_gap
from a3po.run.main import run, run_dir_of


@pytest.fixture
def engine_off_by(monkeypatch):
    """An HF engine whose behave_logp is off by `shift` on every token, as an engine with the wrong
    dtype or stale weights would be."""
    def set_shift(shift: float) -> None:
        generate = HFEngine.generate

        def off(self, prompt_ids, n_samples, *, seed):
            groups = generate(self, prompt_ids, n_samples, seed=seed)
            for group in groups:
                for sample in group:
                    sample.behave_logp = sample.behave_logp + shift
            return groups

        monkeypatch.setattr(HFEngine, "generate", off)
    return set_shift


def test_an_engine_whose_log_probs_are_off_stops_the_run_before_its_first_step(tiny_cfg, engine_off_by):
    engine_off_by(0.5)
    cfg = tiny_cfg("train.total_steps=2")
    with pytest.raises(ConfigError, match=r"rollout.logprob_check: the hf engine's log-probs of \d+ sampled tokens "
                                          r"differ from the trainer's by up to 0\.5, past the 0\.001 allowed at "
                                          r"precision=fp32"):
        run(cfg)
    assert not (run_dir_of(cfg) / "metrics.jsonl").exists() or not (run_dir_of(cfg) / "metrics.jsonl").read_text()


def test_the_tolerance_is_the_key_and_zero_skips_the_check(tiny_cfg, engine_off_by):
    engine_off_by(0.05)
    assert run(tiny_cfg("train.total_steps=1", "rollout.logprob_check=0.1"))  # within the key's 0.1
    engine_off_by(5.0)
    assert run(tiny_cfg("train.total_steps=1", "rollout.logprob_check=0", "seed=1"))  # not checked


def test_a_sound_engine_passes_within_float_rounding(tiny_cfg, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="a3po.run.engine_check"):
        run(tiny_cfg("train.total_steps=1"))
    line = next(r.getMessage() for r in caplog.records if r.name == "a3po.run.engine_check")
    gap = float(line.split(" within ")[1].split(" ")[0])
    assert gap < 1e-4 and "allowed 0.001" in line


def test_the_gap_and_the_tolerances():
    assert logprob_gap(torch.tensor([-1.0, -2.0]), torch.tensor([-1.25, -2.0])) == 0.25
    assert TOLERANCE == {"fp32": 1e-3, "bf16": 0.1}
    with pytest.raises(ConfigError, match=r"rollout.logprob_check=-1 is not allowed; it must be a number >= 0"):
        parse_config(_compose("rollout.logprob_check=-1"))


def _compose(*overrides):
    from conftest import TINY_OVERRIDES, compose_config

    return compose_config([*TINY_OVERRIDES, *overrides])


@pytest.mark.parametrize("runner, variable", [("v1", "0"), ("v2", "1"), (None, "as set")])
def test_the_model_runner_key_pins_vllms_variable(runner, variable):
    from a3po.rollout.vllm_start import pin_model_runner

    environ = {"VLLM_USE_V2_MODEL_RUNNER": "as set"}
    pin_model_runner(runner, environ)
    assert environ["VLLM_USE_V2_MODEL_RUNNER"] == variable


def test_the_model_runner_defaults_to_the_tested_one_and_refuses_others():
    assert parse_config(_compose("rollout=vllm")).rollout.model_runner == "v1"
    with pytest.raises(ConfigError, match=r"rollout.model_runner='v3' is not allowed; allowed: v1"):
        parse_config(_compose("rollout=vllm", "rollout.model_runner=v3"))


def test_an_older_vllm_run_without_the_key_is_another_config():
    """A vLLM run started before `rollout.model_runner` ran the runner vLLM chose: resuming it
    under v1 is a different config, named; `rollout.model_runner=null` resumes it."""
    from a3po.run.rundir import config_differences

    old = {"rollout": {"name": "vllm"}}
    assert config_differences(old, {"rollout": {"name": "vllm", "model_runner": "v1"}}) == \
        [("rollout.model_runner", None, "v1")]
    assert config_differences(old, {"rollout": {"name": "vllm", "model_runner": None}}) == []
    assert config_differences({"rollout": {"name": "hf"}}, {"rollout": {"name": "hf", "logprob_check": 0.5}}) == []
