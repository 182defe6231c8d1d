"""a3po/learner/anchors.py: each method's anchor kind as a strategy, built from its spec."""

from __future__ import annotations

import pytest
import torch

from a3po.learner.anchors import Hybrid, Interpolation, Recompute, build_anchor
from a3po.maths.proximal import ALGOS, approximate_prox_logp
from a3po.maths.schedules import SCHEDULES


def _anchor(method: str, **params):
    spec = ALGOS.lookup(method)
    return build_anchor(spec, spec.check({"name": method, **params}, "algo"), SCHEDULES.bind({"name": "inverse"}))


def test_each_kind_decides_and_anchors_as_its_method_says():
    behave, logp = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.8, -2.5, -0.4])
    versions = torch.tensor([3, 1, 0])
    never = lambda: pytest.fail("no probe for this kind")  # noqa: E731
    coupled, recompute, loglinear = _anchor("coupled"), _anchor("recompute"), _anchor("loglinear")
    assert coupled.decide(4, never) == (False, {}) and torch.equal(coupled.approximate(behave, logp, versions, 4, 0.0), behave)
    assert isinstance(recompute, Recompute) and recompute.decide(4, never) == (True, {})
    with pytest.raises(RuntimeError):
        recompute.approximate(behave, logp, versions, 4, 0.0)
    assert isinstance(loglinear, Interpolation) and loglinear.decide(4, never) == (False, {})
    expected = approximate_prox_logp(behave, logp, versions, 4, method="loglinear", schedule="inverse", position=0.25)
    assert torch.equal(loglinear.approximate(behave, logp, versions, 4, 0.25), expected)


def test_hybrid_recomputes_by_count_and_probes_only_when_it_must():
    by_count = _anchor("hybrid", every=2)
    assert isinstance(by_count, Hybrid) and (by_count.every, by_count.min_ess) == (2, None)
    calls = []
    probe = lambda: calls.append(1) or torch.tensor(0.1)  # noqa: E731
    assert by_count.decide(4, probe)[0] is True and by_count.decide(5, probe)[0] is False and not calls
    by_drift = _anchor("hybrid", every=0, min_ess=0.5)
    recompute, logged = by_drift.decide(5, probe)
    assert recompute is True and calls == [1]
    assert float(logged["hybrid/drift_ess"]) == pytest.approx(0.1) and float(logged["hybrid/recomputed"]) == 1.0
    recompute, logged = by_drift.decide(6, lambda: torch.tensor(0.9))
    assert recompute is False and float(logged["hybrid/recomputed"]) == 0.0
