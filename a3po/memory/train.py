"""The training side of the memory estimate (a3po.memory.estimate): the largest micro-batch's
forward and backward, with or without activation checkpointing, autocast's weight casts, and
FSDP2's gathered weights under torchrun. Pure: numbers in, parts out."""

from __future__ import annotations

import math

from a3po.memory.parts import (ACTIVATION_BYTES, ACTIVATION_OUTSIDE_LAYERS, LOGITS_BYTES, LOGITS_CHUNK_BYTES,
                               Architecture, Part)

__all__ = ["TRAIN_KEYS", "TrainShape", "layer_tensor", "micro_batch_shape", "train_parts"]

TRAIN_KEYS = ("train.token_budget", "train.n_prompts", "train.n_samples", "train.n_minibatches", "rollout.max_new_tokens")
CHECKPOINT_KEYS = ("train.activation_checkpointing",) + TRAIN_KEYS  # what an unchecked run can lower
FSDP_KEYS = ("torchrun --nproc-per-node", "train.fsdp_mixed_precision", "model")


def layer_tensor(arch: Architecture, nbytes: int) -> int:
    """The size of a layer's largest weight matrix: what most of a per-parameter set of tensors
    (gradients, casts, a state dict's clone) is allocated in pieces of."""
    return arch.hidden_size * max(arch.intermediate_size, arch.num_attention_heads * arch.head_dim) * nbytes


def _logprob_chunk_rows(vocab: int) -> int:
    """Rows of logits the vocabulary pass (a3po.maths.logprobs) takes at once."""
    from a3po.maths import logprobs

    return logprobs.chunk_rows(vocab)


def micro_batch_shape(*, n_samples_total: int, n_minibatches: int, world: int, token_budget: int,
                      sequence: int) -> tuple[int, int]:
    """(rows, padded tokens) of the largest training micro-batch: the largest minibatch's
    share on one rank, packed to `token_budget` padded tokens (a3po.learner.batching), every
    sequence `sequence` tokens long."""
    per_minibatch = math.ceil(math.ceil(n_samples_total / n_minibatches) / world)
    rows = max(1, min(per_minibatch, token_budget // sequence))
    return rows, rows * sequence


class TrainShape:
    """How one rank trains: the largest micro-batch (`rows` x `sequence`, `response` of it
    scored), the compute dtype's bytes, and the memory keys (`train.activation_checkpointing`,
    `model.attn_implementation`, torchrun's world, `train.fsdp_mixed_precision`)."""

    def __init__(self, *, rows: int, sequence: int, response: int, compute: int, cast_bf16: bool, eager: bool,
                 checkpointing: bool = False, world: int = 1, fsdp_mixed: bool = False, weight_bytes: int = 4,
                 gemms_in_float32: bool = False) -> None:
        # bf16 GEMMs in float32 (a3po.gemms.Bf16GemmsInFloat32) keep float32 operands for backward
        self.gemms_in_float32 = gemms_in_float32 and cast_bf16
        self.saved = 4 if self.gemms_in_float32 else compute  # the saved activations' bytes
        # eager attention's probabilities: softmax's float32 output, and the copy the second
        # product keeps (bf16, or rounded and held in float32 where the GEMMs run in it)
        self.attention = ACTIVATION_BYTES[self.saved][2] + (4 if self.gemms_in_float32 else 0)
        self.rows, self.sequence, self.response, self.compute = rows, sequence, response, compute
        self.cast_bf16, self.eager, self.checkpointing = cast_bf16, eager, checkpointing
        self.world, self.fsdp_mixed, self.weight_bytes = world, fsdp_mixed and world > 1, weight_bytes

    @property
    def tokens(self) -> int:
        return self.rows * self.sequence

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: float32 under autocast over float32 weights (the embedding's
        output is float32 and the bf16 matmul outputs add to it), else the compute dtype."""
        return 4 if self.cast_bf16 and not self.fsdp_mixed else self.compute


def _activations(arch: Architecture, shape: TrainShape) -> Part:
    """The layers' saved activations (eager attention's probabilities included); checkpointed,
    each layer's input and one layer's activations while backward runs it again."""
    per_h, per_i, _ = ACTIVATION_BYTES[shape.saved]
    per_attention = shape.attention
    rows, sequence, tokens, layers = shape.rows, shape.sequence, shape.tokens, arch.num_hidden_layers
    per_token_layer = per_h * arch.hidden_size + per_i * arch.intermediate_size
    attention = rows * arch.num_attention_heads * sequence * sequence * per_attention if shape.eager else 0
    one_layer = tokens * per_token_layer + attention
    outside = tokens * ACTIVATION_OUTSIDE_LAYERS * arch.hidden_size
    largest = max(tokens * arch.intermediate_size * shape.saved, tokens * arch.hidden_size * 4,
                  rows * arch.num_attention_heads * sequence * sequence * 4 if shape.eager else 0)
    layer_formula = (f"{tokens} tokens ({rows} rows x {sequence}) x ({per_h} x {arch.hidden_size} + {per_i} x "
                     f"{arch.intermediate_size}) B"
                     + (f" + {rows} x {arch.num_attention_heads} heads x {sequence}^2 x {per_attention} B" if shape.eager
                        else ""))
    attention_key = ("model.attn_implementation",) if shape.eager else ()
    if shape.checkpointing:
        inputs = layers * tokens * arch.hidden_size * shape.residual_bytes
        return Part("training activations (checkpointed)", inputs + one_layer + outside, attention_key + TRAIN_KEYS,
                    "train",
                    "", f"{layers} layer inputs x {tokens} tokens x {arch.hidden_size} x {shape.residual_bytes} B + "
                    f"one layer's ({layer_formula})", tensor=largest)
    return Part("training activations", layers * one_layer + outside, CHECKPOINT_KEYS + attention_key, "train", "",
                f"{layers} layers x ({layer_formula})", tensor=largest)


def _fsdp_working_set(arch: Architecture, shape: TrainShape) -> Part:
    """FSDP2 under torchrun: the root's weights (embedding, final norm, an untied output layer)
    gathered for the whole forward and backward, two layers' gathered at a time (one computing,
    the next prefetched), and one layer's full gradient before its reduce-scatter."""
    gather = 2 if shape.fsdp_mixed else shape.weight_bytes
    root = arch.lm_head_params * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    layer = arch.layer_linear_params + 2 * arch.hidden_size
    nbytes = (root + 2 * layer) * gather + layer * 4
    return Part("FSDP2 gathered weights", nbytes, FSDP_KEYS, "train", "",
                f"(root {root:,} + 2 layers x {layer:,}) params x {gather} B + one layer's gradient x 4 B",
                tensor=layer_tensor(arch, gather))


def train_parts(arch: Architecture, shape: TrainShape, device: str) -> list[Part]:
    """The largest micro-batch's forward and backward on one rank: activations, the response
    positions' logits (a3po.learner.trainer `_response_logits`) with their gradient and one
    vocabulary-pass chunk (a3po.maths.logprobs), autocast's bf16 weight casts (kept for backward
    for the whole minibatch: every layer's, FSDP2 or not, unless FSDP2 gathers bf16 weights
    itself) and, under torchrun, FSDP2's gathered weights."""
    response_rows = shape.rows * shape.response
    chunk = min(response_rows, _logprob_chunk_rows(arch.vocab_size))
    logits = (response_rows * LOGITS_BYTES[shape.compute] + chunk * LOGITS_CHUNK_BYTES) * arch.vocab_size
    parts = [
        _activations(arch, shape),
        Part("training response logits", logits, TRAIN_KEYS, "train", "",
             f"{response_rows} response rows x {arch.vocab_size} vocab x {LOGITS_BYTES[shape.compute]} B + one chunk of "
             f"{chunk} rows x {LOGITS_CHUNK_BYTES} B", tensor=response_rows * arch.vocab_size * shape.compute),
    ]
    if shape.cast_bf16 and not shape.fsdp_mixed:
        cast = 4 if shape.gemms_in_float32 else 2  # rounded to bf16, held in float32 where the GEMMs run in it
        parts.append(Part("training autocast weight casts", arch.linear_params * cast, ("precision", "model.dtype", "model"),
                          "train", "", f"{arch.linear_params:,} linear params x {cast} B", tensor=layer_tensor(arch, cast)))
    if shape.world > 1:
        parts.append(_fsdp_working_set(arch, shape))
    return [Part(p.name, p.nbytes, p.keys, p.phase, device, p.formula, p.tensor) for p in parts]
