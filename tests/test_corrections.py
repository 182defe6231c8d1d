"""Off-policy corrections of the behaviour weight w = pi_prox/pi_behave (a3po/maths/corrections.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.maths.corrections import CORRECTIONS, apply_correction, sequence_mean
from a3po.maths.loss import policy_loss
from a3po.maths.objectives import ppo

LN = math.log


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def approx(value):
    return pytest.approx(value, rel=1e-6, abs=1e-7)


# --- hand-checked cases --------------------------------------------------------------------


def test_none_hand_checked_with_and_without_cap():
    log_w = t([0.0, LN(2.0), LN(10.0), 50.0])
    seq, valid = torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, True, False])
    out = apply_correction("none", log_w, seq, valid, {})
    assert out.weight.tolist() == approx([1.0, 2.0, 10.0, 0.0])
    assert out.keep.tolist() == [True, True, True, False]
    capped = apply_correction("none", log_w, seq, valid, {"cap": 5.0})
    assert capped.weight.tolist() == approx([1.0, 2.0, 0.0, 0.0])  # dropped, not truncated to 5
    assert capped.keep.tolist() == [True, True, False, False]
    assert capped.masked_high.item() == approx(1 / 3)  # of the 3 valid tokens
    assert capped.masked_low.item() == 0.0 and capped.truncated.item() == 0.0


def test_tis_hand_checked():
    out = apply_correction("tis", t([LN(0.5), LN(1.5), LN(4.0), LN(8.0)]), torch.zeros(4, dtype=torch.long),
                           torch.tensor([True, True, True, False]), {"cap": 2.0})
    assert out.weight.tolist() == approx([0.5, 1.5, 2.0, 0.0])
    assert out.keep.tolist() == [True, True, True, False]
    assert out.truncated.item() == approx(1 / 3)
    assert out.masked_low.item() == 0.0 and out.masked_high.item() == 0.0


def test_icepop_hand_checked_and_bounds_inclusive():
    out = apply_correction("icepop", t([LN(0.25), 0.0, LN(3.0), LN(1.9)]), torch.zeros(4, dtype=torch.long),
                           torch.ones(4, dtype=torch.bool), {"lo": 0.5, "hi": 2.0})
    assert out.weight.tolist() == approx([0.0, 1.0, 0.0, 1.9])
    assert out.keep.tolist() == [False, True, False, True]
    assert out.masked_low.item() == 0.25 and out.masked_high.item() == 0.25 and out.truncated.item() == 0.0
    # exp(0) = 1 exactly: a weight equal to a bound is kept, as in slime (r >= lo) & (r <= hi)
    edge = apply_correction("icepop", t([0.0]), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
                            {"lo": 1.0, "hi": 3.0})
    assert edge.keep.tolist() == [True]


def test_seq_tis_hand_checked_geometric_mean_replaces_token_weights():
    # sequence 0: w = 4, 1 -> rho = exp((ln 4 + 0) / 2) = 2, truncated to 1.5 on both tokens
    # sequence 1: w = 0.5, 0.5 and an invalid token with log_w = 50 -> rho = 0.5
    log_w = t([LN(4.0), 0.0, LN(0.5), LN(0.5), 50.0])
    seq, valid = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([True, True, True, True, False])
    out = apply_correction("seq_tis", log_w, seq, valid, {"cap": 1.5})
    assert out.weight.tolist() == approx([1.5, 1.5, 0.5, 0.5, 0.0])
    assert out.truncated.item() == approx(2 / 4)
    assert out.keep.tolist() == [True, True, True, True, False]


def test_seq_mis_hand_checked():
    # seq 0: rho = sqrt(2.5 * 2.5) = 2.5 > 2 dropped high; seq 1: rho = 0.25 dropped low;
    # seq 2: w = 2, 0.5 -> rho = 1, kept with their OWN weights 2 and 0.5
    log_w = t([LN(2.5), LN(2.5), LN(0.25), LN(2.0), LN(0.5)])
    seq = torch.tensor([0, 0, 1, 2, 2])
    out = apply_correction("seq_mis", log_w, seq, torch.ones(5, dtype=torch.bool), {})
    assert out.keep.tolist() == [False, False, False, True, True]
    assert out.weight.tolist() == approx([0.0, 0.0, 0.0, 2.0, 0.5])
    assert out.masked_high.item() == approx(2 / 5) and out.masked_low.item() == approx(1 / 5)


def test_sequence_weight_is_a_mean_not_a_sum():
    # 10 tokens with w = 1.2: the geometric mean is 1.2 (kept); the product 1.2^10 = 6.2 would be dropped.
    out = apply_correction("seq_mis", torch.full((10,), LN(1.2)), torch.zeros(10, dtype=torch.long),
                           torch.ones(10, dtype=torch.bool), {})
    assert bool(out.keep.all())
    tis_out = apply_correction("seq_tis", torch.full((10,), LN(1.2)), torch.zeros(10, dtype=torch.long),
                               torch.ones(10, dtype=torch.bool), {})
    assert tis_out.weight.tolist() == approx([1.2] * 10)


def test_m2po_hand_checked_mean_over_remaining_tokens():
    # m2 = 0.25, 0.09, 0.01, 0. tau = 0.04: drop 1 (0.10 / 3 = 0.033 < 0.04).
    log_w = t([0.5, -0.3, 0.1, 0.0])
    seq, valid = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    out = apply_correction("m2po", log_w, seq, valid, {"tau": 0.04})
    assert out.keep.tolist() == [False, True, True, True]
    assert out.masked_high.item() == 0.25 and out.masked_low.item() == 0.0
    # tau = 0.03: mean over the REMAINING 3 is 0.033 >= 0.03, so drop 2 (0.01 / 2 < 0.03).
    # (A mean over all 4 tokens, 0.10 / 4 = 0.025, would have stopped after 1.)
    out = apply_correction("m2po", log_w, seq, valid, {"tau": 0.03})
    assert out.keep.tolist() == [False, False, True, True]
    assert out.masked_high.item() == 0.25 and out.masked_low.item() == 0.25
    assert out.weight.tolist() == approx([0.0, 0.0, math.exp(0.1), 1.0])


def test_m2po_keeps_the_smallest_when_nothing_gets_below_tau_and_ignores_invalid():
    log_w = t([1.0, -2.0, 30.0])
    out = apply_correction("m2po", log_w, torch.zeros(3, dtype=torch.long), torch.tensor([True, True, False]), {})
    assert out.keep.tolist() == [True, False, False]  # AReaL: mask all but one
    assert out.masked_low.item() == 0.5 and out.masked_high.item() == 0.0


def test_sequence_mean_broadcasts_over_valid_tokens_only():
    values = t([1.0, 3.0, 100.0, 5.0])
    out = sequence_mean(values, torch.tensor([1, 1, 1, 0]), torch.tensor([True, True, False, True]))
    assert out.tolist() == [2.0, 2.0, 2.0, 5.0]


# --- properties ----------------------------------------------------------------------------


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    log_w = draw(st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=n))
    seq = [i for i, length in enumerate(lengths) for _ in range(length)][:n]
    seq += [len(lengths) - 1] * (n - len(seq))
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return t(log_w), torch.tensor(seq), torch.tensor(valid)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_infinite_bounds_equal_none_bit_for_bit(batch):
    log_w, seq, valid = batch
    base = apply_correction("none", log_w, seq, valid, {})
    for name, params in (("tis", {"cap": math.inf}), ("icepop", {"lo": 0.0, "hi": math.inf}),
                         ("seq_mis", {"lo": 0.0, "hi": math.inf}), ("m2po", {"tau": math.inf})):
        out = apply_correction(name, log_w, seq, valid, params)
        assert torch.equal(out.weight, base.weight), name
        assert torch.equal(out.keep, base.keep), name


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from(sorted(CORRECTIONS)))
def test_invariants(batch, name):
    log_w, seq, valid = batch
    out = apply_correction(name, log_w, seq, valid, {})
    assert not bool((out.keep & ~valid).any())
    assert bool((out.weight[~out.keep] == 0).all())
    assert bool((out.weight >= 0).all()) and not out.weight.requires_grad
    dropped = (valid & ~out.keep).sum().item() / max(valid.sum().item(), 1)
    assert out.masked_low.item() + out.masked_high.item() == pytest.approx(dropped, abs=1e-6)
    for stat in (out.masked_low, out.masked_high, out.truncated):
        assert stat.dim() == 0 and stat.dtype == torch.float32 and 0.0 <= stat.item() <= 1.0
    if name in ("none", "tis", "seq_tis"):
        assert torch.equal(out.keep, valid)


# --- each correction re-stated from the peer's formula -------------------------------------


def random_batch(seed, n=40, n_seq=6, scale=0.8):
    gen = torch.Generator().manual_seed(seed)
    log_w = torch.randn(n, generator=gen) * scale
    seq = torch.sort(torch.randint(0, n_seq, (n,), generator=gen)).values
    valid = torch.rand(n, generator=gen) < 0.8
    return log_w, seq, valid


@pytest.mark.parametrize("seed", range(5))
def test_tis_and_icepop_match_slime(seed):
    log_w, seq, valid = random_batch(seed)
    ratio = torch.exp(log_w)  # slime: exp(old_log_probs - rollout_log_probs)
    tis_slime = torch.clamp(ratio, min=0.0, max=2.0)  # vanilla_tis_function, --tis-clip-low 0
    ice_slime = torch.where((ratio >= 0.5) & (ratio <= 2.0), ratio, torch.zeros_like(ratio))  # icepop_function
    torch.testing.assert_close(apply_correction("tis", log_w, seq, valid, {}).weight, tis_slime * valid)
    torch.testing.assert_close(apply_correction("icepop", log_w, seq, valid, {}).weight, ice_slime * valid)


@pytest.mark.parametrize("seed", range(5))
def test_sequence_corrections_match_areal_and_verl(seed):
    log_w, seq, valid = random_batch(seed)
    tis_out = apply_correction("seq_tis", log_w, seq, valid, {"cap": 1.2})
    mis_out = apply_correction("seq_mis", log_w, seq, valid, {"lo": 0.8, "hi": 1.25})
    for s in seq.unique().tolist():
        tokens = (seq == s) & valid
        if not bool(tokens.any()):
            continue
        mean_log = log_w[tokens].double().mean()
        rho = math.exp(mean_log)  # AReaL: exp(seq_log_sum / valid_count), broadcast to every token
        expected = rho if rho <= 1.2 else 1.2  # AReaL action=clamp: clamp(rho, 0, upper) out of bounds
        assert tis_out.weight[tokens].tolist() == pytest.approx([expected] * int(tokens.sum()), rel=1e-5)
        # verl seq_mean_k1: k1 = -log r, keep if log(lo) <= mean k1 <= log(hi) (symmetric bounds)
        kept = math.log(0.8) <= -mean_log <= math.log(1.25)
        assert bool((mis_out.keep[tokens] == kept).all())
        if kept:
            torch.testing.assert_close(mis_out.weight[tokens], torch.exp(log_w[tokens]))


def areal_m2po_keep(log_w, valid, tau):
    """AReaL's `_apply_m2po_masking` / `_get_m2po_loss_mask`, re-stated."""
    m2 = log_w[valid] ** 2
    if m2.numel() == 0:
        return valid.clone()
    sorted_m2, indices = torch.sort(m2, descending=True)
    n = sorted_m2.numel()
    avg_suffix = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(avg_suffix < tau)[0]
    num_to_mask = int(below[0]) if len(below) > 0 else n - 1
    sorted_keep = torch.ones(n, dtype=torch.bool)
    sorted_keep[:num_to_mask] = False
    keep = valid.clone()
    keep[valid] = sorted_keep[torch.argsort(indices)]
    return keep


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("tau", [0.01, 0.04, 0.3, 5.0])
def test_m2po_matches_areal(seed, tau):
    log_w, seq, valid = random_batch(seed, scale=0.3)
    out = apply_correction("m2po", log_w, seq, valid, {"tau": tau})
    assert torch.equal(out.keep, areal_m2po_keep(log_w, valid, tau))


# --- bad parameters and non-finite inputs --------------------------------------------------


@pytest.mark.parametrize("name, params, argument", [
    ("tis", {"cap": 0}, "cap=0"), ("tis", {"cap": -1.0}, "cap=-1"), ("seq_tis", {"cap": 0.0}, "cap=0"),
    ("none", {"cap": 0.0}, "cap=0"), ("icepop", {"lo": 2.0, "hi": 2.0}, "lo=2, hi=2"),
    ("seq_mis", {"lo": 3.0, "hi": 2.0}, "lo=3, hi=2"), ("icepop", {"lo": -0.1}, "lo=-0.1"),
    ("m2po", {"tau": 0.0}, "tau=0"), ("m2po", {"tau": -1}, "tau=-1"), ("tis", {"cap": True}, "cap=True"),
    ("tis", {"cap": math.nan}, "cap=nan"), ("tis", {"clip": 2.0}, "'clip'"), ("m2po", {"cap": 2.0}, "'cap'"),
])
def test_bad_parameters_name_the_argument(name, params, argument):
    log_w, seq, valid = random_batch(0)
    with pytest.raises(ValueError, match=argument):
        apply_correction(name, log_w, seq, valid, params)


def test_unknown_name_lists_allowed_and_config_name_key_is_ignored():
    log_w, seq, valid = random_batch(0)
    allowed = r"\['icepop', 'm2po', 'none', 'seq_mis', 'seq_tis', 'tis'\]"
    with pytest.raises(ValueError, match=r"correction='tiss'.*" + allowed):
        apply_correction("tiss", log_w, seq, valid, {})
    apply_correction("tis", log_w, seq, valid, {"name": "tis", "cap": 3.0})


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        apply_correction("tis", torch.zeros(3), torch.zeros(4, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_index must be an integer"):
        apply_correction("tis", torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("name", ["icepop", "seq_mis", "m2po", "none"])
def test_huge_log_weight_is_dropped_with_weight_exactly_zero_and_finite_loss(name):
    log_w = t([200.0, 0.1, -0.1, 0.05])  # exp(200) = inf in float32
    seq, valid = torch.tensor([0, 1, 1, 1]), torch.ones(4, dtype=torch.bool)
    out = apply_correction(name, log_w, seq, valid, {"cap": 2.0} if name == "none" else {})
    assert out.weight[0].item() == 0.0 and not out.keep[0].item()
    assert bool(torch.isfinite(out.weight).all())
    # the token's ratio overflows as well: per_token = -A * inf; the loss must still be finite
    logp = t([100.0, -1.0, -1.2, -0.9]).requires_grad_(True)
    prox = t([0.0, -1.0, -1.1, -1.0])
    objective = ppo(logp, prox, t([-1.0, 1.0, 1.0, -1.0]), seq, valid, eps_clip=0.2)
    loss = policy_loss(objective, out, valid)
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(logp.grad).all())


def test_parameters_are_checked_without_running_the_correction():
    from a3po.maths.corrections import check_correction

    assert check_correction("icepop", {"name": "icepop", "lo": 0.5, "hi": 2.0}) == {"lo": 0.5, "hi": 2.0}
    assert check_correction("icepop", {"hi": 3}) == {"lo": 0.5, "hi": 3.0}  # the spec's defaults fill in
    assert check_correction("none", {"cap": None}) == {"cap": None}
    with pytest.raises(ValueError, match="cap=0 is not allowed"):
        check_correction("tis", {"cap": 0})
    with pytest.raises(ValueError, match="lo=2, hi=1 is not allowed"):
        check_correction("seq_mis", {"lo": 2, "hi": 1})
    with pytest.raises(ValueError, match="tau=-1 is not allowed"):
        check_correction("m2po", {"tau": -1})
    with pytest.raises(ValueError, match=r"does not take \['capp'\]"):
        check_correction("tis", {"capp": 2})
