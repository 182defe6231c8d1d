"""The HF engine's decode loop: what `generate` did, without what it cost.

Inside transformers' `generate` most of a CPU's time went around the matmuls: autocast
re-casting every float32 weight at every decode step, a sampler drawing one exponential per
vocabulary entry per row per token, a KV cache that grows by concatenation, and the stored
full-vocabulary scores of every step (profiles in docs/benchmarks.md, "Rollout at the
hardware's pace"). Here:

- the weights are the engine's: `a3po.rollout.weights.ComputeWeights` keeps a copy whose linear
  layers are stored in the compute dtype, refreshed at each weight sync, so autocast has nothing
  left to cast (a bf16 tensor's autocast cast is itself: the logits are bit for bit those of the
  float32 weights);
- `sample_next` draws one uniform per row against the cumulative distribution (top-p on the
  same sorted pass) and returns the sampled token's log-prob from the step's float32
  log-softmax, so nothing of size tokens x vocab outlives its step;
- `PreallocatedCache` writes each step's keys and values into buffers sized once for the
  longest sequence and hands attention a view of the filled part;
- eager attention runs grouped by key-value head (`a3po.rollout.attention`): the cache is read
  where it lies, not repeated for every query head at every layer and step.

The distribution sampled is exactly the one `generate` sampled (temperature, then top-p with
transformers' rule, no top-k), so `behave_logp` means what it always meant; the random stream
is not the same (`tests/test_decode.py` checks the distribution against exact probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from a3po.device import autocast
from a3po.rollout.attention import grouped_eager

__all__ = ["PreallocatedCache", "Decoded", "sample_next", "top_p_keep", "decode"]


# --------------------------------------------------------------------------- sampling
def top_p_keep(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the descending-sorted probabilities top-p keeps: transformers' rule (drop a
    token when the mass at or below it is <= 1 - top_p), written from the top: keep a token
    when the mass strictly above it is < top_p. The most likely token is always kept."""
    above = sorted_probs.cumsum(-1) - sorted_probs
    return above < top_p


def sample_next(logits: torch.Tensor, generator: torch.Generator | None = None, *, temperature: float = 1.0,
                top_p: float = 1.0, uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [rows, vocab] and its float32 log-prob under the
    distribution it was sampled from (temperature, then top-p, renormalised).

    One uniform per row, found in the cumulative distribution (accumulated in float64, so the
    last entry is the total mass to ~1e-16): O(rows) random numbers instead of O(rows x vocab).
    `uniform` [rows]: those numbers, drawn by the caller (else one each from `generator`).
    A token of probability 0 is never drawn: the uniform is scaled by the total, strictly below
    the last cumulative value, and the search returns the first entry strictly above it."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    log_z = torch.logsumexp(scores, dim=-1, keepdim=True)
    log_probs = scores - log_z
    probs = log_probs.exp()
    if uniform is None:
        uniform = torch.rand(scores.shape[0], generator=generator, device=scores.device, dtype=torch.float32)
    uniform = uniform[:, None]
    if top_p >= 1.0:
        cdf = probs.double().cumsum(-1)  # not cumsum(dtype=): its conversion is far slower on CPU
        index = torch.searchsorted(cdf, uniform.double() * cdf[:, -1:], right=True)
        tokens = index.clamp_(max=scores.shape[-1] - 1)
        return tokens.squeeze(-1), log_probs.gather(-1, tokens).squeeze(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = torch.where(top_p_keep(sorted_probs, top_p), sorted_probs, 0.0)
    cdf = kept.double().cumsum(-1)
    position = torch.searchsorted(cdf, uniform.double() * cdf[:, -1:], right=True).clamp_(max=scores.shape[-1] - 1)
    tokens = order.gather(-1, position)
    # log of the renormalised probability: log p - log(kept mass), both in float32 as the
    # log-softmax of the masked scores would give them
    kept_log_mass = torch.log(cdf[:, -1:].float())
    return tokens.squeeze(-1), (log_probs.gather(-1, tokens) - kept_log_mass).squeeze(-1)


# --------------------------------------------------------------------------- KV cache
class _PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers of `capacity` positions, allocated on the first
    write (its dtype and head count are the model's); `update` copies the new positions in and
    returns views of the filled part, so attention reads exactly the sequence so far."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.dtype = dtype
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]), dtype=self.dtype)
        self.values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions written, {self.capacity} allocated")
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity


class PreallocatedCache(Cache):
    """A transformers Cache whose layers never reallocate: no concatenation per decode step.

    `dtype`: store keys and values in it (None: as they come). Under bf16 autocast, attention's
    matmuls cast them to bf16 at every step; stored in bf16 they are cast once, when written, to
    the same values (the rotated keys arrive in float32)."""

    def __init__(self, n_layers: int, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[_PreallocatedLayer(capacity, dtype) for _ in range(n_layers)])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """The batch's new rows, by index into the current ones (stopped sequences leave; a
        prompt's cache goes to each of its samples): one copy of every layer."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)


# --------------------------------------------------------------------------- the loop
@dataclass
class Decoded:
    """A chunk's new tokens [rows, steps] (pad after a row's stop token), their log-probs
    (0 after the stop) and, per row, the number of tokens kept (stop token included) and
    whether it stopped."""

    tokens: torch.Tensor
    logp: torch.Tensor
    lengths: list[int]
    finished: list[bool]


def _prefill_mask(real: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The prefill's 4-D mask [rows, 1, width, width] from the prompt tokens `real` [rows, width]:
    causal, padding keys hidden; a padding query sees itself, so no softmax row is empty (its
    output is never read). Boolean for sdpa; additive (0 / dtype min) for eager, as
    transformers builds them."""
    width = real.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()
    allowed = causal[None] & real[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool, device=real.device)[None]
    return _as_mask(allowed[:, None], implementation, dtype)


def _as_mask(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


# Rows that have stopped are dropped from the batch once they are this share of it: each drop
# copies the KV cache, so not after every stop; measured in docs/benchmarks.md.
COMPACT_AT = 0.25


class _Rows:
    """The chunk's rows as the loop runs them: what each has sampled so far (indexed by chunk
    row), and for the rows still in the batch (`running`, chunk indices) whether each is still
    alive, which key positions are real, and the position its next token takes."""

    def __init__(self, rows: int, max_new_tokens: int, pad_id: int, keys_real: torch.Tensor,
                 next_position: torch.Tensor) -> None:
        device = keys_real.device
        self.tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logp = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
        self.stopped_at = torch.zeros(rows, dtype=torch.long, device=device)  # 0: still running
        self.running = torch.arange(rows, device=device)
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)
        self.keys_real, self.next_position, self.pad_id = keys_real, next_position, pad_id

    def record(self, step: int, token: torch.Tensor, token_logp: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
        """Store the step's samples (pad and 0 for rows already stopped); returns the tokens fed next."""
        token = torch.where(self.alive, token, self.pad_id)
        self.tokens[self.running, step] = token
        self.logp[self.running, step] = torch.where(self.alive, token_logp, 0.0)
        stops = self.alive & torch.isin(token, stop_ids)
        self.stopped_at[self.running] = torch.where(stops, step + 1, self.stopped_at[self.running])
        self.alive &= ~stops
        return token

    def leave(self, cache: PreallocatedCache, token: torch.Tensor) -> torch.Tensor:
        """Drop the stopped rows from the batch and the cache; returns the live rows' tokens."""
        keep = self.alive.nonzero().squeeze(1)
        cache.keep_rows(keep)
        self.running, self.alive = self.running[keep], self.alive[keep]
        self.keys_real, self.next_position = self.keys_real[keep], self.next_position[keep]
        return token[keep]

    def result(self, steps: int) -> Decoded:
        stopped_at = self.stopped_at.tolist()
        return Decoded(self.tokens[:, :steps], self.logp[:, :steps], [n if n else steps for n in stopped_at],
                       [n > 0 for n in stopped_at])


@torch.no_grad()
def decode(model: torch.nn.Module, input_ids: torch.Tensor, real: torch.Tensor, *, max_new_tokens: int,
           stop_ids: torch.Tensor, pad_id: int, generator: torch.Generator, temperature: float, top_p: float,
           autocast_dtype: torch.dtype | None, rows_of: torch.Tensor | None = None) -> Decoded:
    """Sample up to `max_new_tokens` per row, stopping a row at its first token in `stop_ids`
    and the loop when every row has stopped. Stopped rows leave the batch (`COMPACT_AT`).

    `input_ids` [prompts, width] are left-padded prompts (`real` marks their tokens); row r of
    the result continues prompt `rows_of[r]` (default: one row per prompt). Each prompt is
    prefilled once and its KV cache copied to its rows: a GRPO group's samples share a prompt.

    Positions count real tokens only (a left-padded row's first prompt token is position 0), as
    in the trainer's right-padded forward. The decoder and the output layer are called apart,
    as the trainer calls them (`Trainer._response_logits`), on the last position only. One
    host read a step: how many rows still run."""
    implementation = getattr(model.config, "_attn_implementation", "eager")
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"the HF engine's decode loop supports attention {ATTENTION_IMPLEMENTATIONS}, "
                         f"not {implementation!r}; load the model with one of them or use rollout.name=vllm")
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device, width = input_ids.device, input_ids.shape[1]
    rows_of = torch.arange(input_ids.shape[0], device=device) if rows_of is None else rows_of
    n_rows = rows_of.numel()
    cache = PreallocatedCache(model.config.num_hidden_layers, width + max_new_tokens, autocast_dtype)
    mask_dtype = decoder.get_input_embeddings().weight.dtype
    step_mask = _prefill_mask(real, implementation, mask_dtype)
    positions = (real.long().cumsum(-1) - 1).clamp_(min=0)
    rows = _Rows(n_rows, max_new_tokens, pad_id, next_position=positions[rows_of, -1:] + 1,
                 keys_real=torch.cat([real[rows_of], real.new_ones(n_rows, max_new_tokens)], dim=1))
    step_input, step_positions, step = input_ids, positions, 0
    with autocast(device, autocast_dtype), grouped_eager(model):
        for step in range(max_new_tokens):
            hidden = decoder(input_ids=step_input, attention_mask=step_mask, position_ids=step_positions,
                             past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            if step == 0:  # the prefill: each prompt once, then its cache and last state to its rows
                hidden = hidden.index_select(0, rows_of)
                cache.keep_rows(rows_of)
            # one uniform per row of the chunk, stopped or not: a row's draws do not depend on
            # which other rows still run, so leaving the batch changes no sample
            uniform = torch.rand(n_rows, generator=generator, device=device, dtype=torch.float32)[rows.running]
            token, token_logp = sample_next(lm_head(hidden), temperature=temperature, top_p=top_p, uniform=uniform)
            token = rows.record(step, token, token_logp, stop_ids)
            n_alive = int(rows.alive.sum())  # the loop's one host read a step
            if n_alive == 0:
                break
            if n_alive <= (1 - COMPACT_AT) * rows.alive.numel():
                token = rows.leave(cache, token)
            step_input, step_positions = token[:, None], rows.next_position
            rows.next_position = rows.next_position + 1
            step_mask = _as_mask(rows.keys_real[:, None, None, :width + step + 1], implementation, mask_dtype)
    return rows.result(step + 1)
