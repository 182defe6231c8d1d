"""The precision rule end to end (tiny model): what a run records, what refuses a run
directory, and the warm-up that keeps step 0's cost out of the training time."""

from __future__ import annotations

import pytest
import yaml

from a3po.errors import ConfigError
from a3po.run.metrics_log import read_metrics
from a3po.run.main import run, run_dir_of
from conftest import comparable


def test_a_run_records_its_resolved_precision(tiny_cfg, monkeypatch):
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr("torch.cpu._is_amx_tile_supported", lambda: False)
    cfg = tiny_cfg("precision=auto", "train.total_steps=1", "train.eval_every=0")
    run(cfg)
    run_dir = run_dir_of(cfg)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["precision"] == "fp32"  # auto, resolved
    assert run_dir.name == "loglinear-d2-s0"  # fp32 is the unnamed default


def test_bf16_is_a_different_run_and_refuses_the_fp32_directory(tiny_cfg, monkeypatch):
    """On a CPU with AMX (mocked) auto is bf16: named `-bf16`, recorded as bf16. The
    same directory asked to hold an fp32 run stops with the differing key."""
    monkeypatch.setattr("torch.cpu._is_amx_tile_supported", lambda: True)
    cfg = tiny_cfg("precision=auto", "train.total_steps=2", "train.eval_every=0")
    assert cfg.run_name == "loglinear-bf16-d2-s0"
    run(cfg)
    run_dir = run_dir_of(cfg)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["precision"] == "bf16"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    fp32 = tiny_cfg("precision=fp32", "train.total_steps=2", "train.eval_every=0")
    with pytest.raises(ConfigError, match=r"precision: 'bf16' in the existing run, 'fp32' now"):
        run(fp32, run_dir=run_dir)


def test_bf16_changes_the_numbers_but_trains(tiny_cfg, monkeypatch):
    """bf16 autocast reaches the forward: the same run in bf16 and fp32 differ (not bit-equal),
    and behave vs current at staleness 0 stay close (the HF engine samples under the same rule)."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
    base = ("train.total_steps=2", "train.eval_every=0", "staleness=0", "algo=recompute")
    bf16, fp32 = tiny_cfg("precision=bf16", *base), tiny_cfg("precision=fp32", *base)
    run(bf16)
    run(fp32)
    a = read_metrics(run_dir_of(bf16) / "metrics.jsonl")
    b = read_metrics(run_dir_of(fp32) / "metrics.jsonl")
    assert a[0]["actor/entropy"] != b[0]["actor/entropy"]
    assert a[0]["actor/entropy"] == pytest.approx(b[0]["actor/entropy"], rel=0.05)
    # at staleness 0 the behave weight pi_prox / pi_behave is 1 up to the engine/trainer mismatch
    assert abs(a[0]["actor/behave_weight/max"] - 1) < 0.1 and abs(b[0]["actor/behave_weight/max"] - 1) < 1e-3


def test_warm_up_is_timed_apart_and_changes_no_result(tiny_cfg):
    base = ("train.total_steps=3", "algo=recompute")
    warm, cold = tiny_cfg(*base, "experiment_name=warm"), tiny_cfg(*base, "experiment_name=cold", "train.warmup=false")
    run(warm)
    run(cold)
    warm_records = read_metrics(run_dir_of(warm) / "metrics.jsonl")
    cold_records = read_metrics(run_dir_of(cold) / "metrics.jsonl")
    assert comparable(warm_records) == comparable(cold_records)  # bit for bit
    assert warm_records[0]["time/warmup"] > 0
    assert all("time/warmup" not in r for r in warm_records[1:])  # once per invocation
    assert all("time/warmup" not in r for r in cold_records)
    assert warm_records[-1]["wall_time"] > warm_records[0]["time/warmup"]  # wall_time counts it


def test_a_resumed_invocation_logs_its_own_warm_up(tiny_cfg):
    first = tiny_cfg("train.total_steps=3", "train.max_steps_this_run=1")
    run(first)
    run(tiny_cfg("train.total_steps=3"))
    records = read_metrics(run_dir_of(first) / "metrics.jsonl")
    assert [("time/warmup" in r) for r in records] == [True, True, False]


def test_bf16_with_its_linear_layers_in_float32_trains_as_onednns_bf16(tiny_cfg, monkeypatch):
    """The same bf16 run, its linear layers multiplied by oneDNN's bf16 GEMM and in float32
    (`Bf16GemmsInFloat32`, what a CPU where bf16 is not the faster runs): the trainer, the
    recompute forward and the sampler all pass through it, and the first step's figures agree
    up to the order of float32 sums."""
    from a3po import device, gemms

    calls = []
    in_float32 = gemms.Bf16GemmsInFloat32._linear
    monkeypatch.setattr(gemms.Bf16GemmsInFloat32, "_linear",
                        lambda self, *a, **k: calls.append(1) or in_float32(self, *a, **k))
    base = ("precision=bf16", "train.total_steps=1", "train.eval_every=0", "staleness=0", "algo=recompute")
    records = {}
    for name, rule in (("onednn", False), ("float32", True)):
        monkeypatch.setattr(device, "bf16_gemm_in_float32", lambda _device, rule=rule: rule)
        cfg = tiny_cfg(*base, f"experiment_name={name}")
        run(cfg)
        records[name] = read_metrics(run_dir_of(cfg) / "metrics.jsonl")[0]
        assert bool(calls) is rule
    onednn, float32 = records["onednn"], records["float32"]
    assert float32["actor/entropy"] == pytest.approx(onednn["actor/entropy"], rel=1e-2)
    assert float32["response/length_mean"] == onednn["response/length_mean"]
    assert abs(float32["actor/behave_weight/max"] - 1) < 0.1
