"""One precision rule for the trainer and the HF engine, and the device config value."""

from __future__ import annotations

import pytest
import torch

from a3po.device import autocast_dtype, cpu_vendor, native_bf16, resolve_device, resolve_precision
from a3po.errors import ConfigError

from conftest import TINY_OVERRIDES, compose_config


def test_autocast_rule():
    float32 = torch.nn.Linear(2, 2)
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    for device in ("cuda", "cpu", "cuda:1"):
        assert autocast_dtype(torch.device(device), float32, "bf16") is torch.bfloat16  # float32 master weights
        assert autocast_dtype(torch.device(device), float32, "fp32") is None  # exact float32
        assert autocast_dtype(torch.device(device), bf16, "bf16") is None  # already bf16


def _cpu_bf16(monkeypatch, avx512_bf16: bool, amx: bool = False, vendor: str = "AuthenticAMD") -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr("a3po.device.cpu_vendor", lambda: vendor)


def test_precision_rule_on_this_cpu_follows_torchs_detection_and_the_vendor():
    """auto is bf16 exactly where torch reports AMX, or AVX512-BF16 on a CPU not Intel's (read, not assumed)."""
    avx512_bf16, amx = torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()
    faster = amx or (avx512_bf16 and cpu_vendor() != "GenuineIntel")
    assert native_bf16(torch.device("cpu")) is bool(avx512_bf16 or amx)
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if faster else "fp32")
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"


@pytest.mark.parametrize("avx512_bf16, amx, vendor, expected", [
    (True, False, "AuthenticAMD", "bf16"),  # AMD EPYC: bf16 5x float32's AVX2 GEMM
    (True, False, "GenuineIntel", "fp32"),  # Intel without AMX: MKL's AVX-512 float32 is the faster
    (True, False, "", "bf16"),               # vendor unknown: the instructions decide
    (False, True, "GenuineIntel", "bf16"),
    (True, True, "GenuineIntel", "bf16"),
    (False, False, "AuthenticAMD", "fp32"),
    (False, False, "GenuineIntel", "fp32")])
def test_precision_auto_on_cpus_by_instructions_and_vendor(monkeypatch, avx512_bf16, amx, vendor, expected):
    _cpu_bf16(monkeypatch, avx512_bf16, amx, vendor)
    assert resolve_precision("auto", torch.device("cpu")) == expected


def test_precision_bf16_on_a_cpu_without_it_runs_emulated_with_a_warning(monkeypatch, caplog):
    _cpu_bf16(monkeypatch, False)
    with caplog.at_level("WARNING"):
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert "emulates bf16" in caplog.text and "precision=auto picks fp32" in caplog.text


def test_precision_bf16_on_an_intel_cpu_without_amx_runs_natively_with_a_warning(monkeypatch, caplog):
    _cpu_bf16(monkeypatch, True, False, "GenuineIntel")
    with caplog.at_level("WARNING"):
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert "no AMX" in caplog.text and "slower than MKL's fp32 GEMM" in caplog.text
    assert "emulates" not in caplog.text


def test_precision_bf16_where_it_is_the_faster_runs_without_a_warning(monkeypatch, caplog):
    _cpu_bf16(monkeypatch, True, False, "AuthenticAMD")
    with caplog.at_level("WARNING"):
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert caplog.text == ""


def test_cpu_vendor_reads_the_vendor_line_and_is_empty_where_there_is_none(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert cpu_vendor(str(cpuinfo)) == "GenuineIntel"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # an ARM machine names no vendor_id
    assert cpu_vendor(str(cpuinfo)) == ""
    assert cpu_vendor(str(tmp_path / "missing")) == ""


def test_precision_on_a_gpu_mocked(monkeypatch):
    """auto follows the GPU's bf16 support; a GPU without it refuses bf16, naming the key."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert resolve_precision("auto", torch.device("cuda")) == "fp32"
    with pytest.raises(ConfigError, match=r"precision='bf16' is not allowed on this machine: Tesla V100 .*allowed: fp32 or auto"):
        resolve_precision("bf16", torch.device("cuda"))


def test_precision_bad_values_and_low_precision_weights():
    with pytest.raises(ConfigError, match=r"precision='fp16' is not allowed; allowed: \['auto', 'fp32', 'bf16'\]"):
        resolve_precision("fp16", torch.device("cpu"))
    assert resolve_precision("auto", torch.device("cpu"), "bfloat16") == "bf16"  # bf16 weights compute in bf16
    with pytest.raises(ConfigError, match="precision='fp32' is not allowed with model.dtype=bfloat16"):
        resolve_precision("fp32", torch.device("cpu"), "bfloat16")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda' is not allowed"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="device='tpu' is not allowed"):
        resolve_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_engine_samples_as_the_trainer_computes_on_gpu():
    """Under bf16 autocast on both sides, behave_logp matches the trainer's forward at d = 0
    to bf16 precision (float32 sampling against a bf16 trainer differed by ~1e-2)."""
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.tasks import build_task
    from a3po.timer import PhaseTimer
    from a3po.rollout.producer import RolloutProducer
    from a3po.learner.trainer import Trainer

    device = torch.device("cuda")
    cfg = compose_config([*TINY_OVERRIDES, "device=cuda", "rollout.max_new_tokens=12"])
    policy, tokenizer = load_policy(cfg.model, device=device, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, device)
    timer = PhaseTimer(device)
    batch, _ = RolloutProducer(cfg, build_task(cfg.task, 0), tokenizer, engine, timer)(0)
    trainer = Trainer(policy, cfg, pad_id=tokenizer.pad_token_id, device=device, timer=timer)
    with torch.no_grad():
        logp, _ = trainer.response_logp(batch.samples)
    behave = torch.cat([s.behave_logp for s in batch.samples]).to(device)
    assert (logp - behave).abs().max().item() < 5e-2
