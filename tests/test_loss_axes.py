"""The correction and objective axes through the trainer: every combination trains and logs
the new diagnostics, finite; bad values and meaningless combinations fail at start."""

from __future__ import annotations

import math
import re

import pytest

import a3po.models
from a3po.identity import identity_record, run_name
from a3po.errors import ConfigError
from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of

CORRECTIONS = ["none", "tis", "icepop", "seq_tis", "seq_mis", "m2po"]
OBJECTIVES = ["ppo", "gspo", "cispo"]
NEW_KEYS = [
    "offpolicy/ess_token", "offpolicy/ess_seq", "offpolicy/chi2_token", "offpolicy/kl_k1", "offpolicy/kl_k3",
    "correction/masked_low", "correction/masked_high", "correction/truncated", "actor/clip_low", "actor/clip_high",
]


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_correction_and_objective_trains_and_logs_finite_diagnostics(tiny_cfg, correction, objective):
    cfg = tiny_cfg("algo=loglinear", "staleness=2", f"correction={correction}", f"objective={objective}",
                   "train.total_steps=3", "train.eval_every=0")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        missing = [k for k in NEW_KEYS if k not in record]
        assert not missing, missing
        assert all(math.isfinite(record[k]) for k in NEW_KEYS)
        assert 0 < record["offpolicy/ess_token"] <= 1 and 0 < record["offpolicy/ess_seq"] <= 1
        assert record["offpolicy/kl_k3"] >= 0
        assert record["actor/clip_low"] + record["actor/clip_high"] == pytest.approx(record["actor/clip_ratio"])
    # at step 0 nothing is stale: w = 1 on every token, so no correction drops or truncates anything
    assert records[0]["offpolicy/ess_token"] == pytest.approx(1.0)
    assert records[0]["correction/masked_low"] == records[0]["correction/masked_high"] == 0.0


def test_run_names_carry_correction_and_objective_with_parameters(tiny_cfg):
    cfg = tiny_cfg("algo=loglinear", "staleness=4", "correction=icepop", "objective=gspo")
    assert cfg.run_name == "loglinear-icepop0.5_2-gspo0.0003_0.0004-d4-s0"
    assert tiny_cfg("algo=recompute", "correction=tis", "correction.cap=3").run_name == "recompute-tis3-d2-s0"
    assert tiny_cfg("algo=recompute").run_name == "recompute-d2-s0"  # the defaults are left out
    record = identity_record("loglinear", "inverse", {"name": "m2po", "tau": 0.04}, {"name": "ppo"}, None, 8, 1, "fp32")
    assert run_name(record) == "loglinear-m2po0.04-d8-s1"


@pytest.mark.parametrize("overrides, expected", [
    (["correction=tis", "correction.cap=0"], "cap=0"),
    (["correction=icepop", "correction.lo=2", "correction.hi=1"], "lo"),
    (["correction=m2po", "correction.tau=-1"], "tau"),
    (["correction=tis", "algo=coupled"], "correction='tis' is not allowed with algo=coupled"),
    (["correction=tis", "+correction.clip=5"], "correction=tis does not take ['clip']"),
    (["objective=gspo", "objective.eps_clip=1.5"], "objective.eps_clip=1.5"),
    (["correction.name=bogus"], "correction='bogus'"),
])
def test_bad_correction_or_objective_fails_before_loading(tiny_cfg, monkeypatch, overrides, expected):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before validation")

    monkeypatch.setattr(a3po.models, "load_policy", must_not_load)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        run(tiny_cfg(*overrides))
