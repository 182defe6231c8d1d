"""What is measured: the options, the composed config, the policy, one trainer per algo, the
synthetic batch and the training state every repetition starts from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from a3po.batch import RolloutBatch, Sample
from a3po.device import resolve_device, resolve_precision
from a3po.maths.proximal import METHODS, SCHEDULES
from a3po.run.timer import PhaseTimer
from a3po.learner.trainer import Trainer, pack_micro_batches

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
DEFAULT_ALGOS = ("coupled", "recompute", "loglinear", "linear")


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


@lru_cache(maxsize=None)
def group_configs(algo: str, schedule: str) -> tuple[DictConfig, dict[str, Any]]:
    """`algo=<algo> schedule=<schedule>` as training composes them (conf defaults, no user
    overrides): the algo config and the schedule as a plain dict."""
    cfg = compose([f"algo={algo}", f"schedule={schedule}"])
    return cfg.algo, OmegaConf.to_container(cfg.schedule, resolve=True)


def parse_algo(spec: str) -> tuple[str, str]:
    """`loglinear` -> (loglinear, inverse); `loglinear:exponential` -> (loglinear, exponential)."""
    algo, _, schedule = spec.partition(":")
    return algo, schedule or "inverse"


def algo_label(spec: str) -> str:
    algo, schedule = parse_algo(spec)
    return algo if ":" not in spec else f"{algo}-{schedule}"


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
    for _ in range(n_prompts):
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=generator)
        for _ in range(n_samples):
            length = int(torch.randint(shortest, response_len + 1, (1,), generator=generator))
            response = torch.randint(0, vocab_size, (length,), generator=generator)
            samples.append(Sample(prompt_ids=prompt, response_ids=response, behave_logp=torch.zeros(length),
                                  versions=torch.full((length,), version - staleness, dtype=torch.long),
                                  reward=float(torch.rand((), generator=generator))))
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


class TrainingState:
    """A copy of the weights and optimizer state, restored in place before each repetition.

    In place (copy_ into the live tensors) rather than load_state_dict: no allocation, and the
    optimizer keeps the tensors it already holds, as it would in a run. Optimizer state that
    did not exist when the copy was taken is dropped.
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


@dataclass
class Workload:
    """The model, one trainer per algo, the batch, its plans, and the state steps start from."""

    cfg: DictConfig
    options: BenchmarkOptions
    device: torch.device
    policy: torch.nn.Module
    tokenizer: Any
    timer: PhaseTimer  # the step trainers' timer: step variants read their phases from it
    precision: str  # resolved (a3po.device), as a training run resolves it
    trainers: dict[str, Trainer]  # label -> trainer, sharing one optimizer
    reference: Trainer  # recompute, own timer: builds the batch and times the recompute forward
    batch: RolloutBatch
    plans: list[list[list[int]]]
    start: TrainingState
    staleness: int
    version: int
    plan_seed: int

    @property
    def samples(self) -> list[Sample]:
        return self.batch.samples


def make_trainer(cfg: DictConfig, policy: torch.nn.Module, tokenizer: Any, algo: str, schedule: str,
                 device: torch.device, timer: PhaseTimer, precision: str = "fp32") -> Trainer:
    """A trainer built as training builds it, for `algo` with the alpha `schedule`."""
    algo_cfg, schedule_cfg = group_configs(algo, schedule)
    return Trainer(policy, algo_cfg=algo_cfg, schedule_cfg=schedule_cfg, train_cfg=cfg.train,
                   temperature=cfg.rollout.temperature, pad_id=tokenizer.pad_token_id, device=device, timer=timer,
                   precision=precision)


def build_workload(cfg: DictConfig, options: BenchmarkOptions) -> Workload:
    """Load the policy, one trainer per algo (one shared optimizer: the trainers would hold
    identical state, and one copy of Adam's moments, twice the weights, is what a 1.5B model on
    one GPU can afford), the synthetic batch, and the state every step repetition starts from."""
    from a3po.models import load_policy

    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.get("precision", "auto"), device, cfg.model.get("dtype", "float32"))
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_policy(cfg.model, device=device, seed=cfg.seed)
    timer = PhaseTimer(device)
    staleness = int(cfg.staleness)
    version = staleness + 1  # behaviour version 1 (never the prompt-only version -1)
    trainers = {algo_label(spec): make_trainer(cfg, policy, tokenizer, *parse_algo(spec), device, timer, precision)
                for spec in options.algos}
    first = next(iter(trainers.values()))
    for trainer in trainers.values():
        trainer.optimizer = first.optimizer
    reference = make_trainer(cfg, policy, tokenizer, "recompute", "inverse", device, PhaseTimer(device), precision)
    reference.optimizer = first.optimizer
    batch = synthetic_batch(reference, vocab_size=policy.config.vocab_size, n_prompts=cfg.train.n_prompts,
                            n_samples=cfg.train.n_samples, prompt_len=options.prompt_len,
                            response_len=options.response_len, length_spread=options.length_spread,
                            staleness=staleness, version=version, token_budget=cfg.train.token_budget, seed=cfg.seed)
    plan_seed = cfg.seed + 17
    plans = reference.plan(batch.samples, torch.Generator().manual_seed(plan_seed))
    # One untimed step first, then back to the initial weights. The restore also drops the
    # optimizer state that step created, so every timed step starts, as a run's first step
    # does, by creating Adam's moments.
    start = TrainingState(policy, first.optimizer)
    first.step(batch, version=version, generator=torch.Generator().manual_seed(plan_seed))
    timer.pop()
    start.restore()
    return Workload(cfg=cfg, options=options, device=device, policy=policy, tokenizer=tokenizer, timer=timer,
                    precision=precision,
                    trainers=trainers, reference=reference, batch=batch, plans=plans, start=start,
                    staleness=staleness, version=version, plan_seed=plan_seed)
