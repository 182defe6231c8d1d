"""The memory check (a3po.memory.estimate, a3po.run.memory_check): the estimate's parts scale as their formulas say, a run
that cannot fit stops at start with exit 2 and leaves no run directory, warn-only goes on, and
(slow) the estimate is within 30% of a real run's measured peak RSS."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import a3po.run.memory_check as check
from a3po.errors import ConfigError
from a3po.memory.estimate import estimate_memory
from a3po.run.memory_check import architecture_of, host_ceiling, verdict, wait_for_room
from a3po.memory.machine import cgroup_room, host_resident, parse_meminfo, process_memory
from a3po.memory.parts import MIB, MMAP_THRESHOLD_MAX, PHASES, SMOLLM2_135M, Estimate, Part, architecture_from
from a3po.run.main import run, run_dir_of
from a3po.run.rundir import config_differences, holds_only_hydra_output, remove_refused_job_dir

from conftest import REPO
from a3po.config import parse_config
from a3po.rollout.engines import engine_spec

SMOLLM2 = architecture_from(SMOLLM2_135M)
PROMPT = 45  # arith level 1's longest prompt under SmolLM2's chat template


def parts_of(estimate: Estimate) -> dict[str, int]:
    return {p.name: p.nbytes for p in estimate.parts}


def estimate(tiny_cfg, *overrides: str, **kwargs) -> Estimate:
    cfg = tiny_cfg(*overrides)
    arch, _ = architecture_of(cfg.model)
    return estimate_memory(parse_config(cfg), arch, rollout_parts=engine_spec(cfg.rollout.name).memory_parts,
                           prompt_tokens=PROMPT, **kwargs)


# --- the architecture --------------------------------------------------------------------------

def test_smollm2_parameter_counts_match_the_model():
    assert SMOLLM2.n_params == 134_515_008  # sum(p.numel() for p in model.parameters()), tied lm_head once
    assert SMOLLM2.linear_params == 30 * 3_538_944 + 49152 * 576  # the tied lm_head counted: it gets its own copy
    untied = architecture_from({**SMOLLM2_135M, "tie_word_embeddings": False})
    assert untied.n_params == SMOLLM2.n_params + 49152 * 576


def test_tiny_architecture_comes_from_the_model_keys(tiny_cfg):
    arch, source = architecture_of(tiny_cfg("model.num_hidden_layers=3").model)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.head_dim, arch.vocab_size) == (3, 64, 16, 49152)
    assert source == "model.*"


def test_a_hub_model_that_cannot_be_read_skips_the_check_with_a_warning(tiny_cfg, caplog, monkeypatch):
    monkeypatch.setattr(check, "architecture_of", lambda model_cfg: (None, "the config of model.path='x' could not be read"))
    with caplog.at_level(logging.WARNING, logger="a3po.run.memory_check"):
        assert check.check_memory(parse_config(tiny_cfg()), "cpu") is None
    assert "memory check skipped" in caplog.text and "model.path='x'" in caplog.text


# --- the parts scale as they should ------------------------------------------------------------

def test_kv_cache_is_linear_in_new_tokens_and_rows(tiny_cfg):
    def kv(*overrides):  # a budget above the longest response, which a run requires (a3po.config)
        return parts_of(estimate(tiny_cfg, "train.token_budget=1024", *overrides))["rollout KV cache"]

    base = kv("rollout.max_new_tokens=100")
    assert kv("rollout.max_new_tokens=200") - base == kv("rollout.max_new_tokens=300") - kv("rollout.max_new_tokens=200")
    assert kv("rollout.max_new_tokens=100", "train.n_prompts=4") == 2 * base  # rows = n_prompts * n_samples
    assert kv("rollout.max_new_tokens=100", "train.n_prompts=4", "rollout.batch_size=4") == base  # a chunk's rows
    # 2 layers x 2 (k, v) x 4 rows x 2 kv heads x (45 + 100) positions x 16 x 4 bytes (fp32)
    assert base == 2 * 2 * 4 * 2 * (PROMPT + 100) * 16 * 4


def test_bf16_linear_copy_only_under_bf16_with_float32_weights(tiny_cfg):
    arch, _ = architecture_of(tiny_cfg().model)
    bf16 = parts_of(estimate(tiny_cfg, "precision=bf16"))
    assert bf16["rollout bf16 linear weights"] == 2 * arch.linear_params
    assert bf16["training autocast weight casts"] == 2 * arch.linear_params
    assert "rollout bf16 linear weights" not in parts_of(estimate(tiny_cfg))  # fp32
    stored_bf16 = parts_of(estimate(tiny_cfg, "precision=bf16", "model.dtype=bfloat16"))
    assert "rollout bf16 linear weights" not in stored_bf16  # nothing to cast: the weights are bf16
    assert stored_bf16["weights"] == 2 * arch.n_params


def test_bf16_gemms_in_float32_hold_float32_copies_and_operands(tiny_cfg):
    """Where bf16's GEMMs multiply in float32 (a3po.gemms.Bf16GemmsInFloat32): the training
    casts are float32 (4 B), the rollout holds rounded float32 copies while it samples, the saved
    activations are float32's, and eager attention keeps 8 B a probability (softmax's float32
    output and the second product's float32 operand; 6 B natively); only under bf16 over float32
    weights."""
    arch, _ = architecture_of(tiny_cfg().model)
    native = parts_of(estimate(tiny_cfg, "precision=bf16"))
    in_float32 = parts_of(estimate(tiny_cfg, "precision=bf16", gemms_in_float32=(True, True)))
    assert in_float32["training autocast weight casts"] == 4 * arch.linear_params
    assert in_float32["rollout linear weights rounded, in float32"] == 4 * arch.linear_params
    assert "rollout linear weights rounded, in float32" not in native
    assert in_float32["training activations"] > native["training activations"]
    assert in_float32["training response logits"] == native["training response logits"]  # still bf16 logits
    formulas = {p.name: p.formula for p in estimate(tiny_cfg, "precision=bf16", gemms_in_float32=(True, True)).parts}
    native_formulas = {p.name: p.formula for p in estimate(tiny_cfg, "precision=bf16").parts}
    assert "^2 x 8 B" in formulas["training activations"] and "^2 x 6 B" in native_formulas["training activations"]
    fp32 = parts_of(estimate(tiny_cfg, gemms_in_float32=(True, True)))
    assert fp32 == parts_of(estimate(tiny_cfg))  # fp32 has no bf16 GEMM to move
    rollout_only = parts_of(estimate(tiny_cfg, "precision=bf16", gemms_in_float32=(False, True)))
    assert rollout_only["training autocast weight casts"] == 2 * arch.linear_params
    assert rollout_only["rollout linear weights rounded, in float32"] == 4 * arch.linear_params


def test_what_decode_attention_copies_depends_on_the_implementation(tiny_cfg):
    """sdpa repeats the tiny model's 2 key-value heads for its 4 query heads (keys and values);
    the loop's eager attention reads the cache where it lies (a3po.rollout.attention), and takes
    a float32 copy of one layer's keys (then values) only where bf16's GEMMs multiply in float32."""
    positions = PROMPT + tiny_cfg().rollout.max_new_tokens
    sdpa = parts_of(estimate(tiny_cfg, "precision=bf16", eager_attention=False))
    assert sdpa["rollout repeated key/value heads"] == 2 * 4 * 4 * positions * 16 * 2  # 2 x rows x H x P x d x 2 B
    assert "rollout key/value heads in float32" not in sdpa
    eager = parts_of(estimate(tiny_cfg, "precision=bf16"))
    assert "rollout repeated key/value heads" not in eager and "rollout key/value heads in float32" not in eager
    in_float32 = parts_of(estimate(tiny_cfg, "precision=bf16", gemms_in_float32=(False, True)))
    assert in_float32["rollout key/value heads in float32"] == 4 * 2 * positions * 16 * 4  # rows x K x P x d x 4 B
    assert "rollout repeated key/value heads" not in in_float32


def test_rollout_weight_copies(tiny_cfg):
    arch, _ = architecture_of(tiny_cfg().model)
    lagged = parts_of(estimate(tiny_cfg))
    assert not any("copy" in name or "private" in name for name in lagged)  # samples from the trainer's module
    async_ = parts_of(estimate(tiny_cfg, "runtime=async"))
    assert async_["rollout private weights (async)"] == 4 * arch.n_params
    elsewhere = parts_of(estimate(tiny_cfg, rollout_device="cuda:1"))
    assert elsewhere["rollout policy copy"] == 4 * arch.n_params


def test_async_adds_the_phases_and_a_gpu_holds_the_larger(tiny_cfg):
    async_ = estimate(tiny_cfg, "runtime=async")
    assert async_.peak() == sum(p.nbytes for p in async_.parts)
    gpu = estimate(tiny_cfg, trainer_device="cuda:0")
    rollout, train = gpu.phase_bytes("rollout", "cuda:0"), gpu.phase_bytes("train", "cuda:0")
    assert gpu.peak("cuda:0") == gpu.phase_bytes("always", "cuda:0") + max(rollout, train)
    assert gpu.peak("cpu") == gpu.phase_bytes("always", "cpu")  # the host: the process and the batches


def test_phases_combine_by_what_the_allocator_keeps():
    """CPU: both phases' heap shares (the heap keeps them) plus the larger mmapped share (returned
    when freed); GPU: the larger phase (torch's cache reuses its blocks)."""
    big = MMAP_THRESHOLD_MAX
    parts = (Part("a", 10, (), "always"), Part("r heap", 5, (), "rollout", tensor=1), Part("r mmap", 7, (), "rollout", tensor=big),
             Part("t heap", 6, (), "train", tensor=1), Part("t mmap", 2, (), "train", tensor=big))
    assert Estimate(parts).peak("cpu") == 10 + 5 + 6 + 7
    assert Estimate(parts, mmap_threshold=2**30).peak("cpu") == 10 + 5 + 7 + 6 + 2  # a3po.allocator: all kept
    gpu = tuple(Part(p.name, p.nbytes, p.keys, p.phase, "cuda:0", tensor=p.tensor) for p in parts)
    assert Estimate(gpu).peak("cuda:0") == 10 + 12


def test_training_parts_follow_the_token_budget_and_the_minibatch(tiny_cfg):
    def train(*overrides):
        parts = parts_of(estimate(tiny_cfg, "train.n_prompts=8", "train.n_samples=4", "train.n_minibatches=1", *overrides))
        return parts["training activations"], parts["training response logits"]

    small, larger = train("train.token_budget=256"), train("train.token_budget=1024")
    assert larger[0] > 3 * small[0] and larger[1] > 3 * small[1]
    # 32 samples of 45 + 8 tokens fill at most 32 x 53 tokens: a larger budget changes nothing
    assert train("train.token_budget=4096") == train("train.token_budget=65536")


def test_the_eval_rollout_counts_where_it_is_larger(tiny_cfg):
    parts = parts_of(estimate(tiny_cfg, "train.eval_size=64"))
    assert "eval rollout KV cache" in parts and "rollout KV cache" not in parts
    assert "eval rollout KV cache" not in parts_of(estimate(tiny_cfg, "train.eval_size=64", "train.eval_every=0"))
    # several samples a problem: eval_size x eval_samples rows
    eight = parts_of(estimate(tiny_cfg, "train.eval_size=16", "train.eval_samples=4"))
    assert eight["eval rollout KV cache"] == parts["eval rollout KV cache"]  # 16 x 4 rows = 64 x 1


def test_every_part_names_its_keys(tiny_cfg):
    for part in estimate(tiny_cfg, "precision=bf16").parts:
        assert part.keys or part.name == "process baseline", part.name
        assert part.phase in PHASES


# --- what the machine has -----------------------------------------------------------------------

def test_meminfo_and_cgroup_parsing():
    assert parse_meminfo("MemTotal:  1000 kB\nMemAvailable:   512 kB\nHugePages_Total: 0\n")["MemAvailable"] == 512 * 1024
    assert cgroup_room("max\n", "100", "") is None
    assert cgroup_room("9223372036854771712\n", "100", "") is None  # v1's "no limit"
    assert cgroup_room("1000\n", "700\n", "anon 500\ninactive_file 200\n") == 500  # page cache is reclaimable
    assert cgroup_room("1000", "1500", "") == 0


def test_process_memory_reads_rss_and_its_peak_in_gib():
    status = "Name:\tpython\nUid:\t0\t0\t0\t0\nVmHWM:\t 3145728 kB\nVmRSS:\t 2097152 kB\nThreads:\t4\n"
    assert process_memory("cpu", status) == {"memory/host_rss": 2.0, "memory/host_peak": 3.0}
    assert process_memory("cpu", "Name:\tkthread\n") == {}  # no resident set to report
    live = process_memory("cpu")
    assert 0 < live["memory/host_rss"] <= live["memory/host_peak"]
    assert host_resident(status) == 2 * 2**30 and host_resident("Name:\tkthread\n") is None
    assert host_resident() > 0


def test_the_host_ceiling_is_the_estimates_host_peak_for_one_cpu_process():
    parts = (Part("weights", 3 * MIB, (), "always", "cpu"), Part("decode", 2 * MIB, (), "rollout", "cpu"),
             Part("activations", 5 * MIB, (), "train", "cpu"))
    estimate = Estimate(parts)
    assert host_ceiling(estimate, "cpu", 1) == estimate.peak("cpu") == 10 * MIB  # the heap's phases add
    assert host_ceiling(None, "cpu", 1) is None  # memory_check=off: no estimate, no ceiling
    assert host_ceiling(estimate, "cuda", 1) is None
    assert host_ceiling(estimate, "cpu", 2) is None  # torchrun's ranks share one estimate


def test_verdict_error_warning_and_ok():
    est = Estimate((Part("weights", 900, ("model",), "always"),))
    assert verdict(est, {"cpu": (800, "MemAvailable")})[0] == "error"
    level, message = verdict(est, {"cpu": (1000, "MemAvailable")})
    assert level == "warn" and "weights" in message and "(model)" in message
    assert verdict(est, {"cpu": (10_000, "MemAvailable")}) == ("ok", None)


# --- the check in a run -------------------------------------------------------------------------

def test_memory_check_value_is_validated_before_loading(tiny_cfg, monkeypatch):
    import a3po.models

    monkeypatch.setattr(a3po.models, "load_policy", lambda *a, **k: pytest.fail("loaded before validation"))
    with pytest.raises(ConfigError, match=r"memory_check='maybe' is not allowed; allowed: \['error', 'warn', 'off'\]"):
        run(tiny_cfg("memory_check=maybe"))


def test_a_run_that_cannot_fit_stops_before_its_directory_or_model(tiny_cfg, monkeypatch):
    import a3po.models

    monkeypatch.setattr(a3po.models, "load_policy", lambda *a, **k: pytest.fail("loaded before the memory check"))
    cfg = tiny_cfg("train.n_prompts=100000")
    with pytest.raises(ConfigError) as err:
        run(cfg)
    message = str(err.value)
    assert "memory check" in message and "GiB" in message and "train.n_prompts" in message
    assert "memory_check=warn" in message
    assert not run_dir_of(cfg).exists()


def test_warn_only_goes_on(tiny_cfg, monkeypatch, caplog):
    monkeypatch.setattr(check, "available_memory", lambda device: (100 * MIB, "a test's limit"))
    with pytest.raises(ConfigError, match="memory check"):
        run(tiny_cfg("train.total_steps=1"))
    with caplog.at_level(logging.WARNING, logger="a3po.run.memory_check"):
        run(tiny_cfg("train.total_steps=1", "train.eval_every=0", "memory_check=warn"))
    assert "Starting anyway (memory_check=warn)" in caplog.text
    assert (run_dir_of(tiny_cfg()) / "finished.json").exists()
    run(tiny_cfg("train.total_steps=1", "train.eval_every=0", "memory_check=off", "experiment_name=off"))  # no estimate


def test_an_old_run_directory_without_the_key_still_compares_equal(tiny_cfg):
    cfg = tiny_cfg()
    new = OmegaConf.to_container(cfg, resolve=True)
    old = {k: v for k, v in new.items() if k != "memory_check"}
    assert config_differences(old, new) == []
    assert config_differences(new, {**new, "memory_check": "off"}) == []  # result-neutral
    assert config_differences({k: v for k, v in new.items() if k != "memory_check_wait_min"}, new) == []
    assert config_differences(new, {**new, "memory_check_wait_min": 20}) == []


# --- waiting for memory another job holds (memory_check_wait_min) -------------------------------

class FakeClock:
    """time.monotonic and time.sleep for a3po.run.memory_check: sleeping moves the clock."""

    def __init__(self, monkeypatch):
        self.now, self.sleeps = 0.0, []
        monkeypatch.setattr(check.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(check.time, "sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_waiting_run_starts_once_the_memory_frees(monkeypatch, caplog):
    clock = FakeClock(monkeypatch)
    free = iter([800, 800, 800, 10_000])  # bytes the host gives at each ask
    monkeypatch.setattr(check, "available_memory", lambda device: (next(free), "MemAvailable"))
    est = Estimate((Part("weights", 900, ("model",), "always"),))
    with caplog.at_level(logging.WARNING, logger="a3po.run.memory_check"):
        assert wait_for_room(est, ["cpu"], wait_min=5) == ("ok", None, 90.0)
    assert clock.sleeps == [30.0, 30.0, 30.0]
    assert caplog.text.count("Waiting up to 5 min") == 1 and "freed after 1.5 min" in caplog.text


def test_a_wait_ends_at_its_limit_and_zero_does_not_wait(monkeypatch):
    clock = FakeClock(monkeypatch)
    monkeypatch.setattr(check, "available_memory", lambda device: (800, "MemAvailable"))
    est = Estimate((Part("weights", 900, ("model",), "always"),))
    level, _, waited = wait_for_room(est, ["cpu"], wait_min=1.25, poll_s=30)
    assert (level, waited, clock.sleeps) == ("error", 75.0, [30.0, 30.0, 15.0])  # the last sleep ends at the limit
    clock.sleeps.clear()
    assert wait_for_room(est, ["cpu"], wait_min=0)[::2] == ("error", 0.0) and clock.sleeps == []


def test_a_run_that_waited_in_vain_says_so_and_leaves_nothing(tiny_cfg, monkeypatch):
    clock = FakeClock(monkeypatch)
    cfg = tiny_cfg("train.n_prompts=100000", "memory_check_wait_min=2")
    with pytest.raises(ConfigError, match=r"It waited 2\.0 min \(memory_check_wait_min=2\)\. .*memory_check_wait_min"):
        run(cfg)
    assert sum(clock.sleeps) == 120 and not run_dir_of(cfg).exists()
    clock.sleeps.clear()
    warn = tiny_cfg("train.n_prompts=100000", "memory_check_wait_min=2", "memory_check=warn")
    assert check.check_memory(parse_config(warn), "cpu") is not None and clock.sleeps == []  # warn starts at once


@pytest.mark.parametrize("value", ["-1", "abc", "true", ".inf"])
def test_memory_check_wait_min_is_validated(tiny_cfg, value):
    with pytest.raises(ConfigError, match=r"memory_check_wait_min=.* is not allowed; it must be a number of minutes >= 0"):
        run(tiny_cfg(f"memory_check_wait_min={value}"))


# --- a refused run leaves no directory ----------------------------------------------------------

def hydra_job_dir(path: Path, *extra: str) -> Path:
    (path / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (path / ".hydra" / name).write_text("{}\n")
    (path / "train.log").write_text("")
    for name in extra:
        (path / name).write_text("x")
    return path


def test_only_a_directory_of_hydra_files_is_removed(tmp_path):
    root = tmp_path / "outputs"
    fresh = hydra_job_dir(root / "exp" / "run")
    assert holds_only_hydra_output(fresh, "train.log")
    assert remove_refused_job_dir(fresh, "train.log", stop_at=root)
    assert not (root / "exp").exists() and root.exists()  # empty parents up to output_root, not it
    for own in ("config.yaml", ".lock", "metrics.jsonl"):
        existing = hydra_job_dir(root / "exp" / own.strip("."), own)
        assert not remove_refused_job_dir(existing, "train.log", stop_at=root)
        assert (existing / own).exists() and (existing / ".hydra").exists()
    odd = hydra_job_dir(root / "odd")
    (odd / ".hydra" / "notes.txt").write_text("mine")
    assert not remove_refused_job_dir(odd, "train.log", stop_at=root)


def train_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "experiments/train.py", "model=tiny", "logger=none",
                           f"output_root={tmp_path / 'outputs'}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_cli_refuses_a_run_that_cannot_fit_and_leaves_no_directory(tmp_path):
    proc = train_cli(tmp_path, "train.n_prompts=100000")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: memory check: this run needs an estimated" in proc.stderr
    assert "GiB is available" in proc.stderr and "train.n_prompts" in proc.stderr and "Traceback" not in proc.stderr
    assert files_under(tmp_path / "outputs") == [] and not list((tmp_path / "outputs").glob("*"))


def test_cli_refuses_an_over_long_rollout_and_leaves_no_directory(tmp_path):
    proc = train_cli(tmp_path, "rollout.max_new_tokens=1000000", "train.token_budget=1000001")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "memory check" in proc.stderr and "rollout.max_new_tokens" in proc.stderr
    assert files_under(tmp_path / "outputs") == []


def test_cli_config_error_keeps_an_existing_run_directory(tmp_path):
    run_dir = tmp_path / "existing"
    hydra_job_dir(run_dir, "config.yaml", "metrics.jsonl")
    proc = train_cli(tmp_path, "train.n_prompts=0", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "train.n_prompts=0" in proc.stderr
    assert (run_dir / "config.yaml").read_text() == "x" and (run_dir / "metrics.jsonl").exists()
    fresh = tmp_path / "fresh"
    proc = train_cli(tmp_path, "train.n_prompts=0", f"hydra.run.dir={fresh}")
    assert proc.returncode == 2 and not fresh.exists()


# --- calibration ---------------------------------------------------------------------------------

MEASURE = textwrap.dedent("""
    import resource, subprocess, sys
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-3000:])
    print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
""")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "smollm2_135m"])
def test_estimate_within_30_percent_of_measured_peak_rss(tmp_path, model):
    """A short real run in a process of its own (so this process's memory does not count), its
    peak RSS read by a parent whose only child it is."""
    from hydra import compose, initialize_config_dir

    from a3po.device import resolve_device, resolve_precision

    overrides = [f"model={model}", "logger=none", "train.total_steps=2", "train.eval_every=0",
                 f"output_root={tmp_path / 'outputs'}"]
    proc = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "experiments/train.py", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    returncode, peak_rss = map(int, proc.stdout.split())
    assert returncode == 0, proc.stderr
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = parse_config(compose(config_name="config", overrides=overrides))
    cfg = cfg.with_values(precision=resolve_precision(cfg.precision, resolve_device(cfg.device), cfg.model.dtype))
    arch, _ = architecture_of(cfg.model)
    prompt, _ = check.longest_prompt_tokens(cfg.task, cfg.model)
    estimated = estimate_memory(cfg, arch, rollout_parts=engine_spec(cfg.rollout.name).memory_parts,
                                prompt_tokens=prompt).peak()
    assert 0.7 < estimated / peak_rss < 1.3, f"estimated {estimated / 2**20:.0f} MiB, measured {peak_rss / 2**20:.0f} MiB"


# --- /dev/shm: a vLLM child maps the host copy's storage from shared memory ---------------------

def test_a_vllm_child_needs_its_weights_in_shared_memory_and_a_process_engine_does_not(tiny_cfg):
    from a3po.memory.parts import SHARED_MEMORY

    arch, _ = architecture_of(tiny_cfg().model)
    child = estimate(tiny_cfg, "rollout=vllm", "train.token_budget=1024", world=2)  # under torchrun: a child
    assert parts_of(child)["vLLM child's weights in shared memory"] == arch.n_params * 4
    assert SHARED_MEMORY in child.devices() and child.peak(SHARED_MEMORY) == arch.n_params * 4
    in_process = estimate(tiny_cfg, "rollout=vllm", "train.token_budget=1024")  # the CPU, one process
    assert SHARED_MEMORY not in in_process.devices() and "rollout policy copy (host)" not in parts_of(in_process)


def test_the_start_refuses_a_child_whose_weights_do_not_fit_shared_memory(tiny_cfg, monkeypatch):
    from a3po.memory.machine import shared_memory_free

    room, where = shared_memory_free()
    assert room > 0 and where == "/dev/shm free (statvfs)"
    assert shared_memory_free("/nonexistent/shm")[0] == 0
    small = {"/dev/shm": (1000, "/dev/shm free (statvfs)")}
    monkeypatch.setattr(check, "available_memory", lambda device: small.get(device, (64 << 30, "test")))
    with pytest.raises(ConfigError, match=r"this run needs an estimated [0-9.]+ [MG]iB at its peak on /dev/shm"):
        check.check_memory(parse_config(tiny_cfg("rollout=vllm", "train.token_budget=1024")), "cpu", world=2)
