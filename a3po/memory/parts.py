"""The building blocks of the memory estimate (a3po.memory.estimate): the model's architecture as
numbers, the named parts an estimate is made of, how the phases' parts combine into a peak, and
the constants measured for them (docs/design.md, "Memory check": how, and on what). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["MIB", "GIB", "PHASES", "MMAP_THRESHOLD_MAX", "SMALL_ALLOCATION", "Architecture", "architecture_from", "SMOLLM2_135M", "PUBLISHED_CONFIGS", "Part",
           "Estimate", "format_bytes"]

MIB = 2**20
GIB = 2**30

# --- measured constants (docs/design.md, "Memory check": how, and on what) ----------------------
# The process before any weight loads: python, torch, transformers' Llama modules, hydra, a3po
# and the tokenizer imported and loaded: the midpoint of two machines' measurements (docs/design.md,
# the table of parts: "process baseline").
BASELINE_BYTES = 524 * MIB
# Training activations saved for backward, per token and per decoder layer, by the compute
# dtype's size in bytes (2: bf16 autocast, 4: float32): bytes per unit of hidden_size, per unit
# of intermediate_size, and (eager attention) per head per position of the sequence (the
# attention probabilities). Measured with torch.autograd.graph.saved_tensors_hooks on Llama
# layers of several widths: bf16 34 h + 8 I + 6 heads*seq, float32 40 h + 16 I + 4 heads*seq.
ACTIVATION_BYTES = {2: (34, 8, 6), 4: (40, 16, 4)}
# Per token outside the layers (embedding output, final norm, the response positions' hidden rows).
ACTIVATION_OUTSIDE_LAYERS = 16
# The response-position logits of a micro-batch, per row and vocabulary entry, by the compute
# dtype's size: the logits the vocabulary pass keeps for backward and their gradient, both in
# the compute dtype (a3po.maths.logprobs), and the lm_head backward's share. Fitted to the tiny
# model's peak RSS, where the vocabulary is all there is: 5.9-7 B under bf16, 9.6 B in float32.
LOGITS_BYTES = {2: 6, 4: 9}
# What one row chunk of the vocabulary pass holds on top (its float32 scores, exp, the entropy's
# log-probs and probabilities), per row of the chunk and vocabulary entry.
LOGITS_CHUNK_BYTES = 16
# One decode step of the HF engine, per row and vocabulary entry (a3po.rollout.decode
# `sample_next`): the logits in the compute dtype, their float32 copy, log-probs,
# probabilities, the float64 cumulative distribution and its float64 input; fitted to the tiny
# model's generate at 128 and 512 rows (30-35 B).
DECODE_VOCAB_BYTES = 32
# One sampled response as the runtime holds it (a3po.batch.Sample): four tensors' objects and
# allocations, measured 3.1 KB for a 45-token prompt and 32 new tokens; plus its data per token.
SAMPLE_BYTES = 2150
# The HF engine's prefill with eager attention, per row, head and prompt position squared: the
# scores in the compute dtype, their float32 softmax and its cast back, and the float32 mask.
PREFILL_ATTENTION_BYTES = 12

# bf16 on a CPU: the process grows by about this much per sequence length the decode loop runs
# at (oneDNN's bf16 kernels for each attention shape, kept for the process's life): measured
# 0.75 MiB per position on the tiny model's first generate, none under float32; SmolLM2-135M's
# grows on over its first few calls, to ~3.4 MiB per position (8 rows, 128 new tokens).
BF16_CPU_BYTES_PER_POSITION = 1 * MIB
# What glibc's heap holds at a phase's peak for every byte of its allocations under the mmap
# threshold (activations, gradients, casts, per-layer KV buffers): freed tensors leave holes
# that the next micro-batch's, of another shape, do not fit. Fitted to SmolLM2's peak RSS:
# 1.16 (micro-batches of one shape) to 1.52 (shapes varying with the response lengths).
HEAP_SLACK = 1.35
# What counts as a small allocation for that: glibc's own default ceiling for its heap.
SMALL_ALLOCATION = 32 * MIB

PHASES = ("always", "rollout", "train")
# glibc serves allocations of at least this size (its dynamic mmap threshold's ceiling on 64-bit)
# with mmap and returns them to the system when freed; smaller ones come from its heap, which
# keeps freed memory for the process's next allocations instead of returning it. A run raises
# the threshold (a3po.allocator); `Estimate.mmap_threshold` is the one the run will have.
MMAP_THRESHOLD_MAX = SMALL_ALLOCATION



# --- the architecture ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """What the estimate needs of a dense decoder-only transformer (llama, qwen2, mistral):
    every count follows from these, no weights needed."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool = False

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o (with q/k/v biases where the model has them) and the gated MLP."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        attention = 2 * h * q + 2 * h * self.kv_dim + (q + 2 * self.kv_dim if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        """Every nn.Linear's weights and biases, the output layer included even where it is tied
        to the embedding: a compute-dtype copy of the linear layers (the HF engine's, autocast's
        casts) has one for it either way."""
        return self.num_hidden_layers * self.layer_linear_params + self.lm_head_params

    @property
    def n_params(self) -> int:
        """Distinct parameters: the embedding, the layers (two norms each), the final norm, and
        the output layer where it is not tied."""
        h = self.hidden_size
        layers = self.num_hidden_layers * (self.layer_linear_params + 2 * h)
        return self.lm_head_params + layers + h + (0 if self.tie_word_embeddings else self.lm_head_params)


def architecture_from(config: Mapping[str, Any]) -> Architecture:
    """An Architecture from a transformers config as a mapping (config.json, or
    `PretrainedConfig.to_dict()`); a multimodal config's `text_config` where it has one.
    Raises KeyError naming a missing key."""
    config = config.get("text_config") or config
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return Architecture(
        vocab_size=int(config["vocab_size"]), hidden_size=hidden, intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        # transformers' own default where the file leaves it out is model-specific; untied is
        # the larger model
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")))


# SmolLM2-135M-Instruct as the converted cache's config.json gives it, for a machine where the
# GGUF has not been converted yet (the conversion takes tens of seconds; the check must not).
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True}


# The hub models the shipped experiments name, from their published config.json, for a machine
# that cannot reach the hub (planning a GPU run from a laptop or CI): the estimate then still
# refuses what cannot fit instead of skipping the check.
PUBLISHED_CONFIGS = {
    "Qwen/Qwen2.5-1.5B-Instruct": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                                   "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                   "tie_word_embeddings": True, "model_type": "qwen2"},
    "Qwen/Qwen2.5-7B-Instruct": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                                 "tie_word_embeddings": False, "model_type": "qwen2"},
}


@dataclass(frozen=True)
class Part:
    """One named share of the peak: its bytes, the config keys that drive it, the phase it is
    held in and the device it lives on; `formula` says how it was computed. `tensor` is its
    largest single allocation: on a CPU, memory freed from allocations under glibc's mmap
    threshold (`Estimate.mmap_threshold`) stays with the process (`Estimate.peak`)."""

    name: str
    nbytes: int
    keys: tuple[str, ...]
    phase: str = "always"
    device: str = "cpu"
    formula: str = ""
    tensor: int = 0


@dataclass(frozen=True)
class Estimate:
    """The parts, and how the phases combine into the peak (`peak`)."""

    parts: tuple[Part, ...]
    concurrent: bool = False
    mmap_threshold: int = MMAP_THRESHOLD_MAX

    def devices(self) -> list[str]:
        return sorted({p.device for p in self.parts})

    def _in(self, phase: str, device: str, heap: bool | None = None) -> list[Part]:
        return [p for p in self.parts if p.phase == phase and p.device == device
                and (heap is None or (p.tensor < self.mmap_threshold) == heap)]

    def phase_bytes(self, phase: str, device: str, heap: bool | None = None) -> int:
        return sum(p.nbytes for p in self._in(phase, device, heap))

    def _contributing(self, device: str) -> list[Part]:
        """The parts the peak on `device` is made of.

        runtime=async generates while it trains: every part. Otherwise the phases take turns,
        and what a phase frees stays with the process where the allocator keeps it. On a GPU,
        torch's caching allocator keeps every freed block and splits it for the next phase: the
        peak holds the larger phase. On a CPU, glibc's heap keeps what allocations under its
        mmap threshold freed, and the other phase's tensors, of other shapes, mostly do not fit
        the holes: both phases' heap shares add; allocations at or over the threshold are
        mmapped and returned, so only the larger phase's of those counts."""
        always = self._in("always", device)
        if self.concurrent:
            return always + self._in("rollout", device) + self._in("train", device)
        if device != "cpu":
            larger = max(("rollout", "train"), key=lambda ph: self.phase_bytes(ph, device))
            return always + self._in(larger, device)
        mapped = max(("rollout", "train"), key=lambda ph: self.phase_bytes(ph, device, heap=False))
        return always + self._in("rollout", device, heap=True) + self._in("train", device, heap=True) \
            + self._in(mapped, device, heap=False)

    def peak(self, device: str = "cpu") -> int:
        return sum(p.nbytes for p in self._contributing(device))

    def table(self, device: str = "cpu") -> str:
        """The estimate on `device` as a table, a part a line (`python -m a3po.run.memory_plan`)."""
        lines = [f"{'part':44s} {'phase':8s} {'size':>10s}  keys; formula"]
        for part in sorted(self.parts, key=lambda p: (PHASES.index(p.phase), -p.nbytes)):
            if part.device == device:
                lines.append(f"{part.name:44s} {part.phase:8s} {format_bytes(part.nbytes):>10s}  "
                             f"{', '.join(part.keys) or '-'}; {part.formula}")
        concurrent = " (phases concurrent: runtime=async)" if self.concurrent else ""
        lines.append(f"{'peak' + concurrent:44s} {'':8s} {format_bytes(self.peak(device)):>10s}")
        return "\n".join(lines)

    def peak_parts(self, device: str = "cpu") -> list[Part]:
        """The parts of the peak on `device`, largest first."""
        return sorted(self._contributing(device), key=lambda p: -p.nbytes)


# The device name of the estimate's shared-memory parts: a tmpfs of its own size (docker's default
# 64 MiB, a node's often half its memory), held against its own free space (a3po.memory.machine).
SHARED_MEMORY = "/dev/shm"


def format_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"
