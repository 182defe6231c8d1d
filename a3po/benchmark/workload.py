"""What is measured: the options, the composed config, the policy, one trainer per algo, the
synthetic batch and the weights every repetition starts from."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

from a3po.allocator import retain_freed_memory
from a3po.batch import RolloutBatch, Sample
from a3po.device import resolve_device, resolve_precision
from a3po.errors import composition_error
from a3po.learner.trainer import Trainer
from a3po.learner.build import trainer_from
from a3po.maths.proximal import approximations
from a3po.maths.schedules import SCHEDULES
from a3po.run_config import Choice, RunConfig
from a3po.schema import as_plain
from a3po.timer import PhaseTimer

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
DEFAULT_ALGOS = ("coupled", "recompute", "loglinear", "linear")


def _option(default: Any, help_text: str | None = None) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass
class BenchmarkOptions:
    """Everything not already in the composed training config (model, train.*, staleness);
    the command line's flags are these fields (a3po.benchmark.cli)."""

    prompt_len: int = 48
    response_len: int = _option(32, "longest response")
    # Real rollouts are ragged, and the padding the micro-batch packing leaves is part of the cost.
    length_spread: float = _option(0.5, "responses are uniform in [(1 - spread) * response_len, response_len]")
    reps: int = 5
    warmup: int = 1
    algos: tuple[str, ...] = _option(DEFAULT_ALGOS, "comma-separated; algo or algo:schedule "
                                                    "(e.g. loglinear:exponential)")
    approx_methods: tuple[str, ...] = approximations()
    approx_schedules: tuple[str, ...] = tuple(SCHEDULES)
    kernel_tokens: tuple[int, ...] = _option((65_536, 1_048_576), "flat sizes for the bandwidth-floor comparison")
    bandwidth_mib: int = 256
    min_kernel_seconds: float = _option(0.05, "short variants are repeated in blocks until a measurement lasts "
                                              "this long (torch.utils.benchmark's min_run_time)")
    rollout: bool = True
    optimizer_kernels: bool = _option(True, "skip timing AdamW default vs fused (saves two sets of Adam moments "
                                            "of memory)")
    label: str = _option("", "appended to the report's heading, e.g. 'before: ...'")
    progress: bool = True


def compose(overrides: Sequence[str] = (), conf_dir: Path = CONF_DIR) -> RunConfig:
    """The root training config with Hydra-style overrides, validated as a run's start validates
    it (`parse_composed`) and typed (the benchmark's door); the task group is dropped because
    a benchmark batch needs no task (and must not depend on one being installed). Raises
    ConfigError, naming the key (or the group and its options where Hydra cannot compose)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import a3po.config  # noqa: F401  (registers the run-name resolver)

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            composed = hydra_compose(config_name="config", overrides=["~task", *overrides])
        return parse_composed(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise composition_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()


def parse_composed(composed: Mapping[str, Any]) -> RunConfig:
    """a3po.config.parse_config on the benchmark's config, with what does not apply to a
    benchmark left out: without a task group (dropped) the task is a partial config's,
    TaskConfig's defaults; and the rollout generates `--response-len` tokens, not
    `rollout.max_new_tokens` (probes.rollout_variant), so the run's rule `train.token_budget >
    rollout.max_new_tokens` gives way to the benchmark's own (cli.check_fits: prompt + response
    within the budget): checked at budget - 1, kept as given. Every other check is a run's."""
    from a3po.config import parse_config

    plain = as_plain({key: composed[key] for key in composed if key != "hydra"})
    budget, new_tokens = plain["train"].get("token_budget"), plain["rollout"].get("max_new_tokens")
    if not (all(isinstance(v, int) and not isinstance(v, bool) for v in (budget, new_tokens)) and 2 <= budget <= new_tokens):
        return parse_config(plain)
    config = parse_config({**plain, "rollout": {**plain["rollout"], "max_new_tokens": budget - 1}})
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, max_new_tokens=new_tokens),
                               resolved={**config.resolved, "rollout": plain["rollout"]})


@lru_cache(maxsize=None)
def parse_algo(spec: str) -> tuple[str, str]:
    """`loglinear` -> (loglinear, inverse); `loglinear:exponential` -> (loglinear, exponential)."""
    algo, _, schedule = spec.partition(":")
    return algo, schedule or "inverse"


def algo_label(spec: str) -> str:
    algo, schedule = parse_algo(spec)
    return algo if ":" not in spec else f"{algo}-{schedule}"


def make_trainer(cfg: RunConfig, policy: torch.nn.Module, tokenizer: Any, algo: str, schedule: str,
                 device: torch.device, timer: PhaseTimer, precision: str = "fp32") -> Trainer:
    """A trainer built as a3po.run.main builds it from the typed `cfg`, with `algo=<algo>
    schedule=<schedule>` composed as training composes them (the two axis groups are the one
    thing typed here: an axis choice is this benchmark's to make)."""
    chosen_algo, chosen_schedule = axis_choices(algo, schedule)
    run_cfg = cfg.with_values(algo=chosen_algo, schedule=chosen_schedule, precision=precision)
    return trainer_from(run_cfg, policy, pad_id=tokenizer.pad_token_id, device=device, timer=timer)


def axis_choices(algo: str, schedule: str) -> tuple[Choice, Choice]:
    """The `algo` and `schedule` groups as training composes them, typed."""
    composed = compose([f"algo={algo}", f"schedule={schedule}"])
    return composed.algo, composed.schedule


def synthetic_batch(trainer: Trainer, *, vocab_size: int, n_prompts: int, n_samples: int, prompt_len: int,
                    response_len: int, length_spread: float, staleness: int, version: int, seed: int) -> RolloutBatch:
    """Random tokens, every response token stamped `version - staleness`, behaviour log-probs
    from the policy's own no-grad forward (`Trainer.recompute_prox_logp`). A group shares its
    prompt, as in GRPO. A step's time depends on shapes, not on what the tokens say."""
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
            samples.append(Sample(prompt, torch.randint(0, vocab_size, (length,), generator=generator),
                                  torch.zeros(length), torch.full((length,), version - staleness, dtype=torch.long),
                                  reward=float(torch.rand((), generator=generator))))
    logp = trainer.recompute_prox_logp(samples, trainer.plan(samples, torch.Generator().manual_seed(seed)))
    for index, sample in enumerate(samples):
        sample.behave_logp = logp[index].float().cpu()
    return RolloutBatch(step=version, samples=samples, n_prompts=n_prompts, n_samples=n_samples)


def padding_stats(samples: list[Sample], plans: list[list[list[int]]]) -> dict[str, float]:
    """How much of each padded micro-batch (count x longest) is padding."""
    micro_batches = [micro for plan in plans for micro in plan]
    real = sum(samples[i].length for micro in micro_batches for i in micro)
    padded = sum(len(micro) * max(samples[i].length for i in micro) for micro in micro_batches)
    return {"micro_batches": len(micro_batches), "samples_per_micro_batch_max": max(map(len, micro_batches)),
            "real_tokens": real, "padded_tokens": padded, "padding_waste": 1.0 - real / padded}


class StartState:
    """The weights as they are now, restored in place (no allocation) before a repetition,
    and the optimizer's state zeroed in place (moments and step count): every timed step then
    computes what a run's first step computes, from the same weights, at the cost of a run's
    later steps. (Dropping the state instead made every timed step allocate and zero Adam's
    moments, as only a run's first step does.)"""

    def __init__(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.policy, self.optimizer = policy, optimizer
        self.saved = [tensor.detach().clone() for tensor in self._live()]

    def _live(self) -> list[torch.Tensor]:
        return [*self.policy.parameters(), *self.policy.buffers()]

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in zip(self._live(), self.saved):
            live.copy_(saved)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()
        self.policy.zero_grad(set_to_none=True)


@dataclass
class Workload:
    """The model, the trainers, the batch, its plans, and the state steps start from."""

    cfg: RunConfig  # typed once, at the benchmark's entry (a3po.benchmark.cli.main)
    options: BenchmarkOptions
    device: torch.device
    precision: str  # resolved (a3po.device), as a training run resolves it
    policy: torch.nn.Module
    tokenizer: Any
    reference: Trainer  # recompute, with a timer of its own: builds the batch, runs prox/recompute
    batch: RolloutBatch
    start: StartState
    timer: PhaseTimer = field(init=False)  # the step trainers': step variants read their phases from it
    plans: list[list[list[int]]] = field(init=False)
    trainers: dict[str, Trainer] = field(init=False)  # label -> trainer, all sharing one optimizer

    def __post_init__(self) -> None:
        self.timer = PhaseTimer(self.device)
        self.plans = self.reference.plan(self.samples, torch.Generator().manual_seed(self.plan_seed))
        self.trainers = {algo_label(spec): self.trainer(*parse_algo(spec), self.timer) for spec in self.options.algos}

    @property
    def samples(self) -> list[Sample]:
        return self.batch.samples

    @property
    def version(self) -> int:
        return self.batch.step

    @property
    def plan_seed(self) -> int:
        """The minibatch split's seed, apart from the batch's."""
        return int(self.cfg.seed) + 17

    def trainer(self, algo: str, schedule: str = "inverse", timer: PhaseTimer | None = None) -> Trainer:
        """A trainer on this workload's policy that shares the reference's optimizer."""
        trainer = make_trainer(self.cfg, self.policy, self.tokenizer, algo, schedule, self.device,
                               timer or PhaseTimer(self.device), self.precision)
        trainer.optimizer = self.start.optimizer
        return trainer


def build_workload(cfg: RunConfig, options: BenchmarkOptions) -> Workload:
    """The policy, the trainers (one shared optimizer: they would hold identical state, and one
    copy of Adam's moments is what a large model on one GPU affords), the synthetic batch at
    behaviour version 1 (never the prompt's -1), and the state every repetition starts from."""
    from a3po.models import load_policy

    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device, cfg.model.dtype)
    cfg = cfg.with_values(precision=precision)
    retain_freed_memory()  # as a training run does (a3po.run.main)
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_policy(cfg.model, device=device, seed=cfg.seed)
    reference = make_trainer(cfg, policy, tokenizer, "recompute", "inverse", device, PhaseTimer(device), precision)
    staleness = int(cfg.staleness)
    batch = synthetic_batch(reference, vocab_size=policy.config.vocab_size, n_prompts=cfg.train.n_prompts,
                            n_samples=cfg.train.n_samples, prompt_len=options.prompt_len,
                            response_len=options.response_len, length_spread=options.length_spread,
                            staleness=staleness, version=staleness + 1, seed=cfg.seed)
    return Workload(cfg, options, device, precision, policy, tokenizer, reference, batch,
                    StartState(policy, reference.optimizer))


def parameter_counts(policy: torch.nn.Module) -> dict[str, Any]:
    """All parameters (a tied weight once), and the non-embedding ones: without the input
    embedding and, where untied, without the output layer either, which `forward_flops`
    counts apart (at response positions only), so it is counted once tied or untied."""
    params = {id(p): p.numel() for p in policy.parameters()}
    embeddings = {id(p) for p in policy.get_input_embeddings().parameters()}
    output = policy.get_output_embeddings()
    if output is not None:
        embeddings |= {id(p) for p in output.parameters()}
    return {"params": sum(params.values()),
            "non_embedding_params": sum(n for key, n in params.items() if key not in embeddings),
            "tied_embeddings": output is not None and output.weight is policy.get_input_embeddings().weight}


def model_info(w: Workload) -> dict[str, Any]:
    """The model as the report records it; the FLOP counts are computed from it."""
    config = w.policy.config
    return {"name": w.cfg.model.name, "dtype": w.cfg.model.dtype, "precision": w.precision,
            **parameter_counts(w.policy),
            "hidden": int(config.hidden_size), "layers": int(config.num_hidden_layers), "vocab": int(config.vocab_size)}


def batch_info(w: Workload) -> dict[str, Any]:
    """The batch as the report records it: its shape, its tokens, its padding."""
    samples, train = w.samples, w.cfg.train
    return {"n_prompts": w.batch.n_prompts, "n_samples": w.batch.n_samples, "prompt_len": w.options.prompt_len,
            "response_len_max": w.options.response_len, "length_spread": w.options.length_spread,
            "response_tokens": sum(s.response_ids.numel() for s in samples), "tokens": sum(s.length for s in samples),
            # query-key pairs a causal attention uses, summed over sequences: its FLOPs' size
            "attention_pairs": sum(s.length * (s.length + 1) // 2 for s in samples),
            "staleness": int(w.cfg.staleness), "version": w.version, "n_minibatches": int(train.n_minibatches),
            "token_budget": int(train.token_budget), **padding_stats(samples, w.plans)}
