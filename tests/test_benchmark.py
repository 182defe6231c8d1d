"""The benchmark on the tiny model: a well-formed report, never a timing assertion."""

from __future__ import annotations

import json
import math
import runpy
import sys

import pytest
import torch

from a3po.batch import Sample
from a3po.benchmark import DEFAULT_ALGOS, main
from a3po.benchmark.cli import build_parser, options_from
from a3po.benchmark.harness import CpuClock, TrafficCounter, Variant, measure, summarize
from a3po.benchmark.results import DOCS_HEADER, append_to_docs
from a3po.errors import ConfigError
from a3po.benchmark.workload import StartState, algo_label, padding_stats, parse_algo

from conftest import REPO

DOCS = REPO / "docs" / "benchmarks.md"
TINY_ARGS = [
    "model=tiny", "train.n_prompts=2", "train.n_samples=2", "train.n_minibatches=2", "train.token_budget=128",
    "staleness=2", "device=cpu",
    "--prompt-len", "12", "--response-len", "6", "--reps", "2", "--warmup", "1", "--threads", "1",
    "--approx-schedules", "inverse,exponential", "--kernel-tokens", "512", "--bandwidth-mib", "4",
    "--min-kernel-seconds", "0.001", "--no-progress", "--label", "test",
]
# The fewest variants a run can have: for what a run writes, not what it measures.
MINIMAL_ARGS = [
    "model=tiny", "train.n_prompts=2", "train.n_samples=2", "train.n_minibatches=1", "train.token_budget=128",
    "device=cpu", "--prompt-len", "8", "--response-len", "4", "--reps", "1", "--warmup", "1", "--threads", "1",
    "--algos", "coupled", "--approx-methods", "loglinear", "--approx-schedules", "inverse", "--kernel-tokens", "64",
    "--bandwidth-mib", "1", "--min-kernel-seconds", "0.0001", "--no-rollout", "--no-optimizer-kernels",
    "--no-progress", "--label", "appended",
]


def _run(argv):
    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


def _docs_state():
    return DOCS.read_bytes(), DOCS.stat().st_mtime_ns


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """A default run (no --append-docs, no --docs), with the tracked docs file's bytes and
    mtime before and after it."""
    out = tmp_path_factory.mktemp("bench")
    before = _docs_state()
    report = _run([*TINY_ARGS, "--out", str(out / "run")])
    return report, out, before, _docs_state()


def test_report_is_well_formed(tiny_report):
    report, out, _, _ = tiny_report
    on_disk = json.loads((out / "run" / "benchmark.json").read_text())
    assert on_disk.keys() == report.keys()
    for key in ("command", "machine", "model", "options", "batch", "results", "derived", "elapsed_s"):
        assert key in on_disk
    for key in ("cpu", "cpu_count", "torch", "device", "torch_threads"):
        assert key in on_disk["machine"]
    assert on_disk["machine"]["torch_threads"] == 1
    results = on_disk["results"]
    expected = {"rollout", "prox/recompute", "kernel/copy",
                *(f"step/{algo}" for algo in DEFAULT_ALGOS),
                *(f"prox/{m}-{s}" for m in ("loglinear", "linear") for s in ("inverse", "exponential"))}
    assert expected <= results.keys()
    assert not any("@baseline" in name for name in results)
    for name, entry in results.items():
        seconds = entry["seconds"]
        assert seconds["n"] == 2, name
        for stat in ("median", "q25", "q75", "iqr", "min", "max"):
            assert math.isfinite(seconds[stat]) and seconds[stat] >= 0, (name, stat)
        assert seconds["median"] > 0 and seconds["min"] <= seconds["median"] <= seconds["max"], name
    for algo in DEFAULT_ALGOS:
        assert results[f"step/{algo}"]["prox_logp"]["median"] >= 0
    derived = on_disk["derived"]
    for key in ("prox_ratio_recompute_over_loglinear", "step_ratio_recompute_over_loglinear",
                "step_ratio_ceiling", "memory_bandwidth_GBps", "bandwidth_floor", "throughput",
                "entropy_extra_s", "adamw_fused_speedup"):
        assert key in derived and derived[key], key
    assert all(math.isfinite(v) and v > 0 for v in (derived["prox_ratio_recompute_over_loglinear"],
                                                    derived["step_ratio_ceiling"]))
    # the matmul probe in the run's compute dtype, and MFU against it for every step and the recompute forward
    assert on_disk["model"]["precision"] in ("fp32", "bf16")
    probe = derived["peak_flops_measured"]
    assert probe["dtype"] == ("float32" if on_disk["model"]["precision"] == "fp32" else "bfloat16")
    assert 0 < probe["flops_per_s"] <= probe["flops_per_s_best"]
    for name in (*(f"step/{algo}" for algo in DEFAULT_ALGOS), "prox/recompute", "step/recompute/train_phase"):
        row = derived["throughput"][name]
        assert row["mfu_measured_peak"] == pytest.approx(row["flops_per_s"] / probe["flops_per_s"]), name
    assert derived["throughput"]["step/recompute"]["model_flops"] == pytest.approx(
        4 * derived["throughput"]["prox/recompute"]["model_flops"])  # fwd + bwd (3 forwards) + recompute's forward
    assert "measured matmul peak" in (out / "run" / "benchmark.md").read_text()
    floor = derived["bandwidth_floor"]["loglinear@512"]
    assert floor["bytes_minimal"] == 512 * (4 + 4 + 8 + 4) and floor["bytes_eager"] > floor["bytes_minimal"]
    assert 0.0 <= on_disk["batch"]["padding_waste"] < 1.0


def test_every_step_repetition_starts_from_the_same_weights(tiny_report):
    report, _, _, _ = tiny_report
    for name in (f"step/{algo}" for algo in DEFAULT_ALGOS):
        losses = [sample["loss"] for sample in report["results"][name]["raw"]]
        assert len(set(losses)) == 1, (name, losses)


def test_markdown_has_a_row_per_algo(tiny_report):
    _, out, _, _ = tiny_report
    markdown = (out / "run" / "benchmark.md").read_text()
    assert markdown.startswith("# tiny (float32), 2x2 samples") and markdown.rstrip().endswith("|")
    for algo in DEFAULT_ALGOS:
        assert f"| step/{algo} |" in markdown
    assert "| prox/recompute |" in markdown and "| prox/loglinear-inverse |" in markdown
    assert "model=tiny" in markdown and "Machine:" in markdown and ": test" in markdown
    assert "| approximation | tokens |" in markdown and "| loglinear | 512 |" in markdown


def test_default_run_leaves_the_tracked_docs_untouched(tiny_report):
    _, _, before, after = tiny_report
    assert after == before


def test_append_docs_appends_a_section(tiny_report, tmp_path):
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n\nearlier section\n")
    report = _run([*MINIMAL_ARGS, "--out", str(tmp_path / "run"), "--append-docs", "--docs", str(docs)])
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nearlier section\n\n## tiny (float32), 2x2 samples")
    assert text.count("## tiny") == 1 and "model=tiny" in text and "Machine:" in text and ": appended" in text
    assert "| step/coupled |" in text and report["command"] in text
    # A docs file that does not exist yet starts with the page header.
    fresh = tmp_path / "fresh.md"
    append_to_docs(tiny_report[0], fresh)
    assert fresh.read_text().startswith(DOCS_HEADER.rstrip("\n") + "\n\n## tiny")


def test_forward_flops_by_hand():
    """2 x non-embedding params per real token + 4 x hidden x layers per causal query-key pair
    + the lm_head at response positions only."""
    from a3po.benchmark.derive import forward_flops

    model = {"non_embedding_params": 1000, "hidden": 8, "layers": 2, "vocab": 50}
    batch = {"tokens": 10, "attention_pairs": 30, "response_tokens": 4}
    assert forward_flops(model, batch) == 2 * 1000 * 10 + 4 * 8 * 2 * 30 + 2 * 8 * 50 * 4


@pytest.mark.parametrize("name, key, peak", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200 SXM", 989e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", "GH200", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312e12),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA B200", "B200", 2250e12),
    ("NVIDIA H800", None, None),  # a model not in the table
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None, None),  # a slice: no datasheet figure
    ("NVIDIA H100 PCIe NVL", None, None),  # two form factors
    ("Tesla V100-SXM2-16GB", None, None),
    ("", None, None),
])
def test_peak_flops_matches_the_device_name_exactly(monkeypatch, name, key, peak):
    from a3po.benchmark.derive import device_model, peak_flops

    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: seen.append(device) or name)
    assert device_model(name) == key
    assert peak_flops(torch.device("cuda:1"), "bf16") == peak and seen == [torch.device("cuda:1")]
    assert peak_flops(torch.device("cuda:1"), "fp32") is None and peak_flops(torch.device("cpu")) is None
    assert len(seen) == 1  # neither fp32 nor a CPU asks for a name


@pytest.mark.parametrize("tied", [True, False])
def test_the_output_layer_is_counted_once_tied_or_untied(tied):
    """hidden 16, intermediate 32, 2 layers, 4 heads of 4, 2 key-value heads, vocab 64, no
    biases: a layer is q 16x16 + k, v 16x8 each + o 16x16 + MLP 3 x 16x32 + 2 norms of 16 =
    2,336; two layers and the final norm 4,688 non-embedding parameters, tied or not, and
    the 64x16 output layer only in the lm_head term (at response positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from a3po.benchmark.derive import forward_flops
    from a3po.benchmark.workload import parameter_counts

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    counts = parameter_counts(LlamaForCausalLM(config))
    assert counts == {"params": 4688 + 64 * 16 * (1 if tied else 2), "non_embedding_params": 4688,
                      "tied_embeddings": tied}
    model = {**counts, "hidden": 16, "layers": 2, "vocab": 64}
    batch = {"tokens": 10, "attention_pairs": 30, "response_tokens": 4}
    assert forward_flops(model, batch) == 2 * 4688 * 10 + 4 * 16 * 2 * 30 + 2 * 16 * 64 * 4 == 105_792


def test_parse_algo_and_summary():
    assert parse_algo("loglinear") == ("loglinear", "inverse")
    assert parse_algo("linear:exponential") == ("linear", "exponential")
    assert algo_label("linear:exponential") == "linear-exponential" and algo_label("coupled") == "coupled"
    stats = summarize([3.0, 1.0, 2.0, 4.0])
    assert stats["median"] == 2.5 and stats["min"] == 1.0 and stats["max"] == 4.0 and stats["iqr"] > 0
    assert summarize([5.0])["iqr"] == 0.0


def test_padding_stats_counts_count_times_longest():
    def sample(n_prompt, n_resp):
        return Sample(torch.zeros(n_prompt, dtype=torch.long), torch.zeros(n_resp, dtype=torch.long),
                      torch.zeros(n_resp), torch.zeros(n_resp, dtype=torch.long))

    samples = [sample(2, 8), sample(2, 4), sample(2, 2)]
    stats = padding_stats(samples, [[[0, 1], [2]]])
    assert stats["real_tokens"] == 10 + 6 + 4 and stats["padded_tokens"] == 2 * 10 + 4
    assert stats["padding_waste"] == pytest.approx(1 - 20 / 24)


def test_start_state_restores_weights_in_place_and_zeroes_optimizer_state():
    """Every repetition computes the first step's numbers, without a first step's allocations."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = StartState(model, optimizer)
    weight, live_weight = model.weight.detach().clone(), model.weight

    def train_once():
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        return model.weight.detach().clone()

    first = train_once()
    train_once()
    assert not torch.equal(model.weight, weight) and optimizer.state
    moments = optimizer.state[model.weight]["exp_avg"]
    state.restore()
    assert model.weight is live_weight and torch.equal(model.weight, weight) and model.weight.grad is None
    assert optimizer.state[model.weight]["exp_avg"] is moments and not moments.any()  # zeroed in place
    assert torch.equal(train_once(), first)  # as a run's first step


def test_measure_times_one_call_after_each_setup_unless_blocked():
    """A variant that is not blocked is one call after its `before` (a restored state); a
    blocked one runs in blocks of as many calls as the Timer picks, and reports per call."""
    calls = {"since_before": 0}

    def before():
        calls["since_before"] = 0

    def run():
        calls["since_before"] += 1

    once = measure(Variant("once", "step", run, before=before, after=lambda: dict(calls)), min_run_time=0.01)
    assert once["since_before"] == 1 and once["inner"] == 1.0
    assert once["seconds"] > 0 and once["cpu_seconds"] >= 0
    blocked = measure(Variant("blocked", "kernel", run, blocked=True), min_run_time=0.01)
    assert blocked.keys() == {"seconds", "cpu_seconds", "inner"} and blocked["inner"] >= 1
    assert blocked["inner"] == int(blocked["inner"]) and blocked["seconds"] > 0


def test_cpu_clock_pairs_its_readings_into_blocks():
    clock = CpuClock()
    clock.readings = [0.0, 1.0, 5.0, 7.0, 7.5, 10.0]
    assert clock.block_seconds(2) == [2.0, 2.5] and clock.block_seconds(3) == [1.0, 2.0, 2.5]
    assert clock() > 0 and len(clock.readings) == 7


def test_command_line_flags_are_the_options():
    args = build_parser().parse_args(["model=tiny", "--no-rollout", "--kernel-tokens", "64,128", "--algos",
                                      "coupled,loglinear:exponential", "--min-kernel-seconds", "0.5"])
    options = options_from(args)
    assert args.overrides == ["model=tiny"] and not options.rollout and options.progress
    assert options.kernel_tokens == (64, 128) and options.algos == ("coupled", "loglinear:exponential")
    assert options.min_kernel_seconds == 0.5 and options.optimizer_kernels
    mixed = build_parser().parse_intermixed_args(["model=tiny", "--no-progress", "staleness=1", "--reps", "2"])
    assert mixed.overrides == ["model=tiny", "staleness=1"] and mixed.reps == 2 and not mixed.progress
    for bad in (["--reps", "0"], ["--threads", "0"]):
        with pytest.raises(ConfigError, match=f"{bad[0]}=0 is not allowed; it must be an integer >= 1"):
            options_from(build_parser().parse_args(bad))


def test_entry_point_is_thin_and_documents_overrides(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["experiments/benchmark.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "experiments" / "benchmark.py"), run_name="__main__")
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "Hydra overrides" in help_text and "--append-docs" in help_text and "git worktree" in help_text
    assert "--no-docs" not in help_text and "--compare-trainer" not in help_text


def test_approximation_runs_no_forward_and_a_nan_still_raises():
    """The approximation probe (the trainer's per-micro-batch calls and its per-minibatch
    check) allocates nothing larger than the token count and calls no module; a NaN
    behaviour log-prob raises there, and in the trainer's step before the weights change."""
    from a3po.benchmark.probes import approximate_step
    from a3po.benchmark.workload import compose, make_trainer, synthetic_batch
    from a3po.models import load_policy
    from a3po.timer import PhaseTimer

    cfg = compose(["model=tiny", "train.n_prompts=2", "train.n_samples=2", "train.n_minibatches=1",
                   "train.token_budget=32"])
    policy, tokenizer = load_policy(cfg.model, seed=0)
    trainer = make_trainer(cfg, policy, tokenizer, "loglinear", "inverse", torch.device("cpu"),
                           PhaseTimer())
    batch = synthetic_batch(trainer, vocab_size=policy.config.vocab_size, n_prompts=2, n_samples=2, prompt_len=8,
                            response_len=6, length_spread=0.5, staleness=2, version=3, seed=0)
    plans = trainer.plan(batch.samples, torch.Generator().manual_seed(0))
    assert len(plans[0]) > 1  # several micro-batches
    minibatches = [[(torch.cat([batch.samples[i].behave_logp for i in micro]),
                     torch.cat([batch.samples[i].behave_logp for i in micro]) - 0.1,
                     torch.cat([batch.samples[i].versions for i in micro])) for micro in plan] for plan in plans]
    forwards = []
    policy.register_forward_pre_hook(lambda *args: forwards.append(1))
    largest_micro = max(behave.numel() for plan in minibatches for behave, _, _ in plan)
    with TrafficCounter() as traffic:
        approximate_step(trainer, minibatches, 3)
    assert not forwards and 0 < traffic.largest <= largest_micro

    minibatches[-1][-1][0][0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        approximate_step(trainer, minibatches, 3)
    batch.samples[-1].behave_logp[0] = float("nan")
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(ValueError, match="non-finite"):
        trainer.step(batch, version=3, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))
