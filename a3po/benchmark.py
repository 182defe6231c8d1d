"""What the proximal policy costs: recompute's forward pass against A-3PO's approximation.

The paper's headline is a cost (about 10 s of recompute forward per step against about
0.0012 s of loglinear approximation, and 18-27% less training time), so this module measures,
on one synthetic batch and in one process:

- `prox/recompute`: the no-grad forward the trainer runs (`Trainer.recompute_prox_logp`);
- `prox/<method>-<schedule>`: the trainer's approximation path (`Trainer.approximate_prox`)
  over the same micro-batches, i.e. what one training step spends on it;
- `step/<algo>`: the whole `Trainer.step` per algo;
- `rollout`: `HFEngine.generate` on the batch's prompts;
- `kernel/...`: `approximate_prox_logp` on flat tensors of N tokens, with and without its
  finite check, and the trainer's device-side finite flag; a large tensor copy whose GB/s
  gives the memory-bandwidth floor; AdamW's step, default against fused; the log-prob
  reduction over the vocabulary with and without the entropy.

Variants are interleaved (every repetition runs each once, starting one later each time)
after a warm-up: on a shared machine the load drifts over minutes, and measuring variants in
blocks would charge that drift to whichever ran last. Every `step` and `rollout` repetition
starts from the same weights and optimizer state (restored outside the timed region), so the
repetitions repeat one computation rather than a drifting one.

The batch is synthetic on purpose: random prompt/response token ids, behaviour log-probs
from the policy's own forward, and per-token versions giving a chosen staleness. The timing
of a step depends on shapes, not on what the tokens say, and no task is needed.

A benchmark measures; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from a3po.loss import token_logprobs, token_logprobs_and_entropy
from a3po.proximal import METHODS, SCHEDULES, approximate_prox_logp
from a3po.timer import PhaseTimer, synchronize
from a3po.trainer import RolloutBatch, Sample, Trainer, all_finite, pack_micro_batches

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
DOCS_PATH = REPO / "docs" / "benchmarks.md"
DEFAULT_ALGOS = ("coupled", "recompute", "loglinear", "linear")

# Dense bf16 tensor-core peaks (vendor datasheets), matched against torch.cuda.get_device_name
# in this order, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)

DOCS_HEADER = """# Benchmarks

Figures produced by `experiments/benchmark.py` (logic in `a3po/benchmark.py`). Each section
below is appended by a run, with the machine it ran on (CPU model, cores, torch version,
device) and the exact command, so every figure can be reproduced or re-measured. Times are
medians over interleaved repetitions; spreads are the interquartile range (IQR) and min/max.
"""


@dataclass
class BenchmarkOptions:
    """Everything that is not already in the composed training config (model, train.*, staleness)."""

    prompt_len: int = 48
    response_len: int = 32
    # Response lengths are uniform in [ceil((1 - spread) * response_len), response_len]: real
    # rollouts are ragged, and the padding the micro-batch packing leaves is part of the cost.
    length_spread: float = 0.5
    reps: int = 5
    warmup: int = 1
    algos: tuple[str, ...] = DEFAULT_ALGOS
    approx_methods: tuple[str, ...] = METHODS
    approx_schedules: tuple[str, ...] = tuple(SCHEDULES)
    kernel_tokens: tuple[int, ...] = (65_536, 1_048_576)
    rollout: bool = True
    # Sub-millisecond variants are repeated until one measurement lasts this long, so the
    # clock's resolution and the per-call jitter stay small against what is measured.
    min_kernel_seconds: float = 0.05
    bandwidth_mib: int = 256
    # AdamW's step over the policy's parameters, torch's default implementation against the
    # fused kernel the trainer uses; costs two more sets of Adam moments in memory.
    optimizer_kernels: bool = True
    label: str = ""
    progress: bool = True
    compare_trainer: str | None = None


@dataclass
class Variant:
    name: str
    kind: str  # rollout | prox | step | kernel
    run: Callable[[], dict[str, float]]
    before: Callable[[], None] | None = None  # untimed (state restore)
    info: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- config


def compose(overrides: Sequence[str] = (), conf_dir: Path = CONF_DIR) -> DictConfig:
    """The root training config with Hydra-style overrides; the task group is dropped because
    a benchmark batch needs no task (and must not depend on one being installed)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import a3po.config  # noqa: F401  (registers the run-name resolver)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["~task", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def parse_algo(spec: str) -> tuple[str, str]:
    """`loglinear` -> (loglinear, inverse); `loglinear:exponential` -> (loglinear, exponential)."""
    algo, _, schedule = spec.partition(":")
    return algo, schedule or "inverse"


def algo_label(spec: str) -> str:
    algo, schedule = parse_algo(spec)
    return algo if ":" not in spec else f"{algo}-{schedule}"


def load_group(group: str, name: str, conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        allowed = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        raise ValueError(f"{group}={name!r} is not allowed; allowed: {allowed}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def load_trainer_class(path: str | Path) -> type:
    """`Trainer` from a saved copy of a3po/trainer.py (e.g. `git show HEAD:a3po/trainer.py`),
    so a trainer change is measured against the old code in the same process, interleaved."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"a3po_baseline_trainer_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ValueError(f"--compare-trainer={str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module.Trainer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ----------------------------------------------------------------------------------- batch


def synthetic_batch(trainer: Trainer, *, vocab_size: int, n_prompts: int, n_samples: int, prompt_len: int,
                    response_len: int, length_spread: float, staleness: int, version: int,
                    token_budget: int, seed: int) -> RolloutBatch:
    """Random tokens, behaviour log-probs from the policy's own (no-grad) forward, and every
    response token stamped `version - staleness`. A group shares its prompt, as in GRPO."""
    if not 0.0 <= length_spread < 1.0:
        raise ValueError(f"length_spread={length_spread!r} is not allowed; it must be in [0, 1)")
    if version - staleness < 0:
        raise ValueError(f"version {version} - staleness {staleness} must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    shortest = max(1, math.ceil((1.0 - length_spread) * response_len))
    samples = []
    for group in range(n_prompts):
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=generator)
        for _ in range(n_samples):
            length = int(torch.randint(shortest, response_len + 1, (1,), generator=generator))
            response = torch.randint(0, vocab_size, (length,), generator=generator)
            samples.append(Sample(prompt_ids=prompt, response_ids=response, behave_logp=torch.zeros(length),
                                  versions=torch.full((length,), version - staleness, dtype=torch.long),
                                  group=group, reward=float(torch.rand((), generator=generator))))
    with torch.no_grad():
        for micro in pack_micro_batches({i: s.length for i, s in enumerate(samples)}, token_budget):
            logp, _ = trainer.response_logp([samples[i] for i in micro])
            for i, piece in zip(micro, logp.float().cpu().split([samples[i].response_ids.numel() for i in micro])):
                samples[i].behave_logp = piece.clone()
    return RolloutBatch(step=version, samples=samples, n_prompts=n_prompts, n_samples=n_samples)


def padding_stats(samples: list[Sample], plans: list[list[list[int]]]) -> dict[str, float]:
    """How much of each padded micro-batch (count x longest) is padding."""
    real = sum(samples[i].length for plan in plans for micro in plan for i in micro)
    padded = sum(len(micro) * max(samples[i].length for i in micro) for plan in plans for micro in plan)
    sizes = [len(micro) for plan in plans for micro in plan]
    return {"micro_batches": len(sizes), "samples_per_micro_batch_max": max(sizes),
            "real_tokens": real, "padded_tokens": padded, "padding_waste": 1.0 - real / padded}


# ----------------------------------------------------------------------------------- state


class TrainingState:
    """A copy of the weights and optimizer state, restored in place before each repetition.

    In place (copy_ into the live tensors) rather than load_state_dict: no allocation, and the
    optimizer keeps the tensors it already holds, as it would in a run.
    """

    def __init__(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.policy, self.optimizer = policy, optimizer
        with torch.no_grad():
            self.tensors = [t.detach().clone() for t in self._live_tensors()]
        self.optimizer_state = {
            param: {key: value.detach().clone() if torch.is_tensor(value) else value for key, value in state.items()}
            for param, state in optimizer.state.items()
        }

    def _live_tensors(self) -> list[torch.Tensor]:
        return [*self.policy.parameters(), *self.policy.buffers()]

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in zip(self._live_tensors(), self.tensors):
            live.copy_(saved)
        for param in list(self.optimizer.state):
            if param not in self.optimizer_state:
                del self.optimizer.state[param]
        for param, saved in self.optimizer_state.items():
            live = self.optimizer.state[param]
            for key, value in saved.items():
                if torch.is_tensor(value) and torch.is_tensor(live.get(key)) and live[key].shape == value.shape:
                    live[key].copy_(value)
                else:
                    live[key] = value.clone() if torch.is_tensor(value) else value
        self.policy.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Wall seconds, and this process's CPU seconds: on a CPU shared with other jobs the
    wall clock also counts the time the scheduler gave our core to someone else, the CPU
    clock does not (with one torch thread it is the uncontended wall time, cache and
    memory-bandwidth contention aside). On a GPU the wall clock is the measure."""

    seconds: float
    cpu_seconds: float
    out: Any = None

    def as_dict(self, **extra: float) -> dict[str, float]:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, **extra}


def timed(fn: Callable[[], Any], device: torch.device) -> Timing:
    """fn() timed with the device drained before and after (kernels are asynchronous)."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    synchronize(device)
    return Timing(time.perf_counter() - wall, time.process_time() - cpu, out)


def repeated(fn: Callable[[], Any], device: torch.device) -> Callable[[], dict[str, float]]:
    """A variant for a sub-millisecond call: calibrated on its first (warm-up) run to repeat
    `inner` times per measurement; reports seconds per call."""
    inner = {"n": 1}

    def run() -> dict[str, float]:
        timing = timed(lambda: [fn() for _ in range(inner["n"])], device)
        return {"seconds": timing.seconds / inner["n"], "cpu_seconds": timing.cpu_seconds / inner["n"],
                "inner": float(inner["n"])}

    def calibrate(min_seconds: float) -> None:
        one = timed(fn, device).seconds
        inner["n"] = int(min(100_000, max(1, math.ceil(min_seconds / max(one, 1e-7)))))

    run.calibrate = calibrate  # type: ignore[attr-defined]
    return run


def summarize(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "q25": q1, "q75": q3, "iqr": q3 - q1,
            "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def interleaved(variants: list[Variant], *, reps: int, warmup: int, device: torch.device,
                min_kernel_seconds: float, progress: bool) -> dict[str, list[dict[str, float]]]:
    """Run every variant `warmup` times (discarded), then `reps` rounds of all of them, each
    round starting one variant later so no variant always follows the same neighbour."""
    from tqdm.auto import tqdm

    results: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    total = (max(warmup, 1) + reps) * len(variants)
    with tqdm(total=total, desc="benchmark", unit="run", disable=not progress, dynamic_ncols=True) as bar:
        for round_index in range(max(warmup, 1) + reps):
            is_warmup = round_index < max(warmup, 1)
            shift = 0 if is_warmup else (round_index - max(warmup, 1)) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                bar.set_postfix_str(("warm-up " if is_warmup else "") + variant.name)
                if variant.before is not None:
                    variant.before()
                if round_index == 0 and hasattr(variant.run, "calibrate"):
                    variant.run.calibrate(min_kernel_seconds)  # type: ignore[attr-defined]
                sample = variant.run()
                if not is_warmup:
                    results[variant.name].append(sample)
                bar.update(1)
    return results


class TrafficCounter:
    """Bytes read and written by every aten op run under it (inputs + outputs, as eager
    execution moves them): the memory traffic of an unfused implementation."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = [v for v in (*_flat(args), *_flat(kwargs or {})) if torch.is_tensor(v)]
                outputs = [v for v in _flat(out) if torch.is_tensor(v)]
                input_storages = {v.untyped_storage().data_ptr() for v in inputs}
                if outputs and all(v.untyped_storage().data_ptr() in input_storages for v in outputs):
                    return out  # a view (detach, reshape): no data moves
                counter.ops += 1
                counter.bytes += sum(v.numel() * v.element_size() for v in (*inputs, *outputs))
                counter.largest = max(counter.largest, *(v.numel() for v in outputs), 0)
                return out

        self.ops = 0
        self.bytes = 0
        self.largest = 0  # elements of the largest tensor an op wrote
        self.mode = _Mode()

    def __enter__(self) -> "TrafficCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def _flat(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat(item)
    else:
        yield value


# ----------------------------------------------------------------------------------- machine


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    return info


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def memory_bandwidth_variant(device: torch.device, mib: int) -> tuple[Variant, int]:
    """A large copy: bytes read + written per second is the streaming bandwidth the
    approximation's floor is divided by."""
    n = mib * 2**20 // 4
    source = torch.rand(n, device=device)
    target = torch.empty_like(source)
    moved = 2 * n * 4
    run = repeated(lambda: target.copy_(source), device)
    return Variant("kernel/copy", "kernel", run, info={"bytes": moved}), moved


def optimizer_variants(policy: torch.nn.Module, device: torch.device, train_cfg) -> list[Variant]:
    """One AdamW step over the live parameters with fixed random gradients, default vs fused.

    The steps move the live weights; every `step` and `rollout` repetition restores them first,
    and `prox/recompute`'s timing does not depend on their values.
    """
    params = [p for p in policy.parameters() if p.requires_grad]
    generator = torch.Generator(device=device).manual_seed(7)
    grads = [torch.randn(p.shape, device=device, dtype=p.dtype, generator=generator) * 1e-3 for p in params]
    kwargs = dict(lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
                  weight_decay=train_cfg.weight_decay)
    implementations = {"default": torch.optim.AdamW(params, **kwargs)}
    try:
        implementations["fused"] = torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        pass
    n_params = sum(p.numel() for p in params)

    def set_grads() -> None:
        for param, grad in zip(params, grads):
            param.grad = grad

    variants = []
    for name, optimizer in implementations.items():
        variants.append(Variant(f"kernel/adamw_{name}@{n_params}", "kernel",
                                lambda optimizer=optimizer: timed(optimizer.step, device).as_dict(),
                                before=set_grads, info={"params": n_params}))
    return variants


# ----------------------------------------------------------------------------------- main logic


def run_benchmark(cfg: DictConfig, options: BenchmarkOptions, *, command: str = "",
                  conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """Build the model, the batch and every variant; measure; return the report dict."""
    from a3po.models import load_policy

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_policy(cfg.model, device=device, seed=cfg.seed)
    n_params = sum(p.numel() for p in policy.parameters())
    timer = PhaseTimer(device)
    staleness = int(cfg.staleness)
    version = staleness + 1  # behaviour version 1 (never the prompt-only version -1)
    train_cfg = cfg.train

    def make_trainer(trainer_cls: type, algo: str, schedule: str | dict, trainer_timer: PhaseTimer) -> Trainer:
        schedule_cfg = schedule if isinstance(schedule, dict) else load_group("schedule", schedule, conf_dir)
        return trainer_cls(policy, algo_cfg=OmegaConf.create(load_group("algo", algo, conf_dir)),
                           schedule_cfg=schedule_cfg, train_cfg=train_cfg, temperature=cfg.rollout.temperature,
                           pad_id=tokenizer.pad_token_id, device=device, timer=trainer_timer)

    # One trainer per algo and per trainer implementation (the current one, and a saved copy
    # to compare against). Trainers of one implementation share one optimizer: they would hold
    # identical state, and one copy of Adam's moments (twice the weights) is what a 1.5B model
    # on one GPU can afford.
    groups: dict[str, dict[str, Trainer]] = {"": {}}
    if options.compare_trainer:
        groups["@baseline"] = {}
    for suffix, group in groups.items():
        trainer_cls = Trainer if not suffix else load_trainer_class(options.compare_trainer)
        for spec in options.algos:
            algo, schedule = parse_algo(spec)
            group[algo_label(spec)] = make_trainer(trainer_cls, algo, schedule, timer)
        shared = next(iter(group.values())).optimizer
        for trainer in group.values():
            trainer.optimizer = shared
    trainers = groups[""]
    first = next(iter(trainers.values()))
    reference = make_trainer(Trainer, "recompute", {"name": "inverse"}, PhaseTimer(device))
    reference.optimizer = first.optimizer

    batch = synthetic_batch(reference, vocab_size=policy.config.vocab_size, n_prompts=train_cfg.n_prompts,
                            n_samples=train_cfg.n_samples, prompt_len=options.prompt_len,
                            response_len=options.response_len, length_spread=options.length_spread,
                            staleness=staleness, version=version, token_budget=train_cfg.token_budget,
                            seed=cfg.seed)
    samples = batch.samples
    plan_seed = cfg.seed + 17
    plans = reference.plan(samples, torch.Generator().manual_seed(plan_seed))
    tokens = sum(s.length for s in samples)
    response_tokens = sum(s.response_ids.numel() for s in samples)

    # Prime each optimizer (Adam's moments exist from the first step on), then keep the
    # initial weights and that optimizer state as every repetition's starting point.
    initial_weights = TrainingState(policy, first.optimizer)
    start_states: dict[str, TrainingState] = {}
    for suffix, group in groups.items():
        primer = next(iter(group.values()))
        primer.step(batch, version=version, generator=torch.Generator().manual_seed(plan_seed))
        timer.pop()
        initial_weights.restore()
        start_states[suffix] = TrainingState(policy, primer.optimizer)
    del initial_weights
    initial = start_states[""]
    start_states[""].restore()

    variants: list[Variant] = []
    if options.rollout:
        from a3po.rollout.hf import HFEngine

        engine = HFEngine(policy, tokenizer, temperature=cfg.rollout.temperature, top_p=cfg.rollout.get("top_p", 1.0),
                          max_new_tokens=options.response_len, batch_size=cfg.rollout.get("batch_size"),
                          version=version)
        prompts = [samples[g * batch.n_samples].prompt_ids.tolist() for g in range(batch.n_prompts)]

        def rollout() -> dict[str, float]:
            timing = timed(lambda: engine.generate(prompts, batch.n_samples, seed=cfg.seed), device)
            generated = sum(g.response_ids.numel() for group in timing.out for g in group)
            return timing.as_dict(tokens=float(generated), tokens_per_s=generated / timing.seconds)

        variants.append(Variant("rollout", "rollout", rollout, before=initial.restore))

    variants.append(Variant(
        "prox/recompute", "prox",
        lambda: timed(lambda: reference.recompute_prox_logp(samples, plans), device).as_dict()))

    # The approximation's inputs, per micro-batch, on the device, as the trainer holds them.
    with torch.no_grad():
        recomputed = reference.recompute_prox_logp(samples, plans)
    micro_inputs = []
    for plan in plans:
        for micro in plan:
            micro_inputs.append((
                torch.cat([samples[i].behave_logp for i in micro]).to(device),
                torch.cat([recomputed[i] for i in micro]).to(device),
                torch.cat([samples[i].versions for i in micro]).to(device),
            ))
    approximators: dict[str, Trainer] = {}
    for method in options.approx_methods:
        for schedule in options.approx_schedules:
            approximators[f"{method}-{schedule}"] = make_trainer(Trainer, method, schedule, PhaseTimer(device))
    for label, trainer in approximators.items():
        trainer.optimizer = first.optimizer

        def approximate_step(trainer: Trainer = trainer) -> None:
            finite_flags: list[torch.Tensor] = []
            for behave, logp, versions in micro_inputs:
                trainer.approximate_prox(behave, logp, versions, version, finite_flags)
            trainer.check_prox_finite(finite_flags)

        variants.append(Variant(f"prox/{label}", "prox", repeated(approximate_step, device)))

    for suffix, group in groups.items():
        for label, trainer in group.items():
            def step(trainer: Trainer = trainer) -> dict[str, float]:
                timer.pop()
                generator = torch.Generator().manual_seed(plan_seed)
                timing = timed(lambda: trainer.step(batch, version=version, generator=generator), device)
                phases = timer.pop()
                return timing.as_dict(prox_logp=phases.get("time/prox_logp", 0.0), train=phases.get("time/train", 0.0),
                                      loss=timing.out["actor/loss"])

            variants.append(Variant(f"step/{label}{suffix}", "step", step, before=start_states[suffix].restore))

    if options.optimizer_kernels:
        variants += optimizer_variants(policy, device, train_cfg)

    # The log-prob/entropy reduction over the vocabulary at the response positions of the
    # largest micro-batch (the unit the trainer runs it on), forward and backward, with and
    # without the entropy: what the entropy costs on top.
    micro_tokens = max(sum(samples[i].response_ids.numel() for i in micro) for plan in plans for micro in plan)
    logits_dtype = reference.autocast_dtype or next(policy.parameters()).dtype  # what the lm_head returns
    vocab_logits = torch.randn(micro_tokens, policy.config.vocab_size, device=device,
                               generator=torch.Generator(device=device).manual_seed(cfg.seed + 31)).to(logits_dtype)
    vocab_targets = torch.randint(0, policy.config.vocab_size, (micro_tokens,), device=device)

    def logprob_pass(with_entropy: bool) -> None:
        logits = vocab_logits.detach().requires_grad_(True)
        logp = token_logprobs_and_entropy(logits, vocab_targets)[0] if with_entropy else token_logprobs(logits, vocab_targets)
        logp.sum().backward()

    variants.append(Variant(f"kernel/logprobs@{micro_tokens}", "kernel", repeated(lambda: logprob_pass(False), device),
                            info={"tokens": micro_tokens, "vocab": policy.config.vocab_size}))
    variants.append(Variant(f"kernel/logprobs+entropy@{micro_tokens}", "kernel",
                            repeated(lambda: logprob_pass(True), device),
                            info={"tokens": micro_tokens, "vocab": policy.config.vocab_size}))

    # Flat tensors for the bandwidth floor: the batch's own size and paper-scale sizes.
    bandwidth_variant, _ = memory_bandwidth_variant(device, options.bandwidth_mib)
    variants.append(bandwidth_variant)
    kernel_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    kernel_generator = torch.Generator().manual_seed(cfg.seed + 29)
    for n in sorted({response_tokens, *options.kernel_tokens}):
        behave = -torch.rand(n, generator=kernel_generator).to(device) * 5
        target = behave + torch.randn(n, generator=kernel_generator).to(device) * 0.1
        versions = torch.full((n,), version - staleness, dtype=torch.long, device=device)
        kernel_inputs[n] = (behave, target, versions)
        for method in ("loglinear", "linear"):
            for check in (True, False):
                name = f"kernel/{method}-inverse@{n}" + ("" if check else "/no_check")

                def call(method: str = method, check: bool = check, inputs=kernel_inputs[n]) -> None:
                    approximate_prox_logp(*inputs, version, method=method, check_finite=check)

                variants.append(Variant(name, "kernel", repeated(call, device),
                                        info={"tokens": n, "method": method, "check_finite": check}))
        # The trainer's deferred check: a device-side flag per micro-batch, read once per minibatch.
        variants.append(Variant(f"kernel/finite_flag@{n}", "kernel",
                                repeated(lambda inputs=kernel_inputs[n]: all_finite(inputs[0]), device),
                                info={"tokens": n}))

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    raw = interleaved(variants, reps=options.reps, warmup=options.warmup, device=device,
                      min_kernel_seconds=options.min_kernel_seconds, progress=options.progress)
    elapsed = time.perf_counter() - started

    machine = machine_info(device)
    machine["load_average_start"] = list(load_start) if load_start else None
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    results = {}
    for variant in variants:
        samples_of = raw[variant.name]
        keys = sorted({k for s in samples_of for k in s})
        results[variant.name] = {
            "kind": variant.kind,
            **{k: summarize([s[k] for s in samples_of]) for k in keys},
            "raw": samples_of,
            **({"info": variant.info} if variant.info else {}),
        }

    report = {
        "command": command,
        "label": options.label,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "model": {"name": cfg.model.name, "dtype": cfg.model.dtype, "params": n_params},
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()},
        "batch": {
            "n_prompts": batch.n_prompts, "n_samples": batch.n_samples, "prompt_len": options.prompt_len,
            "response_len_max": options.response_len, "length_spread": options.length_spread,
            "response_tokens": response_tokens, "tokens": tokens, "staleness": staleness, "version": version,
            "n_minibatches": int(train_cfg.n_minibatches), "token_budget": int(train_cfg.token_budget),
            **padding_stats(samples, plans),
        },
        "elapsed_s": elapsed,
        "results": results,
    }
    report["derived"] = derive(report, device, n_params, kernel_inputs, version)
    return report


def _median(report: dict, name: str, key: str = "seconds") -> float | None:
    entry = report["results"].get(name)
    return entry[key]["median"] if entry and key in entry else None


def derive(report: dict, device: torch.device, n_params: int,
           kernel_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], version: int) -> dict[str, Any]:
    """The headline ratios, the ceiling of the step-time ratio, throughput, and the bandwidth floor."""
    out: dict[str, Any] = {}
    results = report["results"]
    prox_recompute = _median(report, "prox/recompute")
    prox_loglinear = _median(report, "prox/loglinear-inverse")
    if prox_recompute and prox_loglinear:
        out["prox_ratio_recompute_over_loglinear"] = prox_recompute / prox_loglinear
        out["prox_ratio_recompute_over_loglinear_cpu"] = (_median(report, "prox/recompute", "cpu_seconds")
                                                          / _median(report, "prox/loglinear-inverse", "cpu_seconds"))
    step_recompute = _median(report, "step/recompute")
    step_loglinear = _median(report, "step/loglinear")
    if step_recompute and step_loglinear:
        out["step_ratio_recompute_over_loglinear"] = step_recompute / step_loglinear
        out["step_time_saved_fraction"] = 1.0 - step_loglinear / step_recompute
        # Paired: the two steps of one round ran a minute apart at most, so slow load drift
        # cancels in their ratio.
        paired = [r["seconds"] / l["seconds"] for r, l in zip(results["step/recompute"]["raw"],
                                                               results["step/loglinear"]["raw"])]
        out["step_ratio_paired_median"] = statistics.median(paired)
        out["step_ratio_min_over_min"] = (results["step/recompute"]["seconds"]["min"]
                                          / results["step/loglinear"]["seconds"]["min"])
        cpu_recompute = _median(report, "step/recompute", "cpu_seconds")
        cpu_loglinear = _median(report, "step/loglinear", "cpu_seconds")
        out["step_ratio_recompute_over_loglinear_cpu"] = cpu_recompute / cpu_loglinear
        if prox_recompute:
            prox_cpu = _median(report, "prox/recompute", "cpu_seconds")
            out["step_ratio_ceiling_cpu"] = cpu_recompute / (cpu_recompute - prox_cpu)
            out["step_ratio_over_ceiling_cpu"] = (out["step_ratio_recompute_over_loglinear_cpu"]
                                                  / out["step_ratio_ceiling_cpu"])
    if step_recompute:
        prox_in_step = _median(report, "step/recompute", "prox_logp")
        out["prox_in_step_recompute_s"] = prox_in_step
        out["step_ratio_ceiling"] = step_recompute / (step_recompute - prox_in_step)
        if "step_ratio_recompute_over_loglinear" in out:
            out["step_ratio_over_ceiling"] = out["step_ratio_recompute_over_loglinear"] / out["step_ratio_ceiling"]
    if step_loglinear:
        out["prox_in_step_loglinear_s"] = _median(report, "step/loglinear", "prox_logp")

    speedups = {}
    for name, entry in report["results"].items():
        baseline = report["results"].get(f"{name}@baseline")
        if entry["kind"] == "step" and baseline:
            speedups[name] = {
                "wall": baseline["seconds"]["median"] / entry["seconds"]["median"],
                "cpu": baseline["cpu_seconds"]["median"] / entry["cpu_seconds"]["median"],
                "paired_wall": statistics.median(b["seconds"] / e["seconds"] for b, e in zip(baseline["raw"], entry["raw"])),
            }
    if speedups:
        out["speedup_over_baseline"] = speedups
    adamw = {name.split("@")[0].removeprefix("kernel/adamw_"): entry for name, entry in results.items()
             if name.startswith("kernel/adamw_")}
    if "default" in adamw and "fused" in adamw:
        out["adamw_fused_speedup"] = {key: adamw["default"][key]["median"] / adamw["fused"][key]["median"]
                                      for key in ("seconds", "cpu_seconds")}
    plain = next((e["seconds"]["median"] for n, e in report["results"].items() if n.startswith("kernel/logprobs@")), None)
    with_entropy = next((e["seconds"]["median"] for n, e in report["results"].items()
                         if n.startswith("kernel/logprobs+entropy@")), None)
    if plain and with_entropy:
        out["entropy_extra_s"] = with_entropy - plain

    tokens = report["batch"]["tokens"]
    peak = peak_flops(device)
    throughput = {}
    for name, entry in report["results"].items():
        if entry["kind"] != "step":
            continue
        seconds = entry["seconds"]["median"]
        recomputes = name.split("@")[0] == "step/recompute"
        flops = 6 * n_params * tokens + (2 * n_params * tokens if recomputes else 0)
        row = {"tokens_per_s": tokens / seconds, "model_flops": flops}
        if peak:
            row["mfu"] = flops / seconds / peak
        throughput[name] = row
    if prox_recompute:
        throughput["prox/recompute"] = {"tokens_per_s": tokens / prox_recompute, "model_flops": 2 * n_params * tokens}
        if peak:
            throughput["prox/recompute"]["mfu"] = 2 * n_params * tokens / prox_recompute / peak
    out["throughput"] = throughput
    out["peak_flops"] = peak

    copy = report["results"].get("kernel/copy")
    if copy:
        bandwidth = copy["info"]["bytes"] / copy["seconds"]["median"]
        out["memory_bandwidth_GBps"] = bandwidth / 1e9
        out["memory_bandwidth_best_GBps"] = copy["info"]["bytes"] / copy["seconds"]["min"] / 1e9
        floors = {}
        for n, (behave, target, versions) in kernel_inputs.items():
            for method in ("loglinear", "linear"):
                measured = _median(report, f"kernel/{method}-inverse@{n}")
                unchecked = _median(report, f"kernel/{method}-inverse@{n}/no_check")
                # Each input read once and the output written once: what a fused kernel moves.
                minimal = (behave.numel() * behave.element_size() + target.numel() * target.element_size()
                           + versions.numel() * versions.element_size() + behave.numel() * 4)
                with TrafficCounter() as traffic:
                    approximate_prox_logp(behave, target, versions, version, method=method, check_finite=True)
                floor = minimal / bandwidth
                floors[f"{method}@{n}"] = {
                    "tokens": n, "bytes_minimal": minimal, "bytes_eager": traffic.bytes, "aten_ops": traffic.ops,
                    "largest_tensor_elements": traffic.largest,
                    "floor_s": floor, "eager_floor_s": traffic.bytes / bandwidth,
                    "measured_s": measured, "measured_no_check_s": unchecked,
                    "over_floor": measured / floor if measured else None,
                    "over_floor_no_check": unchecked / floor if unchecked else None,
                    "check_finite_cost_s": (measured - unchecked) if measured and unchecked else None,
                    "finite_flag_s": _median(report, f"kernel/finite_flag@{n}"),
                }
        out["bandwidth_floor"] = floors
    if "rollout" in report["results"]:
        out["rollout_tokens_per_s"] = report["results"]["rollout"]["tokens_per_s"]["median"]
    return out


# ----------------------------------------------------------------------------------- reports


def _ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def render_markdown(report: dict, *, heading_level: int = 2) -> str:
    b, m, d = report["batch"], report["machine"], report["derived"]
    hashes = "#" * heading_level
    title = (f"{hashes} {report['model']['name']} ({report['model']['dtype']}), {b['n_prompts']}x{b['n_samples']} samples, "
             f"prompt {b['prompt_len']}, response <= {b['response_len_max']}, {m['device']}, {report['date_utc']} UTC")
    if report.get("label"):
        title += f": {report['label']}"
    lines = [title, ""]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    load = m.get("load_average_start")
    lines.append(f"Machine: {m['cpu']}, {m['cpus_available']} of {m['cpu_count']} cores available, "
                 f"{m['torch_threads']} torch threads, torch {m['torch']}, transformers {m['transformers']}, "
                 f"device {m['device']}{gpu}" + (f"; load average {load[0]:.1f} at start, "
                                                 f"{m['load_average_end'][0]:.1f} at end" if load else "") + ".")
    lines.append("")
    lines += ["```", report["command"] or "(called from Python)", "```", ""]
    lines.append(f"Batch: {b['tokens']} tokens ({b['response_tokens']} response), staleness {b['staleness']}, "
                 f"{b['n_minibatches']} minibatches, token budget {b['token_budget']}: {b['micro_batches']} "
                 f"micro-batches, padding waste {b['padding_waste']:.1%} "
                 f"({b['padded_tokens']} padded for {b['real_tokens']} real tokens). "
                 f"{report['options']['reps']} interleaved repetitions after {max(report['options']['warmup'], 1)} "
                 f"warm-up; {report['elapsed_s']:.0f} s in all.")
    lines += ["", "| variant | median | IQR | min | max | CPU time median (IQR) | n |", "|---|---|---|---|---|---|---|"]
    for name, entry in report["results"].items():
        s, c = entry["seconds"], entry["cpu_seconds"]
        lines.append(f"| {name} | {_ms(s['median'])} | {_ms(s['iqr'])} | {_ms(s['min'])} | {_ms(s['max'])} | "
                     f"{_ms(c['median'])} ({_ms(c['iqr'])}) | {s['n']} |")
    lines.append("")
    steps = {k: v for k, v in report["results"].items() if v["kind"] == "step"}
    if steps:
        lines += ["| step | median | prox_logp in step | train in step |", "|---|---|---|---|"]
        for name, entry in steps.items():
            lines.append(f"| {name} | {_ms(entry['seconds']['median'])} | {_ms(entry['prox_logp']['median'])} | "
                         f"{_ms(entry['train']['median'])} |")
        lines.append("")
    derived = []
    if "prox_ratio_recompute_over_loglinear" in d:
        derived.append(f"- prox time, recompute / loglinear: {_ms(_median(report, 'prox/recompute'))} / "
                       f"{_ms(_median(report, 'prox/loglinear-inverse'))} = "
                       f"**{d['prox_ratio_recompute_over_loglinear']:.3g}x** (CPU time: "
                       f"{d['prox_ratio_recompute_over_loglinear_cpu']:.3g}x)")
    if "step_ratio_recompute_over_loglinear" in d:
        derived.append(f"- step time, recompute / loglinear: **{d['step_ratio_recompute_over_loglinear']:.3f}** "
                       f"(loglinear saves {d['step_time_saved_fraction']:.1%}); ceiling T_step/(T_step - T_prox) = "
                       f"{d['step_ratio_ceiling']:.3f}; measured / ceiling = {d['step_ratio_over_ceiling']:.3f}. "
                       f"Paired per round: {d['step_ratio_paired_median']:.3f}; min / min: "
                       f"{d['step_ratio_min_over_min']:.3f}. CPU time: **{d['step_ratio_recompute_over_loglinear_cpu']:.3f}**"
                       + (f", ceiling {d['step_ratio_ceiling_cpu']:.3f}, measured / ceiling "
                          f"{d['step_ratio_over_ceiling_cpu']:.3f}" if "step_ratio_ceiling_cpu" in d else ""))
    for name, speedup in d.get("speedup_over_baseline", {}).items():
        derived.append(f"- {name} vs {name}@baseline (`{report['options']['compare_trainer']}`): baseline / new = "
                       f"{speedup['wall']:.3f} (wall medians), {speedup['paired_wall']:.3f} (paired per round), "
                       f"{speedup['cpu']:.3f} (CPU time)")
    if "adamw_fused_speedup" in d:
        derived.append(f"- AdamW step, default / fused: {d['adamw_fused_speedup']['seconds']:.2f}x (wall), "
                       f"{d['adamw_fused_speedup']['cpu_seconds']:.2f}x (CPU time)")
    if "entropy_extra_s" in d:
        derived.append(f"- entropy on top of the log-probs (fwd + bwd over the vocabulary at the response positions): "
                       f"{_ms(d['entropy_extra_s'])}")
    for name, row in d.get("throughput", {}).items():
        mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
        derived.append(f"- {name}: {row['tokens_per_s']:.0f} tokens/s{mfu}")
    if "rollout_tokens_per_s" in d:
        derived.append(f"- rollout: {d['rollout_tokens_per_s']:.0f} generated tokens/s")
    if "memory_bandwidth_GBps" in d:
        derived.append(f"- memory bandwidth (copy of {report['options']['bandwidth_mib']} MiB, read + write): "
                       f"{d['memory_bandwidth_GBps']:.1f} GB/s median, {d['memory_bandwidth_best_GBps']:.1f} best")
    lines += derived
    if d.get("bandwidth_floor"):
        lines += ["", "| approximation | tokens | bytes (min / eager, ops) | floor | measured | x floor | "
                      "without check | x floor | finite flag |", "|---|---|---|---|---|---|---|---|---|"]
        for key, row in d["bandwidth_floor"].items():
            lines.append(
                f"| {key.split('@')[0]} | {row['tokens']} | {row['bytes_minimal']:,} / {row['bytes_eager']:,}, "
                f"{row['aten_ops']} | {_ms(row['floor_s'])} | {_ms(row['measured_s'])} | {row['over_floor']:.1f} | "
                f"{_ms(row['measured_no_check_s'])} | {row['over_floor_no_check']:.1f} | "
                f"{_ms(row['finite_flag_s'])} |")
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "benchmark.json", out_dir / "benchmark.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report, heading_level=1))
    return json_path, md_path


def append_to_docs(report: dict, docs_path: Path) -> None:
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    existing = docs_path.read_text() if docs_path.exists() else DOCS_HEADER
    docs_path.write_text(existing.rstrip("\n") + "\n\n" + render_markdown(report))


# ----------------------------------------------------------------------------------- CLI


def _csv(value: str) -> tuple[str, ...]:
    return tuple(item for item in value.split(",") if item)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time recompute vs A-3PO approximations, the training step per algo and the rollout.",
        epilog="Positional arguments are Hydra overrides of conf/config.yaml, e.g. model=smollm2_135m "
               "train.n_prompts=4 train.n_samples=4 train.n_minibatches=2 train.token_budget=2048 staleness=2 "
               "device=auto.")
    defaults = BenchmarkOptions()
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., train.*=..., staleness=..., device=...)")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--response-len", type=int, default=defaults.response_len, help="longest response")
    parser.add_argument("--length-spread", type=float, default=defaults.length_spread,
                        help="responses are uniform in [(1 - spread) * response_len, response_len]")
    parser.add_argument("--reps", type=int, default=defaults.reps)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--algos", type=_csv, default=defaults.algos,
                        help="comma-separated; algo or algo:schedule (e.g. loglinear:exponential)")
    parser.add_argument("--approx-methods", type=_csv, default=defaults.approx_methods)
    parser.add_argument("--approx-schedules", type=_csv, default=defaults.approx_schedules)
    parser.add_argument("--kernel-tokens", type=lambda v: tuple(int(x) for x in v.split(",") if x),
                        default=defaults.kernel_tokens, help="flat sizes for the bandwidth-floor comparison")
    parser.add_argument("--bandwidth-mib", type=int, default=defaults.bandwidth_mib)
    parser.add_argument("--min-kernel-seconds", type=float, default=defaults.min_kernel_seconds)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads; on a CPU shared with other jobs 1 is often fastest, "
                             "as OpenMP threads that wait on each other at every barrier lose their core")
    parser.add_argument("--no-rollout", action="store_true")
    parser.add_argument("--no-optimizer-kernels", action="store_true",
                        help="skip timing AdamW default vs fused (saves two sets of Adam moments of memory)")
    parser.add_argument("--compare-trainer", default=None,
                        help="a saved copy of a3po/trainer.py; its steps run as step/<algo>@baseline, interleaved")
    parser.add_argument("--label", default="", help="appended to the docs heading, e.g. 'before: ...'")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default outputs/benchmark/<name>)")
    parser.add_argument("--docs", type=Path, default=DOCS_PATH, help="markdown file the section is appended to")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None, *, program: str = "python -m a3po.benchmark") -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    options = BenchmarkOptions(
        prompt_len=args.prompt_len, response_len=args.response_len, length_spread=args.length_spread,
        reps=args.reps, warmup=args.warmup, algos=args.algos, approx_methods=args.approx_methods,
        approx_schedules=args.approx_schedules, kernel_tokens=args.kernel_tokens, rollout=not args.no_rollout,
        min_kernel_seconds=args.min_kernel_seconds, bandwidth_mib=args.bandwidth_mib, label=args.label,
        progress=not args.no_progress, compare_trainer=args.compare_trainer,
        optimizer_kernels=not args.no_optimizer_kernels)
    if options.reps < 1:
        raise SystemExit(f"--reps={options.reps} is not allowed; it must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads={args.threads} is not allowed; it must be >= 1")
        torch.set_num_threads(args.threads)
    cfg = compose(args.overrides)
    command = " ".join([program, *map(shlex.quote, argv)])
    report = run_benchmark(cfg, options, command=command)
    b = report["batch"]
    out_dir = args.out or Path(cfg.output_root) / "benchmark" / (
        f"{cfg.model.name}-{b['n_prompts']}x{b['n_samples']}-p{b['prompt_len']}-r{b['response_len_max']}")
    json_path, md_path = write_report(report, out_dir)
    if not args.no_docs:
        append_to_docs(report, args.docs)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}" + ("" if args.no_docs else f"; appended to {args.docs}"))
    return report


if __name__ == "__main__":
    main()
