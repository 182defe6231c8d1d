"""analysis/: synthetic run directories with values known in closed form, so every
number in the tidy frame, the figure CSVs and the summary can be checked by hand."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from analysis import summary  # noqa: E402
from analysis.figures import paper as figures  # noqa: E402
from analysis.load import TIDY_COLUMNS, NoRunsError, RunSkippedWarning, label, load_runs, load_wandb  # noqa: E402
from analysis.load import run_identity  # noqa: E402
from analysis.scalars import contended, run_scalars  # noqa: E402
from analysis.stats import t_quantile  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "analysis" / "notebooks" / "paper_figures.ipynb"

TOTAL_STEPS = 20  # final reward window: max(1, 20 // 10) = 2 steps (18 and 19)
EVAL_EVERY = 5
ALGO_INDEX = {"recompute": 0, "loglinear": 1, "coupled": 2, "metrics": 3}
BASE_STEP_TIME = {"recompute": 2.0, "loglinear": 1.5, "coupled": 1.0, "metrics": 2.5}
PROX_TIME = {"recompute": 0.5, "loglinear": 1e-4, "coupled": 0.0, "metrics": 0.5}
USES_SCHEDULE = {"recompute": False, "loglinear": True, "linear": True, "coupled": False, "metrics": False}


# Closed forms of the synthetic metrics: the tests compare against these.
def reward(algo, staleness, seed, step):
    return 0.1 * step + 0.01 * seed + 0.05 * ALGO_INDEX[algo] + 0.001 * staleness


def eval_reward(algo, staleness, seed, step):
    return 0.2 + 0.1 * step + 0.01 * seed


def step_time(algo, staleness, seed):
    # recompute's step time grows with staleness, so the speedup differs per staleness.
    growth = 1 + 0.5 * staleness if algo == "recompute" else 1.0
    return BASE_STEP_TIME[algo] * growth * (1 + 0.1 * seed)


def wall_time(algo, staleness, seed, step):
    return (step + 1) * step_time(algo, staleness, seed)


def entropy(algo, staleness, seed, step):
    return 1.0 - 0.01 * step + 0.01 * seed


def prox_error(schedule, staleness, seed, step):
    base = {"inverse": 0.01, "exponential": 0.02, "inverse-linear": 0.015}[schedule]
    return base * staleness + 0.001 * step + 0.0001 * seed


def record(algo, staleness, seed, step):
    a = ALGO_INDEX[algo]
    row = {
        "step": step,
        "version": step,
        "wall_time": wall_time(algo, staleness, seed, step),
        "time/step": step_time(algo, staleness, seed),
        "time/step_cpu": step_time(algo, staleness, seed),  # one full core: not contended
        "time/eval": 0.0,
        "time/checkpoint": 0.0,
        "time/rollout": 0.3,
        "time/prox_logp": PROX_TIME[algo],
        "time/train": 0.7,
        "time/weight_sync": 0.01,
        "reward/mean": reward(algo, staleness, seed, step),
        "actor/entropy": entropy(algo, staleness, seed, step),
        "actor/importance_weight/max": 1.5 + 0.1 * a + 0.01 * step,
        "actor/importance_weight/min": 0.5 - 0.01 * step,
        "actor/importance_weight/mean": 1.0,
        "actor/behave_weight/max": 1.2,
        "actor/behave_weight/min": 0.8,
        "actor/behave_weight/mean": 1.0,
        "actor/clipped_tokens": 10 * a + step + seed,
        "actor/clip_ratio": 0.01,
        "actor/grad_norm": 0.5,
        "actor/approx_kl": 0.001,
        "actor/loss": -0.1,
        "staleness/mean": float(min(step, staleness)),
        "staleness/max": min(step, staleness),
        "staleness/min": min(step, staleness),
        "custom/extra": 7.0,
        "note": "strings are not curves",
    }
    if step % EVAL_EVERY == 0:
        row["eval/reward"] = eval_reward(algo, staleness, seed, step)
    if algo == "metrics":
        for schedule in ("inverse", "exponential", "inverse-linear"):
            error = prox_error(schedule, staleness, seed, step)
            row[f"prox_error/{schedule}/logp_abs"] = error
            row[f"prox_error/{schedule}/iw_abs"] = 2 * error
    return row


def write_run(sweep: Path, algo: str, staleness: int, seed: int, schedule: str = "inverse",
              steps: int = TOTAL_STEPS, total_steps: int = TOTAL_STEPS, experiment: str = "synthetic") -> Path:
    """A run directory as the trainer leaves it: config.yaml, metrics.jsonl, .hydra/."""
    uses = USES_SCHEDULE[algo]
    name = f"{algo}{'-' + schedule if uses and schedule != 'inverse' else ''}-d{staleness}-s{seed}"
    run_dir = sweep / name
    (run_dir / ".hydra").mkdir(parents=True)
    config = {
        "run_name": name, "experiment_name": experiment, "staleness": staleness, "seed": seed,
        "algo": {"name": algo, "uses_schedule": uses}, "schedule": {"name": schedule},
        "train": {"total_steps": total_steps},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    with open(run_dir / "metrics.jsonl", "w") as handle:
        for step in range(steps):
            handle.write(json.dumps(record(algo, staleness, seed, step)) + "\n")
    return run_dir


STALENESS = [1, 2]
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """3 algos x 2 staleness x 2 seeds, a loglinear[exponential] ablation run, and two
    metrics-mode runs, plus the files Hydra leaves in a sweep dir."""
    root = tmp_path_factory.mktemp("sweep") / "synthetic"
    root.mkdir()
    for algo in ("recompute", "loglinear", "coupled"):
        for staleness in STALENESS:
            for seed in SEEDS:
                write_run(root, algo, staleness, seed)
    write_run(root, "loglinear", 2, 0, schedule="exponential")
    for staleness in STALENESS:
        write_run(root, "metrics", staleness, 0)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


@pytest.fixture(scope="module")
def frame(sweep) -> pd.DataFrame:
    return load_runs(sweep)


@pytest.fixture(scope="module")
def figure_dir(frame, tmp_path_factory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("figures")
    return out, figures.make_figures(frame, out)


def read_csv(out: Path, stem: str) -> pd.DataFrame:
    return pd.read_csv(out / f"{stem}.csv", keep_default_na=False, na_values=[""])


def one(frame: pd.DataFrame, **where) -> pd.Series:
    mask = np.ones(len(frame), dtype=bool)
    for column, value in where.items():
        mask &= (frame[column] == value).to_numpy()
    rows = frame[mask]
    assert len(rows) == 1, (where, rows)
    return rows.iloc[0]


# --- load -----------------------------------------------------------------------------

def test_label():
    assert label("loglinear", "inverse") == "loglinear"
    assert label("loglinear", "exponential0.5") == "loglinear-exponential0.5"
    assert label("recompute", "") == "recompute"
    assert label("recompute", None) == "recompute"
    assert label("loglinear", "inverse", "tis2", "gspo") == "loglinear-tis2-gspo"
    assert label("recompute", None, "none", "ppo") == "recompute"


def test_tidy_frame_columns_and_values(frame):
    assert list(frame.columns) == TIDY_COLUMNS
    assert frame["run"].nunique() == 3 * 2 * 2 + 1 + 2
    row = one(frame, run="loglinear-d2-s1", metric="reward/mean", step=3)
    assert row["experiment"] == "synthetic"
    assert row["algo"] == "loglinear" and row["schedule"] == "inverse" and row["label"] == "loglinear"
    assert row["variant"] == "loglinear-d2" and row["correction"] == "none" and row["objective"] == "ppo"
    assert row["runtime"] == "lagged" and row["max_staleness"] == 2
    assert row["staleness"] == 2 and row["seed"] == 1
    assert row["value"] == pytest.approx(reward("loglinear", 2, 1, 3))
    assert row["wall_time"] == pytest.approx(wall_time("loglinear", 2, 1, 3))
    assert bool(row["complete"]) is True
    # the schedule is blanked where the algorithm ignores it
    assert set(frame.loc[frame["algo"] == "recompute", "schedule"]) == {""}
    assert set(frame.loc[frame["run"] == "loglinear-exponential-d2-s0", "schedule"]) == {"exponential"}
    assert set(frame.loc[frame["run"] == "loglinear-exponential-d2-s0", "label"]) == {"loglinear-exponential"}
    # unknown numeric keys are kept, strings dropped, eval only on eval steps
    assert (frame["metric"] == "custom/extra").any()
    assert not (frame["metric"] == "note").any()
    eval_steps = frame.loc[(frame["run"] == "coupled-d1-s0") & (frame["metric"] == "eval/reward"), "step"]
    assert sorted(eval_steps) == [0, 5, 10, 15]
    assert frame.loc[frame["run"] == "metrics-d1-s0", "metric"].str.startswith("prox_error/").sum() == 6 * TOTAL_STEPS
    assert frame["step"].dtype == np.int64 and frame["complete"].dtype == bool


def test_partial_run_and_truncated_line(tmp_path):
    sweep = tmp_path / "partial"
    run_dir = write_run(sweep, "loglinear", 2, 0, steps=10)
    write_run(sweep, "recompute", 2, 0)
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 10, "reward/mean": 0.')  # killed mid-write
    with pytest.warns(RunSkippedWarning, match=r"metrics\.jsonl:11"):
        df = load_runs(sweep)
    partial = df[df["run"] == "loglinear-d2-s0"]
    assert not partial["complete"].any()
    assert partial["step"].max() == 9
    assert df.loc[df["run"] == "recompute-d2-s0", "complete"].all()
    table = summary.summary_table(df)
    row = one(table, label="loglinear", staleness=2)
    assert row["n_incomplete"] == 1
    assert row["train_time_s_mean"] == pytest.approx(wall_time("loglinear", 2, 0, 9))
    assert row["final_reward_mean"] == pytest.approx(reward("loglinear", 2, 0, 9))  # 10 steps: window 1
    assert one(table, label="recompute", staleness=2)["n_incomplete"] == 0


def test_run_without_metrics_is_skipped_with_its_name(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep, "coupled", 1, 0)
    broken = write_run(sweep, "recompute", 1, 0)
    (broken / "metrics.jsonl").unlink()
    empty = write_run(sweep, "loglinear", 1, 0)
    (empty / "metrics.jsonl").write_text("")
    with pytest.warns(RunSkippedWarning) as caught:
        df = load_runs(sweep)
    messages = " ".join(str(w.message) for w in caught)
    assert "recompute-d1-s0" in messages and "loglinear-d1-s0" in messages
    assert set(df["run"]) == {"coupled-d1-s0"}


@pytest.mark.parametrize("file, content, reason", [
    ("config.yaml", b"run_name: [unclosed\nseed: 0\n", "config.yaml is not valid YAML (ParserError: "),
    ("config.yaml", b"- a list\n- not settings\n", "config.yaml holds a list, not a mapping of settings"),
    ("config.yaml", b"seed: \xff\xfe\n", "config.yaml cannot be read (UnicodeDecodeError: "),
    ("metrics.jsonl", b'{"step": 0}\n\xff\xfe garbage\n', "metrics.jsonl cannot be read (UnicodeDecodeError: "),
])
def test_run_with_an_unreadable_file_is_skipped_in_one_line_naming_it(tmp_path, file, content, reason):
    sweep = tmp_path / "sweep"
    write_run(sweep, "coupled", 1, 0)
    bad = write_run(sweep, "recompute", 1, 0)
    (bad / file).write_bytes(content)
    with pytest.warns(RunSkippedWarning) as caught:
        df = load_runs(sweep)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith(f"{bad.resolve()}: skipped, {reason}")
    assert set(df["run"]) == {"coupled-d1-s0"}
    assert df.attrs["skipped"] == [(str(bad.resolve()), messages[0].split(": skipped, ", 1)[1])]


def test_skipped_runs_are_recorded_whatever_the_reason(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep, "coupled", 1, 0)
    assert load_runs(sweep).attrs["skipped"] == []
    (write_run(sweep, "recompute", 1, 0) / "metrics.jsonl").unlink()
    (write_run(sweep, "loglinear", 1, 0) / "config.yaml").write_text("a: [")
    with pytest.warns(RunSkippedWarning):
        skipped = dict(load_runs(sweep).attrs["skipped"])
    assert sorted(Path(path).name for path in skipped) == ["loglinear-d1-s0", "recompute-d1-s0"]
    assert skipped[str((sweep / "recompute-d1-s0").resolve())] == "no metrics.jsonl (or it is empty)"


def test_load_configs_leaves_out_an_unreadable_config_with_a_warning(tmp_path):
    from analysis.load import load_configs

    sweep = tmp_path / "sweep"
    write_run(sweep, "coupled", 1, 0)
    (write_run(sweep, "recompute", 1, 0) / "config.yaml").write_text("a: [")
    with pytest.warns(RunSkippedWarning, match=r"recompute-d1-s0: skipped, config\.yaml is not valid YAML"):
        configs = load_configs(sweep)
    assert list(configs) == [("synthetic", "coupled-d1-s0")]


def test_only_unreadable_runs_is_a_clear_error(tmp_path):
    sweep = tmp_path / "sweep"
    (write_run(sweep, "coupled", 1, 0) / "config.yaml").write_text("a: [")
    with pytest.warns(RunSkippedWarning), pytest.raises(NoRunsError, match="1 run directories were skipped"):
        load_runs(sweep)


def test_run_dir_directly_and_nested(sweep, tmp_path):
    direct = load_runs(sweep / "recompute-d1-s0")
    assert set(direct["run"]) == {"recompute-d1-s0"}
    nested = load_runs(sweep.parent)  # the sweep dir is found below its parent
    assert nested["run"].nunique() == 15


def test_empty_sweep_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoRunsError, match="no runs found"):
        load_runs(empty)
    assert figures.main([str(empty)]) == 2
    assert "no runs found" in capsys.readouterr().err


def test_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    run_dir = write_run(tmp_path / "sweep", "coupled", 1, 0, steps=4, total_steps=4)
    with open(run_dir / "metrics.jsonl", "a") as handle:  # requeued: step 3 logged again
        handle.write(json.dumps({"step": 3, "wall_time": 99.0, "reward/mean": 0.5}) + "\n")
    df = load_runs(run_dir)
    assert one(df, metric="reward/mean", step=3)["value"] == 0.5
    assert one(df, metric="reward/mean", step=3)["wall_time"] == 99.0
    assert not ((df["step"] == 3) & (df["metric"] == "actor/entropy")).any()


# --- wandb ----------------------------------------------------------------------------

class FakeRun:
    def __init__(self, name, config, rows):
        self.name, self.config, self._rows = name, config, rows

    def scan_history(self):
        return iter(self._rows)


class FakeApi:
    def __init__(self, runs):
        self._runs = runs
        self.paths = []

    def runs(self, path):
        self.paths.append(path)
        return self._runs


def test_load_wandb_with_a_fake_api(monkeypatch, sweep):
    nested = {"run_name": "loglinear-d2-s1", "experiment_name": "synthetic", "staleness": 2, "seed": 1,
              "algo": {"name": "loglinear", "uses_schedule": True}, "schedule": {"name": "inverse"},
              "train": {"total_steps": 3}}
    # flattened and value-wrapped, as an older logger might have left it
    flat = {"run_name": {"value": "recompute-d2-s1"}, "experiment_name": {"value": "synthetic"},
            "staleness": {"value": 2}, "seed": {"value": 1}, "algo.name": {"value": "recompute"},
            "algo.uses_schedule": {"value": False}, "schedule.name": {"value": "inverse"},
            "train.total_steps": {"value": 5}}
    rows = [{**record("loglinear", 2, 1, step), "_step": step, "_runtime": 123.0, "_timestamp": 1.7e9}
            for step in range(3)]
    no_own_step = [{"_step": step, "_runtime": 10.0 * (step + 1), "reward/mean": 0.1 * step} for step in range(3)]
    fake = FakeApi([FakeRun("a", nested, rows), FakeRun("b", flat, no_own_step)])
    import wandb

    monkeypatch.setattr(wandb, "Api", lambda *args, **kwargs: fake)
    df = load_wandb("a3po", entity="team")
    assert fake.paths == ["team/a3po"]
    assert list(df.columns) == TIDY_COLUMNS
    local = load_runs(sweep / "loglinear-d2-s1")
    for step in range(3):
        mine = one(df, run="loglinear-d2-s1", metric="reward/mean", step=step)
        theirs = one(local, metric="reward/mean", step=step)
        assert mine["value"] == pytest.approx(theirs["value"])
        assert mine["wall_time"] == pytest.approx(theirs["wall_time"])
    assert df.loc[df["run"] == "loglinear-d2-s1", "complete"].all()
    assert not df["metric"].str.startswith("_").any()
    other = df[df["run"] == "recompute-d2-s1"]
    assert set(other["algo"]) == {"recompute"} and set(other["schedule"]) == {""}
    assert one(other, step=2)["wall_time"] == 30.0
    assert not other["complete"].any()  # 3 of 5 steps


def test_local_run_and_its_wandb_copy_count_once(monkeypatch, sweep):
    config = {"run_name": "loglinear-d2-s1", "experiment_name": "synthetic", "staleness": 2, "seed": 1,
              "algo": {"name": "loglinear", "uses_schedule": True}, "schedule": {"name": "inverse"},
              "train": {"total_steps": TOTAL_STEPS}}
    copy = FakeRun("copy", config, [{**record("loglinear", 2, 1, t), "reward/mean": 99.0} for t in range(3)])
    import wandb

    monkeypatch.setattr(wandb, "Api", lambda *args, **kwargs: FakeApi([copy]))
    df = figures.load_sources([sweep], "a3po")
    assert df["run"].nunique() == 15 and not (df["value"] == 99.0).any()  # the local copy is kept


# --- figures --------------------------------------------------------------------------

FIGURE_STEMS = ["fig1_prox_time", "fig2_reward_wallclock", "fig3_entropy", "fig4_importance_weight",
                "fig5_clipped_tokens", "staleness_panel", "approx_error"]


def test_every_figure_written_non_empty(figure_dir):
    out, written = figure_dir
    for stem in FIGURE_STEMS:
        for suffix in (".png", ".pdf", ".csv"):
            path = out / f"{stem}{suffix}"
            assert path in written and path.stat().st_size > 0, path
    assert (out / "fig1_prox_time.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "corrections_panel.png").exists()  # one correction only: nothing to compare
    assert (out / "fig1_prox_time.pdf").read_bytes()[:4] == b"%PDF"


def test_per_step_csv_holds_the_seed_mean(figure_dir):
    out, _ = figure_dir
    data = read_csv(out, "fig3_entropy")
    row = one(data, label="loglinear", staleness=1, step=2)
    values = [entropy("loglinear", 1, seed, 2) for seed in SEEDS]
    assert row["mean"] == pytest.approx(np.mean(values))  # (0.98 + 0.99) / 2
    assert row["min"] == pytest.approx(min(values)) and row["max"] == pytest.approx(max(values))
    assert row["std"] == pytest.approx(np.std(values, ddof=1))
    assert row["n_seeds"] == 2
    assert one(data, label="loglinear-exponential", staleness=2, step=2)["n_seeds"] == 1

    weights = read_csv(out, "fig4_importance_weight")
    assert set(weights["metric"]) == {"actor/importance_weight/max", "actor/importance_weight/min"}
    assert one(weights, metric="actor/importance_weight/max", label="coupled", staleness=2, step=4)["mean"] \
        == pytest.approx(1.5 + 0.2 + 0.04)
    clipped = read_csv(out, "fig5_clipped_tokens")
    assert one(clipped, metric="actor/clipped_tokens", label="recompute", staleness=1, step=7)["mean"] \
        == pytest.approx(7.5)
    assert one(clipped, metric="actor/clip_ratio", label="recompute", staleness=1, step=7)["mean"] \
        == pytest.approx(0.01)


def test_log_scale_prox_time_leaves_out_zeros(figure_dir):
    out, _ = figure_dir
    data = read_csv(out, "fig1_prox_time")
    assert "coupled" not in set(data["label"])  # its prox time is 0: nothing to draw on a log axis
    assert one(data, label="loglinear", staleness=1, step=0)["mean"] == pytest.approx(1e-4)


def test_reward_wallclock_csv(figure_dir):
    out, _ = figure_dir
    data = read_csv(out, "fig2_reward_wallclock")
    curve = one(data, panel="reward_vs_training_time", label="recompute", staleness=2, step=19)
    # the running sum of time/step, which equals wall_time here (no eval or checkpoint time)
    assert curve["train_time_s"] == pytest.approx(np.mean([wall_time("recompute", 2, s, 19) for s in SEEDS]))
    assert curve["mean"] == pytest.approx(np.mean([reward("recompute", 2, s, 19) for s in SEEDS]))
    bars = one(data, panel="training_time", label="loglinear", staleness=1)
    times = [wall_time("loglinear", 1, s, TOTAL_STEPS - 1) for s in SEEDS]
    assert bars["mean"] == pytest.approx(np.mean(times))
    assert bars["min"] == pytest.approx(min(times)) and bars["max"] == pytest.approx(max(times))


def steady_mean(function, staleness):
    """The mean of function(step) over the steady-state steps (step >= staleness)."""
    return np.mean([function(step) for step in range(staleness, TOTAL_STEPS)])


def final_reward(algo, staleness, seed):
    return np.mean([reward(algo, staleness, seed, step) for step in (TOTAL_STEPS - 2, TOTAL_STEPS - 1)])


def test_staleness_panel_csv(figure_dir):
    out, _ = figure_dir
    data = read_csv(out, "staleness_panel")
    assert set(data["quantity"]) == {"final_reward", "train_time_s", "entropy", "iw_max", "iw_min",
                                     "clipped_tokens", "clip_ratio", "prox_time_s"}
    row = one(data, quantity="final_reward", label="coupled", staleness=2)
    assert row["mean"] == pytest.approx(np.mean([final_reward("coupled", 2, s) for s in SEEDS]))
    row = one(data, quantity="clipped_tokens", label="loglinear", staleness=1)
    assert row["mean"] == pytest.approx(10 + steady_mean(lambda t: t, 1) + 0.5)  # steps 1..19 only
    row = one(data, quantity="train_time_s", label="recompute", staleness=2)
    assert row["mean"] == pytest.approx(np.mean([TOTAL_STEPS * step_time("recompute", 2, s) for s in SEEDS]))


def test_approx_error_csv(figure_dir):
    out, _ = figure_dir
    data = read_csv(out, "approx_error")
    assert set(data["schedule"]) == {"inverse", "exponential", "inverse-linear"}
    assert set(data["label"]) == {"loglinear", "loglinear-exponential", "linear"}
    row = one(data, kind="logp_abs", schedule="exponential", staleness=2)
    assert row["mean"] == pytest.approx(np.mean([prox_error("exponential", 2, 0, t) for t in range(TOTAL_STEPS)]))
    assert one(data, kind="iw_abs", schedule="exponential", staleness=2)["mean"] == pytest.approx(2 * row["mean"])


def test_figure_with_absent_metrics_is_skipped(frame, tmp_path, caplog):
    without = frame[~frame["metric"].isin(["actor/entropy"]) & ~frame["metric"].str.startswith("prox_error/")]
    with caplog.at_level("WARNING", logger="analysis.figures"):
        assert figures.fig3_entropy(without, tmp_path) == []
        assert figures.approx_error(without, tmp_path) == []
    assert "fig3_entropy skipped" in caplog.text and "approx_error skipped" in caplog.text
    assert not list(tmp_path.iterdir())
    only_max = frame[frame["metric"] != "actor/importance_weight/min"]
    assert len(figures.fig4_importance_weight(only_max, tmp_path)) == 3
    assert set(read_csv(tmp_path, "fig4_importance_weight")["metric"]) == {"actor/importance_weight/max"}


def palette_rows(*rows):
    """A frame of (label, algo, schedule_name[, label_prefix]) rows, as colour_map reads them."""
    rows = [row + ("",) * (4 - len(row)) for row in rows]
    return pd.DataFrame(rows, columns=["label", "algo", "schedule_name", "label_prefix"])


def test_colours_are_fixed_and_deterministic():
    assert figures.colour("loglinear", "loglinear") == figures.PALETTE["loglinear"]
    assert figures.colour("first/loglinear", "loglinear", "inverse", "first") == figures.PALETTE["loglinear"]
    assert figures.colour("recompute", "recompute") != figures.colour("loglinear", "loglinear")
    exponential = figures.colour("loglinear-exponential0.5", "loglinear", "exponential")
    assert exponential == figures.colour("loglinear-exponential0.7 (async)", "loglinear", "exponential")
    assert figures.colour("linear-exponential0.5", "linear", "exponential") != exponential
    assert figures.colour("something-new", "something") == figures.colour("something-new", "something")
    # two gammas prefer the same colour; drawn together they get two
    rows = [("recompute", "recompute"), ("loglinear", "loglinear", "inverse"),
            ("loglinear-exponential0.5", "loglinear", "exponential"),
            ("loglinear-exponential0.7", "loglinear", "exponential")]
    mapping = figures.colour_map(palette_rows(*rows))
    assert mapping["loglinear"] == figures.PALETTE["loglinear"] and mapping["recompute"] == figures.PALETTE["recompute"]
    assert len(set(mapping.values())) == 4
    assert mapping == figures.colour_map(palette_rows(*reversed(rows)))  # deterministic
    assert list(mapping) == ["recompute", "loglinear", "loglinear-exponential0.5", "loglinear-exponential0.7"]
    assert mapping.order(["loglinear-exponential0.7", "recompute"]) == ["recompute", "loglinear-exponential0.7"]
    assert figures.linestyle("loglinear", "loglinear") == "-"
    assert figures.linestyle("loglinear-exponential0.5", "loglinear") == "--"
    assert figures.linestyle("loglinear (async)", "loglinear") == "--"
    assert figures.linestyle("first/loglinear", "loglinear") == "--"
    assert mapping.linestyle("recompute") == "-" and mapping.linestyle("loglinear-exponential0.5") == "--"


def test_colours_come_from_the_identity_columns_not_the_label_text():
    """A label is never taken apart: a schedule ablation's colour follows its schedule_name,
    and a label that merely reads like an algorithm gets no palette colour."""
    mapping = figures.colour_map(palette_rows(("odd-name", "loglinear", "constant"), ("loglinear", "recompute")))
    assert mapping["odd-name"] == figures.colour("loglinear-constant0.5", "loglinear", "constant")
    assert mapping["loglinear"] != figures.PALETTE["loglinear"]  # a recompute run, whatever its label says
    assert mapping.linestyle("loglinear") == "--"


# --- summary --------------------------------------------------------------------------

def test_summary_values(frame):
    table = summary.summary_table(frame)
    for staleness in STALENESS:
        recompute = np.mean([wall_time("recompute", staleness, s, TOTAL_STEPS - 1) for s in SEEDS])
        loglinear = np.mean([wall_time("loglinear", staleness, s, TOTAL_STEPS - 1) for s in SEEDS])
        row = one(table, label="loglinear", staleness=staleness)
        assert row["train_time_s_mean"] == pytest.approx(loglinear)
        assert row["speedup_vs_recompute"] == pytest.approx(recompute / loglinear)
        assert one(table, label="recompute", staleness=staleness)["speedup_vs_recompute"] == pytest.approx(1.0)
    assert one(table, label="loglinear", staleness=2)["speedup_vs_recompute"] == pytest.approx(2 * 2 / 1.5)

    row = one(table, label="coupled", staleness=1)
    finals = [final_reward("coupled", 1, s) for s in SEEDS]
    assert row["final_reward_mean"] == pytest.approx(np.mean(finals))
    assert row["final_reward_std"] == pytest.approx(np.std(finals, ddof=1))
    evals = [eval_reward("coupled", 1, s, 15) for s in SEEDS]
    assert row["final_eval_reward_mean"] == pytest.approx(np.mean(evals))
    # steady state: step 0 (< d = 1) is left out of every per-step mean
    assert row["iw_max_mean"] == pytest.approx(1.5 + 0.2 + 0.01 * steady_mean(lambda t: t, 1))
    assert row["iw_min_mean"] == pytest.approx(0.5 - 0.01 * steady_mean(lambda t: t, 1))
    assert row["prox_time_s_mean"] == pytest.approx(0.0)
    assert row["clip_ratio_mean"] == pytest.approx(0.01)
    assert row["entropy_mean"] == pytest.approx(1.0 - 0.01 * steady_mean(lambda t: t, 1) + 0.005)
    assert row["steady_from_step"] == 1 and row["staleness_reached_mean"] == pytest.approx(1.0)
    assert row["cpu_time_s_mean"] == pytest.approx(row["train_time_s_mean"]) and row["n_contended"] == 0
    assert row["n_seeds"] == 2 and row["n_incomplete"] == 0

    single = one(table, label="loglinear-exponential", staleness=2)
    assert single["n_seeds"] == 1 and math.isnan(single["final_reward_std"])
    # recompute first, then the paper's method, within each staleness level
    assert list(table["label"][table["staleness"] == 1])[:3] == ["recompute", "loglinear", "coupled"]


def test_summary_files_and_markdown(frame, tmp_path):
    markdown, paths = summary.write_summary(frame, tmp_path)
    assert [p.name for p in paths] == ["summary.csv", "summary.md"]
    assert (tmp_path / "summary.md").read_text() == markdown
    csv = pd.read_csv(tmp_path / "summary.csv")
    assert one(csv, label="loglinear", staleness=2)["speedup_vs_recompute"] == pytest.approx(2 * 2 / 1.5)
    assert "## A-3PO paper" in markdown and "2.72" in markdown and "194.5" in markdown
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines[: 2 + len(csv)]}) == 1  # the sweep table lines up
    assert " ± " in markdown


# --- identity from the config ---------------------------------------------------------

def dump_run(root: Path, name: str, config: dict, records: list[dict]) -> Path:
    """A run directory with exactly these records (for crafted values)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run_name": name, **config}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def flat_records(steps: int, **per_step) -> list[dict]:
    """Records whose metric values are constants or functions of the step."""
    return [{"step": t, "wall_time": float(t + 1),
             **{key.replace("__", "/"): (value(t) if callable(value) else value) for key, value in per_step.items()}}
            for t in range(steps)]


def test_identity_carries_every_parameter(tmp_path):
    root = tmp_path / "ids"
    base = {"experiment_name": "ids", "train": {"total_steps": 4}}
    dump_run(root, "recompute-icepop0.5_2-d8-s1", {**base, "algo": {"name": "recompute", "uses_schedule": False},
                                                    "schedule": {"name": "inverse"}, "staleness": 8, "seed": 1,
                                                    "correction": {"name": "icepop", "lo": 0.5, "hi": 2},
                                                    "objective": {"name": "ppo"}},
             flat_records(4, reward__mean=0.1))
    dump_run(root, "loglinear-tis2-gspo-d4-s0", {**base, "algo": {"name": "loglinear", "uses_schedule": True},
                                                  "schedule": {"name": "inverse"}, "staleness": 4, "seed": 0,
                                                  "correction": {"name": "tis", "cap": 2.0},
                                                  "objective": {"name": "gspo"}},
             flat_records(4, reward__mean=0.2))
    dump_run(root, "my-custom-name", {**base, "algo": {"name": "loglinear"}, "staleness": 2, "seed": 3,
                                      "schedule": {"name": "exponential", "gamma": 0.7},
                                      "correction": {"name": "m2po", "tau": 0.04}},
             flat_records(4, reward__mean=0.3))
    runs = load_runs(root).groupby("run").first()
    icepop = runs.loc["recompute-icepop0.5_2-d8-s1"]
    assert (icepop["label"], icepop["variant"], icepop["correction"], icepop["objective"], icepop["schedule"]) \
        == ("recompute-icepop0.5_2", "recompute-icepop0.5_2-d8", "icepop0.5_2", "ppo", "")
    tis = runs.loc["loglinear-tis2-gspo-d4-s0"]
    assert (tis["label"], tis["correction"], tis["objective"], tis["schedule"], tis["staleness"], tis["seed"]) \
        == ("loglinear-tis2-gspo", "tis2", "gspo", "inverse", 4, 0)
    custom = runs.loc["my-custom-name"]  # no -d<D>-s<seed> tail: the label is built from the config
    assert (custom["label"], custom["correction"], custom["schedule"]) == \
        ("loglinear-exponential0.7-m2po0.04", "m2po0.04", "exponential0.7")


def test_run_identity_of_old_and_flattened_configs():
    old = run_identity({"run_name": "loglinear-d2-s0", "algo": {"name": "loglinear"}, "staleness": 2, "seed": 0})
    assert (old["correction"], old["objective"], old["runtime"], old["label"]) == ("none", "ppo", "lagged",
                                                                                    "loglinear")
    flat = {"run_name": {"value": "recompute-icepop0.5_2-d8-s1"}, "algo.name": {"value": "recompute"},
            "staleness": {"value": 8}, "seed": {"value": 1}, "correction.name": {"value": "icepop"},
            "correction.hi": {"value": 2}, "correction.lo": {"value": 0.5}, "runtime.name": {"value": "async"},
            "runtime.max_staleness": {"value": 3}}
    identity = run_identity(flat)
    assert (identity["label"], identity["correction"], identity["max_staleness"]) == \
        ("recompute-icepop0.5_2 (async)", "icepop0.5_2", 3)
    # no run_name: the record names the run; nothing is read from a directory's name
    unnamed = run_identity({"algo": {"name": "coupled"}, "staleness": 4, "seed": 2}, fallback_experiment="sweep")
    assert (unnamed["run"], unnamed["experiment"], unnamed["staleness"], unnamed["seed"], unnamed["label"]) == \
        ("coupled-d4-s2", "sweep", 4, 2, "coupled")


def gamma_config(gamma: float, seed: int) -> dict:
    return {"experiment_name": "gammas", "algo": {"name": "loglinear", "uses_schedule": True},
            "schedule": {"name": "exponential", "gamma": gamma}, "staleness": 4, "seed": seed,
            "train": {"total_steps": 6}}


def test_two_gammas_are_two_labels_not_two_seeds(tmp_path):
    root = tmp_path / "gammas"
    for gamma in (0.5, 0.7):
        for seed in (0, 1):
            dump_run(root, f"loglinear-exponential{gamma:g}-d4-s{seed}", gamma_config(gamma, seed),
                     flat_records(6, reward__mean=gamma + 0.01 * seed, time__step=1.0))
    table = summary.summary_table(load_runs(root)).set_index("label")
    assert list(table.index) == ["loglinear-exponential0.5", "loglinear-exponential0.7"]
    assert table.loc["loglinear-exponential0.5", "n_seeds"] == 2
    assert table.loc["loglinear-exponential0.5", "final_reward_mean"] == pytest.approx(0.505)
    assert table.loc["loglinear-exponential0.7", "final_reward_mean"] == pytest.approx(0.705)


def test_same_run_name_in_two_experiments_stays_two_curves(tmp_path):
    for experiment, reward_value in (("first", 0.1), ("second", 0.9)):
        dump_run(tmp_path / experiment, "loglinear-d2-s0",
                 {"experiment_name": experiment, "algo": {"name": "loglinear"}, "staleness": 2, "seed": 0},
                 flat_records(3, reward__mean=reward_value))
    df = load_runs([tmp_path / "first", tmp_path / "second"])
    assert set(df["label"]) == {"first/loglinear", "second/loglinear"}
    table = summary.summary_table(df).set_index("label")
    assert table.loc["second/loglinear", "final_reward_mean"] == pytest.approx(0.9)


# --- steady state and timing ----------------------------------------------------------

def test_ramp_up_steps_are_left_out_of_run_means(tmp_path):
    root = tmp_path / "ramp"
    config = {"experiment_name": "ramp", "algo": {"name": "loglinear"}, "staleness": 4, "seed": 0,
              "train": {"total_steps": 10}}
    ramp = lambda early, late: (lambda t: early if t < 4 else late(t))  # noqa: E731
    dump_run(root, "loglinear-d4-s0", config, flat_records(
        10, actor__importance_weight__max=ramp(100.0, lambda t: 2.0 + 0.1 * (t - 4)),
        actor__entropy=ramp(9.0, lambda t: 0.5), offpolicy__ess_token=ramp(0.0, lambda t: 0.8),
        actor__clip_ratio=ramp(1.0, lambda t: 0.02), time__prox_logp=ramp(5.0, lambda t: 1e-4),
        staleness__mean=lambda t: float(min(t, 4)), staleness__max=lambda t: min(t, 4), reward__mean=0.5))
    dump_run(root, "loglinear-d4-s1", {**config, "seed": 1},  # shorter than the ramp: no steady value
             flat_records(3, actor__importance_weight__max=100.0, reward__mean=0.5))
    scalars = run_scalars(load_runs(root)).set_index("run")
    row = scalars.loc["loglinear-d4-s0"]
    assert row["steady_steps"] == 6
    assert row["iw_max"] == pytest.approx(2.25)  # mean of 2.0 ... 2.5 over steps 4-9; steps 0-3 (100) left out
    assert (row["entropy"], row["ess_token"], row["clip_ratio"], row["prox_time_s"]) == \
        pytest.approx((0.5, 0.8, 0.02, 1e-4))
    assert (row["staleness_reached_mean"], row["staleness_reached_max"]) == (4.0, 4.0)
    assert scalars.loc["loglinear-d4-s1", "steady_steps"] == 0 and math.isnan(scalars.loc["loglinear-d4-s1", "iw_max"])
    table = summary.summary_table(load_runs(root))
    assert one(table, label="loglinear", staleness=4)["iw_max_mean"] == pytest.approx(2.25)
    assert one(table, label="loglinear", staleness=4)["ess_token_mean"] == pytest.approx(0.8)
    markdown = summary.summary_markdown(table)
    assert "Steady state only: every number here is a mean over steps >= D" in markdown
    assert "### Off-policy diagnostics (steps >= D)" in markdown and "ESS token" in markdown


def test_contention_rule():
    assert contended(10.0, 8.0) is False  # exactly 0.8 of a core: not flagged
    assert contended(10.0, 7.9) is True
    assert contended(10.0, float("nan")) is False and contended(10.0, 0.0) is False


def timing_config(algo: str, seed: int) -> dict:
    return {"experiment_name": "timing", "algo": {"name": algo}, "staleness": 2, "seed": seed,
            "train": {"total_steps": 4}}


def test_training_time_cpu_time_and_contention(tmp_path):
    root = tmp_path / "timing"
    step_times = [1.0, 2.0, 3.0, 4.0]
    pauses = lambda t: sum(step_times[: t + 1]) + 5.0 * (t + 1)  # noqa: E731  (eval: wall grows faster)
    for algo, cpu_share in (("recompute", 0.5), ("loglinear", 0.9)):
        records = flat_records(4, time__step=lambda t: step_times[t],
                               time__step_cpu=lambda t, c=cpu_share: step_times[t] * c, time__eval=5.0)
        for record in records:
            record["wall_time"] = pauses(record["step"])
        dump_run(root, f"{algo}-d2-s0", timing_config(algo, 0), records)
    dump_run(root, "coupled-d2-s0", timing_config("coupled", 0),  # an old log: no CPU time
             flat_records(4, time__step=lambda t: step_times[t]))
    scalars = run_scalars(load_runs(root)).set_index("run")
    recompute, loglinear, old = (scalars.loc[f"{a}-d2-s0"] for a in ("recompute", "loglinear", "coupled"))
    assert recompute["train_time_s"] == pytest.approx(10.0) and recompute["wall_time_s"] == pytest.approx(30.0)
    assert recompute["cpu_time_s"] == pytest.approx(5.0) and recompute["eval_time_s"] == pytest.approx(20.0)
    assert recompute["wall_cpu_ratio"] == pytest.approx(2.0) and bool(recompute["contended"]) is True
    assert loglinear["cpu_time_s"] == pytest.approx(9.0) and bool(loglinear["contended"]) is False
    assert bool(old["cpu_missing"]) is True and bool(old["contended"]) is False
    assert old["train_time_s"] == pytest.approx(10.0) and old["time_basis"] == "time/step"
    table = summary.summary_table(load_runs(root))
    assert one(table, label="recompute", staleness=2)["n_contended"] == 1
    assert one(table, label="coupled", staleness=2)["n_cpu_missing"] == 1
    markdown = summary.summary_markdown(table)
    coupled_line = next(line for line in markdown.splitlines() if line.startswith("| coupled"))
    assert "missing" in coupled_line
    assert "1/1" in next(line for line in markdown.splitlines() if line.startswith("| recompute"))


def test_runs_whose_rollout_shared_the_trainers_gpu_are_flagged_in_the_report(tmp_path):
    from analysis.provenance import compute_lines

    root = tmp_path / "shared"
    dump_run(root, "recompute-d2-s0", timing_config("recompute", 0),
             flat_records(4, time__step=1.0, time__step_cpu=1.0, runtime__shared_device=1.0))
    dump_run(root, "loglinear-d2-s0", timing_config("loglinear", 0), flat_records(4, time__step=1.0, time__step_cpu=1.0))
    scalars = run_scalars(load_runs(root))
    assert dict(zip(scalars["run"], scalars["shared_device"])) == {"recompute-d2-s0": True, "loglinear-d2-s0": False}
    flagged = [line for line in compute_lines(scalars) if "shared one CUDA device" in line]
    assert len(flagged) == 1 and "1 runs (recompute-d2-s0)" in flagged[0]
    alone = run_scalars(load_runs(root)).query("run == 'loglinear-d2-s0'")
    assert not [line for line in compute_lines(alone) if "shared one CUDA device" in line]


def test_speedup_from_training_time_sums_paired_by_seed(tmp_path):
    root = tmp_path / "speedup"
    recompute_step, loglinear_step = [2.0, 2.2, 2.6], [1.0, 1.0, 1.3]
    for seed in range(3):
        for algo, step_time_s in (("recompute", recompute_step[seed]), ("loglinear", loglinear_step[seed])):
            records = flat_records(4, time__step=step_time_s, time__step_cpu=step_time_s)
            for record in records:  # wall time (with a long eval) would give another answer
                record["wall_time"] = 100.0 * (record["step"] + 1)
            dump_run(root, f"{algo}-d2-s{seed}", timing_config(algo, seed), records)
    row = one(summary.summary_table(load_runs(root)), label="loglinear", staleness=2)
    ratios = np.divide(recompute_step, loglinear_step)
    half = t_quantile(0.975, 2) * np.std(ratios, ddof=1) / np.sqrt(3)
    assert row["speedup_vs_recompute"] == pytest.approx(ratios.mean())
    assert (row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx((ratios.mean() - half,
                                                                             ratios.mean() + half))
    assert row["speedup_cpu_vs_recompute"] == pytest.approx(ratios.mean())
    assert row["train_time_s_mean"] == pytest.approx(4 * np.mean(loglinear_step))


def test_async_staleness_reached(tmp_path):
    root = tmp_path / "async"
    config = {"experiment_name": "async", "algo": {"name": "loglinear"}, "staleness": 4, "seed": 0,
              "runtime": {"name": "async", "max_staleness": 4}, "train": {"total_steps": 8}}
    means, maxes = [0, 1, 1.5, 2, 2.5, 3, 2.0, 3.5], [0, 1, 2, 3, 4, 4, 3, 4]
    dump_run(root, "loglinear-d4-s0", config, flat_records(8, staleness__mean=lambda t: means[t],
                                                          staleness__max=lambda t: maxes[t], reward__mean=0.5))
    dump_run(root, "loglinear-d4-s1", {**config, "seed": 1, "runtime": {"name": "async", "max_staleness": 2}},
             flat_records(8, staleness__mean=lambda t: means[t], staleness__max=lambda t: maxes[t]))
    scalars = run_scalars(load_runs(root)).set_index("run")
    row = scalars.loc["loglinear-d4-s0"]
    assert row["label"] == "loglinear (async)" and row["runtime"] == "async"
    assert row["staleness_reached_mean"] == pytest.approx(np.mean(means[4:]))  # 2.75
    assert row["staleness_reached_max"] == 4
    bound_two = scalars.loc["loglinear-d4-s1"]  # grouped and ramped by the bound, not the staleness knob
    assert (bound_two["staleness"], bound_two["variant"]) == (2, "loglinear-d2 (async)")
    assert bound_two["steady_steps"] == 6 and bound_two["staleness_reached_mean"] == pytest.approx(np.mean(means[2:]))
    table = summary.summary_table(load_runs(root))
    assert list(table["label"]) == ["loglinear (async)"] * 2 and list(table["staleness"]) == [2, 4]
    assert set(table["runtime"]) == {"async"} and list(table["n_seeds"]) == [1, 1]


def test_modules_and_functions_stay_small():
    """analysis/ stays readable: modules under 400 lines, functions under 60."""
    import ast

    for path in sorted((REPO_ROOT / "analysis").glob("*.py")):
        source = path.read_text()
        assert source.count("\n") < 400, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 < 60, f"{path.name}:{node.name}"


# --- CLI and notebook -----------------------------------------------------------------

def test_cli_writes_everything(sweep, tmp_path, capsys):
    out = tmp_path / "cli"
    assert figures.main([str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## This sweep" in printed and "files written:" in printed
    for stem in FIGURE_STEMS:
        assert f"{stem}.png" in printed
    assert (out / "summary.md").is_file() and (out / "summary.csv").is_file()


def test_cli_default_out_dir(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep, "loglinear", 1, 0, steps=3, total_steps=3)
    assert figures.main([str(sweep)]) == 0
    assert (sweep / "figures" / "fig3_entropy.png").is_file()
    assert load_runs(sweep)["run"].nunique() == 1  # the figures dir is not mistaken for a run


def test_notebook_is_stored_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_executes_against_the_sweep(sweep, tmp_path, monkeypatch):
    """Runs on a kernelspec written here, pointing at this interpreter, so it needs no
    `ipykernel install`, no user config and no network."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    kernel_dir = tmp_path / "kernels" / "a3po-test"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "a3po test", "language": "python"}))
    out = tmp_path / "nb-figures"
    monkeypatch.setenv("A3PO_SWEEP_DIR", str(sweep))
    monkeypatch.setenv("A3PO_FIGURES_DIR", str(out))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # Not installed? The notebook then finds `analysis` above its working directory.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = KernelManager(kernel_name="a3po-test",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))
    client = NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    for stem in FIGURE_STEMS:
        assert (out / f"{stem}.png").stat().st_size > 0
    assert (out / "summary.md").is_file()
    shown = [output for cell in nb.cells for output in cell.get("outputs", [])
             if "image/png" in output.get("data", {})]
    assert len(shown) == len(FIGURE_STEMS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert nbformat.read(NOTEBOOK, as_version=4).cells[-1].outputs == []  # the stored file is untouched


def test_a_log_archive_reads_as_its_sweep(sweep, tmp_path):
    """`python -m analysis.logs pack`: run files only, the same bytes twice, the same frame."""
    from analysis.logs import main as logs_main

    out, again = tmp_path / "synthetic.tar.xz", tmp_path / "again.tar.xz"
    assert logs_main(["pack", str(sweep), str(out)]) == 0 and logs_main(["pack", str(sweep), str(again)]) == 0
    assert out.read_bytes() == again.read_bytes()
    import tarfile
    with tarfile.open(out) as archive:
        names = archive.getnames()
    assert "synthetic/recompute-d1-s0/metrics.jsonl" in names and not any(".hydra" in n for n in names)
    from_dir, from_archive = load_runs(sweep), load_runs(out)
    key = ["run", "step", "metric"]
    pd.testing.assert_frame_equal(from_dir.sort_values(key).reset_index(drop=True),
                                  from_archive.sort_values(key).reset_index(drop=True))


def test_a_broken_log_archive_is_named_and_skipped(tmp_path):
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(b"not an archive")
    with pytest.warns(RunSkippedWarning, match="broken.tar.xz: not a readable log archive"):
        with pytest.raises(NoRunsError):
            load_runs(broken)
    from analysis.logs import main as logs_main
    assert logs_main(["pack", str(tmp_path / "empty"), str(tmp_path / "x.tar.xz")]) == 2


def test_a_log_archive_can_hold_one_tier_of_a_sweep(sweep, tmp_path):
    """`pack --match`: only the runs whose directory name matches; none matching is an error that says so."""
    import tarfile
    from analysis.logs import main as logs_main

    out = tmp_path / "d1.tar.xz"
    assert logs_main(["pack", str(sweep), str(out), "--match", "*-d1-*"]) == 0
    with tarfile.open(out) as archive:
        runs = {name.split("/")[1] for name in archive.getnames()}
    everything = {d.name for d in sweep.iterdir() if (d / "config.yaml").is_file()}
    assert runs and runs == {r for r in everything if "-d1-" in r} and runs < everything
    assert logs_main(["pack", str(sweep), str(tmp_path / "none.tar.xz"), "--match", "*-d99-*"]) == 2


def test_final_reward_windows_say_what_they_read(tmp_path):
    """final_reward: the last n // 10 steps (the last step alone below 20 steps); final_eval_reward:
    the last eval; last_evals_reward (S6's reward): the mean of the last two evals."""
    root = tmp_path / "windows"
    config = {"experiment_name": "windows", "algo": {"name": "recompute"}, "staleness": 2, "seed": 0,
              "train": {"total_steps": 30}}
    evals = {9: 0.2, 19: 0.5, 29: 0.7}
    records = flat_records(30, reward__mean=lambda t: t / 100)
    for record in records:
        if record["step"] in evals:
            record["eval/reward"] = evals[record["step"]]
    dump_run(root, "recompute-d2-s0", config, records)
    row = run_scalars(load_runs(root)).set_index("run").loc["recompute-d2-s0"]
    assert row["final_reward"] == pytest.approx((0.27 + 0.28 + 0.29) / 3)  # 30 // 10 = 3 steps
    assert row["final_eval_reward"] == pytest.approx(0.7)
    assert row["last_evals_reward"] == pytest.approx(0.6)


def test_plateau_check_reads_each_runs_last_two_evals():
    from analysis.scalars import plateau_check

    interval, holds = plateau_check([[0.2, 0.50, 0.51], [0.4, 0.52, 0.52], [0.6], None, [0.3, 0.55, 0.54]], 0.05)
    assert interval.n == 3 and interval.mean == pytest.approx(0.0, abs=1e-12)  # +0.01, 0.0, -0.01; [0.6] and None left out
    assert holds  # the interval's upper end (~0.025) is below 0.05
    interval, holds = plateau_check([[0.2, 0.3], [0.2, 0.32], [0.2, 0.28]], 0.05)
    assert interval.mean == pytest.approx(0.1) and not holds
    assert plateau_check([[0.5]], 0.05)[1] is False  # nothing to judge is not a plateau
