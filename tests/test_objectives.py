"""Per-token objectives ppo / gspo / cispo and their combination with corrections (a3po/maths/objectives.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.maths.corrections import CORRECTIONS, apply_correction, check_combination
from a3po.maths.loss import policy_loss
from a3po.maths.objectives import OBJECTIVES, cispo, compute_objective, gspo, ppo
from a3po.maths.proximal import ALGOS
from oracles import ppo_actor_loss


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float32, requires_grad=requires_grad)


def approx(value):
    return pytest.approx(value, rel=1e-6, abs=1e-7)


def inputs(seed, n=30, n_seq=5, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(n, generator=gen) * scale - 1.0).requires_grad_(True)
    prox = logp.detach() + torch.randn(n, generator=gen) * scale
    behave = prox + torch.randn(n, generator=gen) * scale
    adv = torch.randn(n, generator=gen)
    seq = torch.sort(torch.randint(0, n_seq, (n,), generator=gen)).values
    valid = torch.rand(n, generator=gen) < 0.8
    return logp, prox, behave, adv, seq, valid


# --- ppo ------------------------------------------------------------------------------------


def test_ppo_hand_checked():
    # r = 1, e^0.5 (A > 0: clipped at 1.2), e^-0.5 (A < 0: clipped at 0.8), e^0.1 (inside)
    logp = t([0.0, 0.5, -0.5, 0.1, 9.0], requires_grad=True)
    prox = torch.zeros(5)
    adv = t([1.0, 1.0, -1.0, 2.0, 1.0])
    valid = torch.tensor([True, True, True, True, False])
    out = ppo(logp, prox, adv, torch.arange(5), valid, eps_clip=0.2)
    assert out.per_token.tolist() == approx([-1.0, -1.2, 0.8, -2.0 * math.exp(0.1), 0.0])
    assert out.clip_high.tolist() == [False, True, False, False, False]
    assert out.clip_low.tolist() == [False, False, True, False, False]
    assert out.ratio.tolist() == approx([1.0, math.exp(0.5), math.exp(-0.5), math.exp(0.1), 0.0])
    out.per_token.sum().backward()
    # clipped tokens and the invalid one get no gradient; d(-A r)/d logp = -A r elsewhere
    assert logp.grad.tolist() == approx([-1.0, 0.0, 0.0, -2.0 * math.exp(0.1), 0.0])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 1.1])
@pytest.mark.parametrize("eps_clip_higher", [None, 0.28])
def test_ppo_with_correction_none_is_ppo_actor_loss_bit_for_bit(seed, cap, eps_clip_higher):
    logp, prox, behave, adv, seq, valid = inputs(seed)
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref_loss, ref_stats = ppo_actor_loss(ref_logp, prox, behave, adv, valid, eps_clip=0.2,
                                         eps_clip_higher=eps_clip_higher, behave_weight_cap=cap)
    ref_loss.backward()
    correction = apply_correction("none", prox - behave, seq, valid, {"cap": cap})
    objective = ppo(logp, prox, adv, seq, valid, eps_clip=0.2, eps_clip_higher=eps_clip_higher)
    loss = policy_loss(objective, correction, valid)
    # the caller's formula written out, too
    literal = (correction.weight * correction.keep * objective.per_token).sum() / valid.sum().clamp(min=1)
    assert torch.equal(loss, ref_loss) and torch.equal(literal, ref_loss)
    loss.backward()
    assert torch.equal(logp.grad, ref_logp.grad)
    assert torch.equal(objective.clip_low | objective.clip_high, ref_stats["clip_mask"])
    assert torch.equal(correction.weight, ref_stats["behave_weight"])
    assert (correction.masked_high * valid.sum()).item() == approx(ref_stats["behave_weight/capped_tokens"].item())


# --- gspo -----------------------------------------------------------------------------------


def test_gspo_hand_checked():
    # seq 0: log r = 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.2, A = 1: clipped high on both tokens.
    # seq 1: log r = -0.1, 0.1 -> s = 1, A = -1: per_token = 1, gradient -A s = 1 per token.
    # seq 2: one valid token log r = -0.4 (s = 0.670 < 0.8), A = -1: clipped low; its invalid
    #        token (log r = 5) is not in the mean.
    logp = t([0.1, 0.3, -0.1, 0.1, -0.4, 5.0], requires_grad=True)
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, True, True, True, True, False])
    adv = t([1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    out = gspo(logp, torch.zeros(6), adv, seq, valid, eps_clip=0.2)
    assert out.ratio.tolist() == approx([math.exp(0.2)] * 2 + [1.0] * 2 + [math.exp(-0.4), 0.0])
    assert out.per_token.tolist() == approx([-1.2, -1.2, 1.0, 1.0, 0.8, 0.0])
    assert out.clip_high.tolist() == [True, True, False, False, False, False]
    assert out.clip_low.tolist() == [False, False, False, False, True, False]
    out.per_token.sum().backward()
    assert logp.grad.tolist() == approx([0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 10), eps_high=st.sampled_from([None, 0.28]))
def test_gspo_equals_ppo_when_every_sequence_has_one_token(seed, n, eps_high):
    logp, prox, _, adv, _, valid = inputs(seed, n=n, scale=0.4)
    seq = torch.arange(n)
    logp_g = logp.detach().clone().requires_grad_(True)
    a = ppo(logp, prox, adv, seq, valid, eps_clip=0.2, eps_clip_higher=eps_high)
    b = gspo(logp_g, prox, adv, seq, valid, eps_clip=0.2, eps_clip_higher=eps_high)
    assert torch.equal(a.per_token, b.per_token) and torch.equal(a.ratio, b.ratio)
    assert torch.equal(a.clip_low, b.clip_low) and torch.equal(a.clip_high, b.clip_high)
    a.per_token.sum().backward()
    b.per_token.sum().backward()
    assert torch.equal(logp.grad, logp_g.grad)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_sequence_gradient_equals_trl_sequence_form(seed):
    # TRL importance_sampling_level="sequence": s_i = exp(mean log r) WITH gradient, loss -A s_i per
    # token. Summed over a sequence (equal token weights) the GSPO-token gradient is the same.
    logp, prox, _, adv, seq, valid = inputs(seed)
    adv = adv[seq]  # GRPO: one advantage per sequence
    ours = gspo(logp, prox, adv, seq, valid, eps_clip=0.5)
    ours.per_token.sum().backward()
    logp_trl = logp.detach().clone().requires_grad_(True)
    log_r = torch.where(valid, logp_trl - prox, 0.0)
    counts = torch.zeros(30).index_add(0, seq, valid.float()).clamp(min=1)
    s = torch.exp(torch.zeros(30).index_add(0, seq, log_r) / counts)[seq]
    trl = torch.maximum(-adv * s, -adv * s.clamp(0.5, 1.5))
    torch.where(valid, trl, 0.0).sum().backward()
    torch.testing.assert_close(ours.per_token, torch.where(valid, trl, 0.0).detach())
    torch.testing.assert_close(logp.grad, logp_trl.grad, rtol=1e-5, atol=1e-6)


# --- cispo ----------------------------------------------------------------------------------


def test_cispo_hand_checked_gradient_through_every_token():
    logp = t([-1.0, -0.5, -2.0, -1.0], requires_grad=True)
    prox = t([-1.5, -0.5, -1.0, -1.0])  # r = e^0.5 (above 1.2), 1, e^-1 (below 0.8), 1 (invalid)
    adv = t([1.0, -2.0, 1.0, 1.0])
    valid = torch.tensor([True, True, True, False])
    out = cispo(logp, prox, adv, torch.zeros(4, dtype=torch.long), valid, eps_clip=0.2)
    assert out.per_token.tolist() == approx([-1.2 * 1 * -1.0, -1.0 * -2.0 * -0.5, -0.8 * 1 * -2.0, 0.0])
    assert out.clip_high.tolist() == [True, False, False, False]
    assert out.clip_low.tolist() == [False, False, True, False]
    out.per_token.sum().backward()
    # d/dlogp = -sg(clip(r)) A: clipped tokens keep a gradient (the point of CISPO)
    assert logp.grad.tolist() == approx([-1.2, 2.0, -0.8, 0.0])


@pytest.mark.parametrize("seed", range(4))
def test_cispo_matches_verl(seed):
    logp, prox, _, adv, seq, valid = inputs(seed, scale=0.5)
    out = cispo(logp, prox, adv, seq, valid, eps_clip=0.2, eps_clip_higher=0.28)
    # verl compute_policy_loss_cispo: -sg(clamp(exp(clamp(log r, -20, 20)), 1 - low, 1 + high)) * A * logp
    ratio = torch.exp(torch.clamp(logp - prox, -20.0, 20.0))
    verl = -torch.clamp(ratio, 0.8, 1.28).detach() * adv * logp
    torch.testing.assert_close(out.per_token, torch.where(valid, verl, 0.0))
    assert torch.equal(out.clip_low | out.clip_high, valid & (torch.clamp(ratio, 0.8, 1.28) != ratio))


def test_cispo_accepts_eps_clip_one_as_no_lower_bound():
    logp, prox, _, adv, seq, valid = inputs(0, scale=2.0)
    out = cispo(logp, prox, adv, seq, valid, eps_clip=1.0, eps_clip_higher=4.0)
    assert not bool(out.clip_low.any())
    ratio = torch.exp(logp - prox).detach()
    torch.testing.assert_close(out.per_token, torch.where(valid, -ratio.clamp(max=5.0) * adv * logp, 0.0))


# --- validation, combinations, numerics -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("kwargs, argument", [
    ({"eps_clip": 0.0}, "objective.eps_clip=0 is not allowed"), ({"eps_clip": -0.1}, "objective.eps_clip=-0.1 "),
    ({"eps_clip": 1.5}, "objective.eps_clip=1.5 "), ({"eps_clip": True}, "objective.eps_clip=True is not a number"),
    ({"eps_clip": 0.2, "eps_clip_higher": 0.0}, "objective.eps_clip_higher=0 is not allowed"),
    ({"eps_clip": 0.2, "eps_clip_higher": -1.0}, "objective.eps_clip_higher=-1 "),
    ({"eps_clip": 0.2, "eps_clp": 0.3}, r"objective=.* does not take \['eps_clp'\]"),
])
def test_bad_clip_parameters_name_the_argument(name, kwargs, argument):
    logp, prox, _, adv, seq, valid = inputs(0)
    with pytest.raises(ValueError, match=argument):
        compute_objective(name, logp, prox, adv, seq, valid, kwargs)


def test_eps_clip_one_only_for_cispo_and_unknown_objective():
    logp, prox, _, adv, seq, valid = inputs(0)
    for name in ("ppo", "gspo"):
        with pytest.raises(ValueError, match=r"eps_clip=1 is not allowed; it must be in \(0, 1\)"):
            compute_objective(name, logp, prox, adv, seq, valid, {"eps_clip": 1.0})
    compute_objective("cispo", logp, prox, adv, seq, valid, {"eps_clip": 1.0})
    with pytest.raises(ValueError, match=r"objective='grpo'.*\['cispo', 'gspo', 'ppo'\]"):
        compute_objective("grpo", logp, prox, adv, seq, valid, {"eps_clip": 0.2})
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo(logp, prox[:3], adv, seq, valid, eps_clip=0.2)


def test_check_combination():
    for correction in CORRECTIONS:
        for method, spec in ALGOS.items():
            if spec.anchor == "behave" and correction != "none":
                with pytest.raises(ValueError, match=f"correction='{correction}'.*algo=coupled"):
                    check_combination(correction, method)
            else:
                check_combination(correction, method)
    for args, key in ((("ice", "recompute"), "correction='ice'"), (("none", "coupledd"), "algo.name='coupledd'")):
        with pytest.raises(ValueError, match=key):
            check_combination(*args)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_overflowing_ratio_on_a_dropped_token_gives_finite_loss_and_gradient(name):
    logp = t([-1.0, -1.0, -1.1], requires_grad=True)
    prox = t([-200.0, -1.2, -1.0])  # log r = 199: exp overflows float32
    behave = t([-400.0, -1.0, -1.0])  # log w = 200: dropped by icepop
    seq, valid, adv = torch.tensor([0, 1, 1]), torch.ones(3, dtype=torch.bool), t([-1.0, 1.0, 1.0])
    correction = apply_correction("icepop", prox - behave, seq, valid, {})
    objective = compute_objective(name, logp, prox, adv, seq, valid, {"eps_clip": 0.2})
    loss = policy_loss(objective, correction, valid)
    loss.backward()
    assert correction.weight[0].item() == 0.0
    assert math.isfinite(loss.item()) and bool(torch.isfinite(logp.grad).all())


def test_gspo_gradient_goes_to_each_tokens_own_logprob():
    # One sequence, log r = 0, 0 (s = 1), A = -1, token weights 2 and 0 (e.g. a behaviour weight and
    # a dropped token). GSPO-token form (verl): d/dlogp_t = weight_t * (-A s) = [2, 0]. The pure
    # sequence form would spread it: (2 + 0) * (-A s) / 2 = [1, 1].
    logp = t([-1.0, -2.0], requires_grad=True)
    out = gspo(logp, t([-1.0, -2.0]), t([-1.0, -1.0]), torch.zeros(2, dtype=torch.long),
               torch.ones(2, dtype=torch.bool), eps_clip=0.2)
    (t([2.0, 0.0]) * out.per_token).sum().backward()
    assert logp.grad.tolist() == approx([2.0, 0.0])


def test_gspo_padding_with_minus_inf_logp_gives_finite_gradient():
    logp = t([-1.0, -0.5, -math.inf], requires_grad=True)
    valid = torch.tensor([True, True, False])
    out = gspo(logp, t([-1.1, -0.4, -1.0]), t([1.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.long), valid, eps_clip=0.2)
    out.per_token.sum().backward()
    assert bool(torch.isfinite(out.per_token).all()) and bool(torch.isfinite(logp.grad).all())
