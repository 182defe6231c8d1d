"""One precision rule for the trainer and the HF engine, and the device config value."""

from __future__ import annotations

import os

import contextlib

import pytest
import torch

from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode

from a3po.device import (BF16_GEMMS_ENV, autocast, autocast_dtype, bf16_gemm_in_float32, cpu_vendor, native_bf16, resolve_device,
                         resolve_precision)
from a3po.errors import ConfigError
from a3po.gemms import Bf16GemmsInFloat32

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
    monkeypatch.delenv(BF16_GEMMS_ENV, raising=False)  # unpinned: the CPU's rule


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
    assert "multiply their bf16 operands in float32" in caplog.text


def test_precision_bf16_on_an_intel_cpu_without_amx_runs_natively_with_a_warning(monkeypatch, caplog):
    _cpu_bf16(monkeypatch, True, False, "GenuineIntel")
    with caplog.at_level("WARNING"):
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert "no AMX" in caplog.text and "slower than MKL's fp32 GEMM" in caplog.text
    assert "multiply their bf16 operands in float32" in caplog.text and "emulates" not in caplog.text


def test_precision_bf16_where_it_is_the_faster_runs_without_a_warning(monkeypatch, caplog):
    _cpu_bf16(monkeypatch, True, False, "AuthenticAMD")
    with caplog.at_level("WARNING"):
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert caplog.text == ""


def _bf16_ulps(value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|value - exact| in units of bf16's last place at `exact` (8 significant bits)."""
    return (value.double() - exact).abs() / (exact.abs().clamp_min(1e-30).log2().floor() - 7).exp2()


def _native_and_in_float32(product, *operands: torch.Tensor):
    """`product(*operands)` under bf16 autocast, by oneDNN's bf16 GEMM then by
    `Bf16GemmsInFloat32`'s: for each, the output and the gradients of its squared sum, with
    respect to the operands and then to any parameter of `product`."""
    params = list(product.parameters()) if isinstance(product, torch.nn.Module) else []
    results = []
    for mode in (contextlib.nullcontext(), Bf16GemmsInFloat32()):
        leaves = [t.clone().requires_grad_() for t in operands]
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), mode:
            y = product(*leaves)
        y.float().square().sum().backward()
        results.append((y.detach(), *[t.grad for t in leaves], *[p.grad.clone() for p in params]))
    return results


def _assert_a_bf16_gemm(native: tuple, ours: tuple, exact: torch.Tensor) -> None:
    """Within one bf16 place of the exact product of the rounded operands, as oneDNN's bf16 GEMM
    is, equal to it but for the order of the float32 sums, and so are the float32 gradients."""
    assert ours[0].dtype == native[0].dtype == torch.bfloat16 and ours[0].shape == exact.shape
    assert _bf16_ulps(ours[0], exact).max() <= 1.0 and _bf16_ulps(native[0], exact).max() <= 1.0
    assert (ours[0] == native[0]).float().mean() > 0.99
    for grad, native_grad in zip(ours[1:], native[1:], strict=True):
        assert grad.dtype == torch.float32  # back at the master weights' and input's dtype
        assert torch.allclose(grad, native_grad, rtol=0, atol=2 ** -7 * native_grad.abs().max())


def test_bf16_linear_in_float32_computes_a_bf16_gemm():
    """Operands rounded to bf16, exact products summed in float32, the output rounded to bf16:
    within one bf16 place of the exact product, as oneDNN's bf16 GEMM is; the gradients too."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(96, 160), torch.randn(48, 96)
    native, ours = _native_and_in_float32(layer, x)
    exact = (x.bfloat16().double() @ layer.weight.detach().bfloat16().double().T
             + layer.bias.detach().bfloat16().double())
    _assert_a_bf16_gemm(native, ours, exact)
    assert len(ours) == 4  # output, input grad, weight grad, bias grad


def test_bf16_matmul_in_float32_computes_attentions_bf16_products():
    """Eager attention's products (`torch.matmul` of [batch, heads, rows, cols] operands) under the
    mode compute as oneDNN's bf16 GEMM does, gradients included."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 16, 24), torch.randn(2, 3, 24, 20)
    native, ours = _native_and_in_float32(torch.matmul, q, k)
    _assert_a_bf16_gemm(native, ours, q.bfloat16().double() @ k.bfloat16().double())
    assert len(ours) == 3  # output, both operands' grads


def test_bf16_gemms_in_float32_pass_through_what_they_do_not_serve():
    """A broadcast product, a matrix-vector one, and anything with autocast turned off inside the
    scope compute exactly as they would without the mode."""
    a, b, v = torch.randn(2, 5, 8), torch.randn(8, 6), torch.randn(8)
    layer = torch.nn.Linear(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = (torch.matmul(a, b), torch.matmul(a, v))
    with torch.autocast("cpu", dtype=torch.bfloat16), Bf16GemmsInFloat32():
        assert torch.matmul(a, b).equal(expected[0]) and torch.matmul(a, v).equal(expected[1])
        with torch.autocast("cpu", enabled=False):
            assert torch.matmul(a, a.transpose(1, 2)).equal(a @ a.transpose(1, 2).detach())
            assert torch.matmul(a, a.transpose(1, 2)).dtype == layer(a).dtype == torch.float32
    with torch.no_grad():
        assert layer(a).equal(torch.nn.functional.linear(a, layer.weight, layer.bias))


class _GemmDtypes(TorchDispatchMode):
    """The operand dtypes of every aten GEMM run inside it, forward or backward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.append((func.__name__, args[-1].dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_gemms_in_float32_backward_stays_float32_inside_nested_scopes(monkeypatch):
    """A backward called inside the autocast scope (the trainer's minibatch scope, its forwards
    in nested scopes) would have autocast cast autograd's GEMMs back to bf16: every GEMM, forward
    and backward, is float32, and a nested scope adds no second mode."""
    monkeypatch.setattr("a3po.device.bf16_gemm_in_float32", lambda device: True)
    layer, x = torch.nn.Linear(8, 4, bias=False), torch.randn(2, 3, 8, requires_grad=True)
    with autocast(torch.device("cpu"), torch.bfloat16):
        with autocast(torch.device("cpu"), torch.bfloat16):
            assert len(_get_current_function_mode_stack()) == 1
            h = layer(x)
            y = torch.matmul(h, h.transpose(1, 2))  # attention's product
        spy = _GemmDtypes()
        with spy:
            y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.shape == x.shape and layer.weight.grad.shape == (4, 8)
    assert {name for name, _ in spy.seen} >= {"mm.default", "bmm.default"}
    assert {dtype for _, dtype in spy.seen} == {torch.float32}


def test_bf16_linear_in_float32_rounds_a_parameter_once_and_again_when_it_changes():
    layer, x = torch.nn.Linear(8, 4, bias=False), torch.randn(3, 8)
    mode = Bf16GemmsInFloat32()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), mode:
        first = layer(x)
        rounded = mode._rounded[id(layer.weight)][2]
        assert layer(x).equal(first) and mode._rounded[id(layer.weight)][2] is rounded  # cached
        layer.weight.mul_(2)  # an optimizer step changes the parameter in place
        assert layer(x).equal((2 * first.float()).bfloat16())  # a power of two: exact
        assert mode._rounded[id(layer.weight)][2] is not rounded
        layer(torch.randn(3, 8))  # an activation is never held
    assert list(mode._rounded) == [id(layer.weight)]
    under_grad = Bf16GemmsInFloat32()
    with torch.autocast("cpu", dtype=torch.bfloat16), under_grad:
        layer(x).float().sum().backward()
        layer(x).float().sum().backward()  # a second micro-batch: a graph of its own (torch.compile frees the first's)
    assert under_grad._rounded == {} and layer.weight.grad is not None


@pytest.mark.parametrize("avx512_bf16, amx, vendor, in_float32", [
    (False, False, "GenuineIntel", True),   # emulated bf16: 4x float32's time
    (True, False, "GenuineIntel", True),    # AVX512-BF16 without AMX: slower than MKL's float32
    (True, False, "AuthenticAMD", False),   # AMD EPYC: oneDNN's bf16 GEMM is the faster
    (True, True, "GenuineIntel", False)])
def test_autocast_multiplies_bf16_in_float32_exactly_where_bf16_is_not_the_faster(monkeypatch, avx512_bf16, amx,
                                                                                   vendor, in_float32):
    _cpu_bf16(monkeypatch, avx512_bf16, amx, vendor)
    assert bf16_gemm_in_float32(torch.device("cpu")) is in_float32
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        modes = _get_current_function_mode_stack()
        assert [type(m) for m in modes] == ([Bf16GemmsInFloat32] if in_float32 else [])
    assert _get_current_function_mode_stack() == [] and not torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), None):
        assert _get_current_function_mode_stack() == [] and not torch.is_autocast_enabled("cpu")


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
    from a3po.learner.build import trainer_from

    device = torch.device("cuda")
    cfg = compose_config([*TINY_OVERRIDES, "device=cuda", "rollout.max_new_tokens=12"])
    policy, tokenizer = load_policy(cfg.model, device=device, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, device)
    timer = PhaseTimer(device)
    batch, _ = RolloutProducer(parse_config(cfg), build_task(cfg.task, 0), tokenizer, engine, timer)(0)
    trainer = trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=device, timer=timer)
    with torch.no_grad():
        logp, _ = trainer.response_logp(batch.samples)
    behave = torch.cat([s.behave_logp for s in batch.samples]).to(device)
    assert (logp - behave).abs().max().item() < 5e-2


@pytest.mark.parametrize("avx512_bf16, amx, vendor", [
    (False, False, "AuthenticAMD"),   # AMD EPYC without AVX-512: bf16 emulated
    (True, False, "GenuineIntel"),    # Intel Xeon with AVX512-BF16, no AMX
    (True, False, "AuthenticAMD"),    # AMD EPYC with AVX512-BF16
    (True, True, "GenuineIntel")])    # Intel Xeon with AMX
def test_bf16_gemms_pins_one_gemm_path_on_every_cpu(monkeypatch, avx512_bf16, amx, vendor):
    """A study that pins `bf16_gemms` multiplies the same way whatever CPU a session lands on; null
    keeps the CPU's rule; a child process inherits the pin through the environment."""
    import a3po.device
    _cpu_bf16(monkeypatch, avx512_bf16, amx, vendor)
    faster = amx or (avx512_bf16 and vendor != "GenuineIntel")
    cpu = torch.device("cpu")
    monkeypatch.setenv(BF16_GEMMS_ENV, "")
    a3po.device.pin_bf16_gemms(None, cpu)
    assert bf16_gemm_in_float32(cpu) is (not faster)
    a3po.device.pin_bf16_gemms("bf16", cpu)
    assert bf16_gemm_in_float32(cpu) is False and os.environ[BF16_GEMMS_ENV] == "bf16"
    with autocast(cpu, torch.bfloat16):
        assert _get_current_function_mode_stack() == []
    a3po.device.pin_bf16_gemms("float32", cpu)
    assert bf16_gemm_in_float32(cpu) is True
    assert bf16_gemm_in_float32(torch.device("meta")) is False  # not a CPU: no effect
    with pytest.raises(ConfigError, match=r"bf16_gemms='fp16' is not allowed; allowed: \[None, 'bf16', 'float32'\]"):
        a3po.device.pin_bf16_gemms("fp16", cpu)


def test_bf16_gemms_is_checked_at_start_and_recorded(tiny_cfg, monkeypatch):
    """A bad `bf16_gemms` fails at start naming the key and what is allowed; a good one is what the
    run's config.yaml records."""
    from a3po.config import parse_config
    from a3po.run.main import run, run_dir_of

    with pytest.raises(ConfigError, match=r"bf16_gemms.*'native'.*allowed: \[None, 'bf16', 'float32'\]"):
        parse_config(tiny_cfg("bf16_gemms=native"))
    monkeypatch.setenv(BF16_GEMMS_ENV, "")
    cfg = tiny_cfg("bf16_gemms=float32", "train.total_steps=1", "train.eval_every=0")
    run(cfg)
    assert "bf16_gemms: float32" in (run_dir_of(cfg) / "config.yaml").read_text()
    assert os.environ[BF16_GEMMS_ENV] == "float32"
