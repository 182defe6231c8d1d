"""algo=hybrid: loglinear with recompute's forward on the steps a3po.maths.proximal.recomputes_at
picks. With every=1 it is recompute and with every=0 (no ESS trigger) loglinear, on every
non-timing metric; it recomputes on exactly the configured steps; its parameters are part of
its identity."""

from __future__ import annotations

import re

import pytest

from a3po.maths.proximal import recomputes_at
from a3po.run.main import run, run_dir_of
from a3po.run.metrics_log import read_metrics
from conftest import comparable


def test_recomputes_at_counts_steps_and_asks_the_probe_only_when_it_decides():
    assert [s for s in range(10) if recomputes_at(s, 3, None, lambda: pytest.fail("no probe"))] == [0, 3, 6, 9]
    assert not any(recomputes_at(s, 0, None, lambda: pytest.fail("no probe")) for s in range(5))
    calls = []

    def probe():
        calls.append(1)
        return 0.4

    assert recomputes_at(4, 2, 0.5, probe) and calls == []  # the count decides first
    assert recomputes_at(5, 2, 0.5, probe) and calls == [1]  # 0.4 < 0.5
    assert not recomputes_at(5, 2, 0.3, probe)


def _run(tiny_cfg, *overrides):
    cfg = tiny_cfg("staleness=2", "train.total_steps=5", "train.n_minibatches=2", "train.lr=1e-3", *overrides)
    run(cfg)
    return cfg, read_metrics(run_dir_of(cfg) / "metrics.jsonl")


def _comparable(record: dict) -> dict:
    return comparable([record], "hybrid/")[0]


def test_hybrid_is_recompute_at_every_1_and_loglinear_at_every_0(tiny_cfg, earnable_reward):
    _, recompute = _run(tiny_cfg, "algo=recompute")
    _, loglinear = _run(tiny_cfg, "algo=loglinear")
    _, always = _run(tiny_cfg, "algo=hybrid", "algo.every=1")
    _, never = _run(tiny_cfg, "algo=hybrid", "algo.every=0")
    assert [r["hybrid/recomputed"] for r in always] == [1.0] * 5 and [r["hybrid/recomputed"] for r in never] == [0.0] * 5
    assert [_comparable(r) for r in always] == [_comparable(r) for r in recompute]
    assert [_comparable(r) for r in never] == [_comparable(r) for r in loglinear]
    assert _comparable(recompute[3]) != _comparable(loglinear[3])  # the two really differ: the test can fail


def test_hybrid_recomputes_on_exactly_the_configured_steps_and_pays_the_forward_only_there(tiny_cfg, earnable_reward):
    cfg, records = _run(tiny_cfg, "algo=hybrid", "algo.every=2")
    assert [r["hybrid/recomputed"] for r in records] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert "hybrid/drift_ess" not in records[0]  # no ESS trigger, no probe
    assert cfg.identity.label == "hybrid2" and cfg.identity.method_params == {"every": 2, "min_ess": None}
    assert run_dir_of(cfg).name == "hybrid2-d2-s0"


def test_an_ess_trigger_probes_each_step_the_count_does_not_decide(tiny_cfg, earnable_reward):
    # min_ess = 1: any drift at all (ESS < 1) recomputes; at step 0 nothing has drifted (ESS = 1)
    cfg, records = _run(tiny_cfg, "algo=hybrid", "algo.every=0", "algo.min_ess=1.0")
    assert "hybrid/drift_ess" in records[0] and records[0]["hybrid/drift_ess"] == pytest.approx(1.0)
    assert records[0]["hybrid/recomputed"] == 0.0
    assert all(r["hybrid/drift_ess"] < 1.0 and r["hybrid/recomputed"] == 1.0 for r in records[2:])
    assert cfg.identity.label == "hybrid0_1"


@pytest.mark.parametrize("override, message", [
    ("algo.every=-1", "algo.every=-1 is not allowed; it must be an integer >= 0"),
    ("algo.every=1.5", "algo.every=1.5 is not allowed; it must be an integer >= 0"),
    ("algo.min_ess=0", "algo.min_ess=0 is not allowed; it must be in (0, 1]"),
    ("+algo.typo=1", "algo=hybrid does not take ['typo']"),
])
def test_a_bad_hybrid_parameter_fails_at_start(tiny_cfg, override, message):
    from a3po.config import parse_config
    from a3po.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(tiny_cfg("algo=hybrid", override))


def test_the_drift_probe_runs_in_eval_mode_as_the_recompute_forward_does(tiny_cfg, earnable_reward, monkeypatch):
    import a3po.learner.trainer as trainer_module

    modes, measure = [], trainer_module.drift_ess

    def spy(response_logp, micro):
        modes.append(response_logp.__self__.policy.training)
        return measure(response_logp, micro)

    monkeypatch.setattr(trainer_module, "drift_ess", spy)
    _run(tiny_cfg, "algo=hybrid", "algo.every=0", "algo.min_ess=1.0")  # probes at every step
    assert modes == [False] * 5
