"""AReaL's decoupled PPO loss (tests/oracles.py, the reference the library's loss is held to),
token log-probs/entropy and GRPO advantages."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import a3po.maths.logprobs as logprobs_module
from a3po.maths.advantages import grpo_advantages
from a3po.maths.logprobs import token_logprobs, token_logprobs_and_entropy
from oracles import ppo_actor_loss


def test_hand_computed_2x3():
    # ratios exp(logp - prox): 1.0, e^0.5=1.6487 (clipped above for A>0), e^-0.5=0.6065
    # (clipped below for A<0 -> in force? -A r = 0.6065 vs -A clip = 0.8 -> clipped is max -> clipped)
    logp = torch.tensor([[0.0, 0.5, -0.5], [0.1, -1.0, 0.0]], requires_grad=True)
    prox = torch.zeros(2, 3)
    behave = torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, 1.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = ppo_actor_loss(logp, prox, behave, adv, mask, eps_clip=0.2)
    # per token surrogate max(-A r, -A clip(r)) times w = exp(prox - behave)
    s00 = -1.0 * 1.0
    s01 = max(-1.0 * math.exp(0.5), -1.0 * 1.2)  # = -1.2, clipped
    s02 = max(1.0 * math.exp(-0.5), 1.0 * 0.8)  # = 0.8, clipped
    s10 = -2.0 * math.exp(0.1)  # r = 1.105 inside [0.8, 1.2]: not clipped
    s11 = max(-1.0 * math.exp(-1.0), -1.0 * 0.8) * 0.5  # w = exp(0 - log 2) = 0.5; = -0.3679*0.5
    expected = (s00 + s01 + s02 + s10 + s11) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_mask"].tolist() == [[False, True, True], [False, False, False]]
    assert stats["clipped_tokens"].item() == 2
    assert stats["clip_ratio"].item() == pytest.approx(2 / 5)
    assert stats["importance_weight/max"].item() == pytest.approx(math.exp(0.5))
    assert stats["importance_weight/min"].item() == pytest.approx(math.exp(-1.0))
    assert stats["behave_weight/min"].item() == pytest.approx(0.5)
    assert stats["behave_weight/max"].item() == pytest.approx(1.0)
    assert stats["importance_weight"][1, 2].item() == 0.0  # invalid token


def test_cap_drops_tokens_but_keeps_denominator():
    logp = torch.zeros(1, 2, requires_grad=True)
    prox = torch.tensor([[0.0, math.log(10.0)]])
    behave = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = ppo_actor_loss(logp, prox, behave, adv, mask, eps_clip=0.2, behave_weight_cap=5.0)
    assert loss.item() == pytest.approx(-1.0 / 2)  # only token 0 counts; still divided by 2
    assert stats["behave_weight/capped_tokens"].item() == 1
    assert stats["behave_weight/max"].item() == pytest.approx(10.0)


def test_eps_clip_higher_is_used_for_upper_bound():
    zeros = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.tensor([[0.22]], requires_grad=True)  # r = 1.246: inside 1.28, outside 1.2
    loss, stats = ppo_actor_loss(logp, zeros, zeros, torch.ones(1, 1), mask, eps_clip=0.2, eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-math.exp(0.22))
    assert stats["clipped_tokens"].item() == 0
    loss, stats = ppo_actor_loss(logp, zeros, zeros, torch.ones(1, 1), mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clipped_tokens"].item() == 1


def test_coupled_is_prox_equals_behave():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=gen, requires_grad=True)
    behave = torch.randn(3, 4, generator=gen)
    adv = torch.randn(3, 4, generator=gen)
    mask = torch.ones(3, 4, dtype=torch.bool)
    loss, stats = ppo_actor_loss(logp, behave, behave, adv, mask, eps_clip=0.2)
    ratio = torch.exp(logp - behave)
    ref = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    torch.testing.assert_close(loss, ref)
    assert torch.equal(stats["behave_weight"], torch.ones(3, 4))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    cap=st.one_of(st.none(), st.floats(0.5, 4.0)),
)
def test_gradient_property(n, seed, cap):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(1, n, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True)
    prox = torch.randn(1, n, generator=gen, dtype=torch.float64) * 0.5
    behave = torch.randn(1, n, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(1, n, generator=gen, dtype=torch.float64)
    mask = torch.rand(1, n, generator=gen) < 0.8
    loss, stats = ppo_actor_loss(logp, prox, behave, adv, mask, eps_clip=0.2, behave_weight_cap=cap)
    loss.backward()
    n_valid = max(int(mask.sum()), 1)
    r = torch.exp(logp.detach() - prox)
    w = stats["behave_weight"]
    expected = torch.where(mask & ~stats["clip_mask"], -adv * w * r / n_valid, torch.zeros_like(r))
    # clipped tokens: zero gradient (the clipped term is constant in logp)
    torch.testing.assert_close(logp.grad, expected)


def naive(logits, tokens):
    log_softmax = torch.log_softmax(logits.double(), dim=-1)
    logp = log_softmax.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return logp, entropy


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 50), seed=st.integers(0, 1000), scale=st.floats(0.1, 30.0))
def test_token_logprobs_and_entropy_equal_naive(rows, vocab, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, rows, vocab, generator=gen) * scale
    tokens = torch.randint(0, vocab, (2, rows), generator=gen)
    ref_logp, ref_entropy = naive(logits, tokens)
    torch.testing.assert_close(token_logprobs(logits, tokens).double(), ref_logp, rtol=1e-5, atol=1e-4)
    both_logp, both_entropy = token_logprobs_and_entropy(logits, tokens)
    torch.testing.assert_close(both_logp.double(), ref_logp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(both_entropy.double(), ref_entropy, rtol=1e-5, atol=1e-4)


def test_chunking_crosses_chunk_boundaries_and_keeps_gradient(monkeypatch):
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_BYTES", 4 * 7 * 3)  # 3 rows of 7
    logits = torch.randn(2, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 5))
    logp, entropy = token_logprobs_and_entropy(logits, tokens)
    ref_logp, ref_entropy = naive(logits.detach(), tokens)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad
    logp.sum().backward()
    expected_grad = torch.nn.functional.one_hot(tokens, 7).float() - torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_bf16_logits_are_upcast():
    logits = (torch.randn(4, 11) * 5).bfloat16()
    tokens = torch.randint(0, 11, (4,))
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    ref, _ = naive(logits.float(), tokens)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [3.0, 1.0, 2.0, 2.0]])
    # Default: AReaL's unbiased std (n - 1) and eps 1e-5.
    adv = grpo_advantages(rewards)
    std = math.sqrt(1 / 3)  # [1, 0, 0, 1]: squared deviations 4 x 0.25 = 1, over n - 1 = 3
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-5))
    assert torch.equal(adv[1], torch.zeros(4))  # all equal: exactly zero, no NaN
    std = math.sqrt(2 / 3)
    torch.testing.assert_close(adv[2], torch.tensor([1.0, -1.0, 0.0, 0.0]) / (std + 1e-5))
    # Population std (n), selectable.
    population = grpo_advantages(rewards, unbiased=False, eps=1e-6)
    torch.testing.assert_close(population[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), rtol=1e-5, atol=1e-5)
    std = math.sqrt(0.5)
    torch.testing.assert_close(population[2], torch.tensor([1 / std, -1 / std, 0.0, 0.0]), rtol=1e-5, atol=1e-5)
    centred = grpo_advantages(rewards, norm_std=False)
    torch.testing.assert_close(centred[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    single = grpo_advantages(torch.tensor([[0.7]]))
    assert single.item() == 0.0
    with pytest.raises(ValueError, match="eps=0"):
        grpo_advantages(rewards, eps=0)


def test_the_library_rejects_mismatched_shapes_naming_them():
    """The library's own contract (not the oracle's): a ValueError naming each argument's shape,
    never torch's broadcasting or its RuntimeError from deep inside."""
    from a3po.maths.loss import decoupled_loss, token_decisions
    from a3po.maths.proximal import linear, loglinear

    n = 6
    t, seq, valid = torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool)
    groups = {"objective": {"name": "ppo", "eps_clip": 0.2}, "correction": {"name": "none", "cap": None}}
    with pytest.raises(ValueError, match=r"'behave': \(4,\)"):
        decoupled_loss(t, t, torch.zeros(4), t, seq, valid, **groups)
    with pytest.raises(ValueError, match=r"'advantages': \(6, 1\)"):  # broadcastable, still refused
        token_decisions(t, t, t, torch.zeros(n, 1), seq, valid, **groups)
    with pytest.raises(ValueError, match=r"'alpha': \(3,\)"):
        loglinear(t, t, torch.zeros(3), seq)
    with pytest.raises(ValueError, match=r"'versions': \(2,\)"):
        linear(t, t, torch.tensor(0.5), torch.zeros(2))
    loss, stats = decoupled_loss(t, t, t, t, seq, valid, **groups)  # matching shapes still pass
    assert loss.item() == 0.0 and stats["actor/valid_tokens"].item() == n


def test_bad_inputs_raise():
    """The oracle's checks (tests/oracles.py), and the library's own for log-probs and advantages."""
    t = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_actor_loss(t, t, t[:, :2], t, mask, eps_clip=0.2)
    with pytest.raises(ValueError, match=r"eps_clip=0.*> 0"):
        ppo_actor_loss(t, t, t, t, mask, eps_clip=0.0)
    with pytest.raises(ValueError, match=r"eps_clip_higher=-0.1"):
        ppo_actor_loss(t, t, t, t, mask, eps_clip=0.2, eps_clip_higher=-0.1)
    with pytest.raises(ValueError, match=r"behave_weight_cap=0"):
        ppo_actor_loss(t, t, t, t, mask, eps_clip=0.2, behave_weight_cap=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[n_groups, group_size\]"):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="NaN or Inf"):
        grpo_advantages(torch.tensor([[1.0, float("nan")]]))


def _unfused(logits, tokens, temperature=1.0):
    """The vocabulary pass as autograd composes it: the fused one's oracle, bit for bit."""
    scores = logits.float() / temperature if temperature != 1.0 else logits.float()
    log_z = torch.logsumexp(scores, dim=-1)
    logp = scores.gather(-1, tokens[..., None]).squeeze(-1) - log_z
    log_probs = scores.detach() - log_z.detach()[..., None]
    return logp, -(torch.exp(log_probs) * log_probs).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_the_fused_pass_is_autograds_bit_for_bit(dtype, rows, monkeypatch):
    """Log-probs, entropy and the logits' gradient equal the unfused composition exactly, across
    chunk boundaries (a small chunk here) and in bf16 (the gradient cast as autograd casts it)."""
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_BYTES", 4 * 1000 * 16)  # 16 rows of 1,000
    gen = torch.Generator().manual_seed(rows)
    base = (torch.randn(rows, 1000, generator=gen) * 4).to(dtype)
    tokens = torch.randint(0, 1000, (rows,), generator=gen)
    weights = torch.randn(rows, generator=gen)
    fused_in, unfused_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    logp, entropy = token_logprobs_and_entropy(fused_in, tokens)
    ref_logp, ref_entropy = _unfused(unfused_in, tokens)
    assert torch.equal(logp, ref_logp) and torch.equal(entropy, ref_entropy)
    (logp * weights).sum().backward()
    (ref_logp * weights).sum().backward()
    assert fused_in.grad.dtype == dtype and torch.equal(fused_in.grad, unfused_in.grad)
    assert torch.equal(token_logprobs(base, tokens), ref_logp.detach())


def test_a_temperature_divides_the_float32_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 40, (5,), generator=gen)
    logp, entropy = token_logprobs_and_entropy(logits, tokens, temperature=0.7)
    ref_logp, ref_entropy = naive(logits.detach() / 0.7, tokens)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-6, atol=1e-6)
    logp.sum().backward()
    expected = (torch.nn.functional.one_hot(tokens, 40).float() - torch.softmax(logits.detach() / 0.7, -1)) / 0.7
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(logits, tokens, temperature=0)
