"""One RL step's work, phase by phase, from the model's shapes and the step's token counts:
FLOPs and bytes (pure counts), and the seconds they take on a device at given efficiencies.

Counts, for a dense decoder (a3po.memory.parts.Architecture) with N non-embedding
parameters in its layers, hidden size h, L layers, vocabulary V, over sequences of prompt P
and response R tokens (R̄ the mean, R_max the longest):

- a forward over the trained tokens (the recompute forward; the trainer's forward):
  2 N (P + R̄) per sequence, causal attention 4 h L S(S+1)/2 with S = P + R̄, and the output
  layer 2 h V at the response positions only (a3po.benchmark.derive.forward_flops, the same
  formula the benchmark's MFU uses);
- training: the forward, a backward of twice it, and one more forward where activations are
  checkpointed;
- the rollout's prefill: 2 N P per sequence, attention over P, the output layer once per
  sequence; its decode: per generated token 2 N + 2 h V plus attention over the context so far,
  R_max steps, each reading the weights once and every sequence's KV cache;
- an AdamW step with float32 master weights: 16 bytes read and 12 written per parameter (weight,
  gradient and the two moments; the moments and weight written back), once per minibatch;
- the weight sync: every parameter once, in the rollout's dtype, over the link between the
  trainer and the rollout devices (0 where they share memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from a3po.benchmark.derive import forward_flops as benchmark_forward_flops
from a3po.memory.parts import Architecture

__all__ = ["StepShape", "Efficiency", "Hardware", "forward_flops", "train_flops", "prefill_flops",
           "decode_flops", "decode_bytes", "decode_seconds", "optimizer_bytes", "sync_bytes", "phase_seconds", "PHASES"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAMW_BYTES_PER_PARAM = 28  # read weight, gradient, m, v (16); write weight, m, v (12), float32
PHASES = ("rollout", "prox_logp", "train", "optimizer", "weight_sync")


@dataclass(frozen=True)
class StepShape:
    """One step's token counts and how the trainer splits it."""

    prompts: int
    samples: int
    prompt_len: int
    response_len: float          # mean response tokens
    response_max: int            # the longest response: the rollout's decode steps
    minibatches: int = 1         # optimizer steps a step
    precision: str = "bf16"      # the compute dtype of the forwards
    checkpointing: bool = False  # activation checkpointing: one more forward in training
    padding: float = 0.0         # share of the trainer's computed tokens that is padding
    rollout_padded: bool = False  # a static decode batch (the HF engine): every sequence decodes R_max
    micro_batches: int = 0       # the trainer's micro-batches a step, all minibatches (0: one per minibatch)

    def __post_init__(self) -> None:
        if self.micro_batches < 0 or (self.micro_batches and self.micro_batches < self.minibatches):
            raise ValueError(f"StepShape.micro_batches must be 0 or at least minibatches={self.minibatches}, "
                             f"got {self.micro_batches!r}")
        for name in ("prompts", "samples", "prompt_len", "response_max", "minibatches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"StepShape.{name} must be a positive count, got {getattr(self, name)!r}")
        if not 0 < self.response_len <= self.response_max:
            raise ValueError(f"StepShape.response_len must be in (0, response_max={self.response_max}], "
                             f"got {self.response_len!r}")
        if not 0 <= self.padding < 1:
            raise ValueError(f"StepShape.padding must be in [0, 1), got {self.padding!r}")
        if self.precision not in DTYPE_BYTES:
            raise ValueError(f"StepShape.precision must be one of {sorted(DTYPE_BYTES)}, got {self.precision!r}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def passes(self) -> int:
        """Micro-batches the trainer runs a step (each pass over them pays `Efficiency`'s fixed
        cost per micro-batch)."""
        return self.micro_batches or self.minibatches


@dataclass(frozen=True)
class Hardware:
    """What one side of the step runs on: `devices` of a kind with these peaks."""

    flops: float           # peak dense FLOP/s of one device in the step's precision
    bandwidth: float       # memory bytes/s of one device
    devices: int = 1
    link: float = math.inf  # bytes/s from the trainer to the rollout (inf: shared memory, no copy)


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak per phase (MFU for compute, of bandwidth for memory), and the
    fixed costs the FLOPs do not see: per decode step (kernel launches, sampling, the engine's
    loop) and per micro-batch pass of the trainer (the weights' cast to the compute dtype under
    autocast, the loss and its bookkeeping, the framework's per-layer work)."""

    prefill: float = 0.5
    decode: float = 0.5             # of bandwidth, and of FLOP/s where decode is compute-bound
    decode_step_s: float = 0.0      # fixed seconds per decode step
    forward: float = 0.4            # the recompute forward's MFU
    train: float = 0.4              # the training forward + backward's MFU
    optimizer: float = 0.5          # of the reference bandwidth
    forward_pass_s: float = 0.0     # fixed seconds per micro-batch of the recompute forward
    train_pass_s: float = 0.0       # fixed seconds per micro-batch of the training pass

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "forward", "train", "optimizer"):
            value = getattr(self, name)
            # a share of peak FLOP/s is at most 1; a share of the reference bandwidth may pass 1
            # where the reference is conservative (a CPU copy pays write-allocate)
            most = 1 if name in ("prefill", "forward", "train") else 8
            if not 0 < value <= most:
                raise ValueError(f"Efficiency.{name} must be in (0, {most}], got {value!r}")
        for name in ("decode_step_s", "forward_pass_s", "train_pass_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Efficiency.{name} must be >= 0 seconds, got {getattr(self, name)!r}")


def non_embedding(arch: Architecture) -> int:
    """Parameters of the layers' matmuls: what every token multiplies (the output layer apart)."""
    return arch.num_hidden_layers * arch.layer_linear_params


def forward_flops(arch: Architecture, shape: StepShape) -> float:
    """One forward over the step's trained tokens, as the trainer runs it: the benchmark's own
    count (a3po.benchmark.derive.forward_flops) with the padded micro-batches' tokens and pairs
    computed, and the output layer at the real response positions only."""
    length, padded = shape.prompt_len + shape.response_len, 1 - shape.padding
    model = {"non_embedding_params": non_embedding(arch), "hidden": arch.hidden_size,
             "layers": arch.num_hidden_layers, "vocab": arch.vocab_size}
    batch = {"tokens": shape.sequences * length / padded, "response_tokens": shape.sequences * shape.response_len,
             "attention_pairs": shape.sequences * length * (length + 1) / 2 / padded}
    return benchmark_forward_flops(model, batch)


def train_flops(arch: Architecture, shape: StepShape) -> float:
    """Forward and backward (twice the forward), plus the recomputed forward of checkpointing."""
    return (3 + shape.checkpointing) * forward_flops(arch, shape)


def prefill_flops(arch: Architecture, shape: StepShape) -> float:
    p = shape.prompt_len
    per_sequence = (2 * non_embedding(arch) * p + 4 * arch.hidden_size * arch.num_hidden_layers * p * (p + 1) / 2
                    + 2 * arch.hidden_size * arch.vocab_size)
    return shape.sequences * per_sequence


def _decoded(shape: StepShape) -> float:
    return shape.response_max if shape.rollout_padded else shape.response_len


def decode_flops(arch: Architecture, shape: StepShape) -> float:
    """Every generated token: the layers, the output layer, attention over its context (R_max
    tokens a sequence in a static batch, whose finished sequences still decode)."""
    r, p = _decoded(shape), shape.prompt_len
    per_token = 2 * non_embedding(arch) + 2 * arch.hidden_size * arch.vocab_size
    context = r * p + r * (r - 1) / 2  # summed over the response's positions
    return shape.sequences * (r * per_token + 4 * arch.hidden_size * arch.num_hidden_layers * context)


def decode_bytes(arch: Architecture, shape: StepShape) -> tuple[float, float]:
    """(weights, KV cache) bytes the decode reads: the weights once per decode step (R_max
    steps) on every replica, each sequence's KV cache once per generated token."""
    width = DTYPE_BYTES[shape.precision]
    r, p = _decoded(shape), shape.prompt_len
    kv_per_position = 2 * arch.num_hidden_layers * arch.kv_dim * width
    return shape.response_max * arch.n_params * width, shape.sequences * kv_per_position * (r * p + r * (r - 1) / 2)


def decode_seconds(arch: Architecture, shape: StepShape, hw: Hardware, eff: Efficiency) -> float:
    """The decode on `hw.devices` data-parallel replicas: each reads the whole weights every step
    and its share of the KV cache, or computes its share, whichever is slower, plus the fixed
    cost of each decode step."""
    weights, kv = decode_bytes(arch, shape)
    memory = (weights + kv / hw.devices) / (hw.bandwidth * eff.decode)
    compute = decode_flops(arch, shape) / (hw.flops * hw.devices * eff.decode)
    return max(memory, compute) + shape.response_max * eff.decode_step_s


def optimizer_bytes(arch: Architecture, shape: StepShape) -> float:
    return shape.minibatches * ADAMW_BYTES_PER_PARAM * arch.n_params


def sync_bytes(arch: Architecture, shape: StepShape) -> float:
    return arch.n_params * DTYPE_BYTES[shape.precision]


def phase_seconds(arch: Architecture, shape: StepShape, trainer: Hardware, rollout: Hardware,
                  eff: Efficiency, algo: str) -> dict[str, float]:
    """Seconds per phase of one step of `algo` (recompute runs the extra forward; the others do
    not), each side's work split evenly over its devices."""
    if algo not in ("recompute", "loglinear"):
        raise ValueError(f"algo must be 'recompute' or 'loglinear', got {algo!r}")
    t_flops = trainer.flops * trainer.devices
    return {
        "rollout": prefill_flops(arch, shape) / (rollout.flops * rollout.devices * eff.prefill)
        + decode_seconds(arch, shape, rollout, eff),
        "prox_logp": forward_flops(arch, shape) / (t_flops * eff.forward) + shape.passes * eff.forward_pass_s
        if algo == "recompute" else 0.0,
        "train": train_flops(arch, shape) / (t_flops * eff.train) + shape.passes * eff.train_pass_s,
        "optimizer": optimizer_bytes(arch, shape) / (trainer.bandwidth * trainer.devices * eff.optimizer),
        "weight_sync": 0.0 if math.isinf(trainer.link) else sync_bytes(arch, shape) / trainer.link,
    }
