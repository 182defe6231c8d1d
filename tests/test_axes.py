"""Every ablation axis is one spec per choice (a3po.maths.spec): each YAML under conf/<axis>/
states exactly its spec's parameters at their defaults, and a new choice is two files (the
Python definition, the YAML), seen through config validation, a run and a figure."""

from __future__ import annotations

import pytest
import torch
import yaml

from a3po.maths.corrections import CORRECTIONS, Correction, CorrectionSpec
from a3po.maths.objectives import OBJECTIVES
from a3po.maths.proximal import ALGOS, Method
from a3po.maths.schedules import SCHEDULES, ScheduleSpec
from a3po.maths.spec import Param
from a3po.run.main import run, run_dir_of
from a3po.run.metrics_log import read_metrics
from conftest import CONF_DIR, TINY_OVERRIDES, compose_config

AXES = {"algo": ALGOS, "schedule": SCHEDULES, "correction": CORRECTIONS, "objective": OBJECTIVES}


@pytest.mark.parametrize("group", sorted(AXES))
def test_every_yaml_states_its_specs_defaults_and_every_spec_has_a_yaml(group):
    """conf/<axis>/<name>.yaml of a spec holds its defaults; a file of another name is a preset
    of the spec it names (conf/schedule/fitted.yaml: `name: rational` and fitted values), whose
    values that spec accepts."""
    registry = AXES[group]
    files = {path.stem: yaml.safe_load(path.read_text()) for path in (CONF_DIR / group).glob("*.yaml")}
    assert set(registry) <= set(files)
    for stem, content in files.items():
        name = content.pop("name")
        if stem == name:
            assert content == registry[name].defaults(), f"conf/{group}/{stem}.yaml"
        else:
            assert name in registry, f"conf/{group}/{stem}.yaml names {name!r}, not a {group}"
            assert set(content) == set(registry[name].params), f"conf/{group}/{stem}.yaml"
            registry[name].check(content, group)


# ---- a toy choice on three axes, each one Python definition plus one YAML file ---------------

def _toy_schedule(staleness: torch.Tensor, k: float) -> torch.Tensor:
    return 1.0 - 1.0 / (staleness + k - 1.0)  # w_b = 1 / (d + k - 1)


def _toy_interpolation(behave, target, alpha, versions):
    return behave + 0.5 * alpha * (target - behave)  # half of loglinear's step


def _toy_correction(log_w, seq_index, valid, *, scale: float) -> Correction:
    zero = torch.zeros((), dtype=torch.float32)
    return Correction(torch.where(valid, torch.exp(log_w.detach()) * scale, 0.0), valid.bool(), zero, zero, zero)


TOYS = [
    ("schedule", SCHEDULES, ScheduleSpec("toy", _toy_schedule, "w_b = 1/(d + k - 1)", {"k": Param(3.0, lambda v: v >= 1, ">= 1")}),
     {"name": "toy", "k": 3.0}),
    ("algo", ALGOS, Method("halfway", _toy_interpolation, "half of loglinear's step"), {"name": "halfway"}),
    ("correction", CORRECTIONS,
     CorrectionSpec("scaled", _toy_correction, "w times scale", {"scale": Param(0.5, lambda v: v > 0, "> 0")}),
     {"name": "scaled", "scale": 0.5}),
]


@pytest.fixture
def toy_axes(tmp_path):
    """The toys registered (the Python file) and their YAML in a config directory of their own."""
    conf = tmp_path / "conf"
    for group, registry, spec, content in TOYS:
        registry.register(spec)
        (conf / group).mkdir(parents=True)
        (conf / group / f"{spec.name}.yaml").write_text(yaml.safe_dump(content))
    try:
        yield conf
    finally:
        for _, registry, spec, _ in TOYS:
            registry.unregister(spec.name)


def test_a_toy_schedule_method_and_correction_run_and_reach_a_figure(toy_axes, tmp_path):
    from analysis.figures.paper import main as figures

    cfg = compose_config([*TINY_OVERRIDES, "algo=halfway", "schedule=toy", "correction=scaled", "staleness=2",
                          f"hydra.searchpath=[file://{toy_axes}]"], output_root=tmp_path / "outputs")
    assert cfg.run_name == "halfway-toy3-scaled0.5-d2-s0"
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert len(records) == cfg.train.total_steps and records[-1]["staleness/max"] == 2.0
    out = tmp_path / "figures"
    assert figures([str(run_dir_of(cfg).parent), "--out", str(out)]) == 0
    drawn = (out / "fig3_entropy.csv").read_text()
    assert "halfway-toy3-scaled0.5" in drawn


def test_a_toy_parameter_out_of_range_fails_at_start(toy_axes, tmp_path):
    from a3po.errors import ConfigError

    cfg = compose_config([*TINY_OVERRIDES, "algo=halfway", "schedule=toy", "schedule.k=0.5",
                          f"hydra.searchpath=[file://{toy_axes}]"], output_root=tmp_path / "outputs")
    with pytest.raises(ConfigError, match=r"schedule.k=0.5 is not allowed; it must be >= 1"):
        run(cfg)


# ---- a toy rollout engine: its class, its schema, its memory parts and one EngineSpec ----------

def test_a_toy_rollout_engine_is_one_spec_seen_by_validation_memory_and_a_run(tmp_path, monkeypatch):
    """A new engine (a3po.rollout.engines) is its class, its config schema, its memory parts and
    one registered EngineSpec, plus conf/rollout/<name>.yaml: validation reads its schema (its own
    key checked, an unknown one refused), the memory check its parts, and a run samples with it."""
    import dataclasses

    from a3po.config import parse_config
    from a3po.errors import ConfigError
    from a3po.memory.rollout import hf_rollout_memory
    from a3po.memory.parts import Part
    from a3po.rollout.engines import ENGINES, EngineSpec, register_engine
    from a3po.rollout.hf import HFEngine
    from a3po.run.memory_check import architecture_of, estimate_run
    from a3po.schema import RolloutConfig, rule

    @dataclasses.dataclass(frozen=True)
    class ToyRollout(RolloutConfig):
        name: str = rule("toy", "it must name an engine")
        buffer_mib: int = rule(3, "it must be an integer >= 1", lambda v: v >= 1)

    calls = []

    class ToyEngine(HFEngine):
        def generate(self, prompt_ids, n_samples, *, seed):
            calls.append(len(prompt_ids))
            return super().generate(prompt_ids, n_samples, seed=seed)

    def build(group, policy, tokenizer, device, *, concurrent, precision, trainer_device=None, world=1,
              max_sequences=None):
        return ToyEngine(policy, tokenizer, temperature=group.temperature, top_p=group.top_p,
                         max_new_tokens=group.max_new_tokens, batch_size=group.batch_size, precision=precision)

    def memory(m):
        buffer = m.config.rollout.buffer_mib << 20
        return [*hf_rollout_memory(m), Part("toy engine buffer", buffer, ("rollout.buffer_mib",), "always", m.device, "")]

    conf = tmp_path / "conf"
    (conf / "rollout").mkdir(parents=True)
    (conf / "rollout" / "toy.yaml").write_text(yaml.safe_dump({"name": "toy", "temperature": 1.0, "top_p": 1.0,
                                                               "max_new_tokens": 8, "device": None,
                                                               "batch_size": None, "buffer_mib": 3}))
    register_engine(EngineSpec("toy", ToyRollout, build, memory))
    try:
        overrides = [*TINY_OVERRIDES, "rollout=toy", f"hydra.searchpath=[file://{conf}]"]
        with pytest.raises(ConfigError, match=r"rollout.buffer_mib=0 is not allowed; it must be an integer >= 1"):
            parse_config(compose_config([*overrides, "rollout.buffer_mib=0"]))
        with pytest.raises(ConfigError, match=r"rollout.buffr_mib is not a key of rollout"):
            parse_config(compose_config([*overrides, "+rollout.buffr_mib=1"]))
        cfg = compose_config(overrides, output_root=tmp_path / "outputs")
        typed = parse_config(cfg)
        assert isinstance(typed.rollout, ToyRollout) and typed.rollout.buffer_mib == 3
        parts = {part.name: part.nbytes for part in estimate_run(typed, architecture_of(typed.model)[0], "cpu").parts}
        assert parts["toy engine buffer"] == 3 << 20 and "rollout KV cache" in parts
        run(cfg)
        records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
        assert len(records) == cfg.train.total_steps and calls  # every step's batch came from the toy engine
    finally:
        del ENGINES["toy"]
