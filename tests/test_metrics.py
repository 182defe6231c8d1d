"""Every metric is declared once (a3po.metrics): docs/design.md's table is that
declaration, and every key a run logs belongs to one."""

from __future__ import annotations

import pytest

from a3po.run.main import run, run_dir_of
from a3po.metrics import METRICS, declaration_of, markdown_table, reduction_of
from a3po.run.metrics_log import read_metrics
from conftest import REPO


def test_design_doc_carries_the_declared_table():
    assert markdown_table() in (REPO / "docs" / "design.md").read_text()


def test_declarations_are_unique_and_families_match():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert declaration_of("prox_error/inverse-linear/iw_abs").name == "prox_error/<label>/<error>"
    assert declaration_of("staleness/hist/12").source == "runtime"
    assert reduction_of("actor/importance_weight/max") == "max"
    with pytest.raises(KeyError, match="not declared"):
        declaration_of("actor/made_up")
    with pytest.raises(KeyError, match="logged by the rollout"):
        reduction_of("reward/mean")


@pytest.mark.parametrize("overrides", [
    ("algo=loglinear", "staleness=1"),
    ("algo=recompute", "runtime=async", "staleness=1", "train.log_prox_errors=true"),
])
def test_every_logged_key_is_declared(tiny_cfg, overrides):
    cfg = tiny_cfg(*overrides)
    run(cfg)
    keys = {key for record in read_metrics(run_dir_of(cfg) / "metrics.jsonl") for key in record}
    undeclared = sorted(key for key in keys if not any(m.matches(key) for m in METRICS))
    assert not undeclared
    assert {"staleness/mean", "reward/mean", "actor/clip_ratio", "time/step", "memory/host_rss", "memory/host_peak"} <= keys
    for record in read_metrics(run_dir_of(cfg) / "metrics.jsonl"):  # GiB of a live process: not bytes, not 0
        assert 0.05 < record["memory/host_rss"] <= record["memory/host_peak"] < 64
