"""Off-policy diagnostics: ESS, chi^2 and KL estimators (a3po/maths/diagnostics.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.maths.diagnostics import ess, offpolicy_metrics

LN = math.log
KEYS = {"offpolicy/ess_token", "offpolicy/ess_seq", "offpolicy/chi2_token", "offpolicy/kl_k1", "offpolicy/kl_k3",
        "offpolicy/total_ratio_max", "offpolicy/total_ratio_min", "offpolicy/ess_total"}


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def approx(value):
    return pytest.approx(value, rel=1e-5, abs=1e-7)


def test_ess_hand_checked():
    # (1 + 2 + 3)^2 / (3 * (1 + 4 + 9)) = 36 / 42; the invalid 100 is ignored
    assert ess(t([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False])).item() == approx(36 / 42)
    # one weight carries everything: 1/n
    assert ess(t([0.0, 0.0, 5.0, 0.0]), torch.ones(4, dtype=torch.bool)).item() == approx(0.25)


def test_ess_edge_cases_and_huge_weights():
    assert ess(t([]), torch.zeros(0, dtype=torch.bool)).item() == 1.0
    assert ess(t([3.0]), torch.zeros(1, dtype=torch.bool)).item() == 1.0
    assert ess(t([0.0, 0.0]), torch.ones(2, dtype=torch.bool)).item() == 0.0
    # (2e30 + 1)^2 / (3 * 2e60) = 2/3: no overflow of w^2
    assert ess(t([1e30, 1e30, 1.0]), torch.ones(3, dtype=torch.bool)).item() == approx(2 / 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        ess(t([1.0, 2.0]), torch.ones(3, dtype=torch.bool))


@settings(max_examples=100, deadline=None)
@given(value=st.floats(1e-6, 1e6), n=st.integers(1, 64))
def test_ess_is_exactly_one_for_equal_weights(value, n):
    assert ess(torch.full((n,), value), torch.ones(n, dtype=torch.bool)).item() == 1.0
    # equal sequence weights too: one token per sequence (a mean of 3 equal floats can be an ulp off)
    log_w = torch.full((n,), math.log(value))
    metrics = offpolicy_metrics(torch.zeros(n), log_w, torch.zeros(n), torch.arange(n), torch.ones(n, dtype=torch.bool))
    assert metrics["offpolicy/ess_token"].item() == 1.0 and metrics["offpolicy/ess_seq"].item() == 1.0


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=30), data=st.data())
def test_ess_in_unit_interval(weights, data):
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(weights), max_size=len(weights))))
    w = t(weights)
    value = ess(w, valid).item()
    if bool((w[valid] > 0).any()):
        assert 0.0 < value <= 1.0 + 1e-6
        assert value >= 1.0 / int(valid.sum()) - 1e-6


def test_offpolicy_metrics_hand_checked():
    behave = t([-1.0, -2.0, -0.5])
    prox = behave + t([LN(2.0), 0.0, LN(0.5)])  # w = 2, 1, 0.5
    log_r = t([0.1, -0.2, 0.3])
    logp = behave + log_r
    seq, valid = torch.tensor([0, 0, 1]), torch.ones(3, dtype=torch.bool)
    metrics = offpolicy_metrics(behave, prox, logp, seq, valid)
    assert set(metrics) == KEYS
    for value in metrics.values():
        assert value.dim() == 0 and value.dtype == torch.float32
    assert metrics["offpolicy/ess_token"].item() == approx(3.5**2 / (3 * 5.25))
    # rho = exp((ln 2 + 0) / 2) = sqrt 2 and 0.5: (sqrt 2 + 0.5)^2 / (2 * (2 + 0.25))
    assert metrics["offpolicy/ess_seq"].item() == approx((math.sqrt(2) + 0.5) ** 2 / 4.5)
    assert metrics["offpolicy/chi2_token"].item() == approx((4 + 1 + 0.25) / 3 - 1)
    assert metrics["offpolicy/kl_k1"].item() == approx(-(0.1 - 0.2 + 0.3) / 3)
    k3 = sum(math.exp(x) - 1 - x for x in (0.1, -0.2, 0.3)) / 3
    assert metrics["offpolicy/kl_k3"].item() == approx(k3)
    # the anchor-free ratio r = pi_theta / pi_behave = e^0.1, e^-0.2, e^0.3, whatever prox is
    r = [math.exp(x) for x in (0.1, -0.2, 0.3)]
    assert metrics["offpolicy/total_ratio_max"].item() == approx(math.exp(0.3))
    assert metrics["offpolicy/total_ratio_min"].item() == approx(math.exp(-0.2))
    assert metrics["offpolicy/ess_total"].item() == approx(sum(r) ** 2 / (3 * sum(x * x for x in r)))
    other_anchor = offpolicy_metrics(behave, behave, logp, seq, valid)
    for key in ("offpolicy/total_ratio_max", "offpolicy/total_ratio_min", "offpolicy/ess_total"):
        assert other_anchor[key].item() == metrics[key].item()


def test_total_ratio_reads_valid_tokens_only():
    behave, logp = torch.zeros(4), t([3.0, 0.5, -0.25, -4.0])
    valid = torch.tensor([False, True, True, False])
    metrics = offpolicy_metrics(behave, behave, logp, torch.tensor([0, 0, 1, 1]), valid)
    assert metrics["offpolicy/total_ratio_max"].item() == approx(math.exp(0.5))
    assert metrics["offpolicy/total_ratio_min"].item() == approx(math.exp(-0.25))
    none = offpolicy_metrics(behave, behave, logp, torch.tensor([0, 0, 1, 1]), torch.zeros(4, dtype=torch.bool))
    assert none["offpolicy/total_ratio_max"].item() == 1.0 and none["offpolicy/total_ratio_min"].item() == 1.0


def test_sequence_ess_uses_the_geometric_mean():
    # two 20-token sequences with w = 1.1 and w = 1: rho = 1.1 and 1 (ESS 0.9977); the product
    # 1.1^20 = 6.7 would give (7.7)^2 / (2 * 46.3) = 0.64.
    n = 40
    prox = torch.cat([torch.full((20,), LN(1.1)), torch.zeros(20)])
    all_valid = torch.ones(n, dtype=torch.bool)
    metrics = offpolicy_metrics(torch.zeros(n), prox, torch.zeros(n), torch.arange(n) // 20, all_valid)
    assert metrics["offpolicy/ess_seq"].item() == approx(2.1**2 / (2 * (1.21 + 1)))


def test_sequences_without_valid_tokens_are_left_out_of_ess_seq():
    prox = t([LN(2.0), 0.0, 5.0, 5.0])
    seq, valid = torch.tensor([0, 1, 2, 2]), torch.tensor([True, True, False, False])
    metrics = offpolicy_metrics(torch.zeros(4), prox, torch.zeros(4), seq, valid)
    assert metrics["offpolicy/ess_seq"].item() == approx(9 / (2 * 5))


def test_on_policy_is_zero_kl_and_no_nan_when_empty():
    logp = t([-1.0, -0.3, -2.0])
    metrics = offpolicy_metrics(logp, logp, logp, torch.tensor([0, 0, 1]), torch.ones(3, dtype=torch.bool))
    assert metrics["offpolicy/kl_k1"].item() == 0.0 and metrics["offpolicy/kl_k3"].item() == 0.0
    assert metrics["offpolicy/chi2_token"].item() == 0.0 and metrics["offpolicy/ess_token"].item() == 1.0
    empty = offpolicy_metrics(logp, logp + 1, logp, torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.bool))
    assert all(math.isfinite(v.item()) for v in empty.values())


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([1e-4, 0.1, 1.0, 100.0]))
def test_metric_properties(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    behave = torch.randn(12, generator=gen) - 2
    prox = behave + torch.randn(12, generator=gen) * scale
    logp = behave + torch.randn(12, generator=gen) * scale
    valid = torch.rand(12, generator=gen) < 0.8
    metrics = offpolicy_metrics(behave, prox, logp.requires_grad_(True), torch.arange(12) // 4, valid)
    assert all(math.isfinite(v.item()) and not v.requires_grad for v in metrics.values())
    assert metrics["offpolicy/kl_k3"].item() >= 0.0
    assert 0.0 < metrics["offpolicy/ess_token"].item() <= 1.0 and 0.0 < metrics["offpolicy/ess_seq"].item() <= 1.0
    assert metrics["offpolicy/chi2_token"].item() >= -1.0
