"""The proximal approximation: hand-checked numbers, AReaL equality, properties, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.maths.proximal import approximate_prox_logp, approximation_errors, staleness_stats
from a3po.maths.schedules import SCHEDULES, target_weight

SCHEDULE_PARAMS = {
    "inverse": {},
    "inverse_sqrt": {},
    "exponential": {"gamma": 0.5},
    "linear_decay": {"horizon": 4},
    "constant": {"c": 0.25},
    "behave": {},
    "target": {},
    "step_start": {},
    "rational": {"gamma": 0.5, "c": 1.0, "b": 2.0},
}


def areal_reference(old_logp, logprobs, versions, current_version, method):
    """The reference formula as the issue states it (AReaL compute_prox_logp_approximations):
    alpha = (v_prox - v_behave) / (v_theta - v_behave), v_prox = v_theta - 1, 0 where
    v_theta <= v_behave or version < 0, clamped to [0, 1]."""
    v_behave = versions.float()
    v_theta = float(current_version)
    gap = (current_version - 1) - v_behave
    diff = v_theta - v_behave
    alpha = torch.where((diff > 0) & (versions >= 0), gap / diff, torch.zeros_like(v_behave))
    alpha = torch.clamp(alpha, 0.0, 1.0)
    if method == "loglinear":
        return old_logp + alpha * (logprobs - old_logp)
    mix = (1 - alpha) * torch.exp(old_logp) + alpha * torch.exp(logprobs)
    return torch.log(mix + 1e-10)


# A 2x3 example a reader can check by hand. current_version = 4.
BEHAVE = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
TARGET = torch.tensor([[-2.0, -1.0, -0.5], [-1.0, -1.0, -4.0]])
VERSIONS = torch.tensor([[-1, 4, 3], [2, 0, 1]])  # staleness: prompt, 0, 1, 2, 4, 3


def test_hand_computed_loglinear_inverse():
    # alpha = (d-1)/d: prompt -> 0, d=0 -> 0, d=1 -> 0, d=2 -> 1/2, d=4 -> 3/4, d=3 -> 2/3
    expected = torch.tensor([
        [-1.0, -2.0, -0.5],
        [-3.0 + 0.5 * (-1.0 + 3.0), -1.0, -2.0 + (2 / 3) * (-4.0 + 2.0)],
    ])
    got = approximate_prox_logp(BEHAVE, TARGET, VERSIONS, 4)
    torch.testing.assert_close(got, expected)
    assert got[1, 0].item() == pytest.approx(-2.0)
    assert got[1, 2].item() == pytest.approx(-2.0 - 4 / 3)


def test_hand_computed_linear_inverse():
    got = approximate_prox_logp(BEHAVE, TARGET, VERSIONS, 4, method="linear")
    expected_10 = math.log(0.5 * math.exp(-3.0) + 0.5 * math.exp(-1.0) + 1e-10)
    assert got[1, 0].item() == pytest.approx(expected_10, rel=1e-6)
    assert got[0, 0].item() == -1.0  # prompt token: behave_logp exactly
    assert got[0, 1].item() == pytest.approx(-2.0, abs=1e-8)  # d = 0


def test_hand_computed_target_weights_every_schedule():
    current = 4
    versions = torch.tensor([4, 3, 2, 0])  # staleness d = 0, 1, 2, 4
    expected_behave_weight = {
        "inverse": [1, 1, 1 / 2, 1 / 4],
        "inverse_sqrt": [1, 1, 1 / math.sqrt(2), 1 / 2],
        "exponential": [1, 1, 0.5, 0.125],
        "linear_decay": [1, 1, 0.75, 0.25],
        "constant": [1, 0.25, 0.25, 0.25],
        "behave": [1, 1, 1, 1],
        "target": [1, 0, 0, 0],
    }
    for name, weights in expected_behave_weight.items():
        got = 1.0 - target_weight(versions, current, name, **SCHEDULE_PARAMS[name])
        torch.testing.assert_close(got, torch.tensor(weights, dtype=torch.float32), msg=name)


def test_hand_computed_rational_and_the_schedules_it_nests():
    """w_b = (c + b k/m) / (d^gamma + c + b k/m): at k/m = 1/2 with gamma 1/2, c 1, b 2 the lag is
    2, so w_b = 2 / (sqrt(d) + 2); gamma 1, c 0, b 1 is step_start at every position."""
    versions = torch.tensor([4, 3, 2, 0])  # d = 0, 1, 2, 4
    got = 1.0 - target_weight(versions, 4, "rational", position=0.5, **SCHEDULE_PARAMS["rational"])
    torch.testing.assert_close(got, torch.tensor([1, 2 / 3, 2 / (math.sqrt(2) + 2), 0.5]))
    for position in (0.0, 0.25, 0.75):
        torch.testing.assert_close(target_weight(versions, 4, "rational", position=position),
                                   target_weight(versions, 4, "step_start", position=position))
    w_b = 1.0 - target_weight(versions, 4, "rational", position=0.5, gamma=1.0, c=1.0, b=0.0)
    torch.testing.assert_close(w_b, torch.tensor([1, 1 / 2, 1 / 3, 1 / 5]))  # 1 / (d + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_matches_areal_bit_for_bit(dtype, method):
    gen = torch.Generator().manual_seed(0)
    shape = (16, 64)
    behave = (-torch.rand(shape, generator=gen) * 8).to(dtype)
    target = (-torch.rand(shape, generator=gen) * 8).to(dtype)
    current = 37
    versions = torch.randint(-1, current + 2, shape, generator=gen)  # prompt, fresh, stale, future
    ours = approximate_prox_logp(behave, target, versions, current, method=method)
    ref = areal_reference(behave, target, versions, current, method)
    generated = versions >= 0
    assert ours.dtype == ref.dtype
    assert torch.equal(ours[generated], ref[generated])
    assert torch.equal(ours[~generated], behave[~generated])


def test_no_gradient_through_anchor():
    target = TARGET.clone().requires_grad_(True)
    behave = BEHAVE.clone().requires_grad_(True)
    out = approximate_prox_logp(behave, target, VERSIONS, 4)
    assert not out.requires_grad


finite_logp = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@st.composite
def token_batches(draw):
    n = draw(st.integers(1, 12))
    current = draw(st.integers(0, 20))
    behave = torch.tensor(draw(st.lists(finite_logp, min_size=n, max_size=n)), dtype=torch.float64)
    target = torch.tensor(draw(st.lists(finite_logp, min_size=n, max_size=n)), dtype=torch.float64)
    versions = torch.tensor(draw(st.lists(st.integers(-1, current), min_size=n, max_size=n)))
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    return behave, target, versions, current, schedule


@settings(max_examples=200, deadline=None)
@given(token_batches())
def test_properties(batch):
    behave, target, versions, current, schedule = batch
    params = SCHEDULE_PARAMS[schedule]
    alpha = target_weight(versions, current, schedule, **params)
    assert bool(((alpha >= 0) & (alpha <= 1)).all())
    fresh_or_prompt = (versions < 0) | (versions == current)
    assert bool((alpha[fresh_or_prompt] == 0).all())
    prox = approximate_prox_logp(behave, target, versions, current, schedule=schedule, **params)
    # d = 0 and prompt tokens: the behaviour policy itself
    assert torch.equal(prox[fresh_or_prompt], behave[fresh_or_prompt])
    # loglinear anchor between behave and target in log space
    low, high = torch.minimum(behave, target), torch.maximum(behave, target)
    assert bool(((prox >= low - 1e-12) & (prox <= high + 1e-12)).all())
    stale = (versions >= 0) & (versions < current)
    if schedule == "behave":
        assert torch.equal(prox, behave)
    if schedule == "target":
        # behave + 1 * (target - behave): the endpoint up to one rounding of |behave|
        torch.testing.assert_close(prox[stale], target[stale], rtol=0, atol=1e-13)


@settings(max_examples=100, deadline=None)
@given(token_batches())
def test_linear_lies_between_in_probability_space(batch):
    behave, target, versions, current, schedule = batch
    prox = approximate_prox_logp(behave, target, versions, current, method="linear",
                                 schedule=schedule, **SCHEDULE_PARAMS[schedule])
    p = torch.exp(prox)
    low, high = torch.minimum(behave, target).exp(), torch.maximum(behave, target).exp()
    assert bool(((p >= low * (1 - 1e-9)) & (p <= high + 2e-10)).all())


def test_staleness_stats_token_weighted():
    versions = torch.tensor([[-1, -1, 3, 3, 3], [-1, 1, 1, -1, -1]])
    stats = staleness_stats(versions, current_version=4)
    # generated tokens: staleness 1, 1, 1, 3, 3 -> mean 9/5
    assert stats["staleness/mean"].item() == pytest.approx(9 / 5)
    assert stats["staleness/max"].item() == 3
    assert stats["staleness/min"].item() == 1
    empty = staleness_stats(torch.full((2, 2), -1), current_version=4)
    assert all(v.item() == 0 for v in empty.values())


def test_approximation_errors_zero_when_exact_and_hand_value():
    behave = torch.tensor([[-1.0, -2.0]])
    target = torch.tensor([[-2.0, -2.0]])
    versions = torch.tensor([[2, 2]])  # d = 2 at version 4: alpha = 1/2
    mask = torch.tensor([[True, True]])
    truth = torch.tensor([[-1.5, -2.0]])  # exactly the loglinear value
    errs = approximation_errors(truth, behave, target, versions, 4, mask, {"inverse": {}, "behave": {}},
                                methods=("loglinear",))
    assert errs["prox_error/inverse/logp_abs"].item() == pytest.approx(0.0, abs=1e-7)
    # behave schedule: prox = behave -> |(-1) - (-1.5)| = 0.5 and 0 -> mean 0.25
    assert errs["prox_error/behave/logp_abs"].item() == pytest.approx(0.25)
    iw = abs(math.exp(-2.0 + 1.0) - math.exp(-2.0 + 1.5)) / 2
    assert errs["prox_error/behave/iw_abs"].item() == pytest.approx(iw, rel=1e-6)
    bw = abs(1.0 - math.exp(-0.5)) / 2
    assert errs["prox_error/behave/bw_abs"].item() == pytest.approx(bw, rel=1e-6)
    both = approximation_errors(truth, behave, target, versions, 4, mask, {"inverse": {}})
    assert set(both) == {f"prox_error/{label}/{m}" for label in ("inverse", "inverse-linear")
                         for m in ("logp_abs", "iw_abs", "bw_abs")}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="cubic"), r"algo.name='cubic'.*allowed: \['coupled', 'hybrid', 'linear', 'loglinear', 'recompute'\]"),
        (dict(method="recompute"), r"method='recompute' is not an approximation; allowed: \['loglinear', 'linear'\]"),
        (dict(schedule="nope"), r"schedule='nope'.*allowed: \['behave'"),
        (dict(schedule="exponential", gamma=0.0), r"schedule.gamma=0 .*\(0, 1\]"),
        (dict(schedule="exponential", gamma=1.5), r"gamma=1.5.*\(0, 1\]"),
        (dict(schedule="exponential", gama=0.5), r"does not take \['gama'\]"),
        (dict(schedule="linear_decay", horizon=0.5), r"horizon=0.5.*>= 1"),
        (dict(schedule="constant", c=-0.1), r"c=-0.1.*\[0, 1\]"),
        (dict(schedule="constant", c=1.1), r"c=1.1.*\[0, 1\]"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        approximate_prox_logp(BEHAVE, TARGET, VERSIONS, 4, **kwargs)


def test_shape_mismatch_and_nonfinite_raise():
    with pytest.raises(ValueError, match="shape mismatch"):
        approximate_prox_logp(BEHAVE, TARGET[:, :2], VERSIONS, 4)
    with pytest.raises(ValueError, match="integer tensor"):
        approximate_prox_logp(BEHAVE, TARGET, VERSIONS.float(), 4)
    bad_target = TARGET.clone()
    bad_target[1, 0] = float("-inf")
    with pytest.raises(ValueError, match="non-finite"):
        approximate_prox_logp(BEHAVE, bad_target, VERSIONS, 4)
    nan_behave = BEHAVE.clone()
    nan_behave[0, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        approximate_prox_logp(nan_behave, TARGET, VERSIONS, 4, method="linear")


# ---- step_start: the step-start anchor under linear drift ----------------------------------


def _linear_drift(d: torch.Tensor, position: float, slope: torch.Tensor):
    """Per-token log-probs drifting linearly with versions: behaviour (version t - d), the
    step-start weights (version t, recompute's anchor) and the current weights in minibatch k of
    m (version t + k/m)."""
    behave = torch.full_like(slope, -2.0)
    return behave, behave + d * slope, behave + (d + position) * slope


@pytest.mark.parametrize("position", [0.0, 0.25, 0.5, 0.75])
def test_step_start_is_exact_under_linear_drift_and_inverse_is_not(position):
    versions = torch.tensor([[3, 4, 5, 6]])  # trained at version 7: d = 4, 3, 2, 1
    d = (7 - versions).float()
    slope = torch.tensor([[0.3, -0.2, 0.05, 0.4]])
    behave, step_start_truth, current = _linear_drift(d, position, slope)
    got = approximate_prox_logp(behave, current, versions, 7, schedule="step_start", position=position)
    torch.testing.assert_close(got, step_start_truth, rtol=0, atol=1e-6)
    inverse = approximate_prox_logp(behave, current, versions, 7, schedule="inverse", position=position)
    assert (inverse - step_start_truth).abs().max() > 1e-2  # one version behind (and k/m more)


def test_step_start_edge_cases():
    behave, current = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.5, -2.0]])
    versions = torch.tensor([[2, 1, -1]])  # d = 2, 3 and a prompt token
    # k = 0: alpha = 1 on every generated token, the current policy (= the step-start one)
    first = approximate_prox_logp(behave, current, versions, 4, schedule="step_start", position=0.0)
    assert first[0, :2].tolist() == current[0, :2].tolist() and first[0, 2] == behave[0, 2]
    # d = 0 (fresh tokens): the behaviour policy, which is the step-start policy there
    fresh = approximate_prox_logp(behave, current, torch.tensor([[4, 4, 4]]), 4, schedule="step_start", position=0.5)
    assert torch.equal(fresh, behave)
    # alpha = d / (d + k/m) by hand: d = 2, k/m = 0.5 -> 0.8
    alpha = target_weight(torch.tensor([2]), 4, "step_start", position=0.5)
    assert alpha.item() == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"position=1.0 is not allowed"):
        target_weight(torch.tensor([2]), 4, "step_start", position=1.0)


def test_decision_flip_rate_is_zero_for_equal_anchors_and_counted_by_hand():
    from a3po.maths.loss import token_decisions

    versions = torch.tensor([2, 2, 2, 2, 2])  # d = 2 at version 4
    behave = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    logp = torch.tensor([-0.5, -1.4, -0.7, -1.0, -0.2])
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0])
    valid = torch.tensor([True, True, True, True, False])
    seq = torch.arange(5)

    def decisions(anchor):
        return token_decisions(logp, anchor, behave, advantages, seq, valid,
                               objective={"name": "ppo", "eps_clip": 0.2}, correction={"name": "none", "cap": None})

    # the recomputed anchor equal to the current log-probs: "target" is then the same anchor
    same = approximation_errors(logp, behave, logp, versions, 4, valid, {"target": {}}, methods=("loglinear",),
                                decisions=decisions)
    assert same["prox_error/target/clip_flip"].item() == 0.0 and same["prox_error/target/keep_flip"].item() == 0.0
    # "behave" anchors on behave = -1: r = exp(logp + 1) = e^0.5 (A > 0: clipped), e^-0.4 (A < 0: clipped),
    # e^0.3 (A > 0: clipped), 1 (not); against the true anchor logp (r = 1, nothing clipped): 3 of 4 valid flip
    flips = approximation_errors(logp, behave, logp, versions, 4, valid, {"behave": {}}, methods=("loglinear",),
                                 decisions=decisions)
    assert flips["prox_error/behave/clip_flip"].item() == pytest.approx(0.75)
    assert flips["prox_error/behave/keep_flip"].item() == 0.0  # no cap: every valid token kept under both
    # the rates say which anchor clips: "behave" 3 of 4 valid tokens, the recomputed anchor none
    assert flips["prox_error/behave/clip_rate"].item() == pytest.approx(0.75)
    assert flips["prox_error/recompute/clip_rate"].item() == 0.0
    assert flips["prox_error/behave/keep_rate"].item() == flips["prox_error/recompute/keep_rate"].item() == 1.0
    # the other way round: the recomputed anchor on behave clips 3, the "target" anchor (logp) none
    swapped = approximation_errors(behave, behave, logp, versions, 4, valid, {"target": {}}, methods=("loglinear",),
                                   decisions=decisions)
    assert swapped["prox_error/recompute/clip_rate"].item() == pytest.approx(0.75)
    assert swapped["prox_error/target/clip_rate"].item() == 0.0
    assert swapped["prox_error/target/clip_flip"].item() == pytest.approx(0.75)
    # without decisions nothing is said about them
    assert not any(key.endswith(("_rate", "_flip")) for key in approximation_errors(
        logp, behave, logp, versions, 4, valid, {"behave": {}}, methods=("loglinear",)))
