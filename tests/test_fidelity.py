"""The approximation against recompute in a real run: the step-start anchor (schedule
step_start) is recompute's on a step's first minibatch."""

from __future__ import annotations

import pytest

from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_step_start_tracks_recompute_where_inverse_cannot(tiny_cfg, n_minibatches):
    cfg = tiny_cfg("algo=recompute", "staleness=2", "train.total_steps=4", "train.log_prox_errors=true",
                   f"train.n_minibatches={n_minibatches}", "train.lr=1e-3")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    stale = [r for r in records if r["step"] >= 2]  # every token has d = 2
    inverse = [r["prox_error/inverse/logp_abs"] for r in stale]
    step_start = [r["prox_error/step_start/logp_abs"] for r in stale]
    assert min(inverse) > 0
    if n_minibatches == 1:  # k = 0 only: the anchor is the current policy, i.e. recompute's, exactly
        assert max(step_start) < 1e-6
    else:
        assert all(s < i for s, i in zip(step_start, inverse))
