"""The approximation against recompute in a real run: the step-start anchor (schedule
step_start) is recompute's on a step's first minibatch."""

from __future__ import annotations

import pytest

from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_step_start_tracks_recompute_where_inverse_cannot(tiny_cfg, n_minibatches, earnable_reward):
    """With a reward the tiny model earns, so the policy moves between versions (with the arith
    task's constant 0 every advantage is 0 and the policy never changes: no drift to track)."""
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

    from analysis.anchor.drift import fit_drift

    rng = np.random.default_rng(0)
    distance = np.repeat([0.0, 1.0, 1.5, 2.0, 4.25, 8.0, 8.75], 20)
    drift = 0.03 * distance**beta * np.exp(rng.normal(0, 0.02, distance.size))
    fit = fit_drift(distance, drift)
    assert fit.beta == pytest.approx(beta, abs=0.02) and fit.c == pytest.approx(0.03, rel=0.05)
    assert fit.n_points == 120  # distance 0 carries nothing on beta
    with pytest.raises(ValueError, match="two distances"):
        fit_drift(np.array([2.0, 2.0]), np.array([0.1, 0.2]))


def test_a_run_logs_drift_per_minibatch_and_the_fit_reads_it(tiny_cfg, capsys):
    from analysis.anchor.drift import drift_points, main
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
    groups = fidelity_metrics(reference, logp, torch.zeros(4), tokens, 4, 1, 4, schedules={},
                              objective={"name": "ppo", "eps_clip": 0.2}, correction={"name": "none", "cap": None})
    out = groups[0][0]
    alpha = out["alpha_fit/cross/k1"] / out["alpha_fit/delta_sq/k1"]
    assert alpha.item() == pytest.approx(0.75)
    assert out["drift/logp_abs/k1"].item() == pytest.approx((0.4 + 0.2 + 0.8 + 0.1) / 4)


def test_the_approx_quality_report_tabulates_every_schedule_and_the_drift(tiny_cfg, tmp_path, earnable_reward):
    from analysis.studies.approx_quality import main

    common = ("staleness=1", "train.total_steps=3", "train.log_prox_errors=true", "train.n_minibatches=2")
    cfg = tiny_cfg("algo=recompute", "train.grad_fidelity_every=1", *common)
    run(cfg)
    hybrid = tiny_cfg("algo=hybrid", "algo.every=2", *common)
    run(hybrid)
    out = tmp_path / "docs" / "approx_quality.md"
    assert main([str(run_dir_of(cfg).parent), "--out", str(out), "--figures-dir", str(tmp_path / "docs" / "figs")]) == 0
    text = out.read_text()
    for schedule in ("inverse", "step_start", "target", "behave-linear"):
        assert f"| `{schedule}` |" in text
    assert "clip flips, d = 1" in text and "Drift: mean |logp - behave_logp| = " in text
    assert "by minibatch k and by entropy tercile (H1 lowest), d = 1" in text and "| schedule | k0 | k1 | H1 | H2 | H3 |" in text
    assert "| schedule | cos, d = 1 | norm_ratio, d = 1 |" in text
    # hybrid at every=2 over steps 1, 2 (>= d): recomputed at step 2 only
    assert "`hybrid2-d1-s0` (algo=hybrid, d = 1): recomputed on 50% of its steps >= d" in text
    assert (tmp_path / "docs" / "figs" / "approx_error.png").exists()


PPO, NONE = {"name": "ppo", "eps_clip": 0.2}, {"name": "none", "cap": None}


def test_the_strata_are_means_over_their_own_tokens_weighted_by_their_counts():
    """By hand on 7 tokens (one invalid): the k stratum is the whole micro-batch; the entropy
    terciles split the 6 valid tokens 2-2-2 and each is the mean |error| over its own two,
    weighted by 2 for the step's token mean."""
    import torch

    from a3po.learner.fidelity import fidelity_metrics
    from a3po.maths.diagnostics import entropy_terciles

    behave = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, -9.0])
    logp = behave + torch.tensor([0.4, -0.2, 0.8, 0.1, 0.3, -0.6, 5.0])
    reference = behave.clone()  # the recomputed anchor is the behaviour policy: |error| = |alpha * delta|
    entropy = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.8, 0.4, 0.0])
    valid = torch.tensor([True] * 6 + [False])
    tokens = {"behave": behave, "mask": valid, "seq_index": torch.zeros(7, dtype=torch.long),
              "advantages": torch.ones(7), "versions": torch.full((7,), 3)}
    groups = fidelity_metrics(reference, logp, entropy, tokens, 4, 1, 2, schedules={"target": {}},
                              objective=PPO, correction=NONE)
    by_name = {name: (float(value), float(weight)) for values, weight in groups for name, value in values.items()}
    error = (logp - behave).abs()  # target's anchor is logp itself
    assert by_name["prox_error/target/logp_abs"][0] == pytest.approx(float(error[:6].mean()))
    assert by_name["prox_error/target/logp_abs/k1"] == pytest.approx((float(error[:6].mean()), 6.0))
    terciles = entropy_terciles(entropy, valid)
    assert [terciles[h].nonzero().flatten().tolist() for h in ("H1", "H2", "H3")] == [[0, 3], [2, 5], [1, 4]]
    for h, members in (("H1", [0, 3]), ("H2", [2, 5]), ("H3", [1, 4])):
        assert by_name[f"prox_error/target/logp_abs/{h}"] == pytest.approx((float(error[members].mean()), 2.0))
    assert "prox_error/target-linear/logp_abs/k1" not in by_name  # strata for the loglinear anchors only
    empty = entropy_terciles(entropy, torch.zeros(7, dtype=torch.bool))
    assert all(int(m.sum()) == 0 for m in empty.values())


def test_gradient_agreement_is_exact_for_equal_anchors_and_counts_the_difference():
    import torch

    from a3po.learner.fidelity import gradient_agreement

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    x = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, -1.0]])

    def loss_of(anchor):  # a loss whose gradient in w is linear in the anchor
        return ((x @ w) * anchor).sum()

    reference = torch.tensor([1.0, 2.0])
    out = gradient_agreement(loss_of, [w], reference, {"same": reference.clone(), "double": 2 * reference,
                                                       "other": torch.tensor([1.0, -3.0])})
    assert out["grad_fidelity/same/cos"].item() == pytest.approx(1.0)
    assert out["grad_fidelity/same/norm_ratio"].item() == pytest.approx(1.0)
    assert out["grad_fidelity/double/cos"].item() == pytest.approx(1.0)
    assert out["grad_fidelity/double/norm_ratio"].item() == pytest.approx(2.0)
    g_ref, g_other = x.T @ reference, x.T @ torch.tensor([1.0, -3.0])
    assert out["grad_fidelity/other/cos"].item() == pytest.approx(
        float(g_ref @ g_other / (g_ref.norm() * g_other.norm())), rel=1e-6)
    assert w.grad is None  # nothing accumulated


def test_a_run_logs_strata_and_gradient_fidelity_on_due_steps_outside_time_step(tiny_cfg, earnable_reward):
    cfg = tiny_cfg("algo=loglinear", "staleness=2", "train.total_steps=4", "train.log_prox_errors=true",
                   "train.grad_fidelity_every=2", "train.n_minibatches=2", "train.lr=1e-3",
                   "+train.prox_error_schedules.fitted={name: rational, gamma: 0.5, c: 0.25, b: 2.0}")
    run(cfg)
    records = read_metrics(run_dir_of(cfg) / "metrics.jsonl")
    for r in records:
        assert {"prox_error/inverse/logp_abs/k0", "prox_error/inverse/logp_abs/k1", "prox_error/step_start/clip_flip/H3",
                "prox_error/fitted/logp_abs", "prox_error/fitted/logp_abs/H1", "prox_error/inverse/clip_rate/H3",
                "prox_error/recompute/clip_rate", "prox_error/recompute/clip_rate/k1"} <= set(r)
        # this run trains loglinear with the paper's schedule: its anchor on the tokens trained is the
        # `inverse` one, so what it would clip there is what its loss clipped
        assert r["prox_error/inverse/clip_rate"] == pytest.approx(r["actor/clip_ratio"], abs=1e-6)
        assert "prox_error/inverse/iw_abs/k0" not in r and r["time/fidelity"] > 0
        due = r["step"] % 2 == 0
        assert ("grad_fidelity/inverse/cos" in r) is due and ("grad_fidelity/fitted/norm_ratio" in r) is due
    # step 0 (d = 0): every schedule gives alpha = 0, the behaviour policy, which is the step-start
    # policy recompute anchors on: the same anchor, the same gradient
    for schedule in ("inverse", "behave", "step_start", "fitted"):
        assert records[0][f"grad_fidelity/{schedule}/cos"] == pytest.approx(1.0, abs=1e-5)
        assert records[0][f"grad_fidelity/{schedule}/norm_ratio"] == pytest.approx(1.0, abs=1e-4)
    step2 = records[2]  # d = 2: the anchors differ from recompute's, and so do the gradients
    assert all(-1.0 - 1e-6 <= step2[f"grad_fidelity/{s}/cos"] <= 1.0 + 1e-6 for s in ("inverse", "behave", "fitted"))
    assert step2["grad_fidelity/behave/cos"] < 1.0 - 1e-6


def test_grad_fidelity_every_needs_log_prox_errors(tiny_cfg):
    from a3po.config import parse_config
    from a3po.errors import ConfigError

    with pytest.raises(ConfigError, match="train.grad_fidelity_every=2 is not allowed; it needs train.log_prox_errors"):
        parse_config(tiny_cfg("train.grad_fidelity_every=2"))
    with pytest.raises(ConfigError, match="train.grad_fidelity_every=-1 is not allowed"):
        parse_config(tiny_cfg("train.log_prox_errors=true", "train.grad_fidelity_every=-1"))


def test_the_schedule_fit_recovers_a_rational_schedule_from_its_cells():
    import numpy as np
    import pandas as pd

    from analysis.anchor.fit_schedule import excess_table, fit_rational

    d, k = np.repeat([1.0, 2.0, 4.0, 8.0], 4), np.tile([0, 1, 2, 3], 4)
    p = k / 4
    alpha = d**0.6 / (d**0.6 + 0.3 + 1.5 * p)
    cells = pd.DataFrame({"d": d, "k": k, "m": 4, "C": 2.0 * alpha, "D": 2.0, "alpha_star": alpha, "n": 5})
    fit = fit_rational(cells)
    assert (fit.gamma, fit.c, fit.b) == pytest.approx((0.6, 0.3, 1.5), rel=1e-3)
    table = excess_table(cells, {"fitted": ("rational", fit.params()), "inverse": ("inverse", {})})
    assert table["fitted"].max() < 1e-3 < table["inverse"].min()
    with pytest.raises(ValueError, match="3 \\(d, k/m\\) cells at least"):
        fit_rational(cells.head(2))


def test_fit_schedule_reads_a_run_and_writes_a_schedule_that_trains(tiny_cfg, tmp_path, earnable_reward):
    from omegaconf import OmegaConf

    from a3po.maths.schedules import validate_schedule
    from analysis.anchor.fit_schedule import alpha_cells, main
    from analysis.load import load_runs

    cfg = tiny_cfg("algo=recompute", "staleness=2", "train.total_steps=4", "train.log_prox_errors=true",
                   "train.n_minibatches=2", "train.lr=1e-3")
    run(cfg)
    cells = alpha_cells(load_runs(run_dir_of(cfg)))
    assert sorted(zip(cells["d"], cells["k"])) == [(1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1)]  # step 1 at d = 1
    assert cells.loc[cells["k"] == 0, "alpha_star"].to_numpy() == pytest.approx(1.0, abs=1e-4)  # k = 0: current
    out, report = tmp_path / "conf" / "schedule" / "fitted.yaml", tmp_path / "fit.md"
    assert main([str(run_dir_of(cfg)), "--out", str(out), "--report", str(report)]) == 0
    schedule = OmegaConf.to_container(OmegaConf.load(out))
    assert schedule["name"] == "rational" and set(schedule) == {"name", "gamma", "c", "b"}
    validate_schedule("rational", schedule)
    assert "`fitted` excess" in report.read_text() and "# Fitted by `python -m analysis.anchor.fit_schedule" in out.read_text()
    trained = tiny_cfg("algo=loglinear", "staleness=2", "train.total_steps=2", "schedule=rational",
                       *(f"schedule.{key}={schedule[key]}" for key in ("gamma", "c", "b")))
    run(trained)
    assert len(read_metrics(run_dir_of(trained) / "metrics.jsonl")) == 2


def test_the_s2_fidelity_verdicts_follow_the_preregistered_rules():
    import pandas as pd

    from analysis.anchor.tracking import s2_verdicts

    rows = []
    for seed, (start, inverse, fitted) in enumerate([(0.05, 0.12, None), (0.06, 0.11, 0.05), (0.04, 0.13, 0.07)]):
        for schedule, value in (("step_start", start), ("inverse", inverse), ("fitted", fitted)):
            for kind in ("logp_abs", "clip_flip"):
                if value is not None:
                    rows += [{"algo": "recompute", "metric": f"prox_error/{schedule}/{kind}", "step": step,
                              "staleness": 4, "seed": seed, "value": value} for step in (3, 4, 5)]
    text = "\n".join(s2_verdicts(pd.DataFrame(rows)))
    assert "| 4 | logp_abs | 3 | -0.0700 |" in text and text.count("| holds |") == 2  # step (3) is before d
    # fitted below step_start at seed 1 (0.05 < 0.06), above at seed 2 (0.07 > 0.04): mixed
    assert "H-S2c (fitted below step_start, log-prob error, held-out seeds): 1 of 2 (seed, d) cells: undecided" in text


def test_log_prox_errors_changes_no_training_value(tiny_cfg, tmp_path, earnable_reward):
    """The telemetry is a diagnostic: a loglinear run with it trains exactly as one without it
    (every logged value but the telemetry's own and the machine's), so a study may leave it off
    to save its recompute forward (S8 does)."""
    from tests.conftest import comparable

    common = ("algo=loglinear", "staleness=2", "train.total_steps=4", "train.n_minibatches=2", "train.lr=1e-3")
    records = {}
    for flag in ("false", "true"):
        cfg = tiny_cfg(*common, f"train.log_prox_errors={flag}", f"experiment_name=prox_errors_{flag}")
        run(cfg)
        records[flag] = comparable(read_metrics(run_dir_of(cfg) / "metrics.jsonl"),
                                   "prox_error/", "drift/", "alpha_fit/", "grad_fidelity/")
    assert len(records["true"]) == 4
    assert records["true"] == records["false"]
