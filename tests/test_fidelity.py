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


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_the_drift_fit_recovers_the_exponent(beta):
    import numpy as np

    from analysis.drift import fit_drift

    rng = np.random.default_rng(0)
    distance = np.repeat([0.0, 1.0, 1.5, 2.0, 4.25, 8.0, 8.75], 20)
    drift = 0.03 * distance**beta * np.exp(rng.normal(0, 0.02, distance.size))
    fit = fit_drift(distance, drift)
    assert fit.beta == pytest.approx(beta, abs=0.02) and fit.c == pytest.approx(0.03, rel=0.05)
    assert fit.n_points == 120  # distance 0 carries nothing on beta
    with pytest.raises(ValueError, match="two distances"):
        fit_drift(np.array([2.0, 2.0]), np.array([0.1, 0.2]))


def test_a_run_logs_drift_per_minibatch_and_the_fit_reads_it(tiny_cfg, capsys):
    from analysis.drift import drift_points, main
    from analysis.load import load_runs

    cfg = tiny_cfg("algo=loglinear", "staleness=2", "train.total_steps=4", "train.log_prox_errors=true",
                   "train.n_minibatches=2", "train.lr=1e-3")
    run(cfg)
    points = drift_points(load_runs(run_dir_of(cfg)))
    assert len(points) == 4 * 2
    assert sorted(points[points["step"] == 3]["distance"]) == [2.0, 2.5]  # d = 2, k/m = 0 and 1/2
    assert main([str(run_dir_of(cfg))]) == 0
    assert "drift = " in capsys.readouterr().out


def test_the_alpha_fit_statistics_give_the_least_squares_alpha():
    import torch

    from a3po.learner.fidelity import fidelity_metrics

    behave = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    logp = behave + torch.tensor([0.4, -0.2, 0.8, 0.1])
    reference = behave + 0.75 * (logp - behave)  # the recomputed anchor sits 3/4 of the way
    tokens = {"behave": behave, "mask": torch.ones(4, dtype=torch.bool), "seq_index": torch.arange(4),
              "advantages": torch.ones(4), "versions": torch.full((4,), 2)}
    out = fidelity_metrics(reference, logp, tokens, 4, 1, 4, schedules={},
                           objective={"name": "ppo", "eps_clip": 0.2}, correction={"name": "none", "cap": None})
    alpha = out["alpha_fit/cross/k1"] / out["alpha_fit/delta_sq/k1"]
    assert alpha.item() == pytest.approx(0.75)
    assert out["drift/logp_abs/k1"].item() == pytest.approx((0.4 + 0.2 + 0.8 + 0.1) / 4)


def test_the_approx_quality_report_tabulates_every_schedule_and_the_drift(tiny_cfg, tmp_path):
    from analysis.approx_quality import main

    cfg = tiny_cfg("algo=recompute", "staleness=1", "train.total_steps=3", "train.log_prox_errors=true")
    run(cfg)
    out = tmp_path / "docs" / "approx_quality.md"
    assert main([str(run_dir_of(cfg).parent), "--out", str(out), "--figures-dir", str(tmp_path / "docs" / "figs")]) == 0
    text = out.read_text()
    for schedule in ("inverse", "step_start", "target", "behave-linear"):
        assert f"| `{schedule}` |" in text
    assert "clip flips, d = 1" in text and "Drift: mean |logp - behave_logp| = " in text
    assert (tmp_path / "docs" / "figs" / "approx_error.png").exists()
