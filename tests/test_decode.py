"""The HF engine's decode loop (a3po.rollout.decode): the sampler draws exactly the policy's
distribution (temperature, top-p) and returns its log-probs, the loop stops rows at their stop
token, the compute-dtype weights give autocast's logits bit for bit, and the behaviour
log-probs equal the trainer's own forward."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from a3po.rollout.decode import PreallocatedCache, decode, sample_next, top_p_keep
from a3po.rollout.weights import ComputeWeights

from conftest import CONF_DIR
from a3po.config import parse_config


def _oracle(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution transformers' `generate` samples from: its own warpers, then softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = logits.float()[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)[0].double()


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (cells of expected count >= 5)."""
    from scipy.stats import chi2

    n = counts.sum().item()
    keep = probs * n >= 5
    expected = probs[keep] * n
    observed = counts[keep].double()
    statistic = (((observed - expected) ** 2) / expected).sum().item()
    # what the small cells hold together is one more cell
    rest_expected, rest_observed = (probs[~keep] * n).sum().item(), counts[~keep].sum().item()
    cells = int(keep.sum())
    if rest_expected > 0:
        statistic += (rest_observed - rest_expected) ** 2 / rest_expected
        cells += 1
    return float(chi2.sf(statistic, cells - 1))


LOGITS = torch.tensor([2.0, 1.5, 0.3, 0.0, -1.0, -2.5, -4.0, float("-inf")])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.9), (1.0, 0.6)])
def test_the_sampler_draws_the_distribution_generate_draws(temperature, top_p):
    rows = 200_000
    generator = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(LOGITS.expand(rows, -1), generator, temperature=temperature, top_p=top_p)
    exact = _oracle(LOGITS, temperature, top_p)
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    assert counts[exact == 0].sum() == 0  # never a token the distribution excludes (top-p, -inf)
    assert _chi_square_p(counts, exact) > 1e-3
    # each sampled token's log-prob is its log-prob under that distribution, renormalised
    assert torch.allclose(logp.double(), exact.log()[tokens], atol=1e-6)


def test_top_p_keeps_what_transformers_keeps():
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        logits = torch.randn(64, generator=generator) * 3
        probs = torch.softmax(logits, -1)
        for top_p in (0.1, 0.5, 0.9, 0.99):
            sorted_probs, order = probs.sort(descending=True)
            ours = torch.zeros(64, dtype=torch.bool)
            ours[order] = top_p_keep(sorted_probs, top_p)
            assert torch.equal(ours, _oracle(logits, 1.0, top_p) > 0)


def test_the_sampler_is_seeded_and_costs_one_uniform_per_row():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    a = sample_next(logits, torch.Generator().manual_seed(7))
    b = sample_next(logits, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    generator = torch.Generator().manual_seed(7)
    sample_next(logits, generator)
    reference = torch.Generator().manual_seed(7)
    torch.rand(16, generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())  # 16 numbers drawn, not 16 x 1000


@pytest.mark.parametrize("uniform", [0.0, 1.0 - 2.0 ** -24])
def test_extreme_uniforms_never_draw_a_zero_probability_token(uniform, monkeypatch):
    """The uniform is scaled by the total mass and the search returns the first cumulative value
    strictly above it: the least and the greatest uniform land on tokens with mass."""
    logits = torch.tensor([[float("-inf"), 0.0, 0.0, float("-inf")]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, uniform, dtype=kw.get("dtype")))
    token, logp = sample_next(logits, torch.Generator())
    assert int(token) == (1 if uniform == 0.0 else 2)
    assert logp.item() == pytest.approx(math.log(0.5))


def test_the_preallocated_cache_holds_what_was_written():
    cache = PreallocatedCache(n_layers=2, capacity=5)
    k1, v1 = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    keys, values = cache.update(k1, v1, 0)
    assert keys.shape == (2, 3, 2, 4) and torch.equal(keys, k1) and torch.equal(values, v1)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, _ = cache.update(k2, v2, 0)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2))
    assert cache.get_seq_length(0) == 3 and cache.get_seq_length(1) == 0
    with pytest.raises(RuntimeError, match="KV cache full"):
        cache.update(torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4), 0)


# ---------------------------------------------------------------------- on a model
@pytest.fixture
def tiny():
    from a3po.models import load_policy

    policy, tokenizer = load_policy(OmegaConf.load(CONF_DIR / "model" / "tiny.yaml"), seed=0)
    with torch.no_grad():  # away from the initialisation, as after a few training steps
        noise = torch.Generator().manual_seed(1)
        for param in policy.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=noise))
    return policy, tokenizer


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    real = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        real[row, width - len(prompt):] = True
    return ids, real


def test_compute_weights_give_autocasts_logits_bit_for_bit(tiny):
    policy, _ = tiny
    weights = ComputeWeights(policy, torch.bfloat16)
    linear = [m for m in weights.module.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.bfloat16 for m in linear)
    assert weights.module.get_input_embeddings().weight.dtype == torch.float32  # untied from the lm_head
    # shared: the tensors that need no cast are the policy's own
    assert weights.module.get_input_embeddings().weight is policy.get_input_embeddings().weight
    ids = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(0))

    def logits(module):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return module(input_ids=ids).logits

    assert torch.equal(logits(weights.module), logits(policy))
    with torch.no_grad():
        for param in policy.parameters():
            param.mul_(1.01)
    assert not torch.equal(logits(weights.module), logits(policy))
    weights.refresh(policy)  # the weight sync
    assert torch.equal(logits(weights.module), logits(policy))


def test_a_private_copy_owns_every_tensor_and_loads_a_state_dict(tiny):
    policy, _ = tiny
    weights = ComputeWeights(policy, torch.bfloat16, private=True)
    owned = {id(p) for p in policy.parameters()}
    assert not any(id(p) in owned for p in weights.module.parameters())
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.5)
    weights.load_state({k: v.clone() for k, v in policy.state_dict().items()})
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(weights.module(input_ids=ids).logits, policy(input_ids=ids).logits)


def test_float32_shares_the_policy_itself(tiny):
    policy, _ = tiny
    assert ComputeWeights(policy, None).module is policy
    assert ComputeWeights(policy, None, private=True).module is not policy


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_rows_stop_at_their_stop_token_and_keep_it(tiny, attention):
    policy, tokenizer = tiny
    policy.config._attn_implementation = attention
    ids, real = _left_padded([[5, 6, 7], [8, 9], [10, 11, 12, 13]], tokenizer.pad_token_id)
    common = dict(pad_id=tokenizer.pad_token_id, temperature=1.0, top_p=1.0, autocast_dtype=None)
    free = decode(policy, ids, real, max_new_tokens=6, stop_ids=torch.tensor([], dtype=torch.long),
                  generator=torch.Generator().manual_seed(0), **common)
    assert free.tokens.shape == (3, 6) and free.lengths == [6, 6, 6] and free.finished == [False] * 3
    stop = free.tokens[0, 2]  # row 0's third token, as a stop token: same seed, same draws up to it
    stopped = decode(policy, ids, real, max_new_tokens=6, stop_ids=stop[None],
                     generator=torch.Generator().manual_seed(0), **common)
    first = int((free.tokens[0] == stop).nonzero()[0])
    assert stopped.lengths[0] == first + 1 and stopped.finished[0]
    assert torch.equal(stopped.tokens[0, :first + 1], free.tokens[0, :first + 1])
    assert torch.all(stopped.logp[0, first + 1:] == 0)
    everything = torch.arange(policy.config.vocab_size)
    at_once = decode(policy, ids, real, max_new_tokens=6, stop_ids=everything,
                     generator=torch.Generator().manual_seed(0), **common)
    assert at_once.tokens.shape == (3, 1) and at_once.lengths == [1, 1, 1] and at_once.finished == [True] * 3


def _engine_and_trainer_logp(tiny_cfg, precision, *overrides):
    """A batch from the engine (and the same seed's batch again), and the trainer's log-probs of it."""
    from a3po.learner.build import trainer_from
    from a3po.models import load_policy
    from a3po.rollout import build_engine
    from a3po.timer import PhaseTimer

    cfg = tiny_cfg(f"precision={precision}", "rollout.max_new_tokens=10", *overrides)
    policy, tokenizer = load_policy(cfg.model, seed=0)
    engine = build_engine(cfg.rollout, policy, tokenizer, torch.device("cpu"), precision=precision)
    prompts = [tokenizer.encode("What is 12 + 7? Answer:"), tokenizer.encode("Compute 3 * 9 please, now")]
    samples = [s for group in engine.generate(prompts, 3, seed=4) for s in group]
    again = [s for group in engine.generate(prompts, 3, seed=4) for s in group]
    trainer = trainer_from(parse_config(cfg), policy, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), timer=PhaseTimer())
    with torch.no_grad():
        logp, _ = trainer.response_logp(samples, with_entropy=False)
    return samples, again, torch.cat([s.behave_logp for s in samples]), logp


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-4), ("bf16", 0.1)])
def test_behave_logp_equals_the_trainers_forward(tiny_cfg, precision, tolerance, monkeypatch):
    """The engine's log-probs against `Trainer.response_logp` on its own samples: float32 to
    1e-4 (the trainer's check), bf16 to the bf16 run's tolerance (tests/test_precision.py)."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
    samples, again, behave, logp = _engine_and_trainer_logp(tiny_cfg, precision, "rollout.temperature=0.8")
    assert behave.numel() >= 6 * 5
    assert (logp - behave).abs().max().item() < tolerance
    assert all(torch.equal(a.response_ids, b.response_ids) and torch.equal(a.behave_logp, b.behave_logp)
               for a, b in zip(samples, again))  # seeded: the same batch


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-4), ("bf16", 0.1)])
def test_top_p_log_probs_are_renormalised(tiny_cfg, precision, tolerance, monkeypatch):
    """Under top-p the engine's log-prob is the truncated distribution's: never below the
    trainer's, which scores the untruncated policy."""
    monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda: True)
    _, _, behave, logp = _engine_and_trainer_logp(tiny_cfg, precision, "rollout.top_p=0.95", "rollout.temperature=0.9")
    assert behave.numel() >= 6 * 5
    assert torch.all(behave >= logp - tolerance)


def _decode_tiny(policy, tokenizer, prompts, *, rows_of=None, autocast_dtype=None, seed=0, max_new_tokens=8):
    """Every 16th token id stops a row: a random tiny model stops a row every ~16 tokens."""
    ids, real = _left_padded(prompts, tokenizer.pad_token_id)
    stop_ids = torch.arange(0, policy.config.vocab_size, 16)
    return decode(policy, ids, real, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                  pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed), temperature=1.0,
                  top_p=1.0, autocast_dtype=autocast_dtype, rows_of=rows_of)


def test_a_shared_prefill_samples_what_one_prefill_per_row_samples(tiny):
    """A GRPO group's prompt is prefilled once and its cache copied to each sample's row."""
    policy, tokenizer = tiny
    prompts = [[5, 6, 7, 8], [9, 10]]
    shared = _decode_tiny(policy, tokenizer, prompts, rows_of=torch.tensor([0, 0, 0, 1, 1, 1]))
    apart = _decode_tiny(policy, tokenizer, [prompts[0]] * 3 + [prompts[1]] * 3)
    assert torch.equal(shared.tokens, apart.tokens) and shared.lengths == apart.lengths
    torch.testing.assert_close(shared.logp, apart.logp, rtol=0, atol=1e-5)


def test_stopped_rows_leave_the_batch_without_changing_the_others(tiny, monkeypatch):
    from a3po.rollout import decode as decode_module

    policy, tokenizer = tiny
    prompts = [[5, 6, 7, 8], [9, 10], [12, 14, 15], [3, 4]] * 2
    compacting = _decode_tiny(policy, tokenizer, prompts, max_new_tokens=24)
    assert 0 < min(compacting.lengths) < 24 and sum(compacting.finished) >= 2  # rows did stop early
    monkeypatch.setattr(decode_module, "COMPACT_AT", 1.0)  # never drop a row
    whole = _decode_tiny(policy, tokenizer, prompts, max_new_tokens=24)
    assert torch.equal(compacting.tokens, whole.tokens) and compacting.lengths == whole.lengths
    torch.testing.assert_close(compacting.logp, whole.logp, rtol=0, atol=1e-5)


def test_a_bf16_cache_holds_what_autocast_would_cast(tiny, monkeypatch):
    """Keys stored in bf16 when written are the values autocast casts them to at every step."""
    from a3po.rollout import decode as decode_module

    policy, tokenizer = tiny
    weights = ComputeWeights(policy, torch.bfloat16)
    prompts = [[5, 6, 7, 8], [9, 10], [12, 14, 15]]
    stored = _decode_tiny(weights.module, tokenizer, prompts, autocast_dtype=torch.bfloat16)
    original = decode_module.PreallocatedCache
    monkeypatch.setattr(decode_module, "PreallocatedCache", lambda n, capacity, dtype: original(n, capacity))
    cast_each_step = _decode_tiny(weights.module, tokenizer, prompts, autocast_dtype=torch.bfloat16)
    assert torch.equal(stored.tokens, cast_each_step.tokens) and torch.equal(stored.logp, cast_each_step.logp)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_grouped_attention_samples_what_eager_samples(tiny, autocast_dtype, monkeypatch):
    """The loop's attention (grouped by key-value head, a3po.rollout.attention) against
    transformers' eager attention in its place: the same tokens, log-probs to float32's (bf16's)
    rounding, and the model's config as it was."""
    import contextlib

    from a3po.rollout import decode as decode_module

    policy, tokenizer = tiny
    module = ComputeWeights(policy, autocast_dtype).module
    prompts = [[5, 6, 7, 8], [9, 10], [12, 14, 15], [3, 4]]
    grouped = _decode_tiny(module, tokenizer, prompts, autocast_dtype=autocast_dtype, max_new_tokens=16)
    assert module.config._attn_implementation == "eager"
    monkeypatch.setattr(decode_module, "grouped_eager", lambda model: contextlib.nullcontext())
    eager = _decode_tiny(module, tokenizer, prompts, autocast_dtype=autocast_dtype, max_new_tokens=16)
    assert torch.equal(grouped.tokens, eager.tokens) and grouped.lengths == eager.lengths
    torch.testing.assert_close(grouped.logp, eager.logp, rtol=0, atol=1e-5 if autocast_dtype is None else 2e-2)
