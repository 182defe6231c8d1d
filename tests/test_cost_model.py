"""The cost model (analysis.cost_model, issue "What A-3PO saves at your scale"): each phase's
FLOP and byte count for a small model equals a hand computation; the serial sum and the async
simulation match their closed forms; bad inputs fail naming what is wrong."""

from __future__ import annotations

import math

import pytest

from a3po.memory.parts import Architecture
from analysis.cost_model.devices import device
from analysis.cost_model.phases import (Efficiency, Hardware, StepShape, decode_bytes, decode_flops, forward_flops,
                                        optimizer_bytes, phase_seconds, prefill_flops, sync_bytes, train_flops)
from analysis.cost_model.pipeline import async_step, bounding_side, serial_step, simulate_async, steady_interval

# h 8, 2 heads of 4 (kv 1 head: kv_dim 4), MLP 16, 2 layers, vocab 10, tied, no biases
TINY = Architecture(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)
# 2 prompts x 3 samples, prompt 4, responses of mean 2 (at most 3), 2 minibatches
SHAPE = StepShape(prompts=2, samples=3, prompt_len=4, response_len=2, response_max=3, minibatches=2)


def test_the_tiny_architecture_counts_by_hand():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8 = 192; MLP 3 x 8 x 16 = 384 -> 576; two layers 1,152
    assert TINY.num_hidden_layers * TINY.layer_linear_params == 1152
    # + embedding 80 (tied) + norms 2 x 2 x 8 + final 8 = 1,272
    assert TINY.n_params == 1152 + 80 + 32 + 8


def test_the_forward_counts_by_hand():
    # a sequence of 6 tokens: dense 2 x 1152 x 6 = 13,824; attention 4 x 8 x 2 x 21 pairs = 1,344;
    # output layer 2 x 8 x 10 x 2 response tokens = 320; 6 sequences
    assert forward_flops(TINY, SHAPE) == 6 * (13824 + 1344 + 320)
    assert train_flops(TINY, SHAPE) == 3 * forward_flops(TINY, SHAPE)
    checkpointed = StepShape(**{**SHAPE.__dict__, "checkpointing": True})
    assert train_flops(TINY, checkpointed) == 4 * forward_flops(TINY, SHAPE)


def test_padding_is_computed_but_not_in_the_output_layer():
    padded = StepShape(**{**SHAPE.__dict__, "padding": 0.25})  # a quarter of the computed tokens
    assert forward_flops(TINY, padded) == pytest.approx(6 * ((13824 + 1344) / 0.75 + 320))


def test_the_rollout_counts_by_hand():
    # prefill of 4 tokens: 2 x 1152 x 4 = 9,216; attention 4 x 8 x 2 x 10 pairs = 640; one output row 160
    assert prefill_flops(TINY, SHAPE) == 6 * (9216 + 640 + 160)
    # decode of 2 tokens: 2 x (2 x 1152 + 160) = 4,928; contexts 4 and 5 -> 4 x 8 x 2 x 9 = 576
    assert decode_flops(TINY, SHAPE) == 6 * (4928 + 576)
    # weights (bf16) every one of 3 steps: 3 x 1,272 x 2; KV: 2 x 2 layers x 4 x 2 bytes = 32 a position, 9
    # positions read per sequence
    assert decode_bytes(TINY, SHAPE) == (3 * 1272 * 2, 6 * 32 * 9)


def test_the_optimizer_and_the_sync_count_by_hand():
    assert optimizer_bytes(TINY, SHAPE) == 2 * 28 * 1272  # two AdamW steps, 28 bytes a parameter
    assert sync_bytes(TINY, SHAPE) == 1272 * 2


def test_phase_seconds_divide_the_work_by_the_device_and_its_efficiency():
    hw = Hardware(flops=1000.0, bandwidth=100.0, devices=2, link=50.0)
    eff = Efficiency(prefill=0.5, decode=0.5, decode_step_s=0.1, forward=0.25, train=0.5, optimizer=0.5)
    recompute, loglinear = (phase_seconds(TINY, SHAPE, hw, hw, eff, algo) for algo in ("recompute", "loglinear"))
    assert recompute["prox_logp"] == pytest.approx(forward_flops(TINY, SHAPE) / (2000 * 0.25))
    assert loglinear["prox_logp"] == 0.0
    assert recompute["train"] == loglinear["train"] == pytest.approx(train_flops(TINY, SHAPE) / 1000)
    assert recompute["optimizer"] == pytest.approx(2 * 28 * 1272 / (200 * 0.5))
    assert recompute["weight_sync"] == pytest.approx(1272 * 2 / 50)
    weights, kv = decode_bytes(TINY, SHAPE)
    decode = max((weights + kv / 2) / 50, decode_flops(TINY, SHAPE) / 1000) + 3 * 0.1
    assert recompute["rollout"] == pytest.approx(prefill_flops(TINY, SHAPE) / 1000 + decode)


@pytest.mark.parametrize("rollout_s,train_s,sync_s,bound,side", [
    (10.0, 4.0, 1.0, 1, "rollout"), (4.0, 10.0, 1.0, 1, "trainer"), (10.0, 4.0, 1.0, 0, "both"),
    (4.0, 10.0, 0.0, 8, "trainer"), (3.0, 9.0, 2.0, 0, "both"), (9.0, 3.0, 2.0, 8, "rollout")])
def test_the_async_simulation_settles_at_the_closed_form(rollout_s, train_s, sync_s, bound, side):
    done = simulate_async(rollout_s, train_s, sync_s, bound, steps=300)
    assert steady_interval(done) == pytest.approx(async_step(rollout_s, train_s, sync_s, bound))
    assert bounding_side(rollout_s, train_s, bound) == side


def test_bound_zero_is_the_serial_sum():
    phases = {"rollout": 3.0, "prox_logp": 1.0, "train": 4.0, "optimizer": 0.5, "weight_sync": 0.25}
    assert serial_step(phases) == 8.75
    assert async_step(3.0, 5.5, 0.25, bound=0) == 8.75


def test_uneven_rollouts_stall_the_pipeline_where_the_closed_form_does_not_see_it():
    # rollouts alternating 2 s and 8 s against a 5 s trainer: the mean rollout is 5 s, yet the
    # trainer waits after every long one at bound 1
    done = simulate_async([2.0, 8.0] * 100, 5.0, 0.0, bound=1, steps=200)
    assert steady_interval(done, tail=100) > 5.0


@pytest.mark.parametrize("kwargs,message", [
    ({"prompts": -1}, "StepShape.prompts"), ({"response_len": 5}, "StepShape.response_len"),
    ({"precision": "int3"}, "StepShape.precision"), ({"padding": 1.0}, "StepShape.padding")])
def test_a_bad_shape_fails_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepShape(**{**SHAPE.__dict__, **kwargs})


def test_bad_seconds_and_an_unknown_device_fail_clearly():
    with pytest.raises(ValueError, match="rollout_s must be a non-negative"):
        simulate_async(-1.0, 1.0)
    with pytest.raises(ValueError, match="unknown device 'H900'; known: .*H100 SXM"):
        device("H900")
    with pytest.raises(ValueError, match="Efficiency.train must be in"):
        Efficiency(train=0.0)
    with pytest.raises(ValueError, match="algo must be"):
        phase_seconds(TINY, SHAPE, Hardware(1.0, 1.0), Hardware(1.0, 1.0), Efficiency(), "coupled")
    assert math.isfinite(device("H800 SXM").flops("bf16"))


def _benchmark(tmp_path, name: str, minibatches: int = 4, response_max: int = 64, optimizer: bool = True) -> str:
    """A benchmark.json as `python -m a3po.benchmark` writes it, with the fields the model reads."""
    import json

    def cpu(seconds: float, **info) -> dict:
        return {"cpu_seconds": {"median": seconds}, "seconds": {"median": 2 * seconds}, **({"info": info} if info else {})}

    results = {"rollout": cpu(4.0), "prox/recompute": cpu(1.5), "step/recompute": cpu(7.0), "step/loglinear": cpu(5.5),
               "kernel/matmul_bfloat16": cpu(0.01, flops=4e9), "kernel/copy": cpu(0.02, bytes=5e8)}
    if optimizer:
        results["kernel/adamw_fused@134515008"] = cpu(0.07)
    report = {"model": {"precision": "bf16"}, "results": results,
              "batch": {"n_prompts": 4, "n_samples": 4, "prompt_len": 48, "response_len_max": response_max,
                        "response_tokens": 16 * 0.75 * response_max, "n_minibatches": minibatches, "padding_waste": 0.05}}
    path = tmp_path / name / "benchmark.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(report))
    return str(path.parent)


def test_the_fit_reproduces_the_shape_it_was_fitted_on(tmp_path):
    from analysis.cost_model.setting import architecture
    from analysis.cost_model.validate import fit, load_report, predict

    arch = architecture("smollm2-135m")
    report = load_report(_benchmark(tmp_path, "fit"))
    eff = fit([report], arch)
    assert predict(report, arch, eff) == pytest.approx({"step/recompute": 11.0, "step/loglinear": 9.5})
    assert eff.optimizer == pytest.approx(4 * 28 * arch.n_params / (5e8 / 0.02 * 4 * 0.07))


def test_validation_rows_predict_another_shape_and_say_how_far_off(tmp_path):
    from analysis.cost_model.setting import architecture
    from analysis.cost_model.validate import fit, load_report, validation_rows

    fit_report, arch = load_report(_benchmark(tmp_path, "fit")), architecture("smollm2-135m")
    other = load_report(_benchmark(tmp_path, "m8", minibatches=8, optimizer=False))
    rows = validation_rows(fit([fit_report], arch), [fit_report], [other], arch)
    assert [r["fit"] for r in rows] == [True, False]
    assert rows[0]["loglinear_error"] == pytest.approx(0.0) and rows[0]["recompute_error"] == pytest.approx(0.0)
    # 4 more AdamW steps at the fitted 0.07 s each, the same measured steps: the model predicts 0.28 s more
    assert rows[1]["loglinear_predicted_s"] == pytest.approx(9.5 + 4 * 0.07)
    assert rows[1]["loglinear_error"] == pytest.approx((9.5 + 0.28) / 9.5 - 1)


def test_a_benchmark_without_what_the_model_reads_fails_naming_it(tmp_path):
    import json

    from analysis.cost_model.validate import fit, load_report

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": {"rollout": {}}}))
    with pytest.raises(ValueError, match="lacks .*step/recompute"):
        load_report(bad)
    with pytest.raises(ValueError, match="not a readable benchmark.json"):
        load_report(tmp_path / "missing.json")
    report = load_report(_benchmark(tmp_path, "no_adamw", optimizer=False))
    from analysis.cost_model.setting import architecture
    with pytest.raises(ValueError, match="no fit shape timed the optimizer"):
        fit([report], architecture("smollm2-135m"))


def test_the_paper_requirements_follow_from_the_forward_being_a_third_of_training():
    from analysis.cost_model.setting import paper_shape, requirements

    rows = {r["source"]: r for r in requirements(paper_shape(300))}
    areal = rows["AReaL prox_approx docs"]
    assert areal["speedup"] == pytest.approx(207 / 163)
    assert areal["forward_over_train_efficiency"] == pytest.approx((1 / 3) / (207 / 163 - 1))
    assert math.isnan(rows["paper v3 / blog, Qwen3-8B"]["forward_over_train_efficiency"])  # against sync GRPO


def test_the_docs_page_shows_the_device_table_and_the_cli_runs(tmp_path):
    from analysis.cost_model.__main__ import main
    from analysis.cost_model.devices import devices_markdown
    from conftest import REPO

    assert devices_markdown() in (REPO / "docs" / "cost_model.md").read_text()
    out = tmp_path / "predict.md"
    assert main(["predict", "--response-len", "300", "--out", str(out)]) == 0
    assert "loglinear over recompute:" in out.read_text()
    assert main(["predict", "--efficiency", "speed=2"]) == 2


def test_the_validation_table_regenerates_from_the_committed_benchmarks():
    """docs/cost_model.md's validation table is what the command gives on docs/logs/cost_model/."""
    from analysis.cost_model.__main__ import validate_lines, build_parser
    from conftest import REPO

    logs = "docs/logs/cost_model"
    shapes = ["4x4-r64-m2", "4x4-r64-m8", "4x4-r32-m4", "4x4-r128-m4", "8x4-r64-m4", "2x4-r64-m4", "4x4-r64-m4-fp32"]
    args = build_parser().parse_args(["validate", *(f"{REPO}/{logs}/{s}.json" for s in shapes), "--fit",
                                      f"{REPO}/{logs}/4x4-r64-m4.json", f"{REPO}/{logs}/4x4-r64-m1.json"])
    table = "\n".join(validate_lines(args))
    assert table in (REPO / "docs" / "cost_model.md").read_text()
    assert table.startswith("Fitted: the recompute forward at ")
    rows = [line for line in table.splitlines() if line.startswith("| ") and ("bf16" in line or "fp32" in line)]
    assert len(rows) == 9 and sum("(fit)" not in row for row in rows) == 7


def test_the_paper_tables_regenerate():
    """docs/cost_model.md's paper's-setting and requirements tables are what `paper` prints."""
    from analysis.cost_model.__main__ import paper_lines
    from conftest import REPO

    page = (REPO / "docs" / "cost_model.md").read_text()
    tables = [block for block in paper_lines() if block]
    assert len(tables) == 2 and all(table in page for table in tables)


def test_the_scaling_page_step_times_are_the_models(capsys):
    """docs/scaling.md, "Step time": each layout's row is what `predict` prints for it."""
    from analysis.cost_model.__main__ import main
    from conftest import REPO

    page = (REPO / "docs" / "scaling.md").read_text()
    common = ["predict", "--model", "qwen2.5-1.5b", "--device", "H100 SXM"]
    layouts = {"1, shared, sequential, checkpointed (`gpu1`)": ["--rollout-devices", "1", "--trainer-devices", "1",
                                                               "--pipeline", "lagged", "--link", "inf", "--checkpointing"],
               "1 + 1 (`gpu2`)": ["--rollout-devices", "1", "--trainer-devices", "1"],
               "1 + 3": ["--rollout-devices", "1", "--trainer-devices", "3"],
               "1 + 7 (`gpu8`)": ["--rollout-devices", "1", "--trainer-devices", "7"],
               "2 + 6": ["--rollout-devices", "2", "--trainer-devices", "6"]}
    for layout, args in layouts.items():
        assert main([*common, *args]) == 0
        rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
                if line.startswith("| recompute") or line.startswith("| loglinear")}
        steps = [float(rows[algo][7]) for algo in ("recompute", "loglinear")]
        assert f"| {layout} | {steps[0]:.1f} -> {steps[1]:.1f} |" in page, layout
        assert f"| {steps[0] / steps[1]:.2f}x |" in page.split(f"| {layout} |")[1].splitlines()[0], layout
